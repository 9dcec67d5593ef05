"""Which series of a model server's Prometheus exposition feed which pod fields.

The defaults are vLLM's names. Other servers name the same gauges differently
(and some select them by a label value), so every field takes a list of
``MetricSpec`` tried in order: the first spec with at least one matching series
wins, which is how vLLM's renamed KV-cache gauge falls back to the older name.
The presets come from the servers' public documentation and the Gateway API
Inference Extension's model-server protocol table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_MATCHER = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*(?:"([^"\\]*)"|([^,"}\s]*))\s*')


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """A metric name and label values a series must carry to be read.

    Written ``name`` or ``name{label="value",other=value}`` (quotes optional).
    """

    name: str
    labels: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, text: str) -> MetricSpec:
        """Parse the written form; raises ``ValueError`` saying what is wrong."""
        text = text.strip()
        name, brace, rest = text.partition("{")
        name = name.strip()
        if not _METRIC_NAME.fullmatch(name):
            raise ValueError(f"{text!r}: {name!r} is not a Prometheus metric name")
        if not brace:
            return cls(name)
        if not rest.endswith("}"):
            raise ValueError(f"{text!r}: label matchers must end with '}}'")
        labels: list[tuple[str, str]] = []
        for part in rest[:-1].split(","):
            if not part.strip():
                continue
            match = _MATCHER.fullmatch(part)
            if match is None:
                raise ValueError(f'{text!r}: {part.strip()!r} is not label="value"')
            value = match.group(2) if match.group(2) is not None else match.group(3)
            labels.append((match.group(1), value))
        return cls(name, tuple(labels))

    def __str__(self) -> str:
        if not self.labels:
            return self.name
        matchers = ",".join(f'{name}="{value}"' for name, value in self.labels)
        return f"{self.name}{{{matchers}}}"


def specs(*texts: str) -> tuple[MetricSpec, ...]:
    """Specs from their written forms, in fallback order."""
    return tuple(MetricSpec.parse(text) for text in texts)


@dataclass(frozen=True, slots=True)
class MetricNames:
    """Where a model server publishes the numbers policies read.

    ``waiting`` / ``running`` series are summed (a server with several engines,
    e.g. vLLM data parallel, reports one series each), ``kv_cache`` takes the
    fullest series. ``lora_info`` is vLLM's ``lora_requests_info`` convention
    (several series, the one with the newest timestamp value is current);
    ``None`` for servers that publish no LoRA state.
    """

    waiting: tuple[MetricSpec, ...]
    running: tuple[MetricSpec, ...]
    kv_cache: tuple[MetricSpec, ...]
    lora_info: MetricSpec | None = None
    lora_max_label: str = "max_lora"
    lora_running_label: str = "running_lora_adapters"
    lora_waiting_label: str = "waiting_lora_adapters"
    path: str = "/metrics"

    def __post_init__(self) -> None:
        for field_name in ("waiting", "running", "kv_cache"):
            if not getattr(self, field_name):
                raise ValueError(f"metric names: {field_name} needs at least one metric")
        for label in (self.lora_max_label, self.lora_running_label, self.lora_waiting_label):
            if not _LABEL_NAME.fullmatch(label):
                raise ValueError(f"metric names: {label!r} is not a Prometheus label name")
        if not self.path.startswith("/") or any(c.isspace() for c in self.path):
            raise ValueError(
                f"metric names: path {self.path!r} must start with '/' and hold no spaces"
            )

    def family_names(self) -> tuple[str, ...]:
        """Every metric name read, each once, in the order the fields list them."""
        specs = (*self.waiting, *self.running, *self.kv_cache)
        if self.lora_info is not None:
            specs = (*specs, self.lora_info)
        return tuple(dict.fromkeys(spec.name for spec in specs))


VLLM: Final = MetricNames(
    waiting=specs("vllm:num_requests_waiting"),
    running=specs("vllm:num_requests_running"),
    kv_cache=specs("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    lora_info=MetricSpec("vllm:lora_requests_info"),
)

SGLANG: Final = MetricNames(
    waiting=specs("sglang:num_queue_reqs"),
    running=specs("sglang:num_running_reqs"),
    kv_cache=specs("sglang:token_usage"),
)

# trtllm-serve publishes Prometheus text on /prometheus/metrics (its /metrics is JSON).
TRTLLM_SERVE: Final = MetricNames(
    waiting=specs("trtllm_num_requests_waiting"),
    running=specs("trtllm_num_requests_running"),
    kv_cache=specs("trtllm_kv_cache_utilization"),
    path="/prometheus/metrics",
)

# Triton's TensorRT-LLM backend: one family per kind, the gauge chosen by a label.
# Triton serves metrics on its own port (8002 by default): set the scrape port.
TRITON_TRTLLM: Final = MetricNames(
    waiting=specs('nv_trt_llm_request_metrics{request_type="waiting"}'),
    running=specs('nv_trt_llm_request_metrics{request_type="scheduled"}'),
    kv_cache=specs('nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction"}'),
)

PRESETS: Final[dict[str, MetricNames]] = {
    "vllm": VLLM,
    "sglang": SGLANG,
    "trtllm-serve": TRTLLM_SERVE,
    "triton-trtllm": TRITON_TRTLLM,
}
