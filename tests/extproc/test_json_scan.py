"""json_scan decodes exactly as json.loads and raw_decode do, errors included."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policyd.extproc import json_scan

_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text()
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)
_SPACE = st.text(alphabet=" \t\r\n", max_size=3)


def _outcome(decode: Any, *arguments: Any) -> tuple[str, str]:
    """What a decoder made of its input, comparable across decoders (NaN included)."""
    try:
        return "value", json.dumps(decode(*arguments))
    except (ValueError, RecursionError) as error:
        return type(error).__name__, str(error)


_DOCUMENTS = st.tuples(_SPACE, _VALUES, st.booleans(), _SPACE).map(
    lambda parts: parts[0] + json.dumps(parts[1], ensure_ascii=parts[2]) + parts[3]
)


@given(
    text=_DOCUMENTS,
    cut=st.integers(min_value=0, max_value=200),
    junk=st.sampled_from(["", "x", "}", ",", "\x00", "{}", " 1"]),
)
def test_documents_decode_as_json_loads_does(text: str, cut: int, junk: str) -> None:
    for raw in (text, text[: len(text) - cut], text + junk, junk + text):
        data = raw.encode("utf-8", "surrogatepass")
        assert _outcome(json_scan.loads, data) == _outcome(json.loads, data), raw
        assert _outcome(json_scan.loads, bytearray(data)) == _outcome(json.loads, data), raw


@given(st.binary(max_size=64))
def test_any_bytes_decode_or_fail_as_json_loads_does(data: bytes) -> None:
    assert _outcome(json_scan.loads, data) == _outcome(json.loads, data)


@pytest.mark.parametrize(
    "data",
    [
        b'{"model": "m"}',
        b' \n{"model": "m"}\r\n',
        b'\xef\xbb\xbf{"model": "m"}',  # a UTF-8 byte-order mark
        '{"model": "m"}'.encode("utf-16"),
        b'{"model": "m"} {}',
        b'{"model": "m"',
        b'{"model": "\xff"}',  # not UTF-8
        b"[1, 2]",
        b"",
        b"[" * 100_000,  # deeper than the scanner recurses
    ],
)
def test_edge_cases_match_json_loads(data: bytes) -> None:
    assert _outcome(json_scan.loads, data) == _outcome(json.loads, data)


@given(value=_VALUES, prefix=st.text(max_size=8), suffix=st.text(max_size=8))
def test_value_at_reads_what_raw_decode_reads(value: Any, prefix: str, suffix: str) -> None:
    text = prefix + json.dumps(value) + suffix
    decoder = json.JSONDecoder()
    for start in (len(prefix), 0, len(text)):
        expected = _outcome(lambda at: decoder.raw_decode(text, at)[0], start)
        assert _outcome(json_scan.value_at, text, start) == expected
