"""Reads the handful of series the pool needs from a Prometheus text exposition.

A vLLM ``/metrics`` page is 30-50 KB, mostly histogram buckets; the pool needs
a few families of it (``policyd.fields.METRICS``), a hundred pods ten times a
second. So this parser never walks the page line by line: it finds each
wanted family by ``bytes.find`` at C speed, reads that family's group of
sample lines with one pattern match per line (the text format requires a
family's samples to form one contiguous group) and stops. Each metric's
series are then combined by the rule its declaration names (``_count``,
``_fraction``, ``_lora_state``, ``_info``). Labels are decoded only where a
spec matches on them or where the LoRA state or an info metric's values live.
Lines of other families are never looked at, so their oddities cannot fail a
scrape; a malformed line of a family that is read raises
``ExpositionError`` with its line number (a slower, explaining parse of that
line says what is wrong).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from policyd.fields import METRICS, SCRAPED_POD_FIELDS, Field, Metric
from policyd.pool.metric_names import MetricNames, MetricSpec
from policyd.pool.pod_types import PodMetrics

# PodMetrics is generated into pod_types; the pool imports it from here, with its parser.
__all__ = ["NO_METRICS", "ExpositionError", "MetricsParser", "PodMetrics"]


class ExpositionError(ValueError):
    """The exposition lacks a needed series (``missing``) or has a malformed line in one."""

    def __init__(self, reason: str, line: int | None = None, *, missing: bool = False) -> None:
        super().__init__(f"line {line}: {reason}" if line is not None else reason)
        self.reason = reason
        self.line = line
        self.missing = missing


# Active adapters, waiting adapters, max adapters, whether a series said so.
_LoraState = tuple[tuple[str, ...], tuple[str, ...], int, bool]
_NO_LORA_STATE: _LoraState = ((), (), 0, False)
_LORA_PARTS = {"running": 0, "waiting": 1, "max": 2, "known": 3}


# A pod never scraped.
NO_METRICS = PodMetrics()

# One sample line: where it starts in the data, its raw label text, its value.
_Sample = tuple[int, bytes | bytearray, float]

# The CEL pod fields are int64: a count or a slot number beyond it is no count.
_INT64_LIMIT = 2.0**63  # the first float that does not fit
_INT64_MAX = 2**63 - 1
_LORA_STATES_KEPT = 256  # label sets remembered per parser (all pods of a scraper)

# The rest of a well-formed sample line after the family name: optional labels
# (up to the line's last '}'), the value, an optional timestamp. Lines it does
# not match get the slow, explaining parse.
_SAMPLE_REST = rb"(?:\{(.*)\})?[ \t]+([^ \t\r\n]+)(?:[ \t]+[^ \t\r\n]+)?[ \t]*\r?(?:\n|\Z)"


@dataclass(frozen=True, slots=True)
class _Family:
    """A family to read: its spec, its name, its line pattern."""

    spec: MetricSpec
    name: bytes
    needle: bytes  # newline + name: where one of its lines starts
    line: re.Pattern[bytes]

    @classmethod
    def of(cls, spec: MetricSpec) -> _Family:
        name = spec.name.encode("ascii")
        return cls(spec, name, b"\n" + name, re.compile(re.escape(name) + _SAMPLE_REST))


class MetricsParser:
    """Turns exposition bodies into ``PodMetrics`` for one set of ``MetricNames``.

    Each declared metric is read by the rule its ``combine`` names.
    """

    __slots__ = ("_fields", "_info_fields", "_infos", "_lora_states", "_names", "_reads")

    def __init__(self, names: MetricNames) -> None:
        self._names = names
        # One read per declared metric: the metric and its families in fallback order.
        self._reads = tuple(
            (metric, tuple(_Family.of(spec) for spec in names.of(metric))) for metric in METRICS
        )
        index = {metric.key: i for i, metric in enumerate(METRICS)}
        # Per info metric: the fields it gives, in the order of its value's parts.
        self._info_fields = {
            metric.key: tuple(f for f in SCRAPED_POD_FIELDS if f.metric is metric)
            for metric in METRICS
            if metric.combine == "info"
        }
        # Per scraped field: which read gives it, and which part of that read's value.
        self._fields = tuple(
            (index[field.metric.key], _part_of(field, self._info_fields))
            for field in SCRAPED_POD_FIELDS
            if field.metric is not None
        )
        # Label sets read before, by the label text they were read from: they
        # change only when adapters come or go, or a server restarts.
        self._lora_states: dict[bytes, _LoraState] = {}
        self._infos: dict[tuple[str, bytes], tuple[Any, ...]] = {}

    def parse(self, body: bytes | bytearray, start: int = 0, end: int | None = None) -> PodMetrics:
        """The ``PodMetrics`` in ``body[start:end]`` (no copy is made of a slice of a buffer).

        Raises ``ExpositionError`` naming the line (counted from ``start``) and what is wrong.
        """
        page = _Page(body, start, len(body) if end is None else end)
        values: list[Any] = []
        for metric, families in self._reads:
            combine = metric.combine
            if combine == "sum":
                values.append(_count(page, families, metric))
            elif combine == "fullest":
                values.append(_fraction(page, families, metric))
            elif combine == "info":
                values.append(self._info(page, families, metric))
            else:
                values.append(self._lora_state(page, families))
        return PodMetrics(
            *(values[read] if part < 0 else values[read][part] for read, part in self._fields)
        )

    def _lora_state(self, page: _Page, families: tuple[_Family, ...]) -> _LoraState:
        """The adapters of the newest series of the first present LoRA info family.

        Each series' value is the Unix time it was last set; old label sets
        linger with old times, so the largest value is the current state (on
        a tie the first such series wins). No series means nothing is known
        (a vLLM sets its first one when it first logs its stats, up to
        ``VLLM_LOG_STATS_INTERVAL`` after it starts). A value that is no time
        (NaN, infinite) cannot say which series is current: the page is bad.
        """
        for family in families:
            samples = page.samples(family)
            if samples:
                break
        else:
            return _NO_LORA_STATE
        for offset, _, value in samples:
            if not math.isfinite(value):
                raise ExpositionError(
                    f"{family.spec.name}: {value} is not the time a series was set",
                    page.line_of(offset),
                )
        newest = samples[0]
        for sample in samples[1:]:
            if sample[2] > newest[2]:
                newest = sample
        # The label sets change only when adapters come or go: each is read once.
        key = bytes(newest[1])
        state = self._lora_states.get(key)
        if state is None:
            state = self._read_lora_labels(page, family, newest)
            if len(self._lora_states) >= _LORA_STATES_KEPT:
                self._lora_states.clear()
            self._lora_states[key] = state
        return state

    def _info(self, page: _Page, families: tuple[_Family, ...], metric: Metric) -> tuple[Any, ...]:
        """The labels its fields name, of the first series of the first present family.

        A field whose label is missing keeps its default; an int field's label
        that is not a whole number fails the scrape, as a bad count does.
        """
        fields = self._info_fields[metric.key]
        found = _first_present(page, families, metric)
        if found is None:
            return tuple(field.default for field in fields)
        spec, samples = found
        first = samples[0]
        key = (metric.key, bytes(first[1]))
        values = self._infos.get(key)
        if values is None:
            labels = page.labels(first, spec.name)
            values = tuple(_info_value(field, labels, spec, page, first) for field in fields)
            if len(self._infos) >= _LORA_STATES_KEPT:
                self._infos.clear()
            self._infos[key] = values
        return values

    def _read_lora_labels(self, page: _Page, family: _Family, newest: _Sample) -> _LoraState:
        spec = family.spec
        labels = page.labels(newest, spec.name)
        names = self._names
        max_text = labels.get(names.lora_max_label, "").strip()
        if max_text and not (max_text.isdigit() and max_text.isascii()):
            raise ExpositionError(
                f"{spec.name}: {names.lora_max_label}={max_text!r} is not a whole number",
                page.line_of(newest[0]),
            )
        max_loras = int(max_text) if max_text else 0
        if max_loras > _INT64_MAX:
            raise ExpositionError(
                f"{spec.name}: {names.lora_max_label}={max_text!r} is out of range"
                " (more than a 64-bit integer holds)",
                page.line_of(newest[0]),
            )
        return (
            _adapter_list(labels.get(names.lora_running_label, "")),
            _adapter_list(labels.get(names.lora_waiting_label, "")),
            max_loras,
            True,
        )


def _part_of(field: Field, info_fields: dict[str, tuple[Field, ...]]) -> int:
    """Where a field sits in its read's value (-1: it is the whole value)."""
    assert field.metric is not None
    if field.metric.combine == "info":
        return info_fields[field.metric.key].index(field)
    return _LORA_PARTS.get(field.part, -1)


