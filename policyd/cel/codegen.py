"""Generate one Python function from the lowered IR.

Why source code and not a tree of closures: a closure per node costs a Python
call per node per evaluation; one generated function evaluates the seed rule
in a few hundred nanoseconds. The price is care about injection, which is
handled by construction:

* no text from the expression (string literals, field names, map keys,
  variable names) is ever written into the source. Constants, names and
  helpers are bound in the function's globals under generated names (``_k3``);
  only ``int`` / ``float`` / ``bool`` / ``None`` literals are written, from
  their ``repr`` of an exact built-in type;
* message fields are read with ``obj.field`` only when the name is a plain
  identifier that is not a Python keyword and does not start with ``_``;
  anything else goes through ``runtime.get_field`` with a bound constant,
  which refuses names starting with ``_``;
* the function runs with empty ``__builtins__``.

String work: a call of ``cost.METERED_FUNCTIONS`` whose operands are not all
known at load time first adds their lengths to the evaluation's count (a local
of the generated function, so one evaluation's count is its own) and raises
``CelEvalError`` once the count passes ``cost.STRING_BUDGET``, before doing
the work. A program without such calls has no count at all.

Iterations: the load-time bound counts input lists as ``cost.ASSUMED_SIZE``
elements, but a pod or a request may bring longer ones (a pod publishing
thousands of adapters). Each comprehension whose range is not a literal, or
that runs inside another comprehension, adds its range's size to a second
count, and the evaluation stops with ``CelEvalError`` past
``cost.MAX_ITERATIONS``; a literal range at the top is bounded at load time.

Errors: every CEL error is a ``CelEvalError``. ``&&``, ``||``,
``@not_strictly_false`` and error-absorbing comprehension steps catch
exceptions of their operands and hold the error as a value; everything else
lets it propagate. The function's outermost handler turns any exception into
``CelEvalError``, so nothing else escapes ``Program.evaluate``.
"""

from __future__ import annotations

import keyword
import math
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Final

from policyd.cel import cost, ir, runtime, stdlib
from policyd.cel.errors import CelEvalError
from policyd.cel.values import INT64_MAX, INT64_MIN, UINT64_MAX, UInt

_PLAIN_FIELD: Final = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
_ACTIVATION: Final = "act"
_FUNCTION: Final = "_cel_program"
_SPENT: Final = "_spent"
_ITERATIONS: Final = "_iterations"
_SIMPLE_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class GenerationError(Exception):
    """The IR could not be turned into Python (e.g. nesting beyond Python's limits)."""


def _top_level_error(error: Exception) -> CelEvalError:
    """The error a program reports for an exception that reached its top level."""
    try:
        return runtime.as_error(error)
    except Exception as internal:
        return CelEvalError(f"internal error in compiled program: {internal!r}")


def _over_budget() -> None:
    raise CelEvalError(
        f"cost budget: this evaluation built or scanned more than {cost.STRING_BUDGET} "
        "characters of strings; the request's values (e.g. its headers) are too large "
        "for this expression"
    )


def _too_many_iterations() -> None:
    raise CelEvalError(
        f"cost budget: this evaluation iterated over more than {cost.MAX_ITERATIONS} "
        "elements; the pod's or the request's lists or maps are too long for this expression"
    )


def _text_size(value: Any) -> int:
    """The length a metered call on a ``dyn`` operand counts (0 for non-text)."""
    kind = value.__class__
    return len(value) if kind is str or kind is bytes else 0


def _base_namespace() -> dict[str, Any]:
    return {
        "__builtins__": {},
        "_Err": CelEvalError,
        "_as_error": runtime.as_error,
        "_logic_error": runtime.logic_error,
        "_logic_failure": runtime.logic_failure,
        "_condition_error": runtime.condition_error,
        "_overflow": runtime.overflow,
        "_top_error": _top_level_error,
        "_unbound": runtime.unbound,
        "_UInt": UInt,
        "_iterate": runtime.iterate,
        "_is_set": runtime.is_set,
        "_select": runtime.select,
        "_has": runtime.has_field,
        "_make_map": runtime.make_map,
        "_field": runtime.get_field,
        "_over_budget": _over_budget,
        "_too_many_iterations": _too_many_iterations,
        "_text_size": _text_size,
        "len": len,
        "_float": float,
        "Exception": Exception,
        "KeyError": KeyError,
    }


