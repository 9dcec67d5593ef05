"""No user-supplied text ever becomes Python code in a generated program.

The generated source must contain no string literal at all: every string of
the expression (literals, map keys, field and variable names) is bound as a
constant. These tests try to break out anyway and check the answer is the
plain CEL answer.
"""

from __future__ import annotations

from typing import Any

import pytest
from cel_expr_python import cel

from policyd.cel import CelEvalError, Environment, ir
from policyd.cel.codegen import generate

HOSTILE = [
    "'); __import__('os').system('echo pwned'); ('",
    '"""\nimport os\nos._exit(3)\n"""',
    "\\'; raise SystemExit #",
    "{0}{1}{__class__}",
    "\n    return 1\n",
]


def cel_string(text: str) -> str:
    """A CEL literal for ``text`` using escapes, so the CEL parser decodes it back."""
    return '"' + "".join(f"\\u{ord(c):04x}" if ord(c) < 0x10000 else c for c in text) + '"'


ENVIRONMENT = Environment(
    {
        "m": cel.Type.Map(cel.Type.STRING, cel.Type.STRING),
        # Variable names that collide with the generator's own identifiers.
        "act": cel.Type.INT,
        "t1": cel.Type.INT,
        "v1": cel.Type.INT,
        "_k1": cel.Type.INT,
        "__builtins__": cel.Type.INT,
    }
)


def assert_no_literal_text(source: str | None) -> None:
    assert source is not None
    assert "'" not in source
    assert '"' not in source
    assert "__import__" not in source


@pytest.mark.parametrize("text", HOSTILE)
def test_string_literals_with_quotes_newlines_and_code_stay_strings(text: str) -> None:
    program = ENVIRONMENT.compile(f"{cel_string(text)} + m[{cel_string(text)}]")
    assert program.lowered
    assert program.evaluate({"m": {text: "!"}}) == text + "!"
    assert_no_literal_text(program.python_source)


@pytest.mark.parametrize("key", ["class", "lambda", "None", "import", "__class__", "a-b c"])
def test_map_keys_that_are_python_keywords_or_dunders_are_only_keys(key: str) -> None:
    select = f"m.{key}" if key.isidentifier() else f"m[{cel_string(key)}]"
    program = ENVIRONMENT.compile(f"has(m.x) || {select} == 'v'")
    assert program.evaluate({"m": {key: "v"}}) is True
    with pytest.raises(CelEvalError, match="no such key"):
        program.evaluate({"m": {}})
    assert_no_literal_text(program.python_source)


def test_variable_names_cannot_shadow_the_generated_code() -> None:
    program = ENVIRONMENT.compile("act + t1 + v1 + _k1 + __builtins__")
    assert program.evaluate({"act": 1, "t1": 2, "v1": 3, "_k1": 4, "__builtins__": 5}) == 15


def test_unchecked_calls_to_python_names_are_unbound_functions() -> None:
    program = ENVIRONMENT.compile("__import__('os').system('echo pwned')", checked=False)
    with pytest.raises(CelEvalError, match="unbound function"):
        program.evaluate({})


def test_generated_programs_run_without_builtins() -> None:
    program = ENVIRONMENT.compile("size(m) > 0")
    globals_: dict[str, Any] = program.evaluate.__globals__
    assert globals_["__builtins__"] == {}


class Message:
    """An object with fields named like Python keywords (set via setattr)."""


@pytest.mark.parametrize("field", ["class", "lambda", "None", "not", "x y", "a'b"])
def test_message_fields_named_like_keywords_are_read_as_attributes(field: str) -> None:
    message = Message()
    setattr(message, field, "value")
    root = ir.Attr(ir.StaticType("string"), ir.Var(ir.StaticType("message", "M"), "msg"), field)
    evaluate, source = generate(ir.Lowered(root))
    assert evaluate({"msg": message}) == "value"
    assert f".{field}" not in source


@pytest.mark.parametrize("field", ["__class__", "__dict__", "_private"])
def test_fields_starting_with_an_underscore_never_reach_python_internals(field: str) -> None:
    root = ir.Attr(ir.StaticType("string"), ir.Var(ir.StaticType("message", "M"), "msg"), field)
    evaluate, _ = generate(ir.Lowered(root))
    with pytest.raises(CelEvalError, match="no such field"):
        evaluate({"msg": Message()})
    unchecked = ENVIRONMENT.compile(f"dyn(m).{field}", checked=False)
    with pytest.raises(CelEvalError):
        unchecked.evaluate({"m": Message()})