def _info_value(
    field: Field, labels: dict[str, str], spec: MetricSpec, page: _Page, sample: _Sample
) -> Any:
    text = labels.get(field.part)
    if text is None:
        return field.default
    if field.kind != "int":
        return text
    text = text.strip()
    if not (text.isdigit() and text.isascii()) or int(text) > _INT64_MAX:
        raise ExpositionError(
            f"{spec.name}: {field.part}={text!r} is not a whole number", page.line_of(sample[0])
        )
    return int(text)


def _count(page: _Page, families: tuple[_Family, ...], metric: Metric) -> int:
    """Sum of the first present family's series: requests across all engines."""
    found = _first_present(page, families, metric)
    if found is None:
        return 0
    spec, samples = found
    total = 0.0
    for offset, _, value in samples:
        if not math.isfinite(value) or value < 0:
            raise ExpositionError(f"{spec.name}: {value} is not a count", page.line_of(offset))
        if value >= _INT64_LIMIT:
            raise ExpositionError(
                f"{spec.name}: {value} is out of range (more than a 64-bit integer holds)",
                page.line_of(offset),
            )
        total += value
    if total >= _INT64_LIMIT:
        raise ExpositionError(
            f"{spec.name}: the series add up to {total}, out of range"
            " (more than a 64-bit integer holds)",
            page.line_of(samples[0][0]),
        )
    return round(total)


