"""The declarations: one ``Field`` per pod and request field, one ``Metric`` per series read.

To add a pod field a model server exports: declare its ``Metric`` (its name
under each preset that publishes it, how its series combine) and its
``Field``, run ``python -m policyd.fields.generate`` (it rewrites the typed
classes made from these declarations) and add the field's row to
docs/policy-language.md. A field whose value is not scraped (``in_flight``,
counted by the serving path; per-request values such as a prefix-cache match)
is declared with its origin and no metric, and the code that computes it sets
it: a field of origin ``"prefix"`` is a field of ``PrefixMatch``, which the
prefix probe fills and the router lays over pods.

To add a request field: declare its ``Field`` in ``REQUEST_FIELDS`` with its
default, regenerate, fill it where ``policyd.extproc.openai`` builds the
``Request``, and add its row to docs/policy-language.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, Literal

from policyd.fields.roles import BOTH

# CEL kinds: "string" | "int" | "double" | "bool" | "duration" (default in
# seconds) | "list<string>" | "map<string,string>".
Kind = str

# Where a field's value comes from:
# - "identity": discovery (the pod's name, address, labels);
# - "metric": the model server's exposition, through ``Field.metric``;
# - "serving": the serving path (``in_flight``) or, for a field computed per
#   request, the code that computes it;
# - "scrape": the scrape's bookkeeping (``metrics_age``);
# - "prefix": per request and pod, from the prompt and the prefix-cache index
#   (``policyd.prefix``); the router sets it only for a policy that reads it;
# - "prediction": per request and pod, from policyd's latency models
#   (``policyd.latency``); the router sets it only for a policy that reads it;
# - "request": the request's headers and body, read by ``policyd.extproc.openai``;
# - "policy": decided by the router for each request (``Request.decided``).
Origin = Literal[
    "identity", "metric", "serving", "scrape", "prefix", "prediction", "request", "policy"
]

# A predicted_* field's value while the pod has no prediction yet (too few outcomes
# learned since it joined, restarted or changed model): below any real latency, so
# ``pod.predicted_ttft_ms >= 0.0`` says "there is a prediction".
NO_PREDICTION: Final = -1.0

# How the series of a metric make one value; each is one rule of
# ``policyd.pool.exposition``:
# - "sum": a count, summed over the series (one per engine, e.g. vLLM data
#   parallel); each a finite, non-negative number that fits an int64;
# - "fullest": a fraction 0..1, the largest series (the fullest engine);
# - "lora-info": vLLM's ``lora_requests_info``: the newest series' labels;
# - "info": labels of the first series, each field the label its ``part``
#   names (an int field's label must be a whole number).
Combine = Literal["sum", "fullest", "lora-info", "info"]

REQUIRED: Final = object()  # a field with no default: a hand-made pod must give it


@dataclass(frozen=True, slots=True)
class Metric:
    """One value read from a model server's metrics page.

    ``key`` names it in ``MetricNames`` and on the command line
    (``--metric-<key>``). ``presets`` maps a preset to its written specs
    (``name`` or ``name{label="value"}``), tried in order; a preset that
    lists none publishes none. A ``required`` metric missing from a page
    fails the pod's scrape; an optional one leaves its fields at their
    defaults.
    """

    key: str
    combine: Combine
    presets: Mapping[str, tuple[str, ...]]
    required: bool
    help: str


@dataclass(frozen=True, slots=True)
class Field:
    """One attribute policies read: ``pod.<name>`` or ``request.<name>``.

    ``doc`` is its line in docs/policy-language.md's schema table. ``default``
    is its value where nothing says otherwise: a pod written by hand, and a
    scraped field whose optional metric is not published. ``part`` picks a
    field out of a metric that feeds several ("lora-info": "running",
    "waiting", "max", "known"). ``logged`` fields go into the decision log's
    and the span's record of the chosen pod.
    """

    name: str
    kind: Kind
    origin: Origin
    doc: str
    default: object = REQUIRED
    metric: Metric | None = None
    part: str = ""
    logged: bool = True


# The model servers policyd knows, and the path each serves Prometheus text on.
# trtllm-serve's /metrics is JSON; Triton serves metrics on its own port (8002
# by default), which the operator sets with --metrics-port.
PRESET_PATHS: Final[Mapping[str, str]] = {
    "vllm": "/metrics",
    "sglang": "/metrics",
    "trtllm-serve": "/prometheus/metrics",
    "triton-trtllm": "/metrics",
}
PRESET_NAMES: Final = tuple(PRESET_PATHS)

WAITING: Final = Metric(
    "waiting",
    "sum",
    {
        "vllm": ("vllm:num_requests_waiting",),
        "sglang": ("sglang:num_queue_reqs",),
        "trtllm-serve": ("trtllm_num_requests_waiting",),
        "triton-trtllm": ('nv_trt_llm_request_metrics{request_type="waiting"}',),
    },
    required=True,
    help="queued requests",
)
RUNNING: Final = Metric(
    "running",
    "sum",
    {
        "vllm": ("vllm:num_requests_running",),
        "sglang": ("sglang:num_running_reqs",),
        "trtllm-serve": ("trtllm_num_requests_running",),
        "triton-trtllm": ('nv_trt_llm_request_metrics{request_type="scheduled"}',),
    },
    required=True,
    help="running requests",
)
KV_CACHE: Final = Metric(
    "kv-cache",
    "fullest",
    {
        "vllm": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        "sglang": ("sglang:token_usage",),
        "trtllm-serve": ("trtllm_kv_cache_utilization",),
        "triton-trtllm": ('nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction"}',),
    },
    required=True,
    help="KV-cache usage 0..1",
)
LORA_INFO: Final = Metric(
    "lora-info",
    "lora-info",
    {"vllm": ("vllm:lora_requests_info",)},
    required=False,
    help="lora_requests_info-style metric",
)
PREEMPTIONS: Final = Metric(
    "preemptions",
    "sum",
    {"vllm": ("vllm:num_preemptions_total",)},
    required=False,
    help="preemptions since the server started (a counter)",
)

SERVED_MODEL: Final = Metric(
    "served-model",
    "info",
    {
        "vllm": ("vllm:num_requests_running",),
        "sglang": ("sglang:num_running_reqs",),
    },
    required=False,
    help="a series labelled with the served model's name (model_name)",
)
CACHE_CONFIG: Final = Metric(
    "cache-config",
    "info",
    {"vllm": ("vllm:cache_config_info",)},
    required=False,
    help="vLLM's cache_config_info (num_gpu_blocks, block_size labels)",
)

METRICS: Final[tuple[Metric, ...]] = (
    WAITING,
    RUNNING,
    KV_CACHE,
    LORA_INFO,
    PREEMPTIONS,
    SERVED_MODEL,
    CACHE_CONFIG,
)

_EMPTY_MAP: Final[Mapping[str, str]] = MappingProxyType({})

POD_FIELDS: Final[tuple[Field, ...]] = (
    Field("name", "string", "identity", "pod name"),
    Field("address", "string", "identity", "`ip:port` Envoy sends the request to"),
    Field("labels", "map<string,string>", "identity", "pod labels", _EMPTY_MAP, logged=False),
    Field(
        "role",
        "string",
        "identity",
        '`"prefill"`, `"decode"` or `"both"`: the pod\'s part in disaggregated serving, from'
        ' its `llm-d.ai/role` label (`policyd serve --role-label`); `"both"` without one'
        " (see docs/disaggregation.md)",
        BOTH,
    ),
    Field(
        "waiting_queue",
        "int",
        "metric",
        "requests queued in the model server (`vllm:num_requests_waiting`)",
        0,
        WAITING,
    ),
    Field("running", "int", "metric", "requests running (`vllm:num_requests_running`)", 0, RUNNING),
    Field(
        "kv_cache",
        "double",
        "metric",
        "KV-cache use, 0..1 (`vllm:kv_cache_usage_perc`)",
        0.0,
        KV_CACHE,
    ),
    Field(
        "active_loras",
        "list<string>",
        "metric",
        "LoRA adapters with running requests",
        (),
        LORA_INFO,
        "running",
    ),
    Field(
        "waiting_loras",
        "list<string>",
        "metric",
        "LoRA adapters with waiting requests",
        (),
        LORA_INFO,
        "waiting",
    ),
    Field(
        "max_loras", "int", "metric", "adapters the server can hold at once", 0, LORA_INFO, "max"
    ),
    Field(
        "lora_info_known",
        "bool",
        "metric",
        "the pod has published its LoRA state (`vllm:lora_requests_info`); while false,"
        " `active_loras` and `waiting_loras` are empty and `max_loras` is 0 for want of"
        " knowledge, not because the pod is full (see below)",
        # A pod written by hand describes a known state unless it says otherwise;
        # a scraped pod is known only once the series is there.
        True,
        LORA_INFO,
        "known",
        logged=False,
    ),
    Field(
        "num_preemptions",
        "int",
        "metric",
        "requests the model server preempted since it started, a counter"
        " (`vllm:num_preemptions_total`; 0 where the server does not publish it)",
        0,
        PREEMPTIONS,
    ),
    Field(
        "base_model",
        "string",
        "metric",
        "the model the server serves, as its metrics name it (the `model_name` label);"
        ' a request for it needs no LoRA adapter ("" where not published)',
        "",
        SERVED_MODEL,
        "model_name",
    ),
    Field(
        "kv_cache_blocks",
        "int",
        "metric",
        "KV-cache blocks the server holds on its GPUs (`num_gpu_blocks` of"
        " `vllm:cache_config_info`; 0 where not published)",
        0,
        CACHE_CONFIG,
        "num_gpu_blocks",
        logged=False,
    ),
    Field(
        "kv_block_size",
        "int",
        "metric",
        "tokens per KV-cache block (`block_size` of `vllm:cache_config_info`; 0 where"
        " not published)",
        0,
        CACHE_CONFIG,
        "block_size",
        logged=False,
    ),
    Field(
        "in_flight",
        "int",
        "serving",
        "requests policyd sent to the pod that have not finished",
        0,
    ),
    Field(
        "queued_prefill_tokens",
        "int",
        "serving",
        "uncached prompt tokens of the requests policyd sent to the pod that have not"
        " answered a first token yet: the prefill queued there, which `running` does not show",
        0,
    ),
    Field(
        "metrics_age",
        "duration",
        "scrape",
        "time since the pod's metrics were scraped",
        0.0,
    ),
    Field(
        "prefix_match",
        "double",
        "prefix",
        "fraction 0..1 of this request's prompt tokens that are (precise mode) or are"
        " likely to be (approximate mode) in the pod's prefix cache; 0 without a prefix"
        " index (see docs/prefix-cache.md)",
        0.0,
        # Logged per decision instead (the chosen pod's and the best offered).
        logged=False,
    ),
    Field(
        "prefix_tokens",
        "int",
        "prefix",
        "those cached prompt tokens, in whole KV blocks",
        0,
        logged=False,
    ),
    Field(
        "predicted_ttft_ms",
        "double",
        "prediction",
        "time to first token this request is predicted to see on the pod, in ms, learned"
        " from policyd's own outcomes; -1.0 while the pod has no prediction yet (see"
        " docs/policy-language.md, SLO-aware routing)",
        NO_PREDICTION,
        logged=False,
    ),
    Field(
        "predicted_tpot_ms",
        "double",
        "prediction",
        "time per output token predicted for this request on the pod, in ms; -1.0 while"
        " the pod has no prediction yet",
        NO_PREDICTION,
        logged=False,
    ),
)

# The fields the router computes per request and pod from the prompt.
PREFIX_POD_FIELDS: Final = tuple(field for field in POD_FIELDS if field.origin == "prefix")
# The fields the router asks the latency models for, per request and pod.
PREDICTION_POD_FIELDS: Final = tuple(field for field in POD_FIELDS if field.origin == "prediction")

# The fields a scrape produces, in the order of ``policyd.pool.exposition.PodMetrics``.
SCRAPED_POD_FIELDS: Final = tuple(field for field in POD_FIELDS if field.metric is not None)

REQUEST_FIELDS: Final[tuple[Field, ...]] = (
    Field("model", "string", "request", "model named by the client"),
    Field(
        "target_model",
        "string",
        "policy",
        "model after this policy's rewrite / traffic split",
        "",
    ),
    Field(
        "criticality",
        "string",
        "policy",
        '`"critical"`, `"standard"` or `"sheddable"`, as decided by the policy',
        "standard",
    ),
    Field(
        "headers",
        "map<string,string>",
        "request",
        "request headers, lower-case names",
        _EMPTY_MAP,
    ),
    Field("prompt_tokens", "int", "request", "estimated prompt length", 0),
    Field(
        "max_tokens",
        "int",
        "request",
        "completion budget asked for (`max_completion_tokens`, `max_tokens`"
        " or `max_output_tokens`; 0 when absent)",
        0,
    ),
    Field("stream", "bool", "request", "streamed response asked for", False),
    Field(
        "slo_ttft_ms",
        "double",
        "request",
        "the client's time-to-first-token objective in ms (header `x-llm-d-slo-ttft-ms`,"
        " or `x-slo-ttft-ms`); 0 when it states none",
        0.0,
    ),
    Field(
        "slo_tpot_ms",
        "double",
        "request",
        "the client's time-per-output-token objective in ms (header `x-llm-d-slo-tpot-ms`,"
        " or `x-slo-tpot-ms`); 0 when it states none",
        0.0,
    ),
    Field("path", "string", "request", "HTTP path, e.g. `/v1/completions`", "/v1/completions"),
    Field("id", "string", "request", "request id", ""),
    Field(
        "objective",
        "string",
        "request",
        "the InferenceObjective the request names (`x-llm-d-inference-objective`, else"
        ' `x-gateway-inference-objective`) when policyd follows one of that name, else `""`',
        "",
    ),
    Field(
        "priority",
        "int",
        "request",
        "that InferenceObjective's `priority` (0 when it sets none, or without one)",
        0,
    ),
)
