"""Lower cel-cpp's checked expression tree to the compiler's IR (``ir.py``).

Decisions made here, once, at load time: which declared variable or type a
name means, which overload a call is (and whether its inline Python is exact
for the static types), which ``constants`` replace variables, and which
subtrees fold to a constant. Whatever this module cannot lower raises
``NotLoweredError`` with the reason, and the program falls back to cel-expr-python.

An unchecked expression (``checked=False``) has no types or references: every
node is ``dyn``, names resolve against the declared variables (longest
qualified prefix first) and calls dispatch on run-time kinds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any, Final

from cel.expr import checked_pb2, syntax_pb2
from google.protobuf import descriptor, descriptor_pool

from policyd.cel import ir, runtime, stdlib
from policyd.cel.errors import CelEvalError
from policyd.cel.ir import DYN, StaticType
from policyd.cel.values import UInt

_BUILTIN_TYPE_NAMES: Final = frozenset(cel_type.name for cel_type in runtime.TYPE_OF_KIND.values())
_STRUCTURAL: Final = frozenset({"_&&_", "_||_", "_?_:_", "@not_strictly_false"})
# Kinds whose Python ``==`` / ``in`` is exactly CEL's for two values of that kind.
_PYTHON_EQUALITY_KINDS: Final = frozenset(
    {"bool", "int", "uint", "double", "string", "bytes", "null", "timestamp", "duration", "type"}
)
_PYTHON_MEMBERSHIP_KINDS: Final = frozenset({"bool", "int", "uint", "string", "bytes"})


# Type conversions: their errors name the field converted (``runtime.naming``).
_CONVERSIONS: Final = frozenset(
    {"int", "uint", "double", "string", "bytes", "bool", "timestamp", "duration"}
)


def _place(node: ir.Node) -> str | None:
    """The field ``node`` reads, as the expression writes it (``request.headers["x"]``),
    or None when it is not a plain field path."""
    if isinstance(node, ir.Var):
        return node.name
    if isinstance(node, ir.Attr | ir.DynSelect):
        operand = _place(node.operand)
        return None if operand is None else f"{operand}.{node.field}"
    if isinstance(node, ir.MapKey):
        operand = _place(node.operand)
        return None if operand is None else f'{operand}["{node.key}"]'
    if (
        isinstance(node, ir.Call)
        and node.name == "index_map"
        and isinstance(node.args[1], ir.Const)
        and isinstance(node.args[1].value, str)
    ):
        operand = _place(node.args[0])
        return None if operand is None else f'{operand}["{node.args[1].value}"]'
    return None


class NotLoweredError(Exception):
    """The expression uses something the compiler does not lower; the message says what."""


class _Scope:
    """Comprehension variables in scope: CEL name -> (Python slot, type, may hold error)."""

    def __init__(self) -> None:
        self.frames: list[dict[str, ir.Local]] = []

    def find(self, name: str) -> ir.Local | None:
        for frame in reversed(self.frames):
            if name in frame:
                return frame[name]
        return None


class Lowerer:
    """Lowers one expression; see ``lower``."""

    def __init__(
        self,
        *,
        type_map: Mapping[int, checked_pb2.Type],
        reference_map: Mapping[int, checked_pb2.Reference],
        variables: frozenset[str],
        constants: Mapping[str, Any],
        pool: descriptor_pool.DescriptorPool,
        checked: bool,
    ) -> None:
        self._type_map = type_map
        self._references = reference_map
        self._variables = variables
        self._constants = constants
        self._pool = pool
        self._checked = checked
        self._scope = _Scope()
        self._slots = 0
        self.folded = 0

    # -- entry -------------------------------------------------------------------

    def lower(self, expr: syntax_pb2.Expr) -> ir.Node:
        which = expr.WhichOneof("expr_kind")
        if which == "const_expr":
            return ir.Const(self._type(expr), constant_value(expr.const_expr))
        if which == "ident_expr":
            return self._ident(expr, expr.ident_expr.name)
        if which == "select_expr":
            return self._select(expr)
        if which == "call_expr":
            return self._call(expr)
        if which == "list_expr":
            if expr.list_expr.optional_indices:
                raise NotLoweredError("optional list elements ([?x]) are not lowered")
            items = tuple(self.lower(item) for item in expr.list_expr.elements)
            return self._maybe_fold_literal(ir.ListLit(self._type(expr), items))
        if which == "struct_expr":
            return self._struct(expr)
        if which == "comprehension_expr":
            return self._comprehension(expr)
        raise NotLoweredError(f"expression kind {which!r} is not lowered")

    # -- types -------------------------------------------------------------------

    def _type(self, expr: syntax_pb2.Expr) -> StaticType:
        proto = self._type_map.get(expr.id)
        if proto is None:
            return DYN
        try:
            return ir.static_type(proto)
        except ir.UnsupportedTypeError as error:
            raise NotLoweredError(str(error)) from None

    # -- names -------------------------------------------------------------------

    def _ident(self, expr: syntax_pb2.Expr, name: str) -> ir.Node:
        local = self._scope.find(name)
        if local is not None:
            return local
        reference = self._references.get(expr.id)
        if reference is not None:
            if reference.HasField("value"):
                return ir.Const(self._type(expr), constant_value(reference.value))
            name = reference.name or name
        static = self._type(expr)
        if name in self._variables:
            return self._variable(name, static)
        if self._checked and static.kind == "type":
            if static.denoted == "dyn":  # as in cel-cpp: dyn has no run-time type value
                return ir.Fail(DYN, "no value for 'dyn': it is not a run-time type")
            return ir.type_value(static.denoted)
        if not self._checked and name in _BUILTIN_TYPE_NAMES:
            return ir.type_value(name)
        if self._checked:
            raise NotLoweredError(f"name {name!r} resolves to nothing the compiler knows")
        return ir.Fail(DYN, f"undeclared reference to {name!r}")

    def _variable(self, name: str, static: StaticType) -> ir.Node:
        if name in self._constants:
            return ir.Const(static, self._constants[name])
        return ir.Var(static, name)

    def _qualified_name(self, expr: syntax_pb2.Expr) -> list[tuple[str, int]]:
        """For ``a.b.c``: [("a", id of a), ("a.b", id of .b), ("a.b.c", id of .c)]."""
        chain: list[syntax_pb2.Expr] = []
        node = expr
        while node.WhichOneof("expr_kind") == "select_expr" and not node.select_expr.test_only:
            chain.append(node)
            node = node.select_expr.operand
        if node.WhichOneof("expr_kind") != "ident_expr":
            return []
        names = [(node.ident_expr.name, node.id)]
        for select in reversed(chain):
            names.append((f"{names[-1][0]}.{select.select_expr.field}", select.id))
        return names

    # -- field selection -----------------------------------------------------------

    def _select(self, expr: syntax_pb2.Expr) -> ir.Node:
        select = expr.select_expr
        if not self._checked and not select.test_only:
            names = self._qualified_name(expr)
            if names and self._scope.find(names[0][0]) is None:
                for name, node_id in reversed(names):
                    if name in self._variables:
                        return self._rest_of_chain(expr, node_id, self._variable(name, DYN))
        operand = self.lower(select.operand)
        static = self._type(expr)
        field = select.field
        operand_type = operand.type
        if select.test_only:
            return ir.Presence(static, operand, field, self._presence_test(operand_type, field))
        if operand_type.kind == "message":
            self._message_field(operand_type.message, field)
            return ir.Attr(static, operand, field)
        if (
            operand_type.kind == "map"
            and operand_type.key is not None
            and (operand_type.key.kind == "string")
        ):
            return ir.MapKey(static, operand, field)
        return ir.DynSelect(static, operand, field)

    def _rest_of_chain(self, expr: syntax_pb2.Expr, resolved_id: int, resolved: ir.Node) -> ir.Node:
        if expr.id == resolved_id:
            return resolved
        operand = self._rest_of_chain(expr.select_expr.operand, resolved_id, resolved)
        return ir.DynSelect(DYN, operand, expr.select_expr.field)

    def _message_field(self, message: str, field: str) -> descriptor.FieldDescriptor:
        try:
            found = self._pool.FindMessageTypeByName(message).fields_by_name[field]
        except KeyError:
            raise NotLoweredError(f"field {field!r} of message {message!r} is unknown") from None
        return found

    def _presence_test(self, operand_type: StaticType, field: str) -> str:
        if operand_type.kind == "map":
            return "key"
        if operand_type.kind == "message":
            found = self._message_field(operand_type.message, field)
            if found.is_repeated:
                return "sized"
            if found.type == descriptor.FieldDescriptor.TYPE_MESSAGE:
                return "message"
            return "scalar"
        return "dyn"

    def _struct(self, expr: syntax_pb2.Expr) -> ir.Node:
        struct = expr.struct_expr
        if struct.message_name:
            raise NotLoweredError(f"constructing message {struct.message_name!r} is not lowered")
        keys: list[ir.Node] = []
        values: list[ir.Node] = []
        for entry in struct.entries:
            if entry.optional_entry:
                raise NotLoweredError("optional map entries ({?k: v}) are not lowered")
            keys.append(self.lower(entry.map_key))
            values.append(self.lower(entry.value))
        return self._maybe_fold_literal(ir.MapLit(self._type(expr), tuple(keys), tuple(values)))

    def _maybe_fold_literal(self, node: ir.ListLit | ir.MapLit) -> ir.Node:
        """A literal of constants becomes one immutable constant (tuple / mapping proxy),
        so that no caller can change it for the next evaluation."""
        if isinstance(node, ir.ListLit):
            items = _constant_values(node.items)
            if items is None:
                return node
            self.folded += 1
            return ir.Const(node.type, tuple(items))
        keys = _constant_values(node.keys)
        values = _constant_values(node.values)
        if keys is None or values is None:
            return node
        try:
            value = runtime.make_map(keys, values)
        except CelEvalError:  # a repeated key stays a run-time error
            return node
        self.folded += 1
        return ir.Const(node.type, MappingProxyType(value))

    # -- calls ---------------------------------------------------------------------

    def _call(self, expr: syntax_pb2.Expr) -> ir.Node:
        call = expr.call_expr
        function = call.function
        static = self._type(expr)
        receiver = call.HasField("target")
        arg_exprs = ([call.target] if receiver else []) + list(call.args)
        if function in _STRUCTURAL and not receiver:
            return self._structural(function, static, arg_exprs)
        args = tuple(self.lower(arg) for arg in arg_exprs)
        reference = self._references.get(expr.id)
        overload_ids = tuple(reference.overload_id) if reference is not None else ()
        node = self._direct_call(static, overload_ids, args)
        if node is None:
            unknown = [oid for oid in overload_ids if oid not in stdlib.OVERLOADS]
            if unknown:
                raise NotLoweredError(
                    f"function {function!r} (overload {unknown[0]}) is not lowered"
                )
            dispatch = stdlib.dispatcher(function, receiver, len(args))
            if dispatch is None:
                if self._checked:
                    raise NotLoweredError(f"function {function!r} is not in the lowered library")
                return ir.Fail(DYN, f"unbound function {function!r}")
            node = ir.Call(static, function, dispatch, args)
        if function in _CONVERSIONS and node.inline is None and len(args) == 1:
            place = _place(args[0])
            if place is not None:
                node = replace(node, impl=runtime.naming(place, node.impl), checked=None)
        return self._fold(node)

    def _direct_call(
        self, static: StaticType, overload_ids: tuple[str, ...], args: tuple[ir.Node, ...]
    ) -> ir.Call | None:
        """The call specialised on its single overload, when the static types allow."""
        if len(overload_ids) != 1 or overload_ids[0] not in stdlib.OVERLOADS:
            return None
        overload = stdlib.OVERLOADS[overload_ids[0]]
        kinds = [arg.type.kind for arg in args]
        if len(kinds) != len(overload.kinds) or any(
            want is not None and want != kind
            for want, kind in zip(overload.kinds, kinds, strict=True)
        ):
            return None
        inline = overload.inline
        impl = overload.impl
        oid = overload.id
        if oid in ("equals", "not_equals") and _same_kind(args, _PYTHON_EQUALITY_KINDS):
            inline = "({0} == {1})" if oid == "equals" else "({0} != {1})"
            if args[0].type.kind in ("timestamp", "duration"):
                inline = inline.replace("{0}", "{0}.nanos").replace("{1}", "{1}.nanos")
        elif (
            oid == "in_list"
            and _element_kind(args[1]) == args[0].type.kind in _PYTHON_MEMBERSHIP_KINDS
        ) or (
            oid == "in_map" and _key_kind(args[1]) == args[0].type.kind in _PYTHON_MEMBERSHIP_KINDS
        ):
            inline = "({0} in {1})"
        elif (
            oid == "index_map"
            and _key_kind(args[0]) == "string" == args[1].type.kind
            and isinstance(args[1], ir.Const)
        ):
            # A written key: a missing one is named in the error (``runtime.as_error``);
            # a computed key may be a request's value and goes through ``index_map``.
            inline = "{0}[{1}]"
        elif oid == "type":
            return self._static_type_of(static, args[0])
        elif oid == "divide_double" and _nonzero_constant(args[1]):
            inline = "({0} / {1})"  # IEEE division; only x / 0.0 differs from Python
        elif oid in ("matches_string", "matches") and isinstance(args[1], ir.Const):
            try:
                search = runtime.regex(args[1].value)
            except CelEvalError:
                return ir.Call(static, oid, impl, args)
            return ir.Call(static, oid, search, args[:1])
        return ir.Call(static, oid, impl, args, inline, overload.checked if inline else None)

    def _static_type_of(self, static: StaticType, arg: ir.Node) -> ir.Call | None:
        """``type(x)`` where the checker knows x's type: evaluate x (it may be an
        error), then answer the type without looking at the value."""
        kind = arg.type.kind
        if kind == ir.DYN_KIND:
            return None
        name = arg.type.message if kind == "message" else runtime.TYPE_OF_KIND[kind].name
        answer = ir.type_value(name)
        return ir.Call(static, "type", lambda _value, known: known, (arg, answer), "({0}, {1})[1]")

    def _fold(self, node: ir.Call) -> ir.Node:
        args = _constant_values(node.args)
        if args is None:
            return node
        try:
            value = node.impl(*args)
        except Exception:  # an error stays a run-time error, which && / || may absorb
            return node
        self.folded += 1
        return ir.Const(node.type, value)

    def _structural(
        self, function: str, static: StaticType, arg_exprs: list[syntax_pb2.Expr]
    ) -> ir.Node:
        if function in ("_&&_", "_||_"):
            operands: list[ir.Node] = []
            for arg in arg_exprs:
                lowered = self.lower(arg)
                same = ir.And if function == "_&&_" else ir.Or
                if isinstance(lowered, same):
                    operands.extend(lowered.operands)
                else:
                    operands.append(lowered)
            return self._fold_logic(function == "_||_", static, operands)
        if function == "_?_:_":
            condition, then, otherwise = (self.lower(arg) for arg in arg_exprs)
            if isinstance(condition, ir.Const) and condition.value is True:
                self.folded += 1
                return then
            if isinstance(condition, ir.Const) and condition.value is False:
                self.folded += 1
                return otherwise
            return ir.Conditional(static, condition, then, otherwise)
        operand = self.lower(arg_exprs[0])
        if isinstance(operand, ir.Const):
            self.folded += 1
            return ir.Const(static, operand.value is not False)
        return ir.NotStrictlyFalse(static, operand)

    def _fold_logic(self, is_or: bool, static: StaticType, operands: list[ir.Node]) -> ir.Node:
        """``false && x`` is false whatever x is (an error included); ``true`` operands
        of ``&&`` drop out; dually for ``||``."""
        decisive = is_or
        kept: list[ir.Node] = []
        for operand in operands:
            if isinstance(operand, ir.Const) and operand.value is decisive:
                self.folded += 1
                return ir.Const(static, decisive)
            if isinstance(operand, ir.Const) and operand.value is (not decisive):
                self.folded += 1
                continue
            kept.append(operand)
        if not kept:
            return ir.Const(static, not decisive)
        if len(kept) == 1 and kept[0].type.kind == "bool":
            return kept[0]
        return (ir.Or if is_or else ir.And)(static, tuple(kept))

    # -- comprehensions -------------------------------------------------------------

    def _comprehension(self, expr: syntax_pb2.Expr) -> ir.Node:
        loop = expr.comprehension_expr
        if loop.iter_var2:
            raise NotLoweredError("two-variable comprehensions are not lowered")
        iter_range = self.lower(loop.iter_range)
        init = self.lower(loop.accu_init)
        strict = _is_true_constant(loop.loop_condition) and _uses_strictly(
            loop.result, loop.accu_var
        )
        self._slots += 1
        element = iter_range.type.key if iter_range.type.kind == "map" else iter_range.type.element
        iter_local = ir.Local(
            self._type_of_ident(loop.loop_step, loop.iter_var) or element or DYN,
            f"i{self._slots}",
            False,
        )
        accu_local = ir.Local(
            self._type_of_ident(loop.loop_step, loop.accu_var) or init.type,
            f"a{self._slots}",
            not strict,
        )
        self._scope.frames.append({loop.iter_var: iter_local, loop.accu_var: accu_local})
        try:
            condition = self.lower(loop.loop_condition)
            step = self.lower(loop.loop_step)
            result = self.lower(loop.result)
        finally:
            self._scope.frames.pop()
        return ir.Comprehension(
            self._type(expr),
            iter_local.slot,
            iter_range,
            accu_local.slot,
            init,
            condition,
            step,
            result,
            strict,
        )

    def _type_of_ident(self, expr: syntax_pb2.Expr, name: str) -> StaticType | None:
        """The checked type of the first use of ``name`` inside ``expr``."""
        stack = [expr]
        while stack:
            node = stack.pop()
            which = node.WhichOneof("expr_kind")
            if which == "ident_expr" and node.ident_expr.name == name:
                return self._type(node) if node.id in self._type_map else None
            stack.extend(_children(node))
        return None


def _constant_values(nodes: tuple[ir.Node, ...]) -> list[Any] | None:
    """The values of ``nodes`` when all are constants, else None."""
    values = []
    for node in nodes:
        if not isinstance(node, ir.Const):
            return None
        values.append(node.value)
    return values


def _nonzero_constant(node: ir.Node) -> bool:
    return isinstance(node, ir.Const) and isinstance(node.value, float) and node.value != 0


def _same_kind(args: tuple[ir.Node, ...], kinds: frozenset[str]) -> bool:
    return args[0].type.kind == args[1].type.kind and args[0].type.kind in kinds


def _element_kind(node: ir.Node) -> str | None:
    element = node.type.element if node.type.kind == "list" else None
    return element.kind if element is not None else None


def _key_kind(node: ir.Node) -> str | None:
    key = node.type.key if node.type.kind == "map" else None
    return key.kind if key is not None else None


def _is_true_constant(expr: syntax_pb2.Expr) -> bool:
    return expr.WhichOneof("expr_kind") == "const_expr" and expr.const_expr.bool_value is True


def _uses_strictly(expr: syntax_pb2.Expr, accu_var: str) -> bool:
    """Whether ``expr`` is the accumulator itself or a strict call on it directly."""
    which = expr.WhichOneof("expr_kind")
    if which == "ident_expr":
        return bool(expr.ident_expr.name == accu_var)
    if which == "call_expr" and expr.call_expr.function not in _STRUCTURAL:
        return any(
            arg.WhichOneof("expr_kind") == "ident_expr" and arg.ident_expr.name == accu_var
            for arg in expr.call_expr.args
        )
    return False


def _children(expr: syntax_pb2.Expr) -> list[syntax_pb2.Expr]:
    which = expr.WhichOneof("expr_kind")
    if which == "select_expr":
        return [expr.select_expr.operand]
    if which == "call_expr":
        target = [expr.call_expr.target] if expr.call_expr.HasField("target") else []
        return target + list(expr.call_expr.args)
    if which == "list_expr":
        return list(expr.list_expr.elements)
    if which == "struct_expr":
        return [part for entry in expr.struct_expr.entries for part in (entry.map_key, entry.value)]
    if which == "comprehension_expr":
        loop = expr.comprehension_expr
        return [
            loop.iter_range,
            loop.accu_init,
            loop.loop_condition,
            loop.loop_step,
            loop.result,
        ]
    return []


def constant_value(constant: syntax_pb2.Constant) -> Any:
    which = constant.WhichOneof("constant_kind")
    if which == "null_value":
        return None
    if which == "bool_value":
        return constant.bool_value
    if which == "int64_value":
        return constant.int64_value
    if which == "uint64_value":
        return UInt(constant.uint64_value)
    if which == "double_value":
        return constant.double_value
    if which == "string_value":
        return constant.string_value
    if which == "bytes_value":
        return constant.bytes_value
    raise NotLoweredError(f"constant of kind {which!r} is not lowered")


def lower(
    expr: syntax_pb2.Expr,
    *,
    type_map: Mapping[int, checked_pb2.Type],
    reference_map: Mapping[int, checked_pb2.Reference],
    variables: frozenset[str],
    constants: Mapping[str, Any],
    pool: descriptor_pool.DescriptorPool,
    checked: bool,
) -> ir.Lowered:
    lowerer = Lowerer(
        type_map=type_map,
        reference_map=reference_map,
        variables=variables,
        constants=constants,
        pool=pool,
        checked=checked,
    )
    try:
        root = lowerer.lower(expr)
    except RecursionError:
        raise NotLoweredError("the expression nests too deeply to lower") from None
    return ir.Lowered(root, lowerer.folded)