def _fraction(page: _Page, families: tuple[_Family, ...], metric: Metric) -> float:
    """Largest of the first present family's series: the fullest engine's KV cache."""
    found = _first_present(page, families, metric)
    if found is None:
        return 0.0
    spec, samples = found
    fullest = 0.0
    for offset, _, value in samples:
        if not 0.0 <= value <= 1.0:  # NaN fails too
            raise ExpositionError(
                f"{spec.name}: {value} is not a fraction from 0 to 1", page.line_of(offset)
            )
        fullest = max(fullest, value)
    return fullest


def _first_present(
    page: _Page, families: tuple[_Family, ...], metric: Metric
) -> tuple[MetricSpec, list[_Sample]] | None:
    """The first family with series; ``None`` for an optional metric with none."""
    for family in families:
        samples = page.samples(family)
        if samples:
            return family.spec, samples
    if not metric.required:
        return None
    wanted = " or ".join(str(family.spec) for family in families)
    raise ExpositionError(f"no {wanted} series in the response", missing=True)


# What may follow a family name on one of its sample lines (a bare name has no value,
# which is then reported rather than overlooked).
_AFTER_NAME = (b"{", b" ", b"\t", b"\r", b"\n", b"")


class _Page:
    """The body being parsed, ``data[first:last]``.

    Every look at ``data`` stays within ``first:last``: the body may be a
    slice of a connection's receive buffer, with other bytes around it.
    """

    __slots__ = ("data", "first", "last")

    def __init__(self, data: bytes | bytearray, first: int, last: int) -> None:
        self.data = data
        self.first = first
        self.last = last

    def samples(self, family: _Family) -> list[_Sample]:
        """The family's samples whose labels carry every value its spec asks for."""
        spec = family.spec
        start = self._find(family, self.first, self.last)
        samples = self._group(family, start) if start >= 0 else []
        if not spec.labels or not samples:
            return samples
        return [
            sample
            for sample in samples
            if all(self.labels(sample, spec.name).get(k) == v for k, v in spec.labels)
        ]

    def labels(self, sample: _Sample, family: str) -> dict[str, str]:
        try:
            return parse_labels(sample[1].decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as error:
            raise ExpositionError(f"{family}: {error}", self.line_of(sample[0])) from None

    def line_of(self, offset: int) -> int:
        return self.data.count(b"\n", self.first, offset) + 1

    def _find(self, family: _Family, start: int, end: int) -> int:
        """The first line starting in ``start:end`` that is a sample of the family, or -1."""
        name = family.name
        if start == self.first and self._is_sample(name, start):
            return start
        data, needle = self.data, family.needle
        found = data.find(needle, start, end)
        while found >= 0:
            if self._is_sample(name, found + 1):
                return found + 1
            found = data.find(needle, found + len(needle), end)
        return -1

    def _is_sample(self, name: bytes, at: int) -> bool:
        """Whether the line starting at ``at`` is a sample of ``name``."""
        after = at + len(name)
        return (
            self.data.startswith(name, at, self.last)
            and self.data[after : min(after + 1, self.last)] in _AFTER_NAME
        )

    def _group(self, family: _Family, start: int) -> list[_Sample]:
        """The sample lines from ``start`` while they belong to the family."""
        data, last = self.data, self.last
        match = family.line.match
        samples: list[_Sample] = []
        while start < last:
            line = match(data, start, last)
            if line is not None:
                try:
                    samples.append((start, line[1] or b"", float(line[2])))
                    start = line.end()
                    continue
                except ValueError:
                    pass  # not a number: the slow parse below says so
            name = family.name
            if not (data.startswith(name, start, last) and self._is_sample(name, start)):
                break
            end = data.find(b"\n", start, last)
            if end < 0:
                end = last
            try:
                label_text, value = _split_sample(data[start:end], len(family.name))
            except ValueError as error:
                raise ExpositionError(f"{family.spec.name}: {error}", self.line_of(start)) from None
            samples.append((start, label_text, value))
            start = end + 1
        return samples


def _split_sample(line: bytes | bytearray, name_size: int) -> tuple[bytes | bytearray, float]:
    """``name{labels} value [timestamp]`` -> (labels text, value).

    The label set ends at the line's last ``}``: label values may hold braces,
    a value and a timestamp cannot.
    """
    if line[name_size : name_size + 1] == b"{":
        close = line.rfind(b"}")
        if close < 0:
            raise ValueError("the label set is not closed with '}'")
        label_text, tail = line[name_size + 1 : close], line[close + 1 :]
    else:
        label_text, tail = b"", line[name_size:]
    fields = tail.split()
    if not fields:
        raise ValueError("the sample has no value")
    if len(fields) > 2:
        raise ValueError(f"unexpected text after the value: {b' '.join(fields[2:]).decode()!r}")
    try:
        return label_text, float(fields[0])
    except ValueError:
        raise ValueError(f"value {fields[0].decode(errors='replace')!r} is not a number") from None


_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*\s*=\s*"[^"\\\n]*"'
_PLAIN_LABELS = re.compile(rf"\s*{_LABEL}\s*(?:,\s*{_LABEL}\s*)*,?\s*")
_PLAIN_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"([^"\\\n]*)"')


