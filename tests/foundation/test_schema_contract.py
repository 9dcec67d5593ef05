"""The Python objects policies see carry exactly the CEL schema's field names."""

from __future__ import annotations

import dataclasses

from policyd.cel import POD_FIELDS, REQUEST_FIELDS
from policyd.policy.request import Request
from policyd.pool.pod import Pod


def test_pod_has_every_schema_field_as_an_attribute() -> None:
    pod = Pod("p", "10.0.0.1:8000")
    missing = [f.name for f in POD_FIELDS if not hasattr(pod, f.name)]
    assert missing == []


def test_request_has_every_schema_field_and_nothing_else() -> None:
    fields = {field.name for field in dataclasses.fields(Request)}
    assert fields == {f.name for f in REQUEST_FIELDS}
