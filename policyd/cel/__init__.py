"""CEL for routing rules: type-checked at load time, fast closures at run time.

Public API::

    env = Environment({"pod": pod_type(), "request": request_type(),
                       "params.queue_limit": cel.Type.INT})
    program = env.compile("pod.waiting_queue < params.queue_limit",
                          constants={"params.queue_limit": 50})
    program.evaluate({"pod": pod, "request": request})  # value, or raises CelEvalError
"""

from policyd.cel.environment import Activation, Environment, Program
from policyd.cel.errors import CelCompileError, CelEvalError
from policyd.cel.schema import POD_FIELDS, REQUEST_FIELDS, cel_type_of, pod_type, request_type
from policyd.cel.values import Duration

__all__ = [
    "POD_FIELDS",
    "REQUEST_FIELDS",
    "Activation",
    "CelCompileError",
    "CelEvalError",
    "Duration",
    "Environment",
    "Program",
    "cel_type_of",
    "pod_type",
    "request_type",
]
