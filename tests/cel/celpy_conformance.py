"""The same CEL conformance files through cel-python (``celpy``), next to policyd's CEL.

Why policyd does not evaluate CEL with cel-python, measured on the data that
``test_conformance.py`` uses: the eleven core files of cel-spec
``tests/simple/testdata`` (``cel_conformance.FILES``, from ``DATA``). Each
test is compiled and evaluated by cel-python 0.5 (``Environment().compile``,
``program``, ``evaluate``; it has no type checker, so ``disable_check`` makes
no difference to it) and by policyd in the same run, and judged the same way:
the same value of the same CEL kind (``1u`` is not ``1``, ``-0.0`` is not
``0.0``; ``cel_conformance.same_value``), or an error where one is expected.
What neither can run (a ``container``, a function declaration, a binding to an
error) fails for both. The *selected* tests are those
``conformance_exclusions.yaml`` does not exclude (the excluded ones need
protobuf message types policyd does not offer).

    python tests/cel/celpy_conformance.py              # about a minute
    python tests/cel/celpy_conformance.py --failures   # and every cel-python failure
"""

from __future__ import annotations

import argparse
import datetime
import logging
import time
from collections import Counter
from importlib.metadata import version
from typing import Any

import celpy
from cel.expr import value_pb2
from cel.expr.conformance.test import simple_pb2
from cel_conformance import (
    DATA,
    FILES,
    UnsupportedError,
    all_tests,
    load_exclusions,
    run_all,
    same_value,
)
from celpy import celtypes
from google.protobuf import duration_pb2, timestamp_pb2

from policyd.cel.values import CelType, Duration, Timestamp, UInt

EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
TYPE_NAMES: list[tuple[type, str]] = [
    (celtypes.BoolType, "bool"),
    (celtypes.IntType, "int"),
    (celtypes.UintType, "uint"),
    (celtypes.DoubleType, "double"),
    (celtypes.StringType, "string"),
    (celtypes.BytesType, "bytes"),
    (celtypes.ListType, "list"),
    (celtypes.MapType, "map"),
    (celtypes.NullType, "null_type"),
    (celtypes.DurationType, "google.protobuf.Duration"),
    (celtypes.TimestampType, "google.protobuf.Timestamp"),
    (celtypes.TypeType, "type"),
    (type(None), "null_type"),  # cel-python's type(null)
]


def celpy_value(proto: value_pb2.Value) -> Any:
    """A conformance binding as a cel-python value."""
    which = proto.WhichOneof("kind")
    if which == "null_value":
        return None
    if which == "bool_value":
        return celtypes.BoolType(proto.bool_value)
    if which == "int64_value":
        return celtypes.IntType(proto.int64_value)
    if which == "uint64_value":
        return celtypes.UintType(proto.uint64_value)
    if which == "double_value":
        return celtypes.DoubleType(proto.double_value)
    if which == "string_value":
        return celtypes.StringType(proto.string_value)
    if which == "bytes_value":
        return celtypes.BytesType(proto.bytes_value)
    if which == "list_value":
        return celtypes.ListType([celpy_value(v) for v in proto.list_value.values])
    if which == "map_value":
        return celtypes.MapType(
            {celpy_value(e.key): celpy_value(e.value) for e in proto.map_value.entries}
        )
    if which == "object_value":
        if proto.object_value.Is(duration_pb2.Duration.DESCRIPTOR):
            duration = duration_pb2.Duration()
            proto.object_value.Unpack(duration)
            return celtypes.DurationType(duration.seconds, duration.nanos)
        if proto.object_value.Is(timestamp_pb2.Timestamp.DESCRIPTOR):
            timestamp = timestamp_pb2.Timestamp()
            proto.object_value.Unpack(timestamp)
            return celtypes.TimestampType(EPOCH + timestamp.ToTimedelta())
    raise UnsupportedError(f"binding of kind {which}")


def _nanoseconds(delta: datetime.timedelta) -> int:
    return ((delta.days * 86400 + delta.seconds) * 1_000_000 + delta.microseconds) * 1000


def plain(value: Any) -> Any:
    """A cel-python result in policyd's value kinds, for ``same_value``."""
    if value is None or isinstance(value, celtypes.NullType):
        return None
    if isinstance(value, type):
        for cls, name in TYPE_NAMES:
            if issubclass(value, cls):
                return CelType(name)
        return CelType(value.__name__)
    if isinstance(value, celtypes.BoolType | bool):
        return bool(value)
    if isinstance(value, celtypes.UintType):
        return UInt(int(value))
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, bytes):
        return bytes(value)
    if isinstance(value, celtypes.DurationType):
        return Duration(_nanoseconds(value))
    if isinstance(value, celtypes.TimestampType):
        return Timestamp(_nanoseconds(value - EPOCH))
    if isinstance(value, list):
        return [plain(item) for item in value]
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    return value