def parse_labels(text: str) -> dict[str, str]:
    """``a="1",b="x\\"y"`` -> ``{"a": "1", "b": 'x"y'}`` with the format's escapes."""
    if _PLAIN_LABELS.fullmatch(text):  # no escapes: two regex passes do it all
        return dict(_PLAIN_LABEL.findall(text))
    labels: dict[str, str] = {}
    position, size = 0, len(text)
    while position < size:
        equals = text.find("=", position)
        if equals < 0:
            raise ValueError(f"label {text[position:].strip()!r} has no '='")
        name = text[position:equals].strip()
        if not name or not (name[0].isalpha() or name[0] == "_"):
            raise ValueError(f"{name!r} is not a label name")
        quote = equals + 1
        while quote < size and text[quote] in " \t":
            quote += 1
        if quote >= size or text[quote] != '"':
            raise ValueError(f"the value of label {name!r} is not quoted")
        value, position = _quoted(text, quote + 1, name)
        labels[name] = value
        while position < size and text[position] in " \t":
            position += 1
        if position < size:
            if text[position] != ",":
                raise ValueError(f"expected ',' after label {name!r}")
            position += 1
    return labels


_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


def _quoted(text: str, start: int, name: str) -> tuple[str, int]:
    """The label value starting after its opening quote, and the index past its close."""
    parts: list[str] = []
    position = start
    while True:
        close = text.find('"', position)
        backslash = text.find("\\", position, close if close >= 0 else len(text))
        if backslash >= 0:
            escaped = text[backslash + 1 : backslash + 2]
            if escaped not in _ESCAPES:
                raise ValueError(f"label {name!r} has an unknown escape '\\{escaped}'")
            parts.append(text[position:backslash])
            parts.append(_ESCAPES[escaped])
            position = backslash + 2
            continue
        if close < 0:
            raise ValueError(f"the value of label {name!r} is not closed with '\"'")
        parts.append(text[position:close])
        return "".join(parts), close + 1


def _adapter_list(text: str) -> tuple[str, ...]:
    """``"a, b,"`` -> ``("a", "b")``; an empty label value means no adapters."""
    return tuple(name for name in (part.strip() for part in text.split(",")) if name)