class _Generator:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.namespace = _base_namespace()
        self._depth = 1
        self._counter = 0
        self._bound: dict[int, str] = {}
        self._bindings: list[dict[str, str]] = [{}]
        self.metered = False
        self.counts_iterations = False
        self._loops = 0  # comprehensions around the code being generated

    # -- emission helpers ------------------------------------------------------------

    def emit(self, line: str) -> None:
        self.lines.append("    " * self._depth + line)

    @contextmanager
    def block(self) -> Iterator[None]:
        """An indented block; variable bindings made inside stay inside."""
        self._depth += 1
        self._bindings.append({})
        try:
            yield
        finally:
            self._bindings.pop()
            self._depth -= 1

    def temp(self, prefix: str = "t") -> str:
        self._counter += 1
        return f"{prefix}{self._counter}"

    def bind(self, value: Any, prefix: str = "_k") -> str:
        """A global name holding ``value`` (each object bound once)."""
        key = id(value)
        name = self._bound.get(key)
        if name is None:
            self._counter += 1
            name = f"{prefix}{self._counter}"
            self.namespace[name] = value
            self._bound[key] = name
        return name

    def literal(self, value: Any) -> str:
        """Python text for a constant: a literal for exact simple built-ins only."""
        kind = value.__class__
        if value is None or kind is bool:
            return repr(value)
        if kind is int:
            return f"({value!r})" if value < 0 else repr(value)
        if kind is float and math.isfinite(value):
            return f"({value!r})"
        return self.bind(value)

    # -- expressions -----------------------------------------------------------------

    def value(self, node: ir.Node) -> str:
        """Emit what ``node`` needs and return a Python expression for its value."""
        method: Callable[[_Generator, Any], str] = _EMITTERS[node.__class__]
        return method(self, node)

    def _const(self, node: ir.Const) -> str:
        return self.literal(node.value)

    def _var(self, node: ir.Var) -> str:
        for frame in reversed(self._bindings):
            if node.name in frame:
                return frame[node.name]
        local = self.temp("v")
        name = self.bind(node.name)
        self.emit("try:")
        self.emit(f"    {local} = {_ACTIVATION}[{name}]")
        self.emit("except KeyError:")
        self.emit(f"    _unbound({name})")
        if node.type.kind == "uint":
            self.emit(f"{local} = _UInt({local})")
        elif node.type.kind == "double":
            self.emit(f"{local} = {local} * 1.0")
        self._bindings[-1][node.name] = local
        return local

    def _local(self, node: ir.Local) -> str:
        if node.may_hold_error:
            self.emit(f"if {node.slot}.__class__ is _Err: raise {node.slot}")
        return node.slot

    def _attr(self, node: ir.Attr) -> str:
        operand = self.value(node.operand)
        field = node.field
        if _PLAIN_FIELD.fullmatch(field) and not keyword.iskeyword(field):
            text = f"{operand}.{field}"
        else:
            text = f"_field({operand}, {self.bind(field)})"
        # A double field may hold a Python int (Pod(kv_cache=0)); make it a float.
        return f"({text} * 1.0)" if node.type.kind == "double" else text

    def _map_key(self, node: ir.MapKey) -> str:
        return f"{self.value(node.operand)}[{self.bind(node.key)}]"

    def _dyn_select(self, node: ir.DynSelect) -> str:
        return f"_select({self.value(node.operand)}, {self.bind(node.field)})"

    def _presence(self, node: ir.Presence) -> str:
        operand = self.value(node.operand)
        field = self.bind(node.field)
        if node.test == "key":
            return f"({field} in {operand})"
        if node.test == "dyn":
            return f"_has({operand}, {field})"
        value = f"_field({operand}, {field})"
        if node.test == "sized":
            return f"(len({value}) > 0)"
        if node.test == "message":
            return f"({value} is not None)"
        return f"_is_set({value})"

    def _fail(self, node: ir.Fail) -> str:
        self.emit(f"raise _Err({self.bind(node.message)})")
        return "None"

    def _call(self, node: ir.Call) -> str:
        args = [self.value(arg) for arg in node.args]
        overload = stdlib.OVERLOADS.get(node.name)
        if (overload.function if overload else node.name) in cost.METERED_FUNCTIONS:
            args = self._metered(node.args, args)
        if node.inline is None:
            return f"{self.bind(node.impl, '_f')}({', '.join(args)})"
        text = node.inline.format(*(f"({arg})" for arg in args))
        if node.checked is None:
            return text
        result = self.temp()
        self.emit(f"{result} = {text}")
        if node.checked == "int64":
            self.emit(f"if not {INT64_MIN} <= {result} <= {INT64_MAX}: _overflow()")
            return result
        self.emit(f"if not 0 <= {result} <= {UINT64_MAX}: _overflow()")
        return f"_UInt({result})"

    def _metered(self, nodes: tuple[ir.Node, ...], args: list[str]) -> list[str]:
        """Count the string work of a metered call on ``args`` (its operands'
        Python expressions), each evaluated once into a name; returns the names."""
        known = 0
        counted: list[str] = []
        names: list[str] = []
        for node, text in zip(nodes, args, strict=True):
            kind = node.type.kind
            if isinstance(node, ir.Const):
                if node.value.__class__ in (str, bytes):
                    known += len(node.value)
                names.append(text)
                continue
            if kind not in ("string", "bytes", ir.DYN_KIND):
                names.append(text)
                continue
            name = text
            if not _SIMPLE_NAME.fullmatch(text):
                name = self.temp()
                self.emit(f"{name} = {text}")
            counted.append(f"len({name})" if kind != ir.DYN_KIND else f"_text_size({name})")
            names.append(name)
        if counted:
            self.metered = True
            self.emit(f"{_SPENT} += {' + '.join(counted)}" + (f" + {known}" if known else ""))
            self.emit(f"if {_SPENT} > {cost.STRING_BUDGET}: _over_budget()")
        return names

    def _list_lit(self, node: ir.ListLit) -> str:
        items = [self.value(item) for item in node.items]
        return f"[{', '.join(items)}]"

    def _map_lit(self, node: ir.MapLit) -> str:
        keys = [self.value(key) for key in node.keys]
        values = [self.value(value) for value in node.values]
        return (
            f"_make_map(({''.join(k + ', ' for k in keys)}), ({''.join(v + ', ' for v in values)}))"
        )

    # -- control flow ----------------------------------------------------------------

    def _guarded(self, target: str, node: ir.Node, *, on_error: str | None = None) -> None:
        """``target = node`` with an error held as a value (or replaced by ``on_error``)."""
        self.emit("try:")
        with self.block():
            self.emit(f"{target} = {self.value(node)}")
        self.emit("except Exception as _x:")
        with self.block():
            self.emit(f"{target} = _as_error(_x)")
            if on_error is not None:
                self.emit(f"{target} = {on_error}")

    def _logical(self, operands: tuple[ir.Node, ...], decisive: bool, *, hold: bool = False) -> str:
        """``&&`` (decisive False) / ``||`` (decisive True) over any number of
        operands: the decisive value wins whatever the others are (errors
        included); else all must be the other bool; else the first error,
        raised, or with ``hold`` returned as the value (so no ``try`` is needed
        around a comprehension step that is a logical operator)."""
        result = self.temp("r")
        held: list[str] = []
        # One pass of a loop, so that any operand can ``break`` out once decided
        # while the source stays flat however many operands there are.
        self.emit("while True:")
        with self.block():
            for operand in operands:
                current = self.temp()
                held.append(current)
                if isinstance(operand, ir.Local):  # already a held value, maybe an error
                    self.emit(f"{current} = {operand.slot}")
                else:
                    self._guarded(current, operand)
                self.emit(f"if {current} is {decisive}:")
                with self.block():
                    self.emit(f"{result} = {decisive}")
                    self.emit("break")
            all_other = " and ".join(f"{name} is {not decisive}" for name in held)
            self.emit(f"if {all_other}:")
            with self.block():
                self.emit(f"{result} = {not decisive}")
                self.emit("break")
            if hold:
                self.emit(f"{result} = _logic_failure({', '.join(held)})")
                self.emit("break")
            else:
                self.emit(f"_logic_error({', '.join(held)})")
        return result

    def _and(self, node: ir.And) -> str:
        return self._logical(node.operands, False)

    def _or(self, node: ir.Or) -> str:
        return self._logical(node.operands, True)

    def _not_strictly_false(self, node: ir.NotStrictlyFalse) -> str:
        operand = node.operand
        if isinstance(operand, ir.Local):
            return f"({operand.slot} is not False)"
        if (
            isinstance(operand, ir.Call)
            and operand.name == "logical_not"
            and isinstance(operand.args[0], ir.Local)
        ):
            return f"({operand.args[0].slot} is not True)"
        held = self.temp()
        self._guarded(held, operand, on_error="True")
        return f"({held} is not False)"

    def _conditional(self, node: ir.Conditional) -> str:
        condition = self.temp()
        result = self.temp("r")
        self.emit(f"{condition} = {self.value(node.condition)}")
        self.emit(f"if {condition} is True:")
        with self.block():
            self.emit(f"{result} = {self.value(node.then)}")
        self.emit(f"elif {condition} is False:")
        with self.block():
            self.emit(f"{result} = {self.value(node.otherwise)}")
        self.emit("else:")
        with self.block():
            self.emit(f"_condition_error({condition})")
        return result

    def _comprehension(self, node: ir.Comprehension) -> str:
        items = self.temp()
        self.emit(f"{items} = {self.value(node.range)}")
        if node.range.type.kind not in ("list", "map"):
            self.emit(f"{items} = _iterate({items})")
        if self._loops or not isinstance(node.range, ir.Const):
            self.counts_iterations = True
            self.emit(f"{_ITERATIONS} += len({items})")
            self.emit(f"if {_ITERATIONS} > {cost.MAX_ITERATIONS}: _too_many_iterations()")
        appended = _appended_element(node)
        if appended is not None:
            self.emit(f"{node.accu_slot} = []")
        else:
            self.emit(f"{node.accu_slot} = {self.value(node.init)}")
        self.emit(f"for {node.iter_slot} in {items}:")
        self._loops += 1
        with self.block():
            self._loop_condition(node.condition)
            if appended is not None:
                self._append_step(node, *appended)
            elif node.strict:
                self.emit(f"{node.accu_slot} = {self.value(node.step)}")
            elif isinstance(node.step, ir.And | ir.Or):  # exists / all: errors held, not raised
                held = self._logical(node.step.operands, isinstance(node.step, ir.Or), hold=True)
                self.emit(f"{node.accu_slot} = {held}")
            else:
                self._guarded(node.accu_slot, node.step)
        self._loops -= 1
        return self.value(node.result)

    def _loop_condition(self, condition: ir.Node) -> None:
        if isinstance(condition, ir.Const) and condition.value is True:
            return
        if isinstance(condition, ir.NotStrictlyFalse):
            self.emit(f"if not {self.value(condition)}: break")
            return
        held = self.temp()
        self.emit(f"{held} = {self.value(condition)}")
        self.emit(f"if {held} is False: break")
        self.emit(f"if {held} is not True: _condition_error({held})")

    def _append_step(self, node: ir.Comprehension, guard: ir.Node | None, element: ir.Node) -> None:
        """``accu + [x]`` (map) or ``p ? accu + [x] : accu`` (filter), as an append
        to a list only this loop can see."""
        if guard is None:
            self.emit(f"{node.accu_slot}.append({self.value(element)})")
            return
        condition = self.temp()
        self.emit(f"{condition} = {self.value(guard)}")
        self.emit(f"if {condition} is True:")
        with self.block():
            self.emit(f"{node.accu_slot}.append({self.value(element)})")
        self.emit(f"elif {condition} is not False:")
        with self.block():
            self.emit(f"_condition_error({condition})")


