"""A load-time bound on how much work one evaluation of an expression can do.

Rule files are written by many hands and evaluated once per pod per request,
so an expression whose work grows with the square of its inputs must not
load. The estimate counts evaluation steps as a polynomial in N, the size of
any list or map not known at load time (``pod.active_loras``,
``request.headers``); literal lists and ``constants`` have their real sizes.

* Work that is quadratic or worse in N (a comprehension over an input list
  whose body does work proportional to another input list: a nested
  comprehension, ``x in other_list``, list equality) is rejected.
* Linear work is accepted when its estimate for lists of ``ASSUMED_SIZE``
  elements stays within ``MAX_COST`` steps (roughly milliseconds of Python),
  which bounds big literal fan-outs as well.

String work is proportional to the strings' sizes, not one step: the
operations in ``METERED_FUNCTIONS`` build or scan their string and bytes
operands, and an evaluation may do so for at most ``STRING_BUDGET``
characters (bytes for bytes values). What is known at load time (literals,
``constants``) is counted here, over every iteration of the comprehensions
around it; what depends on the request or the pod (a header's size) is known
only at run time, where the generated program counts it (``codegen.py``) and
stops with a ``CelEvalError`` past the budget (``Estimate.runtime_strings``
says there is such work: cel-expr-python, which cannot count it, must not run
that expression).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import zip_longest
from typing import Any, Final

from cel.expr import checked_pb2, syntax_pb2

from policyd.cel.errors import CelCompileError

ASSUMED_SIZE: Final = 100
MAX_COST: Final = 100_000
# Elements one evaluation may iterate over, all comprehensions together: what
# MAX_COST allows for lists of ASSUMED_SIZE, whatever size the lists have at
# run time (``codegen.py`` counts them).
MAX_ITERATIONS: Final = MAX_COST
# Characters of string work per evaluation: a few passes over the largest
# request-header block the serving path accepts (64 KiB), and, like MAX_COST,
# about a millisecond of work and a megabyte of memory at most.
STRING_BUDGET: Final = 1 << 20
# CEL functions whose work is proportional to the length of their string or
# bytes operands: concatenation, substring and regex search, and conversions
# that parse or copy text. Comparisons (``==``, ``startsWith``...) stop at the
# shorter operand, ``size`` and map lookups at a cached length and hash.
METERED_FUNCTIONS: Final = frozenset(
    {
        "_+_",
        "contains",
        "matches",
        "string",
        "bytes",
        "int",
        "uint",
        "double",
        "timestamp",
        "duration",
    }
)


@dataclass(frozen=True, slots=True)
class Polynomial:
    """Non-negative coefficients of 1, N, N**2..."""

    terms: tuple[int, ...]

    @staticmethod
    def constant(value: int) -> Polynomial:
        return Polynomial((value,))

    @property
    def degree(self) -> int:
        nonzero = [index for index, term in enumerate(self.terms) if term]
        return nonzero[-1] if nonzero else 0

    def __add__(self, other: Polynomial) -> Polynomial:
        pairs = zip_longest(self.terms, other.terms, fillvalue=0)
        return Polynomial(tuple(a + b for a, b in pairs))

    def __mul__(self, other: Polynomial) -> Polynomial:
        terms = [0] * (len(self.terms) + len(other.terms) - 1)
        for i, a in enumerate(self.terms):
            for j, b in enumerate(other.terms):
                terms[i + j] += a * b
        return Polynomial(tuple(terms))

    def maximum(self, other: Polynomial) -> Polynomial:
        """Term by term: a bound on either of two sizes (the branches of ``?:``)."""
        pairs = zip_longest(self.terms, other.terms, fillvalue=0)
        return Polynomial(tuple(max(a, b) for a, b in pairs))

    def at(self, size: int) -> int:
        return sum(term * size**power for power, term in enumerate(self.terms))

    def describe(self) -> str:
        parts = []
        for power, term in reversed(list(enumerate(self.terms))):
            if term:
                parts.append(
                    str(term) if power == 0 else f"{term}*N" + (f"^{power}" if power > 1 else "")
                )
        return " + ".join(parts) or "0"


ONE: Final = Polynomial.constant(1)
UNBOUNDED: Final = Polynomial((0, 1))


@dataclass(frozen=True, slots=True)
class Estimate:
    """Steps, and characters of string work known at load time, as polynomials in N;
    ``runtime_strings``: some string work depends on values known only at run time."""

    cost: Polynomial
    known_strings: Polynomial
    runtime_strings: bool

    def describe(self) -> str:
        strings = self.known_strings.at(ASSUMED_SIZE)
        return (
            f"estimated cost {self.cost.describe()} steps (N = size of an input list), "
            f"{self.cost.at(ASSUMED_SIZE)} for lists of {ASSUMED_SIZE}"
            + (f"; {strings} characters of string work known at load time" if strings else "")
        )


class _Estimator:
    def __init__(
        self,
        type_map: Mapping[int, checked_pb2.Type],
        source_info: syntax_pb2.SourceInfo,
        constants: Mapping[str, Any],
    ) -> None:
        self._types = type_map
        self._source = source_info
        self._constants = constants
        self._local_sizes: list[dict[str, Polynomial]] = []
        self._accumulators: list[str] = []
        # How often the expression being walked runs per evaluation (the product
        # of the sizes of the comprehensions around it), and the string work seen.
        self._repeats = ONE
        self.known_strings = Polynomial.constant(0)
        self.runtime_strings = False

    # -- sizes ---------------------------------------------------------------------

    def size(self, expr: syntax_pb2.Expr) -> Polynomial:
        """The size of the list or map ``expr`` evaluates to."""
        which = expr.WhichOneof("expr_kind")
        if which == "list_expr":
            return Polynomial.constant(len(expr.list_expr.elements))
        if which == "struct_expr":
            return Polynomial.constant(len(expr.struct_expr.entries))
        if which == "ident_expr":
            name = expr.ident_expr.name
            for frame in reversed(self._local_sizes):
                if name in frame:
                    return frame[name]
            value = self._constants.get(name)
            if isinstance(value, list | tuple | dict | Mapping):
                return Polynomial.constant(len(value))
            return UNBOUNDED
        if which == "call_expr":
            call = expr.call_expr
            if call.function == "_+_" and len(call.args) == 2:
                return self.size(call.args[0]) + self.size(call.args[1])
            if call.function == "_?_:_" and len(call.args) == 3:
                return self.size(call.args[1]).maximum(self.size(call.args[2]))
        if which == "comprehension_expr":
            return self.size(expr.comprehension_expr.iter_range)
        return UNBOUNDED

    def text_size(self, expr: syntax_pb2.Expr) -> int | None:
        """The length of the string or bytes ``expr`` evaluates to, when known at load time."""
        which = expr.WhichOneof("expr_kind")
        if which == "const_expr":
            constant = expr.const_expr
            kind = constant.WhichOneof("constant_kind")
            if kind == "string_value":
                return len(constant.string_value)
            if kind == "bytes_value":
                return len(constant.bytes_value)
            return None
        if which == "ident_expr":
            value = self._constants.get(expr.ident_expr.name)
            return len(value) if isinstance(value, str | bytes) else None
        if which == "call_expr" and expr.call_expr.function == "_+_":
            sizes = [self.text_size(arg) for arg in expr.call_expr.args]
            if len(sizes) == 2 and None not in sizes:
                return sum(size for size in sizes if size is not None)
        return None

    # -- cost ------------------------------------------------------------------------

    def cost(self, expr: syntax_pb2.Expr) -> Polynomial:
        which = expr.WhichOneof("expr_kind")
        if which == "select_expr":
            return ONE + self.cost(expr.select_expr.operand)
        if which == "call_expr":
            return self._call_cost(expr)
        if which == "list_expr":
            return sum((self.cost(e) for e in expr.list_expr.elements), ONE)
        if which == "struct_expr":
            entries = expr.struct_expr.entries
            return sum(
                (
                    self.cost(e.value) + (self.cost(e.map_key) if e.HasField("map_key") else ONE)
                    for e in entries
                ),
                ONE,
            )
        if which == "comprehension_expr":
            return self._comprehension_cost(expr)
        return ONE

    def _call_cost(self, expr: syntax_pb2.Expr) -> Polynomial:
        call = expr.call_expr
        args = ([call.target] if call.HasField("target") else []) + list(call.args)
        total = sum((self.cost(arg) for arg in args), ONE)
        if call.function in METERED_FUNCTIONS:
            self._count_strings(args)
        # ``x in list`` and equality of lists or maps walk the right operand.
        sized = (call.function == "@in" and self._is_collection(args[-1], maps=False)) or (
            call.function in ("_==_", "_!=_") and self._is_collection(args[-1])
        )
        if sized and len(args) == 2:
            total = total + self.size(args[1])
        elif call.function == "_+_" and len(args) == 2 and self._is_collection(args[0]):
            # ``@result + [x]`` inside a macro appends in place (here and in cel-cpp).
            if not self._is_accumulator(args[0]):
                total = total + self.size(args[0])
            total = total + self.size(args[1])
        return total

    def _count_strings(self, args: list[syntax_pb2.Expr]) -> None:
        """Add the known part of a metered call's string work. A call on known
        operands only is folded at load time and costs nothing per evaluation."""
        texts = [arg for arg in args if self._may_be_text(arg)]
        sizes = [self.text_size(arg) for arg in texts]
        if None in sizes:
            self.runtime_strings = True
            known = sum(size for size in sizes if size is not None)
            self.known_strings = self.known_strings + self._repeats * Polynomial.constant(known)

    def _may_be_text(self, expr: syntax_pb2.Expr) -> bool:
        """Whether ``expr`` may be a string or bytes (``1u + 2u`` does no string work)."""
        checked = self._types.get(expr.id)
        if checked is None:  # unchecked: assume the worst
            return True
        kind = checked.WhichOneof("type_kind")
        return kind == "dyn" or (
            kind == "primitive"
            and checked.primitive in (checked_pb2.Type.STRING, checked_pb2.Type.BYTES)
        )

    def _is_accumulator(self, expr: syntax_pb2.Expr) -> bool:
        return (
            expr.WhichOneof("expr_kind") == "ident_expr"
            and bool(self._accumulators)
            and expr.ident_expr.name == self._accumulators[-1]
        )

    def _is_collection(self, expr: syntax_pb2.Expr, *, maps: bool = True) -> bool:
        """Whether ``expr`` may be a list (or a map, when ``maps``): an operation on it
        may take time proportional to its size (a map lookup does not)."""
        checked = self._types.get(expr.id)
        if checked is None:  # unchecked: assume the worst
            return True
        kinds = ("list_type", "map_type", "dyn") if maps else ("list_type", "dyn")
        return checked.WhichOneof("type_kind") in kinds

    def _comprehension_cost(self, expr: syntax_pb2.Expr) -> Polynomial:
        loop = expr.comprehension_expr
        range_size = self.size(loop.iter_range)
        setup = self.cost(loop.iter_range) + self.cost(loop.accu_init)
        self._local_sizes.append({loop.iter_var: UNBOUNDED, loop.accu_var: range_size})
        self._accumulators.append(loop.accu_var)
        outer_repeats = self._repeats
        self._repeats = outer_repeats * range_size
        try:
            body = self.cost(loop.loop_condition) + self.cost(loop.loop_step)
            self._repeats = outer_repeats
            result = self.cost(loop.result)
        finally:
            self._repeats = outer_repeats
            self._local_sizes.pop()
            self._accumulators.pop()
        per_loop = range_size * body
        if per_loop.degree >= 2:
            line, column = self._position(expr.id)
            raise CelCompileError(
                "cost bound: this comprehension iterates over "
                f"{self._describe(loop.iter_range)}, a list or map whose size is only known "
                "at run time, and does work proportional to another such list or map on "
                "each element (a nested comprehension, `in` on a list, or list equality); "
                "the cost would grow with the square of the input size. Iterate over a "
                "literal list or a constant, or look the value up in a map instead",
                line,
                column,
            )
        return setup + per_loop + result

    # -- reporting ---------------------------------------------------------------------

    def _position(self, expr_id: int) -> tuple[int, int]:
        offset = self._source.positions.get(expr_id, 0)
        line = 1
        line_start = 0
        for line_end in self._source.line_offsets:
            if offset < line_end:
                break
            line += 1
            line_start = line_end
        return line, offset - line_start + 1

    def _describe(self, expr: syntax_pb2.Expr) -> str:
        which = expr.WhichOneof("expr_kind")
        if which == "ident_expr":
            return f"`{expr.ident_expr.name}`"
        if which == "select_expr":
            inner = self._describe(expr.select_expr.operand).strip("`")
            return f"`{inner}.{expr.select_expr.field}`"
        line, column = self._position(expr.id)
        return f"the value at {line}:{column}"


def estimate(
    expr: syntax_pb2.Expr,
    *,
    type_map: Mapping[int, checked_pb2.Type],
    source_info: syntax_pb2.SourceInfo,
    constants: Mapping[str, Any],
) -> Estimate:
    """The cost estimate of ``expr``; raises ``CelCompileError`` when out of bounds."""
    estimator = _Estimator(type_map, source_info, constants)
    try:
        cost = estimator.cost(expr)
    except RecursionError:
        raise CelCompileError("cost bound: the expression nests too deeply") from None
    if cost.at(ASSUMED_SIZE) > MAX_COST:
        raise CelCompileError(
            f"cost bound: estimated {cost.at(ASSUMED_SIZE)} evaluation steps for input lists "
            f"of {ASSUMED_SIZE} elements, above the limit of {MAX_COST}; the expression "
            "does too much work per evaluation"
        )
    strings = estimator.known_strings.at(ASSUMED_SIZE)
    if strings > STRING_BUDGET:
        raise CelCompileError(
            f"cost bound: the expression builds or scans {strings} characters of strings "
            f"known at load time per evaluation (for input lists of {ASSUMED_SIZE} elements), "
            f"above the budget of {STRING_BUDGET}; long literals or constants concatenated "
            "or searched inside a comprehension repeat that work for every element"
        )
    return Estimate(cost, estimator.known_strings, estimator.runtime_strings)
