"""Run the official CEL conformance tests (cel-spec ``tests/simple``) through policyd's compiler.

The data lives outside the project, in ``../shared/cel-spec-tests`` from the
repository root (CI puts it there too), or wherever ``CEL_SPEC_TESTS`` names.
Without it the pytest module is skipped, saying so in the summary, except
under ``CI=true``, where the missing data is a failure. Each test is compiled with
``Environment.compile`` (``checked=False`` where the test disables the type
checker), evaluated, and compared with the expected value, kind for kind
(``1u`` is not ``1``, ``-0.0`` is not ``0.0``).

Run as a script for the summary table::

    python tests/cel/cel_conformance.py
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Final

import yaml
from cel.expr import checked_pb2, value_pb2
from cel.expr.conformance.test import simple_pb2
from cel_expr_python import cel
from google.protobuf import duration_pb2, text_format, timestamp_pb2

from policyd.cel import CelCompileError, CelEvalError, Environment
from policyd.cel.runtime import kind_of
from policyd.cel.values import CelType, Duration, Timestamp, UInt

REPOSITORY: Final = Path(__file__).resolve().parents[2]
DATA: Final = Path(
    os.environ.get("CEL_SPEC_TESTS") or REPOSITORY.parent / "shared" / "cel-spec-tests"
)
EXCLUSIONS: Final = Path(__file__).with_name("conformance_exclusions.yaml")
FILES: Final = (
    "basic",
    "logic",
    "comparisons",
    "integer_math",
    "fp_math",
    "string",
    "lists",
    "macros",
    "fields",
    "conversions",
    "timestamps",
)


def missing_data() -> str | None:
    """What is missing of the conformance data, as a sentence; None when it is all there."""
    missing = [name for name in FILES if not (DATA / f"{name}.textproto").is_file()]
    if not missing:
        return None
    return (
        f"CEL conformance data missing in {DATA}: {', '.join(missing)} (the cel-spec "
        "tests/simple/testdata files; put them at ../shared/cel-spec-tests from the "
        "repository root, or name their folder in CEL_SPEC_TESTS)"
    )


def running_in_ci() -> bool:
    """``CI`` set to true (``true``, ``1``, ``yes``), as CI services set it."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


class UnsupportedError(Exception):
    """The test needs something outside policyd's CEL (message types, functions)."""


@dataclass(frozen=True, slots=True)
class Outcome:
    test_id: str
    passed: bool
    lowered: bool | None  # None when nothing was compiled
    detail: str


def load_file(name: str) -> simple_pb2.SimpleTestFile:
    path = DATA / f"{name}.textproto"
    if not path.is_file():
        raise FileNotFoundError(
            f"CEL conformance data missing: {path} (expected the cel-spec tests/simple "
            "testdata at ../shared/cel-spec-tests from the repository root, or where "
            "CEL_SPEC_TESTS names)"
        )
    # Registers the message types the textprotos mention, so parsing succeeds.
    import cel.expr.conformance.proto2.test_all_types_pb2
    import cel.expr.conformance.proto3.test_all_types_pb2  # noqa: F401

    parsed = simple_pb2.SimpleTestFile()
    text_format.Parse(path.read_text(), parsed, allow_unknown_field=True)
    return parsed


def all_tests() -> Iterator[tuple[str, simple_pb2.SimpleTest]]:
    for name in FILES:
        for section in load_file(name).section:
            for test in section.test:
                yield f"{name}/{section.name}/{test.name}", test


def load_exclusions() -> dict[str, dict[str, str]]:
    data = yaml.safe_load(EXCLUSIONS.read_text())
    return {
        "excluded": dict(data.get("excluded") or {}),
        "failing": dict(data.get("failing") or {}),
    }


# -- conversions between conformance protos and policyd values ------------------------

_PRIMITIVES: Final = {
    checked_pb2.Type.BOOL: cel.Type.BOOL,
    checked_pb2.Type.INT64: cel.Type.INT,
    checked_pb2.Type.UINT64: cel.Type.UINT,
    checked_pb2.Type.DOUBLE: cel.Type.DOUBLE,
    checked_pb2.Type.STRING: cel.Type.STRING,
    checked_pb2.Type.BYTES: cel.Type.BYTES,
}


def declared_type(proto: checked_pb2.Type) -> cel.Type:
    which = proto.WhichOneof("type_kind")
    if which == "primitive":
        return _PRIMITIVES[proto.primitive]
    if which == "dyn":
        return cel.Type.DYN
    if which == "null":
        return cel.Type.NULL
    if which == "list_type":
        return cel.Type.List(declared_type(proto.list_type.elem_type))
    if which == "map_type":
        return cel.Type.Map(
            declared_type(proto.map_type.key_type), declared_type(proto.map_type.value_type)
        )
    if which == "well_known" and proto.well_known == checked_pb2.Type.DURATION:
        return cel.Type.DURATION
    if which == "well_known" and proto.well_known == checked_pb2.Type.TIMESTAMP:
        return cel.Type.TIMESTAMP
    if which == "message_type" and proto.message_type == "google.protobuf.Duration":
        return cel.Type.DURATION
    if which == "message_type" and proto.message_type == "google.protobuf.Timestamp":
        return cel.Type.TIMESTAMP
    raise UnsupportedError(f"declared type {which}: {proto.message_type or proto}")


