"""The inference request as routing policies see it.

Field names are exactly the CEL schema's ``request`` fields
(``policyd.cel.schema.REQUEST_FIELDS``). ``extproc`` builds one per HTTP
request from the headers and the OpenAI JSON body.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(slots=True)
class Request:
    """One OpenAI-style request; ``target_model`` is filled in by the policy."""

    model: str
    target_model: str = ""
    criticality: str = "standard"
    headers: Mapping[str, str] = field(default_factory=dict)
    prompt_tokens: int = 0
    max_tokens: int = 0
    stream: bool = False
    path: str = "/v1/completions"
    id: str = ""
