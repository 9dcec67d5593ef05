"""Reads the handful of series the pool needs from a Prometheus text exposition.

A vLLM ``/metrics`` page is 30-50 KB, mostly histogram buckets; the pool needs
at most five families of it, a hundred pods ten times a second. So this parser
never walks the page line by line: it goes to each wanted family (where it was
in the pod's last page, else by ``bytes.find`` at C speed), reads that
family's group of sample lines with one pattern match per line (the text
format requires a family's samples to form one contiguous group) and stops.
Once a pod's page has been read, the next one is usually read with one
pattern search per family: the group's shape as last seen (see ``Hints``).
Labels are decoded only where a spec matches on them or where the LoRA state
lives. Lines of other families are never looked at, so their oddities cannot
fail a scrape; a malformed line of a family that is read raises
``ExpositionError`` with its line number (a slower, explaining parse of that
line says what is wrong).
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from typing import NamedTuple

from policyd.pool.metric_names import MetricNames, MetricSpec


class ExpositionError(ValueError):
    """The exposition lacks a needed series (``missing``) or has a malformed line in one."""

    def __init__(self, reason: str, line: int | None = None, *, missing: bool = False) -> None:
        super().__init__(f"line {line}: {reason}" if line is not None else reason)
        self.reason = reason
        self.line = line
        self.missing = missing


class PodMetrics(NamedTuple):
    """The scraped numbers the CEL ``pod`` fields are made of.

    A named tuple rather than a frozen dataclass: a thousand are made a
    second, and a tuple is built several times faster.

    ``lora_info_known`` says the page carried a LoRA info series: without
    one (a model server that has not logged its stats yet, one without LoRA,
    a preset that reads none) the adapter lists are empty and ``max_loras``
    is 0 because nothing is known, not because the pod has no free slot.
    """

    waiting_queue: int
    running: int
    kv_cache: float
    active_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()
    max_loras: int = 0
    lora_info_known: bool = False


NO_METRICS = PodMetrics(waiting_queue=0, running=0, kv_cache=0.0)

# One sample line: where it starts in the data, its raw label text, its value.
_Sample = tuple[int, bytes | bytearray, float]

# Active adapters, waiting adapters, max adapters, whether a series said so.
_LoraState = tuple[tuple[str, ...], tuple[str, ...], int, bool]
_NO_LORA_STATE: _LoraState = ((), (), 0, False)
# The CEL pod fields are int64: a count or a slot number beyond it is no count.
_INT64_LIMIT = 2.0**63  # the first float that does not fit
_INT64_MAX = 2**63 - 1
_LORA_STATES_KEPT = 256  # label sets remembered per parser (all pods of a scraper)
_SHAPES_KEPT = 256  # compiled group shapes per parser (pods printing alike share them)
_SHAPE_LINES = 32  # a longer group is read the general way (the simulator keeps 32)
# Where a shape is looked for: from this many bytes before the group's last
# offset (the line above it, and a page that shifted back a little), to
# _NEAR bytes plus this many per line after it.
_SHAPE_BEFORE = 320
_SHAPE_LINE_BYTES = 512

# The rest of a well-formed sample line after the family name: optional labels
# (up to the line's last '}'), the value, an optional timestamp. Lines it does
# not match get the slow, explaining parse.
_SAMPLE_REST = rb"(?:\{(.*)\})?[ \t]+([^ \t\r\n]+)(?:[ \t]+[^ \t\r\n]+)?[ \t]*\r?(?:\n|\Z)"


@dataclass(frozen=True, slots=True)
class _Family:
    """A family to read: its spec, its name, its slot in the hints, its line pattern."""

    spec: MetricSpec
    name: bytes
    slot: int
    needle: bytes  # newline + name: where one of its lines starts
    line: re.Pattern[bytes]
    shape_line: bytes  # pattern source of one sample line in a shape: (start)(labels)(value)
    shape_end: bytes  # pattern source: the line after a group is not the family's

    @classmethod
    def of(cls, spec: MetricSpec, slot: int) -> _Family:
        name = spec.name.encode("ascii")
        line = re.escape(name) + _SAMPLE_REST
        not_next = b"(?!" + re.escape(name) + rb"(?:[{ \t\r\n]|\Z))"
        return cls(spec, name, slot, b"\n" + name, re.compile(line), b"()" + line, not_next)


class Hints:
    """What one pod's last page showed of each family, for reading its next one.

    ``offsets[slot]`` is where the family's group of lines began, from the
    body's start (-1: not seen). ``shapes[slot]`` is a pattern of the group
    as it was: a newline, the line above the group (the same comment, or a
    line of the same other family), as many sample lines of the family with
    any labels and values, and then no further line of it. The next page
    usually prints the same lines with new numbers, a few bytes further on
    or back: one search near the offset then finds the whole group and its
    values, and proves the group is whole (the line above and the line
    below are not the family's), which is what the general path checks line
    by line. Where the shape is not found, the general path reads the group
    and leaves a new shape.
    """

    __slots__ = ("offsets", "shapes")

    def __init__(self, families: int) -> None:
        self.offsets: list[int] = [-1] * families
        self.shapes: list[re.Pattern[bytes] | None] = [None] * families


class MetricsParser:
    """Turns exposition bodies into ``PodMetrics`` for one set of ``MetricNames``.

    ``parse(body, hints)`` may be given the ``Hints`` from ``new_hints()``
    kept per pod: they remember where each family was found and the shape of
    its lines, and since a server prints its page in the same order every
    time, the next parse looks there first instead of scanning the page from
    the top (any answer is still checked, so a moved or vanished family is
    found or missed exactly as without hints).
    """

    __slots__ = (
        "_families",
        "_kv_cache",
        "_lora",
        "_lora_states",
        "_names",
        "_running",
        "_shapes",
        "_single_lines",
        "_waiting",
    )

    def __init__(self, names: MetricNames) -> None:
        self._names = names
        counter = itertools.count()

        def encode(specs: tuple[MetricSpec, ...]) -> tuple[_Family, ...]:
            return tuple(_Family.of(spec, next(counter)) for spec in specs)

        self._waiting = encode(names.waiting)
        self._running = encode(names.running)
        self._kv_cache = encode(names.kv_cache)
        self._lora = None if names.lora_info is None else encode((names.lora_info,))[0]
        self._families = next(counter)
        firsts = (self._waiting[0], self._running[0], self._kv_cache[0])
        # The families the common case reads as one line each (a spec that
        # picks series by label needs the general path).
        self._single_lines = None if any(f.spec.labels for f in firsts) else firsts
        self._lora_states: dict[bytes, _LoraState] = {}  # by the label text they were read from
        self._shapes: dict[bytes, re.Pattern[bytes]] = {}  # by their pattern source

    def new_hints(self) -> Hints:
        """Per-pod memory of where each family was and how it looked (see the class docstring)."""
        return Hints(self._families)

    def parse(
        self,
        body: bytes | bytearray,
        hints: Hints | None = None,
        start: int = 0,
        end: int | None = None,
    ) -> PodMetrics:
        """The metrics in ``body[start:end]`` (no copy is made of a slice of a buffer).

        Raises ``ExpositionError`` naming the line (counted from ``start``) and what is wrong.
        """
        page = _Page(body, start, len(body) if end is None else end, hints, self._shapes)
        if hints is not None and self._single_lines is not None:
            metrics = self._parse_one_line_each(page, self._single_lines)
            if metrics is not None:
                return metrics
        waiting = _count(page, self._waiting)
        running = _count(page, self._running)
        kv_cache = _fraction(page, self._kv_cache)
        if self._lora is None:
            return PodMetrics(waiting, running, kv_cache)
        return PodMetrics(waiting, running, kv_cache, *self._lora_state(page, self._lora))

    def _parse_one_line_each(
        self, page: _Page, singles: tuple[_Family, _Family, _Family]
    ) -> PodMetrics | None:
        """The commonest page in the fewest steps, or ``None`` for the general path.

        Waiting, running and KV cache (their first-choice names) each one
        line, found where the pod's hints say or near it, with values in
        range: the answer the general path would give, without its layers.
        Anything else, including a value out of range, goes the general
        path, which also explains errors.
        """
        values: list[float] = []
        for family in singles:
            samples = page.samples(family)
            if len(samples) != 1:
                return None
            values.append(samples[0][2])
        waiting, running, kv_cache = values
        if not (
            0.0 <= waiting < _INT64_LIMIT
            and 0.0 <= running < _INT64_LIMIT
            and 0.0 <= kv_cache <= 1.0
        ):
            return None
        if self._lora is None:
            return PodMetrics(round(waiting), round(running), kv_cache)
        return PodMetrics(
            round(waiting), round(running), kv_cache, *self._lora_state(page, self._lora)
        )

    def _lora_state(self, page: _Page, family: _Family) -> _LoraState:
        """The adapters of the newest ``lora_requests_info`` series.

        Each series' value is the Unix time it was last set; old label sets
        linger with old times, so the largest value is the current state (on
        a tie the first such series wins). No series means nothing is known
        (a vLLM sets its first one when it first logs its stats, up to
        ``VLLM_LOG_STATS_INTERVAL`` after it starts). A value that is no time
        (NaN, infinite) cannot say which series is current: the page is bad.
        """
        samples = page.samples(family)
        if not samples:
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


def _count(page: _Page, families: tuple[_Family, ...]) -> int:
    """Sum of the first present family's series: requests across all engines."""
    spec, samples = _first_present(page, families)
    total = 0.0
    for offset, _, value in samples:
        if not math.isfinite(value) or value < 0:
            raise ExpositionError(
                f"{spec.name}: {value} is not a request count", page.line_of(offset)
            )
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


def _fraction(page: _Page, families: tuple[_Family, ...]) -> float:
    """Largest of the first present family's series: the fullest engine's KV cache."""
    spec, samples = _first_present(page, families)
    fullest = 0.0
    for offset, _, value in samples:
        if not 0.0 <= value <= 1.0:  # NaN fails too
            raise ExpositionError(
                f"{spec.name}: {value} is not a fraction from 0 to 1", page.line_of(offset)
            )
        fullest = max(fullest, value)
    return fullest


def _first_present(page: _Page, families: tuple[_Family, ...]) -> tuple[MetricSpec, list[_Sample]]:
    for family in families:
        samples = page.samples(family)
        if samples:
            return family.spec, samples
    wanted = " or ".join(str(family.spec) for family in families)
    raise ExpositionError(f"no {wanted} series in the response", missing=True)


# What may follow a family name on one of its sample lines (a bare name has no value,
# which is then reported rather than overlooked).
_AFTER_NAME = (b"{", b" ", b"\t", b"\r", b"\n", b"")
_NEAR = 512  # bytes before a hint where the search for a family that moved starts


class _Page:
    """The body being parsed (``data[first:last]``) and what the pod's last page showed.

    Every look at ``data`` stays within ``first:last``: the body may be a
    slice of a connection's receive buffer, with other bytes around it.
    """

    __slots__ = ("data", "first", "hints", "last", "shapes")

    def __init__(
        self,
        data: bytes | bytearray,
        first: int,
        last: int,
        hints: Hints | None,
        shapes: dict[bytes, re.Pattern[bytes]],
    ) -> None:
        self.data = data
        self.first = first
        self.last = last
        self.hints = hints
        self.shapes = shapes  # the parser's, shared by all its pods

    def samples(self, family: _Family) -> list[_Sample]:
        """The family's samples whose labels carry every value its spec asks for."""
        spec, slot = family.spec, family.slot
        hints = self.hints
        samples: list[_Sample] | None = None
        if hints is None:
            start = self._find(family, self.first, self.last)
        else:
            hint = hints.offsets[slot]
            hint = -1 if hint < 0 else self.first + hint
            shape = hints.shapes[slot]
            if shape is not None:
                samples = self._by_shape(family, shape, hint)
            start = self._locate(family, hint) if samples is None else samples[0][0]
            hints.offsets[slot] = -1 if start < 0 else start - self.first
        if samples is None:
            samples = self._group(family, start) if start >= 0 else []
            if hints is not None:
                hints.shapes[slot] = self._shape(family, start, len(samples)) if samples else None
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

    def _by_shape(
        self, family: _Family, shape: re.Pattern[bytes], hint: int
    ) -> list[_Sample] | None:
        """The group, read in one search for its shape near ``hint``; ``None``
        where the shape is not there (the general path then finds the group,
        or explains what is wrong with it)."""
        first, last = self.first, self.last
        lines = shape.groups // 3
        end = min(last, hint + _NEAR + _SHAPE_LINE_BYTES * lines)
        match = shape.search(self.data, max(first, hint - _SHAPE_BEFORE), end)
        if match is None:
            return None
        if end < last and match.end() + len(family.name) >= end:
            # The search stopped short of the body's end: the last line may be
            # cut there, or the next one, which must not be the family's, unseen.
            return None
        samples: list[_Sample] = []
        for group in range(1, shape.groups, 3):
            try:
                value = float(match[group + 2])
            except ValueError:
                return None
            samples.append((match.start(group), match[group + 1] or b"", value))
        return samples

    def _shape(self, family: _Family, start: int, count: int) -> re.Pattern[bytes] | None:
        """The shape of the family's group of ``count`` lines at ``start``, for the
        next page (see ``Hints``); ``None`` for a group a shape cannot tell."""
        data, first = self.data, self.first
        if count > _SHAPE_LINES or start <= first:
            return None
        newline = data.rfind(b"\n", first, start - 1)
        if newline < 0:
            return None  # the line above is the body's first: no newline to find it by
        above = bytes(data[newline + 1 : start])
        if len(above) > _SHAPE_BEFORE // 2:
            return None  # a search from _SHAPE_BEFORE bytes back might start inside it
        if above.startswith(b"#") or above.strip() == b"":
            head = re.escape(above)  # a comment (or a blank line) stays as it was
        else:  # a sample line of another family: any labels and value
            name = above.split(b"{", 1)[0].split(None, 1)[0]
            head = re.escape(name) + rb"(?:[{ \t][^\n]*)?\n"
        source = b"\n" + head + family.shape_line * count + family.shape_end
        shape = self.shapes.get(source)
        if shape is None:
            if len(self.shapes) >= _SHAPES_KEPT:
                self.shapes.clear()
            shape = self.shapes[source] = re.compile(source)
        return shape

    def _locate(self, family: _Family, hint: int) -> int:
        """Where the family's group of lines starts, or -1."""
        first, last = self.first, self.last
        if hint < 0:
            return self._find(family, first, last)
        # Look from a little before where it was (a page shifts a few bytes
        # either way); if that finds nothing it can only be earlier still.
        near = max(hint - _NEAR, first)
        found = self._find(family, near, last)
        if found < 0:
            return self._find(family, first, min(near + len(family.needle), last))
        # The page may have shifted: step back to the first line of the group.
        data, name = self.data, family.name
        while found > first:
            newline = data.rfind(b"\n", first, found - 1)
            previous = first if newline < 0 else newline + 1
            if not (data.startswith(name, previous, last) and self._is_sample(name, previous)):
                break
            found = previous
        return found

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
