"""Names on the decision span: OpenTelemetry GenAI conventions where they apply.

The span describes one inference request as policyd saw it, from the routing
decision to the end of the response. The attributes the GenAI semantic
conventions define (operation, provider, requested model, streaming, the
server the request went to, token usage) carry their names, as release
v1.41.0 of the OpenTelemetry semantic conventions defines them (the last
release that holds the GenAI conventions; they are of "development"
stability), and the spans' instrumentation scope names that release
(``SCHEMA_URL``); everything about the routing policy lives under
``policyd.``. Durations are in seconds (doubles). Lists and texts are
bounded (``MAX_LISTED_PODS``, ``MAX_TEXT``, ``MAX_WALK``) so a large pool or
filter tree never runs into the SDK's attribute limits. The walk through the filter
tree is one text attribute (``walk_summary``), not an event per node: the
span stays a few dozen values however long the walk (the decision log keeps
every node in full).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Final

from policyd.policy.decision import NodeTrace

# -- OpenTelemetry semantic conventions ------------------------------------------------
SCHEMA_URL: Final = "https://opentelemetry.io/schemas/1.41.0"  # the conventions followed
GEN_AI_OPERATION: Final = "gen_ai.operation.name"
GEN_AI_PROVIDER: Final = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL: Final = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS: Final = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_STREAM: Final = "gen_ai.request.stream"  # set only when true, as the convention says
GEN_AI_INPUT_TOKENS: Final = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS: Final = "gen_ai.usage.output_tokens"
# Prompt tokens the model server served from its prefix cache, as it reports them
# (part of ``gen_ai.usage.input_tokens``).
GEN_AI_CACHED_TOKENS: Final = "gen_ai.usage.cache_read.input_tokens"
SERVER_ADDRESS: Final = "server.address"
SERVER_PORT: Final = "server.port"
HTTP_STATUS: Final = "http.response.status_code"
ERROR_TYPE: Final = "error.type"

# -- the decision ------------------------------------------------------------------------
POLICY: Final = "policyd.policy.name"
POLICY_VERSION: Final = "policyd.policy.version"
REQUEST_ID: Final = "policyd.request.id"
TARGET_MODEL: Final = "policyd.request.target_model"
CRITICALITY: Final = "policyd.request.criticality"
PROMPT_TOKENS: Final = "policyd.request.prompt_tokens"  # policyd's estimate
CANDIDATES: Final = "policyd.candidates"
SURVIVORS: Final = "policyd.survivors"
OUTCOME: Final = "policyd.outcome"
REASON: Final = "policyd.reason"
POD: Final = "policyd.pod"
ENDPOINT: Final = "policyd.endpoint"
FALLBACKS: Final = "policyd.fallbacks"
SCORE: Final = "policyd.score"
SCORED_PODS: Final = "policyd.scores.pods"  # the best candidates, best first ...
SCORED_VALUES: Final = "policyd.scores.values"  # ... and their total scores
DECISION_DURATION: Final = "policyd.decision.duration"
# The prefix-cache match (0..1) of the chosen pod and the best any candidate
# offered, for a policy that reads them: locality lost to load shows as a gap.
PREFIX_MATCH: Final = "policyd.prefix.match"
BEST_PREFIX_MATCH: Final = "policyd.prefix.best_match"
# Flow control held the request before this decision: for how long (seconds), and how
# many requests were held ahead of it (its band and above) when it came.
FLOW_HELD: Final = "policyd.flow.held"
# The client's objectives (ms; request.slo_*), set when it stated them; for a policy
# that reads the predictions, the chosen pod's predicted TTFT and TPOT (ms; absent
# while it had none).
SLO_TTFT: Final = "policyd.slo.ttft_ms"
SLO_TPOT: Final = "policyd.slo.tpot_ms"
PREDICTED_TTFT: Final = "policyd.predicted.ttft_ms"
PREDICTED_TPOT: Final = "policyd.predicted.tpot_ms"
FLOW_QUEUE_POSITION: Final = "policyd.flow.queue_position"
# A two-stage policy (a `prefill` section), once routed: whether it split the request,
# why (a reason of policyd.policy.decision.SPLIT_REASONS), the prefill pod (the decode
# pod is policyd.pod), the prefill stage's walk, and what `note` says (an error of
# `when`, why no prefill pod was found).
PD_SPLIT: Final = "policyd.pd.split"
PD_REASON: Final = "policyd.pd.reason"
PD_NOTE: Final = "policyd.pd.note"
PD_PREFILL_POD: Final = "policyd.pd.prefill.pod"
PD_PREFILL_ENDPOINT: Final = "policyd.pd.prefill.endpoint"
PD_PREFILL_WALK: Final = "policyd.pd.prefill.walk"
SHADOWS: Final = "policyd.shadows"  # how many shadow policies were evaluated
SHADOWS_AGREED: Final = "policyd.shadows.agreed"  # how many agreed with the live pick

# -- the response --------------------------------------------------------------------------
RESPONSE_COMPLETED: Final = "policyd.response.completed"
TIME_TO_HEADERS: Final = "policyd.response.time_to_headers"
TIME_TO_FIRST_TOKEN: Final = "policyd.response.time_to_first_token"
RESPONSE_DURATION: Final = "policyd.response.duration"
# A streamed answer's time per output token after the first (seconds), and whether
# each stated objective was met: TTFT by the first body bytes (a whole answer's are
# its last), TPOT by a streamed answer's pace.
TIME_PER_OUTPUT_TOKEN: Final = "policyd.response.time_per_output_token"
SLO_TTFT_MET: Final = "policyd.slo.ttft_met"
SLO_TPOT_MET: Final = "policyd.slo.tpot_met"

# -- the walk through the filter tree ------------------------------------------------------
WALK: Final = "policyd.walk"  # walk_summary: one step per visited node, "a (filter) 6→4 > ..."
WALK_ERRORS: Final = "policyd.walk.errors"  # CEL errors on pods, all nodes together
WALK_FIRST_ERROR: Final = "policyd.walk.first_error"  # "pod: message" of the first

# -- events ----------------------------------------------------------------------------------
SHADOW_EVENT: Final = "policyd.shadow"
SHADOW_POLICY: Final = "policyd.shadow.policy"
SHADOW_VERSION: Final = "policyd.shadow.version"
SHADOW_OUTCOME: Final = "policyd.shadow.outcome"
SHADOW_POD: Final = "policyd.shadow.pod"
SHADOW_ENDPOINT: Final = "policyd.shadow.endpoint"
SHADOW_REASON: Final = "policyd.shadow.reason"
SHADOW_AGREEMENT: Final = "policyd.shadow.agreement"
SHADOW_AGREES: Final = "policyd.shadow.agrees"

MAX_LISTED_PODS: Final = 8  # pod names listed in one attribute (fallbacks, scores)
MAX_TEXT: Final = 256  # characters of any text value (model, request id, reason, ...)
MAX_WALK: Final = 1024  # characters of the walk's summary

# Path suffix -> (gen_ai.operation.name, gen_ai.provider.name). The provider
# names the API the request speaks, the convention's "telemetry format flavor":
# vLLM serves OpenAI's API and Anthropic's Messages API alike.
_OPERATIONS: Final = (
    ("/chat/completions", ("chat", "openai")),
    ("/completions", ("text_completion", "openai")),
    ("/embeddings", ("embeddings", "openai")),
    ("/messages", ("chat", "anthropic")),
    ("/responses", ("chat", "openai")),
)
# Any other path (a model server's own API): the convention allows a custom value.
_OTHER: Final = ("inference", "openai")


def operation(path: str) -> tuple[str, str]:
    """``gen_ai.operation.name`` and ``gen_ai.provider.name`` for a request path."""
    if len(path) > MAX_TEXT:  # not kept in the cache: a client chose it
        return _operation(path)
    return _cached_operation(path)


def _operation(path: str) -> tuple[str, str]:
    for suffix, names in _OPERATIONS:
        if path.endswith(suffix):
            return names
    return _OTHER


_cached_operation: Final = functools.lru_cache(maxsize=1024)(_operation)  # few paths


def span_name(operation: str, model: str) -> str:
    """GenAI convention: ``{gen_ai.operation.name} {gen_ai.request.model}``."""
    return f"{operation} {model}" if model else operation


def decision_span_name(path: str, model: str) -> str:
    """The decision span's name for a request to ``path`` for ``model`` (cut as ``clip``)."""
    if len(path) > MAX_TEXT or len(model) > MAX_TEXT:  # not kept in the cache
        return span_name(_operation(path)[0], clip(model))
    return _cached_decision_span_name(path, model)


