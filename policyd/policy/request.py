"""The inference request as routing policies see it.

``Request``'s attributes are the CEL schema's ``request`` fields, made from
their declarations (``policyd.fields.REQUEST_FIELDS``), as ``Pod`` is made
from the pod fields: adding a field there adds it here, with its default.
``policyd.extproc.openai`` builds one per HTTP request from the headers and
the OpenAI JSON body; the fields whose origin is ``"policy"``
(``target_model``, ``criticality``) are the router's to decide, on a copy
(``Request.decided``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from policyd.fields import REQUEST_FIELDS, dataclass_fields

# The constructor's order: what the caller gives (model first, the one field
# without a default), then what the policy decides, in ``decided``'s order.
GIVEN_FIELDS: Final = tuple(f for f in REQUEST_FIELDS if f.origin != "policy")
DECIDED_FIELDS: Final = tuple(f for f in REQUEST_FIELDS if f.origin == "policy")
if tuple(f.name for f in DECIDED_FIELDS) != ("target_model", "criticality"):
    raise AssertionError("Request.decided takes target_model and criticality, in that order")


def _build_request_class() -> type:
    cls = dataclasses.make_dataclass(
        "Request",
        dataclass_fields((*GIVEN_FIELDS, *DECIDED_FIELDS), lambda field: field.default),
        slots=True,
        namespace={
            "__doc__": "One OpenAI-style request; target_model and criticality are the policy's.",
        },
    )
    # The router copies one request per decision. The copy is generated from
    # the declarations, as dataclasses generates ``__init__``: one positional
    # call, as cheap as the copy was when spelt out by hand (a star-call over
    # an ``attrgetter`` or ``dataclasses.replace`` costs measurably more on a
    # reused walk, benchmarks/decision.py).
    given = ", ".join(f"self.{f.name}" for f in GIVEN_FIELDS)
    source = (
        "def decided(self, target_model, criticality):\n"
        '    """A copy carrying what the policy decided; this request stays as it was."""\n'
        f"    return Request({given}, target_model, criticality)\n"
    )
    namespace: dict[str, Any] = {}
    exec(source, {"Request": cls}, namespace)  # the source is made from the declarations
    decided = namespace["decided"]
    decided.__qualname__ = "Request.decided"
    decided.__module__ = __name__
    cls.decided = decided  # type: ignore[attr-defined]
    cls.__module__ = __name__
    return cls


if TYPE_CHECKING:

    class Request:
        """The static face of the class built from the declarations.

        The fields Python code reads by name are typed here (a test holds them
        to the declarations); a field added to the declarations alone is read
        by policies through CEL, and in Python through ``__getattr__``.
        """

        @property
        def model(self) -> str: ...
        @property
        def target_model(self) -> str: ...
        @property
        def criticality(self) -> str: ...
        @property
        def headers(self) -> Mapping[str, str]: ...
        @property
        def prompt_tokens(self) -> int: ...
        @property
        def max_tokens(self) -> int: ...
        @property
        def stream(self) -> bool: ...
        @property
        def path(self) -> str: ...
        @property
        def id(self) -> str: ...
        def __init__(
            self,
            model: str,
            *,
            target_model: str = ...,
            criticality: str = ...,
            headers: Mapping[str, str] = ...,
            prompt_tokens: int = ...,
            max_tokens: int = ...,
            stream: bool = ...,
            path: str = ...,
            id: str = ...,
            **fields: Any,
        ) -> None: ...
        def decided(self, target_model: str, criticality: str) -> Request: ...
        def __getattr__(self, name: str) -> Any: ...

else:
    Request = _build_request_class()
