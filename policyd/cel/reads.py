"""What a checked expression reads: the names and schema fields it refers to.

The policy compiler needs this to order variables, to know which request
fields a filter tree depends on, and to warn about params never used. The
checker's reference map names every variable an expression uses; the
selections of ``pod`` / ``request`` fields come from the checked tree.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from cel.expr import checked_pb2

_OBJECTS = ("pod", "request")


def reads_of(
    expr: Any, references: Mapping[int, checked_pb2.Reference], declared: frozenset[str]
) -> frozenset[str]:
    """The ``declared`` variables used (params, ``pod``, ``request``, ...), and
    each ``pod.<field>`` / ``request.<field>`` selected; ``pod.*`` /
    ``request.*`` when the object is used whole (``dyn(pod)``), so that any
    field may be read. Loop variables of macros are not reads."""
    names = {reference.name for reference in references.values() if not reference.overload_id}
    return frozenset((names & declared) | set(_field_reads(expr, references)))


def _field_reads(expr: Any, references: Mapping[int, checked_pb2.Reference]) -> Iterator[str]:
    kind = expr.WhichOneof("expr_kind")
    if kind == "select_expr":
        operand = expr.select_expr.operand
        if operand.WhichOneof("expr_kind") == "ident_expr" and _is_object(operand, references):
            yield f"{references[operand.id].name}.{expr.select_expr.field}"
            return
        yield from _field_reads(operand, references)
    elif kind == "ident_expr":
        if _is_object(expr, references):
            yield f"{references[expr.id].name}.*"
    elif kind == "call_expr":
        call = expr.call_expr
        if call.HasField("target"):
            yield from _field_reads(call.target, references)
        for argument in call.args:
            yield from _field_reads(argument, references)
    elif kind == "list_expr":
        for element in expr.list_expr.elements:
            yield from _field_reads(element, references)
    elif kind == "struct_expr":
        for entry in expr.struct_expr.entries:
            if entry.HasField("map_key"):
                yield from _field_reads(entry.map_key, references)
            yield from _field_reads(entry.value, references)
    elif kind == "comprehension_expr":
        loop = expr.comprehension_expr
        for part in (loop.iter_range, loop.accu_init, loop.loop_condition, loop.loop_step):
            yield from _field_reads(part, references)
        yield from _field_reads(loop.result, references)


def _is_object(ident: Any, references: Mapping[int, checked_pb2.Reference]) -> bool:
    """An identifier that names the ``pod`` or ``request`` variable (not a loop variable)."""
    return ident.id in references and references[ident.id].name in _OBJECTS
