"""Allow ``python -m policyd``."""

from policyd.cli import main

raise SystemExit(main())