_EMITTERS: Final[dict[type[ir.Node], Callable[[_Generator, Any], str]]] = {
    ir.Const: _Generator._const,
    ir.Var: _Generator._var,
    ir.Local: _Generator._local,
    ir.Attr: _Generator._attr,
    ir.MapKey: _Generator._map_key,
    ir.DynSelect: _Generator._dyn_select,
    ir.Presence: _Generator._presence,
    ir.Fail: _Generator._fail,
    ir.Call: _Generator._call,
    ir.ListLit: _Generator._list_lit,
    ir.MapLit: _Generator._map_lit,
    ir.And: _Generator._and,
    ir.Or: _Generator._or,
    ir.NotStrictlyFalse: _Generator._not_strictly_false,
    ir.Conditional: _Generator._conditional,
    ir.Comprehension: _Generator._comprehension,
}


def _is_accu(node: ir.Node, slot: str) -> bool:
    return isinstance(node, ir.Local) and node.slot == slot


def _single_append(node: ir.Node, slot: str) -> ir.Node | None:
    """X when ``node`` is ``accu + [X]`` resolved to the list overload."""
    if (
        isinstance(node, ir.Call)
        and node.name == "add_list"
        and _is_accu(node.args[0], slot)
        and isinstance(node.args[1], ir.ListLit)
        and len(node.args[1].items) == 1
    ):
        return node.args[1].items[0]
    return None


