"""The CEL view of pods and requests, declared as protobuf messages built in code.

Declaring ``pod`` and ``request`` as message types (instead of ``map(string, dyn)``)
lets the type checker reject ``pod.waiting_qeue`` or ``pod.kv_cache > "x"`` when
a policy is loaded, with the column of the mistake. At run time the values are
plain Python objects whose attributes carry these field names; no protobuf
message is built on the hot path. The fields themselves are declared in
``policyd.fields``.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from typing import Final

from cel_expr_python import cel
from google.protobuf import descriptor_pb2, descriptor_pool, duration_pb2

from policyd import fields as declared
from policyd.fields import Field

_F = descriptor_pb2.FieldDescriptorProto
PACKAGE: Final = "policyd"


# The fields are declared once, with their sources and doc lines, in policyd.fields.
POD_FIELDS: Final = declared.POD_FIELDS
REQUEST_FIELDS: Final = declared.REQUEST_FIELDS


_SCALARS: Final[Mapping[str, int]] = {
    "string": _F.TYPE_STRING,
    "int": _F.TYPE_INT64,
    "double": _F.TYPE_DOUBLE,
    "bool": _F.TYPE_BOOL,
}


def _add_message(
    file: descriptor_pb2.FileDescriptorProto, name: str, fields: tuple[Field, ...]
) -> None:
    message = file.message_type.add(name=name)
    for number, field in enumerate(fields, start=1):
        if field.kind in _SCALARS:
            message.field.add(
                name=field.name, number=number, type=_SCALARS[field.kind], label=_F.LABEL_OPTIONAL
            )
        elif field.kind == "list<string>":
            message.field.add(
                name=field.name, number=number, type=_F.TYPE_STRING, label=_F.LABEL_REPEATED
            )
        elif field.kind == "duration":
            message.field.add(
                name=field.name,
                number=number,
                type=_F.TYPE_MESSAGE,
                type_name=".google.protobuf.Duration",
                label=_F.LABEL_OPTIONAL,
            )
        elif field.kind == "map<string,string>":
            entry_name = "".join(part.capitalize() for part in field.name.split("_")) + "Entry"
            entry = message.nested_type.add(name=entry_name)
            entry.options.map_entry = True
            entry.field.add(name="key", number=1, type=_F.TYPE_STRING, label=_F.LABEL_OPTIONAL)
            entry.field.add(name="value", number=2, type=_F.TYPE_STRING, label=_F.LABEL_OPTIONAL)
            message.field.add(
                name=field.name,
                number=number,
                type=_F.TYPE_MESSAGE,
                type_name=f".{PACKAGE}.{name}.{entry_name}",
                label=_F.LABEL_REPEATED,
            )
        else:  # pragma: no cover - a programming error in the tables above
            raise ValueError(f"unsupported schema kind {field.kind!r}")


@cache
def descriptor_pool_for_schema() -> descriptor_pool.DescriptorPool:
    """The pool holding ``policyd.Pod`` and ``policyd.Request`` (built once)."""
    pool = descriptor_pool.DescriptorPool()
    pool.Add(descriptor_pb2.FileDescriptorProto.FromString(duration_pb2.DESCRIPTOR.serialized_pb))
    file = descriptor_pb2.FileDescriptorProto(
        name="policyd/schema.proto",
        package=PACKAGE,
        syntax="proto3",
        dependency=["google/protobuf/duration.proto"],
    )
    _add_message(file, "Pod", POD_FIELDS)
    _add_message(file, "Request", REQUEST_FIELDS)
    pool.Add(file)
    return pool


POD_TYPE_NAME: Final = f"{PACKAGE}.Pod"
REQUEST_TYPE_NAME: Final = f"{PACKAGE}.Request"


def pod_type() -> cel.Type:
    return cel.Type(POD_TYPE_NAME)


def request_type() -> cel.Type:
    return cel.Type(REQUEST_TYPE_NAME)


def cel_type_of(kind: str) -> cel.Type:
    """The CEL type for a schema kind string (also used for typed policy params)."""
    simple = {
        "string": cel.Type.STRING,
        "int": cel.Type.INT,
        "double": cel.Type.DOUBLE,
        "bool": cel.Type.BOOL,
        "duration": cel.Type.DURATION,
        "list<string>": cel.Type.List(cel.Type.STRING),
        "list<int>": cel.Type.List(cel.Type.INT),
        "list<double>": cel.Type.List(cel.Type.DOUBLE),
        "map<string,string>": cel.Type.Map(cel.Type.STRING, cel.Type.STRING),
    }
    try:
        return simple[kind]
    except KeyError:
        raise ValueError(f"unknown type {kind!r}; expected one of {', '.join(simple)}") from None
