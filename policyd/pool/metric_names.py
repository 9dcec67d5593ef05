"""Which series of a model server's Prometheus exposition feed which pod fields.

The metrics and their names under each preset are declared in
``policyd.fields``; this module parses the written specs and builds the
presets from them. Servers name the same gauges differently (and some select
them by a label value), so every metric takes a list of ``MetricSpec`` tried
in order: the first spec with at least one matching series wins, which is how
vLLM's renamed KV-cache gauge falls back to the older name.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from policyd.fields import METRICS, PRESET_PATHS, Metric

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

    ``specs`` maps each declared metric's key (``policyd.fields.METRICS``) to
    the specs tried in order; a key absent or empty is not published (a
    required metric must be given). How each metric's series combine is
    declared with it. The LoRA info metric is vLLM's ``lora_requests_info``
    convention (several series, the one with the newest timestamp value is
    current); its label names can be changed here.
    """

    specs: Mapping[str, tuple[MetricSpec, ...]]
    lora_max_label: str = "max_lora"
    lora_running_label: str = "running_lora_adapters"
    lora_waiting_label: str = "waiting_lora_adapters"
    path: str = "/metrics"

    def __post_init__(self) -> None:
        known = {metric.key for metric in METRICS}
        for key in self.specs:
            if key not in known:
                raise ValueError(f"metric names: no metric {key!r} is declared")
        for metric in METRICS:
            if metric.required and not self.specs.get(metric.key):
                raise ValueError(f"metric names: {metric.key} needs at least one metric")
        for label in (self.lora_max_label, self.lora_running_label, self.lora_waiting_label):
            if not _LABEL_NAME.fullmatch(label):
                raise ValueError(f"metric names: {label!r} is not a Prometheus label name")
        if not self.path.startswith("/") or any(c.isspace() for c in self.path):
            raise ValueError(
                f"metric names: path {self.path!r} must start with '/' and hold no spaces"
            )

    def of(self, metric: Metric) -> tuple[MetricSpec, ...]:
        """The specs read for ``metric``, in fallback order (empty: not read)."""
        return self.specs.get(metric.key, ())

    def replace(self, **specs: tuple[MetricSpec, ...]) -> MetricNames:
        """These names with some metrics' specs replaced (keys as in ``specs``)."""
        return dataclasses.replace(self, specs={**self.specs, **specs})

    def family_names(self) -> tuple[str, ...]:
        """Every metric name read, each once, in the order the metrics are declared."""
        return tuple(dict.fromkeys(spec.name for metric in METRICS for spec in self.of(metric)))


def preset(name: str, path: str = "/metrics") -> MetricNames:
    """The names a model server publishes, as declared per metric."""
    return MetricNames(
        {metric.key: specs(*metric.presets.get(name, ())) for metric in METRICS}, path=path
    )


PRESETS: Final[dict[str, MetricNames]] = {
    name: preset(name, path) for name, path in PRESET_PATHS.items()
}
VLLM: Final = PRESETS["vllm"]
SGLANG: Final = PRESETS["sglang"]
TRTLLM_SERVE: Final = PRESETS["trtllm-serve"]
TRITON_TRTLLM: Final = PRESETS["triton-trtllm"]

PRESET_LABEL: Final = "llm-d.ai/engine-type"
"""The pod label that names a pod's model server, and so its preset (mixed pools).

llm-d's convention for the same purpose (its endpoint picker reads a pod's
metrics by the engine this label names); its values are the preset names,
and llm-d's ``triton-tensorrt-llm`` is read as ``triton-trtllm``.
"""

PRESET_ALIASES: Final[Mapping[str, str]] = {"triton-tensorrt-llm": "triton-trtllm"}


def preset_named(value: str) -> str | None:
    """The preset a label value names (its name or an alias), or ``None`` if none."""
    name = value.strip()
    name = PRESET_ALIASES.get(name, name)
    return name if name in PRESETS else None