def _appended_element(node: ir.Comprehension) -> tuple[ir.Node | None, ir.Node] | None:
    """(guard, element) when the loop only appends to a fresh list it returns."""
    if not (
        node.strict
        and isinstance(node.init, ir.Const)
        and node.init.value == ()
        and _is_accu(node.result, node.accu_slot)
    ):
        return None
    element = _single_append(node.step, node.accu_slot)
    if element is not None:
        return None, element
    step = node.step
    if isinstance(step, ir.Conditional) and _is_accu(step.otherwise, node.accu_slot):
        element = _single_append(step.then, node.accu_slot)
        if element is not None:
            return step.condition, element
    return None


def strict_variables(node: ir.Node) -> dict[str, ir.Var]:
    """Variables every evaluation of ``node`` reads with errors propagating, so
    that an unbound one makes the whole result an error."""
    if isinstance(node, ir.Var):
        return {node.name: node}
    if isinstance(node, ir.Attr | ir.MapKey | ir.DynSelect | ir.Presence):
        return strict_variables(node.operand)
    if isinstance(node, ir.Call | ir.ListLit | ir.MapLit):
        parts = (
            node.args
            if isinstance(node, ir.Call)
            else node.items
            if isinstance(node, ir.ListLit)
            else (*node.keys, *node.values)
        )
        found: dict[str, ir.Var] = {}
        for part in parts:
            found.update(strict_variables(part))
        return found
    if isinstance(node, ir.And | ir.Or):
        each = [strict_variables(operand) for operand in node.operands]
        return {name: var for name, var in each[0].items() if all(name in e for e in each[1:])}
    if isinstance(node, ir.Conditional):
        then = strict_variables(node.then)
        otherwise = strict_variables(node.otherwise)
        both = {name: var for name, var in then.items() if name in otherwise}
        return {**strict_variables(node.condition), **both}
    if isinstance(node, ir.Comprehension):
        return {
            **strict_variables(node.range),
            **strict_variables(node.init),
            **strict_variables(node.result),
        }
    return {}


