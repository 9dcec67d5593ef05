"""CEL for routing rules: type-checked at load time, generated Python at run time.

Public API::

    env = Environment({"pod": pod_type(), "request": request_type(),
                       "params.queue_limit": cel_type_of("int")})
    program = env.compile("pod.waiting_queue < params.queue_limit",
                          constants={"params.queue_limit": 50})
    program.evaluate({"pod": pod, "request": request})  # value, or raises CelEvalError

``Environment.compile`` raises ``CelCompileError`` (syntax, types, names, cost
bound); ``Program.evaluate`` raises only ``CelEvalError``. ``Program.lowered``
and ``Program.report`` say how the expression runs; ``Program.reads`` what
it refers to. Values are plain Python,
with the small types of ``values.py`` where Python has no exact match.

Inside: ``environment`` (the pipeline), ``cost`` (load-time bound),
``lowering`` -> ``ir`` -> ``codegen`` (the compiler), ``runtime`` / ``stdlib``
/ ``chrono`` (CEL semantics), ``fallback`` (cel-expr-python), ``schema``.
"""

from policyd.cel.environment import DYN, Activation, DeclaredType, Environment, Program
from policyd.cel.errors import CelCompileError, CelEvalError
from policyd.cel.schema import POD_FIELDS, REQUEST_FIELDS, cel_type_of, pod_type, request_type
from policyd.cel.values import CelType, Duration, Timestamp, UInt

__all__ = [
    "DYN",
    "POD_FIELDS",
    "REQUEST_FIELDS",
    "Activation",
    "CelCompileError",
    "CelEvalError",
    "CelType",
    "DeclaredType",
    "Duration",
    "Environment",
    "Program",
    "Timestamp",
    "UInt",
    "cel_type_of",
    "pod_type",
    "request_type",
]
