"""Compile CEL source against declared variables into a callable ``Program``.

The pipeline, all at load time:

1. parse and type-check with Google's cel-cpp (``cel-expr-python``), the
   authority on what a valid rule is; errors carry line and column;
2. bound the cost (``cost.py``): expressions whose work could grow with the
   square of their inputs do not load;
3. lower the checked tree (``lowering.py``), folding ``constants``, and
   generate one Python function from it (``codegen.py``);
4. if step 3 meets anything it does not lower, evaluate with cel-expr-python
   instead (``fallback.py``), and say so in ``Program.lowered`` / ``report``.

``Program.evaluate(activation)`` maps each declared variable name to a plain
Python value (objects with attributes for ``pod`` / ``request``; see
``values.py``) and returns a plain Python value or raises ``CelEvalError``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeAlias

from cel.expr import checked_pb2, syntax_pb2
from cel_expr_python import cel
from google.protobuf import any_pb2, message

from policyd.cel import codegen, cost, lowering
from policyd.cel.errors import CelCompileError
from policyd.cel.fallback import FallbackEvaluator
from policyd.cel.reads import reads_of
from policyd.cel.schema import descriptor_pool_for_schema
from policyd.cel.values import Duration, Timestamp, UInt

Activation = Mapping[str, Any]
Evaluator = Callable[[Activation], Any]
# A declared variable's type, as the checker knows it (``cel_type_of``, ``Program.value_type``).
DeclaredType: TypeAlias = cel.Type
DYN: DeclaredType = cel.Type.DYN

_POSITION = re.compile(r"<input>:(\d+):(\d+): (.*)")
_CHECKED_URL = "type.googleapis.com/cel.expr.CheckedExpr"


@dataclass(frozen=True, slots=True)
class Program:
    """A compiled expression: call ``evaluate(activation)`` per input.

    ``evaluate`` returns a plain Python value or raises ``CelEvalError``; no
    other exception escapes it. ``lowered`` says whether it runs as generated
    Python (True) or through cel-expr-python (False); ``report`` says why and
    what was done (constants folded, cost estimate). ``python_source`` is the
    generated function, for ``explain`` output and for review. ``reads``
    names what the expression refers to (``policyd.cel.reads``);
    ``value_type`` is its checked type, to declare a variable that holds it.
    """

    source: str
    return_type: str
    value_type: DeclaredType
    reads: frozenset[str]
    evaluate: Evaluator
    lowered: bool
    report: tuple[str, ...] = field(default=())
    python_source: str | None = None


class Environment:
    """Variables a family of expressions may use, with their CEL types."""

    def __init__(self, variables: Mapping[str, cel.Type]) -> None:
        self._variables = dict(variables)
        self._env = cel.NewEnv(
            descriptor_pool=descriptor_pool_for_schema(), variables=self._variables
        )

    @property
    def variables(self) -> Mapping[str, cel.Type]:
        return self._variables

    def check(self, source: str, *, checked: bool = True) -> cel.Expression:
        """Parse and (unless ``checked`` is False) type-check ``source``, or raise
        ``CelCompileError``."""
        try:
            return self._env.compile(source, disable_check=not checked)
        except RuntimeError as error:
            raise _compile_error(str(error)) from None

    def compile(
        self, source: str, *, constants: Activation | None = None, checked: bool = True
    ) -> Program:
        """Compile ``source``; ``constants`` are variable values known at load time.

        ``checked=False`` skips the type checker and treats every value as
        ``dyn`` (as the CEL conformance suite's unchecked tests do); policies
        always use the default.
        """
        expression = self.check(source, checked=checked)
        folded_constants = self._coerce_constants(constants or {})
        tree, type_map, reference_map = _unpack(expression.serialize())
        estimate = cost.estimate(
            tree.expr,
            type_map=type_map,
            source_info=tree.source_info,
            constants=folded_constants,
        )
        value_type = expression.return_type()
        return_type = value_type.name()
        reads = reads_of(tree.expr, reference_map, frozenset(self._variables))
        try:
            lowered = lowering.lower(
                tree.expr,
                type_map=type_map,
                reference_map=reference_map,
                variables=frozenset(self._variables),
                constants=folded_constants,
                pool=descriptor_pool_for_schema(),
                checked=checked,
            )
            evaluate, python_source = codegen.generate(lowered)
        except (lowering.NotLoweredError, codegen.GenerationError) as reason:
            if checked and estimate.runtime_strings:
                # cel-expr-python has no budget to stop it: a rule must not rely on it.
                raise CelCompileError(
                    f"cost bound: this expression is not lowered ({reason}), and "
                    "cel-expr-python, which would evaluate it, cannot count the string "
                    "work it does on run-time values (concatenation, contains, matches, "
                    "conversions); rewrite it without that construct"
                ) from None
            notes = [f"not lowered: {reason}", "evaluated by cel-expr-python (slower)"]
            if "TIMESTAMP" in return_type or "DURATION" in return_type:
                notes.append("timestamps and durations it returns are rounded to microseconds")
            return Program(
                source=source,
                return_type=return_type,
                value_type=value_type,
                reads=reads,
                evaluate=FallbackEvaluator(expression, self._variables, folded_constants),
                lowered=False,
                report=(*notes, estimate.describe()),
            )
        return Program(
            source=source,
            return_type=return_type,
            value_type=value_type,
            reads=reads,
            evaluate=evaluate,
            lowered=True,
            report=(
                f"lowered to Python; {lowered.folded} constant folding(s)",
                estimate.describe(),
            ),
            python_source=python_source,
        )

    def _coerce_constants(self, constants: Activation) -> dict[str, Any]:
        coerced = {}
        for name, value in constants.items():
            declared = self._variables.get(name)
            if declared is None:
                raise CelCompileError(f"constant {name!r} is not a declared variable")
            try:
                coerced[name] = coerce(value, declared.name())
            except TypeError as error:
                raise CelCompileError(f"constant {name!r}: {error}") from None
        return coerced


def coerce(value: Any, type_name: str) -> Any:
    """``value`` as the runtime value of a declared type (``cel.Type.name()``
    spelling: ``INT``, ``LIST<DOUBLE>``, ``MAP<STRING, INT>``), or TypeError."""
    base, _, inner = type_name.partition("<")
    inner = inner[:-1] if inner.endswith(">") else inner
    is_bool = isinstance(value, bool)
    if base == "INT" and isinstance(value, int) and not is_bool:
        return int(value)
    if base == "UINT" and isinstance(value, int) and not is_bool and value >= 0:
        return UInt(value)
    if base == "DOUBLE" and isinstance(value, int | float) and not is_bool:
        return float(value)
    if (
        (base == "BOOL" and is_bool)
        or (base == "STRING" and isinstance(value, str))
        or (base == "BYTES" and isinstance(value, bytes))
        or (base == "DURATION" and isinstance(value, Duration))
        or (base == "TIMESTAMP" and isinstance(value, Timestamp))
        or base in ("DYN", "NULL")
        or "." in base
    ):
        return value
    if base == "LIST" and isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return tuple(coerce(item, inner) for item in value)
    if base == "MAP" and isinstance(value, Mapping):
        key_type, _, value_type = inner.partition(", ")
        return MappingProxyType(
            {coerce(k, key_type): coerce(v, value_type) for k, v in value.items()}
        )
    raise TypeError(f"expected a value of type {type_name}, got {value!r}")


def _unpack(
    serialized: bytes,
) -> tuple[
    checked_pb2.CheckedExpr | syntax_pb2.ParsedExpr,
    Mapping[int, checked_pb2.Type],
    Mapping[int, checked_pb2.Reference],
]:
    wrapper = any_pb2.Any.FromString(serialized)
    try:
        if wrapper.type_url == _CHECKED_URL:
            checked = checked_pb2.CheckedExpr()
            wrapper.Unpack(checked)
            return checked, dict(checked.type_map), dict(checked.reference_map)
        parsed = syntax_pb2.ParsedExpr()
        if wrapper.Unpack(parsed):
            return parsed, {}, {}
    except message.DecodeError:
        # Deeply nested macros exceed protobuf's decoding depth (100 levels).
        raise CelCompileError(
            "cost bound: the expression nests too deeply to analyse; split it into "
            "several rules or variables"
        ) from None
    raise CelCompileError(f"unexpected serialized expression {wrapper.type_url}")


def _compile_error(text: str) -> CelCompileError:
    match = _POSITION.search(text)
    if match is None:
        return CelCompileError(text.strip())
    message = match.group(3).split(" | ")[0].strip()
    message = re.sub(r"\s*\[INVALID_ARGUMENT\]$", "", message)
    return CelCompileError(message, int(match.group(1)), int(match.group(2)))
