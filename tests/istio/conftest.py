"""The live gateway tests reuse the end-to-end doubles (test upstreams, the scripted router)."""

from __future__ import annotations

import sys
from pathlib import Path

E2E = Path(__file__).resolve().parent.parent / "e2e"
if str(E2E) not in sys.path:
    sys.path.append(str(E2E))