def runtime_value(proto: value_pb2.Value) -> Any:
    which = proto.WhichOneof("kind")
    if which == "null_value":
        return None
    if which in ("bool_value", "int64_value", "double_value", "string_value", "bytes_value"):
        return getattr(proto, which)
    if which == "uint64_value":
        return UInt(proto.uint64_value)
    if which == "list_value":
        return [runtime_value(item) for item in proto.list_value.values]
    if which == "map_value":
        return {
            runtime_value(entry.key): runtime_value(entry.value)
            for entry in proto.map_value.entries
        }
    if which == "type_value":
        return CelType(proto.type_value)
    if which == "object_value":
        if proto.object_value.Is(duration_pb2.Duration.DESCRIPTOR):
            duration = duration_pb2.Duration()
            proto.object_value.Unpack(duration)
            return Duration(duration.ToNanoseconds())
        if proto.object_value.Is(timestamp_pb2.Timestamp.DESCRIPTOR):
            timestamp = timestamp_pb2.Timestamp()
            proto.object_value.Unpack(timestamp)
            return Timestamp(timestamp.ToNanoseconds())
    raise UnsupportedError(f"value kind {which}")


def same_value(actual: Any, expected: Any) -> bool:
    """Equal values of the same CEL kind, element by element."""
    kind = kind_of(expected)
    if kind_of(actual) != kind:
        return False
    if kind == "double":
        if math.isnan(expected):
            return math.isnan(actual)
        return bool(actual == expected and math.copysign(1, actual) == math.copysign(1, expected))
    if kind == "list":
        return len(actual) == len(expected) and all(
            same_value(a, e) for a, e in zip(actual, expected, strict=True)
        )
    if kind == "map":
        return len(actual) == len(expected) and all(
            key in actual and same_value(actual[key], value) for key, value in expected.items()
        )
    return bool(actual == expected)


# -- running --------------------------------------------------------------------------


@cache
def _environment(variables: tuple[tuple[str, bytes], ...]) -> Environment:
    return Environment(
        {name: declared_type(checked_pb2.Type.FromString(raw)) for name, raw in variables}
    )


def run_test(test_id: str, test: simple_pb2.SimpleTest) -> Outcome:
    lowered: bool | None = None
    try:
        if test.container:
            raise UnsupportedError(f"container {test.container}")
        if test.check_only or test.disable_macros:
            raise UnsupportedError("check_only / disable_macros")
        declared: dict[str, bytes] = {}
        for decl in test.type_env:
            if decl.HasField("function"):
                raise UnsupportedError(f"function declaration {decl.name}")
            declared[decl.name] = decl.ident.type.SerializeToString()
        activation = {}
        for name, binding in test.bindings.items():
            if not binding.HasField("value"):
                raise UnsupportedError("binding to an error or unknown")
            activation[name] = runtime_value(binding.value)
            declared.setdefault(
                name,
                checked_pb2.Type(dyn={}).SerializeToString(),  # type: ignore[arg-type]
            )
        environment = _environment(tuple(sorted(declared.items())))
        program = environment.compile(test.expr, checked=not test.disable_check)
        lowered = program.lowered
        matcher = test.WhichOneof("result_matcher")
        try:
            result = program.evaluate(activation)
        except CelEvalError as error:
            if matcher == "eval_error":
                return Outcome(test_id, True, lowered, "error as expected")
            return Outcome(test_id, False, lowered, f"unexpected error: {error}")
        if matcher == "eval_error":
            return Outcome(test_id, False, lowered, f"expected an error, got {result!r}")
        if matcher in (None, "value", "typed_result"):
            if matcher is None:
                expected: Any = True
            elif matcher == "value":
                expected = runtime_value(test.value)
            else:
                expected = runtime_value(test.typed_result.result)
            if same_value(result, expected):
                return Outcome(test_id, True, lowered, "value as expected")
            return Outcome(test_id, False, lowered, f"expected {expected!r}, got {result!r}")
        raise UnsupportedError(f"result matcher {matcher}")
    except UnsupportedError as reason:
        return Outcome(test_id, False, lowered, f"unsupported: {reason}")
    except CelCompileError as error:
        return Outcome(test_id, False, lowered, f"compile error: {error}")


def run_all() -> list[Outcome]:
    return [run_test(test_id, test) for test_id, test in all_tests()]


def summary(outcomes: list[Outcome], exclusions: Mapping[str, Mapping[str, str]]) -> str:
    excluded = set(exclusions["excluded"])
    selected = [o for o in outcomes if o.test_id not in excluded]
    passed = [o for o in selected if o.passed]
    lowered = [o for o in selected if o.lowered is True]
    fallback = [o for o in selected if o.lowered is False]
    rate = 100 * len(passed) / len(selected)
    return (
        f"CEL conformance ({', '.join(FILES)}): {len(outcomes)} tests, "
        f"{len(excluded)} excluded (need protobuf message types or declarations policyd "
        f"does not offer), {len(selected)} selected; {len(passed)} pass ({rate:.2f}%); "
        f"compiled: {len(lowered)} lowered to Python, {len(fallback)} fell back to "
        f"cel-expr-python, {len(selected) - len(lowered) - len(fallback)} did not compile"
    )


if __name__ == "__main__":
    results = run_all()
    lists = load_exclusions()
    for outcome in results:
        if not outcome.passed:
            listed = outcome.test_id in lists["excluded"] or outcome.test_id in lists["failing"]
            print(f"{'listed  ' if listed else 'UNLISTED'} {outcome.test_id}: {outcome.detail}")
    print(summary(results, lists))