def generate(lowered: ir.Lowered) -> tuple[Callable[[Mapping[str, Any]], Any], str]:
    """The Python function evaluating ``lowered`` and its source text."""
    generator = _Generator()
    generator._depth = 2
    for variable in sorted(strict_variables(lowered.root).values(), key=lambda var: var.name):
        # Needed on every path, so a missing one is an error whatever happens:
        # load it once, up front, instead of inside each guarded operand.
        generator.value(variable)
    result = generator.value(lowered.root)
    body = generator.lines
    if generator.counts_iterations:
        body = [f"        {_ITERATIONS} = 0", *body]
    if generator.metered:
        body = [f"        {_SPENT} = 0", *body]
    source = "\n".join(
        [
            f"def {_FUNCTION}({_ACTIVATION}):",
            "    try:",
            *body,
            f"        return {result}",
            "    except _Err:",
            "        raise",
            "    except Exception as _x:",
            "        raise _top_error(_x) from None",
            "",
        ]
    )
    try:
        code = compile(source, "<cel program>", "exec")
    except (SyntaxError, RecursionError, MemoryError) as error:
        raise GenerationError(f"Python cannot compile the lowered program: {error}") from None
    namespace = generator.namespace
    exec(code, namespace)
    function: Callable[[Mapping[str, Any]], Any] = namespace[_FUNCTION]
    return function, source