@functools.lru_cache(maxsize=4096)  # paths times models: few
def _cached_decision_span_name(path: str, model: str) -> str:
    return span_name(_cached_operation(path)[0], model)


@functools.lru_cache(maxsize=4096)  # one entry per pod
def split_endpoint(endpoint: str) -> tuple[str, int | None]:
    """``server.address`` and ``server.port`` of an ``ip:port`` (IPv6 in brackets)."""
    host, _, port = endpoint.rpartition(":")
    if not host:
        return endpoint, None
    return host.strip("[]"), int(port) if port.isdigit() else None


def clip(text: str, limit: int = MAX_TEXT) -> str:
    """``text`` cut to at most ``limit`` characters, the cut marked with the length it had.

    Every text a client can choose (model names, request ids, paths) goes on
    spans and into the decision log through this: a value megabytes long
    must not be kept, encoded or written whole.
    """
    if len(text) <= limit:
        return text
    marker = f"...[{len(text)} chars]"
    if len(marker) >= limit:
        return text[:limit]
    return text[: limit - len(marker)] + marker


def walk_summary(trace: Sequence[NodeTrace]) -> str:
    """The walk through the filter tree as one text, cut as ``clip`` at ``MAX_WALK``.

    One step per node, ``" > "`` between: ``name (kind) in→kept``, then the
    branch the walk left by, the number of CEL errors and the node's note if
    any, e.g. ``has capacity (keep) 6→4 on_success > least kv (top_k) 4→1``.
    """
    return clip(" > ".join([_step(step) for step in trace]), MAX_WALK)


def _step(step: NodeTrace) -> str:
    text = f"{step.node} ({step.kind}) {step.candidates_in}"
    if step.narrows:  # a kind that keeps some of its pods
        text += f"\u2192{len(step.kept)}"
    if step.branch:
        text += f" {step.branch}"
    if step.errors:
        text += f" [{len(step.errors)} errors]"
    if step.note:
        text += f" ({clip(step.note, 64)})"
    return text


def first_error(trace: Sequence[NodeTrace]) -> str:
    """``"pod: message"`` of the walk's first CEL error (cut as ``clip``), else empty."""
    for step in trace:
        if step.errors:
            pod, message = step.errors[0]
            return clip(f"{pod}: {message}" if pod else message)
    return ""
