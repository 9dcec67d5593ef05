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


def test_the_typed_request_fields_match_their_declared_kinds() -> None:
    """request.py's static face types the fields Python reads by name; each is declared
    with the CEL kind of its Python type, and the constructor takes them in the
    order ``decided`` relies on (what the caller gives, then the policy's)."""
    import ast
    import inspect

    import policyd.policy.request as module

    python_of = {
        "string": "str",
        "int": "int",
        "bool": "bool",
        "double": "float",
        "map<string,string>": "Mapping[str, str]",
    }
    kinds = {f.name: f.kind for f in REQUEST_FIELDS}
    typed = {
        node.name: ast.unparse(node.returns)
        for node in ast.walk(ast.parse(inspect.getsource(module)))
        if isinstance(node, ast.FunctionDef)
        and any(ast.unparse(d) == "property" for d in node.decorator_list)
        and node.returns is not None
    }
    assert typed, "request.py's static face has no typed fields"
    assert {name: python_of[kinds[name]] for name in typed} == typed
    order = [f.name for f in dataclasses.fields(Request)]
    assert order[0] == "model"
    assert order[-2:] == ["target_model", "criticality"]
    request = Request(model="m", headers={"x": "1"}, stream=True)
    copy = request.decided("t", "critical")
    assert (copy.target_model, copy.criticality) == ("t", "critical")
    assert dataclasses.replace(copy, target_model="", criticality="standard") == request
