"""The ``flow`` section of a policy: when the pool is saturated, hold requests instead.

Reading (``read_flow``, the shape) and compiling (``compile_flow``, the CEL)
live here together because the section is one feature; ``policyd.flow``
runs the queue it describes. What the section decides, per request:

- ``saturated``: a CEL predicate over ``pod`` (and ``request``, params,
  variables). The pool is saturated for a request when the predicate holds
  for every pod of the policy's pool; then the request is held.
- ``priority``: a CEL string naming the request's band (default
  ``request.criticality``); ``bands`` lists the bands, highest first, each
  with its maximum wait and limits. A name no band has goes to the lowest.
- ``flows``: the flow key (a CEL string; without one, the request's fairness
  id header, ``policyd.policy.client_headers``), the key of a request whose
  expression fails or gives "" (or that carries no fairness id), and
  per-flow weights.
- ``max_flows``: how many flows may hold requests or have them in flight at
  once; a request of another key past it counts under one overflow flow, so
  keys a client makes up cannot each take a turn of their own.
- ``order`` inside a flow: ``fcfs``, or ``deadline`` (earliest first) from
  ``deadline_header`` (milliseconds the client is willing to wait).
- the total limits, what happens past a limit (``when_full``: evict the
  lowest-priority held request, or refuse the new one), and the answer an
  evicted, refused or expired request gets (``answer``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

from policyd.cel import CelEvalError
from policyd.policy.client_headers import FAIRNESS_HEADERS, first_of
from policyd.policy.evaluation import BOOL, Compiling, Evaluation, Evaluator, PodExpression
from policyd.policy.pods import PolicyPod
from policyd.policy.reader import Expression, Fields, expression, is_number, parse_duration
from policyd.policy.request import Request
from policyd.policy.source import YMapping, YScalar, kind_name

# Envoy's ``max_message_timeout`` in the configurations policyd generates: the
# longest a held request can keep its ext_proc message waiting. A band's
# ``max_wait`` must stay under it (the hold ends before Envoy gives up).
MAX_HOLD_SECONDS: Final = 120.0
HOLD_MARGIN_SECONDS: Final = 1.0  # asked of Envoy beyond the band's max wait
DEFAULT_BANDS: Final = ("critical", "standard", "sheddable")
DEFAULT_MAX_WAIT_SECONDS: Final = 30.0
DEFAULT_MAX_FLOWS: Final = 100
ORDERS: Final = ("fcfs", "deadline")
DEFAULT_DEADLINE_HEADER: Final = "x-request-deadline-ms"
WHEN_FULL: Final = ("evict", "refuse")
ANSWER_STATUSES: Final = (429, 503)
_FIELDS: Final = (
    "saturated",
    "priority",
    "bands",
    "flows",
    "max_flows",
    "order",
    "deadline_header",
    "max_requests",
    "max_body_bytes",
    "when_full",
    "answer",
)
_BAND_FIELDS: Final = ("max_wait", "max_requests", "max_body_bytes")


@dataclass(frozen=True, slots=True, eq=False)
class BandSpec:
    name: str
    max_wait_s: float
    max_requests: int | None
    max_body_bytes: int | None


@dataclass(frozen=True, slots=True, eq=False)
class FlowSpec:
    """The section as written; the CEL not yet checked."""

    node: YMapping
    saturated: Expression | None
    priority: Expression | None
    bands: tuple[BandSpec, ...]
    key: Expression | None
    default_flow: str
    weights: tuple[tuple[str, float], ...]
    max_flows: int
    order: str
    deadline_header: str
    max_requests: int | None
    max_body_bytes: int | None
    when_full: str
    status: int
    retry_after_s: int


def read_flow(fields: Fields) -> FlowSpec | None:
    """The ``flow`` section of the policy ``fields`` reads, or None when it has none."""
    node = fields.mapping("flow")
    if node is None:
        return None
    diagnostics = fields.diagnostics
    reader = Fields(node, _FIELDS, diagnostics, what="'flow'")
    saturated = None
    raw = reader.raw("saturated")
    if raw is None:
        reader.error(node, "'flow' needs 'saturated': when is a pod too busy to take more")
    else:
        saturated = expression(reader, raw, "'saturated'")
    priority_node = reader.raw("priority")
    priority = expression(reader, priority_node, "'priority'") if priority_node else None
    key, default_flow, weights = _read_flows(reader)
    order = reader.choice("order", ORDERS, "fcfs")
    header_node = reader.string("deadline_header")
    deadline_header = str(header_node.value).lower() if header_node else DEFAULT_DEADLINE_HEADER
    answer = reader.mapping("answer")
    status, retry_after = 429, 1.0
    if answer is not None:
        answer_reader = Fields(answer, ("status", "retry_after"), diagnostics, what="'answer'")
        status_node = answer_reader.raw("status")
        status = answer_reader.integer("status", minimum=0, default=429) or 429
        if status not in ANSWER_STATUSES and status_node is not None:
            answer_reader.error(status_node, f"'status' must be 429 or 503, not {status}")
        retry_after = _seconds(answer_reader, "retry_after", 1.0)
    return FlowSpec(
        node=node,
        saturated=saturated,
        priority=priority,
        bands=_read_bands(reader),
        key=key,
        default_flow=default_flow,
        weights=weights,
        max_flows=reader.integer("max_flows", minimum=1, default=DEFAULT_MAX_FLOWS)
        or DEFAULT_MAX_FLOWS,
        order=order,
        deadline_header=deadline_header,
        max_requests=reader.integer("max_requests", minimum=1),
        max_body_bytes=reader.integer("max_body_bytes", minimum=1),
        when_full=reader.choice("when_full", WHEN_FULL, "evict"),
        status=status,
        retry_after_s=max(1, round(retry_after)),
    )


def _read_flows(reader: Fields) -> tuple[Expression | None, str, tuple[tuple[str, float], ...]]:
    node = reader.mapping("flows")
    if node is None:
        return None, "default", ()
    flows = Fields(node, ("key", "default", "weights"), reader.diagnostics, what="'flows'")
    raw = flows.raw("key")
    key = expression(flows, raw, "'key'") if raw is not None else None
    default_node = flows.string("default")
    weights: list[tuple[str, float]] = []
    weights_node = flows.mapping("weights")
    if weights_node is not None:
        for name, (_, value) in weights_node.entries.items():
            if not isinstance(value, YScalar) or not is_number(value.value):
                flows.error(value, f"the weight of flow '{name}' must be a number")
            elif float(value.value) <= 0:  # type: ignore[arg-type]
                flows.error(value, f"the weight of flow '{name}' must be above 0")
            else:
                weights.append((name, float(value.value)))  # type: ignore[arg-type]
    default = str(default_node.value) if default_node else "default"
    return key, default, tuple(weights)


def _read_bands(reader: Fields) -> tuple[BandSpec, ...]:
    node = reader.mapping("bands")
    if node is None:
        return tuple(BandSpec(name, DEFAULT_MAX_WAIT_SECONDS, None, None) for name in DEFAULT_BANDS)
    bands: list[BandSpec] = []
    for name, (_, value) in node.entries.items():
        if isinstance(value, YScalar) and value.value is None:
            bands.append(BandSpec(name, DEFAULT_MAX_WAIT_SECONDS, None, None))
            continue
        if not isinstance(value, YMapping):
            reader.error(value, f"band '{name}' must be a mapping, not {kind_name(value)}")
            continue
        band = Fields(value, _BAND_FIELDS, reader.diagnostics, what=f"band '{name}'")
        wait = _seconds(band, "max_wait", DEFAULT_MAX_WAIT_SECONDS)
        if wait > MAX_HOLD_SECONDS - HOLD_MARGIN_SECONDS:
            band.error(
                band.raw("max_wait") or value,
                f"'max_wait' must be under {MAX_HOLD_SECONDS - HOLD_MARGIN_SECONDS:g}s "
                "(Envoy's max_message_timeout in policyd's configurations)",
            )
        bands.append(
            BandSpec(
                name,
                wait,
                band.integer("max_requests", minimum=1),
                band.integer("max_body_bytes", minimum=1),
            )
        )
    if not bands and not node.entries:
        reader.error(node, "'bands' must name at least one band")
    return tuple(bands)


def _seconds(reader: Fields, key: str, default: float) -> float:
    """A duration written like ``30s`` or ``250ms`` (a bare number is seconds), in seconds."""
    node = reader.raw(key)
    if node is None:
        return default
    if isinstance(node, YScalar) and is_number(node.value) and float(node.value) > 0:  # type: ignore[arg-type]
        return float(node.value)  # type: ignore[arg-type]
    nanos = (
        parse_duration(node.value)
        if isinstance(node, YScalar) and isinstance(node.value, str)
        else None
    )
    if nanos is None or nanos <= 0:
        reader.error(node, f"'{key}' must be a positive duration like 250ms, 5s or 1m")
        return default
    return nanos / 1e9


@dataclass(frozen=True, slots=True)
class Band:
    """One priority band: its rank (0 is the highest) and its limits."""

    name: str
    rank: int
    max_wait_s: float
    max_requests: int | None
    max_body_bytes: int | None


@dataclass(frozen=True, slots=True, eq=False)
class CompiledFlow:
    """A policy's flow control, ready to answer per request; immutable."""

    saturated: PodExpression
    priority: Evaluator | None  # None: request.criticality
    bands: tuple[Band, ...]
    key: Evaluator | None  # None: the fairness id header, else the default flow
    default_flow: str
    weights: Mapping[str, float]
    max_flows: int  # flows held or in flight past which new keys share the overflow flow
    order: str
    deadline_header: str
    max_requests: int | None
    max_body_bytes: int | None
    when_full: str
    status: int
    retry_after_s: int

    def band_of(self, request: Request) -> Band:
        """The request's band (``request`` as the router resolved it); the lowest
        for a name no band has or an expression that fails."""
        name: Any = request.criticality
        if self.priority is not None:
            try:
                name = self.priority({"request": request})
            except CelEvalError:
                name = None
        for band in self.bands:
            if band.name == name:
                return band
        return self.bands[-1]

    def flow_of(self, request: Request) -> str:
        """The request's flow key; the default when the expression fails or gives ""."""
        if self.key is None:
            return first_of(request.headers, FAIRNESS_HEADERS) or self.default_flow
        try:
            key = self.key({"request": request})
        except CelEvalError:
            return self.default_flow
        return key if isinstance(key, str) and key else self.default_flow

    def weight_of(self, flow: str) -> float:
        return self.weights.get(flow, 1.0)

    def deadline_of(self, request: Request, now: float, band: Band) -> float:
        """When the request would like to be served: its header's budget, else its band's wait."""
        if self.order == "deadline":
            text = request.headers.get(self.deadline_header, "")
            if text.isdigit():
                return now + int(text) / 1000
        return now + band.max_wait_s

    def room(self, pods: Sequence[PolicyPod], request: Request) -> list[PolicyPod]:
        """The pods not saturated for ``request`` (a pod whose predicate fails counts
        as having room: a broken predicate must not hold every request)."""
        ev = Evaluation(request)
        values, _ = self.saturated.values(pods, ev)
        return [pod for pod, full in zip(pods, values, strict=True) if full is not True]


