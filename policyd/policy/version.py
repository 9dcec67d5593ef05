"""The name of the policy file format: ``apiVersion`` and ``kind``.

A file that names neither is read as this format (files written before the
format carried a name have none). A later format gets a new ``apiVersion``,
so a file written for it is refused by name rather than misread field by
field. ``policy.schema.json`` takes both from here (``kinds.json_schema``).
"""

from typing import Final

API_VERSION: Final = "policyd.dev/v1"
KIND: Final = "RoutingPolicy"
