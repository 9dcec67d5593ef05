"""The lowered form of a checked CEL expression: a small tree the code generator walks.

``lowering.py`` builds it from cel-cpp's ``CheckedExpr`` (resolving names,
overloads and constants; folding what is known at load time) and
``codegen.py`` turns it into one Python function. Every node carries the
static type the checker gave it (``DYN`` when unchecked or unknown), which is
what lets the generator pick exact inline Python for a node.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from cel.expr import checked_pb2

from policyd.cel.runtime import TYPE_OF_KIND
from policyd.cel.values import CelType

# Static kinds share the runtime kind names (runtime.INT...) plus "dyn".
DYN_KIND: Final = "dyn"


@dataclass(frozen=True, slots=True)
class StaticType:
    """A checked type reduced to what code generation needs."""

    kind: str
    message: str = ""  # the full name, for kind "message"
    element: StaticType | None = None  # list element or map value
    key: StaticType | None = None  # map key
    denoted: str = ""  # for kind "type": the CEL name of the type this value is


DYN: Final = StaticType(DYN_KIND)

_PRIMITIVES: Final = {
    checked_pb2.Type.BOOL: "bool",
    checked_pb2.Type.INT64: "int",
    checked_pb2.Type.UINT64: "uint",
    checked_pb2.Type.DOUBLE: "double",
    checked_pb2.Type.STRING: "string",
    checked_pb2.Type.BYTES: "bytes",
}
_WELL_KNOWN: Final = {
    checked_pb2.Type.TIMESTAMP: "timestamp",
    checked_pb2.Type.DURATION: "duration",
}


class UnsupportedTypeError(Exception):
    """A checked type the compiler does not lower (wrappers, Any, JSON, abstract)."""


def static_type(proto: checked_pb2.Type) -> StaticType:
    """The ``StaticType`` of a checker type; raises ``UnsupportedTypeError``."""
    which = proto.WhichOneof("type_kind")
    if which == "primitive" and proto.primitive in _PRIMITIVES:
        return StaticType(_PRIMITIVES[proto.primitive])
    if which == "well_known" and proto.well_known in _WELL_KNOWN:
        return StaticType(_WELL_KNOWN[proto.well_known])
    if which == "null":
        return StaticType("null")
    if which in ("dyn", "type_param", "error"):
        return DYN
    if which == "list_type":
        return StaticType("list", element=static_type(proto.list_type.elem_type))
    if which == "map_type":
        return StaticType(
            "map",
            key=static_type(proto.map_type.key_type),
            element=static_type(proto.map_type.value_type),
        )
    if which == "message_type":
        return StaticType("message", message=proto.message_type)
    if which == "type":
        return StaticType("type", denoted=denoted_name(proto.type))
    raise UnsupportedTypeError(f"values of checked type {which} ({_describe(proto)})")


def denoted_name(proto: checked_pb2.Type) -> str:
    """The CEL name of a type used as a value: ``int``, ``list``, ``policyd.Pod``.

    The checker writes the type of ``type`` itself as an empty ``Type``."""
    which = proto.WhichOneof("type_kind")
    if which in (None, "type"):
        return "type"
    if which in ("dyn", "type_param"):
        return "dyn"
    inner = static_type(proto)
    if inner.kind == "message":
        return inner.message
    return TYPE_OF_KIND[inner.kind].name


def _describe(proto: checked_pb2.Type) -> str:
    return str(proto).replace("\n", " ").strip()


# -- nodes --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Node:
    type: StaticType


@dataclass(frozen=True, slots=True)
class Const(Node):
    value: Any


@dataclass(frozen=True, slots=True)
class Var(Node):
    """A variable of the activation (``pod``, ``params.queue_limit``)."""

    name: str


@dataclass(frozen=True, slots=True)
class Local(Node):
    """A comprehension variable; ``may_hold_error`` for accumulators that keep
    an error value (``exists`` / ``all`` absorb errors until the end)."""

    slot: str
    may_hold_error: bool


@dataclass(frozen=True, slots=True)
class Attr(Node):
    """A message field read as a Python attribute."""

    operand: Node
    field: str


@dataclass(frozen=True, slots=True)
class MapKey(Node):
    """``map.key`` on a map whose keys are strings: a plain lookup."""

    operand: Node
    key: str


@dataclass(frozen=True, slots=True)
class DynSelect(Node):
    operand: Node
    field: str


@dataclass(frozen=True, slots=True)
class Presence(Node):
    """``has(operand.field)``; ``test`` is "key", "sized", "message", "scalar" or "dyn"."""

    operand: Node
    field: str
    test: str


@dataclass(frozen=True, slots=True)
class Call(Node):
    """A strict function call: every argument is evaluated, any error propagates.

    ``inline`` is a Python template exact for the static argument types;
    otherwise ``impl`` is called. ``checked`` asks for an int64/uint64 range
    check of the inline result.
    """

    name: str
    impl: Callable[..., Any]
    args: tuple[Node, ...]
    inline: str | None = None
    checked: str | None = None


@dataclass(frozen=True, slots=True)
class Fail(Node):
    """An expression that always evaluates to an error (an unbound name when unchecked)."""

    message: str


@dataclass(frozen=True, slots=True)
class And(Node):
    operands: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class Or(Node):
    operands: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class NotStrictlyFalse(Node):
    operand: Node


@dataclass(frozen=True, slots=True)
class Conditional(Node):
    condition: Node
    then: Node
    otherwise: Node


@dataclass(frozen=True, slots=True)
class ListLit(Node):
    items: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class MapLit(Node):
    keys: tuple[Node, ...]
    values: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class Comprehension(Node):
    """A macro after expansion: fold ``step`` over ``range`` into ``accu``.

    ``strict`` means an error in any step makes the whole result that error
    (the loop condition is constant true and the result uses the accumulator
    strictly), so steps may raise straight through.
    """

    iter_slot: str
    range: Node
    accu_slot: str
    init: Node
    condition: Node
    step: Node
    result: Node
    strict: bool


@dataclass(frozen=True, slots=True)
class Lowered:
    """A lowered expression and how many subexpressions folded to constants."""

    root: Node
    folded: int = 0


def type_value(name: str) -> Const:
    return Const(StaticType("type", denoted="type"), CelType(name))