def compile_flow(spec: FlowSpec, compiler: Compiling, error: Any) -> CompiledFlow | None:
    """The section compiled, or None after reporting through the compiler."""
    saturated = (
        compiler.pod_expression(spec.saturated, what="'saturated'", want=BOOL)
        if spec.saturated is not None
        else None
    )
    sees = "the flow's priority and key are worked out per request, before any pod"
    priority = (
        compiler.request_expression(spec.priority, what="'priority'", want=("STRING",), sees=sees)
        if spec.priority is not None
        else None
    )
    key = (
        compiler.request_expression(spec.key, what="'key'", want=("STRING",), sees=sees)
        if spec.key is not None
        else None
    )
    names = [band.name for band in spec.bands]
    for name in {n for n in names if names.count(n) > 1}:
        error(spec.node, f"band '{name}' is listed twice")
    if saturated is None or not spec.bands:
        return None
    if (spec.priority is not None and priority is None) or (spec.key is not None and key is None):
        return None
    return CompiledFlow(
        saturated=saturated,
        priority=priority,
        bands=tuple(
            Band(b.name, rank, b.max_wait_s, b.max_requests, b.max_body_bytes)
            for rank, b in enumerate(spec.bands)
        ),
        key=key,
        default_flow=spec.default_flow,
        weights=MappingProxyType(dict(spec.weights)),
        max_flows=spec.max_flows,
        order=spec.order,
        deadline_header=spec.deadline_header,
        max_requests=spec.max_requests,
        max_body_bytes=spec.max_body_bytes,
        when_full=spec.when_full,
        status=spec.status,
        retry_after_s=spec.retry_after_s,
    )