def expected_value(test: simple_pb2.SimpleTest) -> tuple[str, Any]:
    from cel_conformance import runtime_value

    matcher = test.WhichOneof("result_matcher")
    if matcher is None:
        return "value", True
    if matcher == "value":
        return "value", runtime_value(test.value)
    if matcher == "typed_result":
        return "value", runtime_value(test.typed_result.result)
    if matcher == "eval_error":
        return "error", None
    raise UnsupportedError(f"result matcher {matcher}")


def run_celpy(test: simple_pb2.SimpleTest) -> tuple[bool, str]:
    """(passed, detail) for one conformance test under cel-python."""
    try:
        if test.container:
            raise UnsupportedError(f"container {test.container}")
        if test.check_only or test.disable_macros:
            raise UnsupportedError("check_only / disable_macros")
        if any(decl.HasField("function") for decl in test.type_env):
            raise UnsupportedError("function declaration")
        activation = {}
        for name, binding in test.bindings.items():
            if not binding.HasField("value"):
                raise UnsupportedError("binding to an error or unknown")
            activation[name] = celpy_value(binding.value)
        kind, expected = expected_value(test)
    except UnsupportedError as reason:
        return False, f"unsupported: {reason}"
    environment = celpy.Environment()
    try:
        program = environment.program(environment.compile(test.expr))
    except celpy.CELParseError as error:
        return False, f"parse error: {str(error).splitlines()[0]}"
    except Exception as error:
        return False, f"compile crash: {type(error).__name__}: {error}"
    try:
        result = program.evaluate(activation)
    except celpy.CELEvalError as error:
        result = error
    except Exception as error:
        return False, f"evaluation crash: {type(error).__name__}: {error}"
    if isinstance(result, celpy.CELEvalError):
        if kind == "error":
            return True, "error as expected"
        return False, f"unexpected error: {result.args[0] if result.args else result}"
    if kind == "error":
        return False, f"expected an error, got {result!r}"
    try:
        actual = plain(result)
    except Exception as error:
        return False, f"result conversion: {type(error).__name__}: {error}"
    if same_value(actual, expected):
        return True, "value as expected"
    return False, f"expected {expected!r}, got {actual!r}"


def kind_of_failure(detail: str) -> str:
    if detail.startswith("unexpected error"):
        return "an error instead of a value"
    if detail.startswith("expected an error"):
        return "a value instead of an error"
    if detail.startswith("expected"):
        return "a wrong value"
    return detail.split(":", 1)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--failures", action="store_true", help="list every cel-python failure")
    arguments = parser.parse_args()
    logging.disable(logging.CRITICAL)  # celpy logs every evaluation error

    excluded = set(load_exclusions()["excluded"])
    started = time.perf_counter()
    policyd = {o.test_id: o.passed for o in run_all()}
    policyd_seconds = time.perf_counter() - started
    started = time.perf_counter()
    celpy_results = {test_id: run_celpy(test) for test_id, test in all_tests()}
    celpy_seconds = time.perf_counter() - started

    rows: Counter[tuple[str, str]] = Counter()
    reasons: Counter[str] = Counter()
    for test_id, (passed, detail) in celpy_results.items():
        file = test_id.split("/", 1)[0]
        selected = test_id not in excluded
        for scope in (file, "all"):
            rows[scope, "tests"] += 1
            rows[scope, "selected"] += selected
            rows[scope, "policyd"] += selected and policyd[test_id]
            rows[scope, "celpy"] += selected and passed
        rows["all tests", "celpy"] += passed
        rows["all tests", "policyd"] += policyd[test_id]
        if selected and not passed:
            reasons[kind_of_failure(detail)] += 1
            if arguments.failures:
                print(f"FAIL {test_id}: {detail}")

    print(f"CEL conformance files in {DATA}; cel-python {version('cel-python')}")
    print(f"{'file':<14} {'tests':>6} {'selected':>9} {'policyd':>14} {'cel-python':>14}")
    for scope in (*FILES, "all"):
        selected = rows[scope, "selected"]

        def share(key: str, scope: str = scope, selected: int = selected) -> str:
            value = rows[scope, key]
            return f"{value} ({100 * value / selected:.1f}%)" if selected else "-"

        print(
            f"{scope:<14} {rows[scope, 'tests']:>6} {selected:>9} "
            f"{share('policyd'):>14} {share('celpy'):>14}"
        )
    print(
        f"every test, excluded ones included: {rows['all', 'tests']}; policyd passes "
        f"{rows['all tests', 'policyd']}, cel-python {rows['all tests', 'celpy']}"
    )
    print(
        "cel-python failures among the selected tests, by kind: "
        + ", ".join(f"{kind} {count}" for kind, count in reasons.most_common())
    )
    print(f"wall time: policyd {policyd_seconds:.1f} s, cel-python {celpy_seconds:.1f} s")


if __name__ == "__main__":
    main()
