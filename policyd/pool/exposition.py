"""Reads the handful of series the pool needs from a Prometheus text exposition.

A vLLM ``/metrics`` page is 30-50 KB, mostly histogram buckets; the pool needs
at most five families of it, a hundred pods ten times a second. So this parser
never walks the page line by line: it jumps to each wanted family with
``bytes.find`` (C speed), reads that family's group of sample lines (the text
format requires a family's samples to form one contiguous group) and stops.
Labels are decoded only where a spec matches on them or where the LoRA state
lives. Lines of other families are never looked at, so their oddities cannot
fail a scrape; a malformed line of a family that is read raises
``ExpositionError`` with its line number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from policyd.pool.metric_names import MetricNames, MetricSpec


class ExpositionError(ValueError):
    """The exposition lacks a needed series or has a malformed line in one."""

    def __init__(self, reason: str, line: int | None = None) -> None:
        super().__init__(f"line {line}: {reason}" if line is not None else reason)
        self.reason = reason
        self.line = line


@dataclass(frozen=True, slots=True)
class PodMetrics:
    """The scraped numbers the CEL ``pod`` fields are made of."""

    waiting_queue: int
    running: int
    kv_cache: float
    active_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()
    max_loras: int = 0


NO_METRICS = PodMetrics(waiting_queue=0, running=0, kv_cache=0.0)

# One sample line: where it starts in the body, its raw label text, its value.
_Sample = tuple[int, bytes, float]


class MetricsParser:
    """Turns exposition bodies into ``PodMetrics`` for one set of ``MetricNames``."""

    __slots__ = ("_kv_cache", "_lora", "_names", "_running", "_waiting")

    def __init__(self, names: MetricNames) -> None:
        self._names = names
        self._waiting = _encode(names.waiting)
        self._running = _encode(names.running)
        self._kv_cache = _encode(names.kv_cache)
        self._lora = None if names.lora_info is None else _encode((names.lora_info,))[0]

    def parse(self, body: bytes) -> PodMetrics:
        """The pod's metrics; raises ``ExpositionError`` naming the line and what is wrong."""
        waiting = _count(body, self._waiting)
        running = _count(body, self._running)
        kv_cache = _fraction(body, self._kv_cache)
        if self._lora is None:
            return PodMetrics(waiting, running, kv_cache)
        active, queued, max_loras = self._lora_state(body, self._lora)
        return PodMetrics(waiting, running, kv_cache, active, queued, max_loras)

    def _lora_state(
        self, body: bytes, family: tuple[MetricSpec, bytes]
    ) -> tuple[tuple[str, ...], tuple[str, ...], int]:
        """The adapters of the newest ``lora_requests_info`` series.

        Each series' value is the Unix time it was last set; old label sets
        linger with old times, so the largest value is the current state (on
        a tie the first such series wins). No series means no adapters.
        """
        spec, name = family
        samples = _matching(body, spec, name)
        if not samples:
            return (), (), 0
        newest = samples[0]
        for sample in samples[1:]:
            if sample[2] > newest[2]:
                newest = sample
        offset, label_text, _ = newest
        labels = _labels_at(body, offset, label_text, spec.name)
        names = self._names
        max_text = labels.get(names.lora_max_label, "").strip()
        if max_text and not (max_text.isdigit() and max_text.isascii()):
            raise ExpositionError(
                f"{spec.name}: {names.lora_max_label}={max_text!r} is not a whole number",
                _line_of(body, offset),
            )
        return (
            _adapter_list(labels.get(names.lora_running_label, "")),
            _adapter_list(labels.get(names.lora_waiting_label, "")),
            int(max_text) if max_text else 0,
        )


def _encode(specs: tuple[MetricSpec, ...]) -> tuple[tuple[MetricSpec, bytes], ...]:
    return tuple((spec, spec.name.encode("ascii")) for spec in specs)


def _count(body: bytes, family: tuple[tuple[MetricSpec, bytes], ...]) -> int:
    """Sum of the first spec's matching series: requests across all engines."""
    spec, samples = _first_present(body, family)
    total = 0.0
    for offset, _, value in samples:
        if not math.isfinite(value) or value < 0:
            raise ExpositionError(
                f"{spec.name}: {value} is not a request count", _line_of(body, offset)
            )
        total += value
    return round(total)


def _fraction(body: bytes, family: tuple[tuple[MetricSpec, bytes], ...]) -> float:
    """Largest of the first spec's matching series: the fullest engine's KV cache."""
    spec, samples = _first_present(body, family)
    fullest = 0.0
    for offset, _, value in samples:
        if not 0.0 <= value <= 1.0:  # NaN fails too
            raise ExpositionError(
                f"{spec.name}: {value} is not a fraction from 0 to 1", _line_of(body, offset)
            )
        fullest = max(fullest, value)
    return fullest


def _first_present(
    body: bytes, family: tuple[tuple[MetricSpec, bytes], ...]
) -> tuple[MetricSpec, list[_Sample]]:
    for spec, name in family:
        samples = _matching(body, spec, name)
        if samples:
            return spec, samples
    wanted = " or ".join(str(spec) for spec, _ in family)
    raise ExpositionError(f"no {wanted} series in the response")


def _matching(body: bytes, spec: MetricSpec, name: bytes) -> list[_Sample]:
    """The family's samples whose labels carry every value the spec asks for."""
    samples = _family(body, name)
    if not spec.labels:
        return samples
    return [
        sample
        for sample in samples
        if all(
            _labels_at(body, sample[0], sample[1], spec.name).get(label) == value
            for label, value in spec.labels
        )
    ]


def _family(body: bytes, name: bytes) -> list[_Sample]:
    """Every sample line of the family ``name`` (its one contiguous group)."""
    start = _first_sample(body, name)
    if start < 0:
        return []
    samples: list[_Sample] = []
    size = len(name)
    end_of_body = len(body)
    while start < end_of_body:
        end = body.find(b"\n", start)
        if end < 0:
            end = end_of_body
        line = body[start:end]
        if not (line.startswith(name) and line[size : size + 1] in _AFTER_NAME):
            break
        try:
            label_text, value = _split_sample(line, size)
        except ValueError as error:
            raise ExpositionError(f"{name.decode()}: {error}", _line_of(body, start)) from None
        samples.append((start, label_text, value))
        start = end + 1
    return samples


# What may follow a family name on one of its sample lines (a bare name has no value,
# which is then reported rather than overlooked).
_AFTER_NAME = (b"{", b" ", b"\t", b"\r", b"\n", b"")


def _first_sample(body: bytes, name: bytes) -> int:
    """Offset of the first line that is a sample of ``name``, or -1."""
    size = len(name)
    if body.startswith(name) and body[size : size + 1] in _AFTER_NAME:
        return 0
    needle = b"\n" + name
    found = body.find(needle)
    while found >= 0:
        after = found + len(needle)
        if body[after : after + 1] in _AFTER_NAME:
            return found + 1
        found = body.find(needle, after)
    return -1


def _split_sample(line: bytes, name_size: int) -> tuple[bytes, float]:
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


def _labels_at(body: bytes, offset: int, label_text: bytes, family: str) -> dict[str, str]:
    try:
        return parse_labels(label_text.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise ExpositionError(f"{family}: {error}", _line_of(body, offset)) from None


def parse_labels(text: str) -> dict[str, str]:
    """``a="1",b="x\\"y"`` -> ``{"a": "1", "b": 'x"y'}`` with the format's escapes."""
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


def _line_of(body: bytes, offset: int) -> int:
    return body.count(b"\n", 0, offset) + 1
