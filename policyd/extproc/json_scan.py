"""JSON decoding on the request path, straight to the decoder's C scanner.

``json.loads(bytes)`` runs ``detect_encoding``, ``JSONDecoder.decode`` and
``raw_decode`` (two regular-expression matches) before the C scanner does
the work. In a hot loop those layers cost ~2 us; under load they cost more,
because between two ext_proc messages Envoy, the client and gRPC run and
the caches no longer hold that code. Timed with the caches flushed before
each message (as ``benchmarks/cold_cache.py`` does, with a timer around the
part), ``parse_body`` took 40.5 us through ``json.loads`` and 26.3 us with
the scanner called directly. A response's ``usage`` is read the same way.

Only the common case takes the short way: an object (UTF-8 without a
byte-order mark) with nothing but JSON whitespace around it. Anything else,
valid or not, goes through ``json.loads``, so the values and the error
messages are exactly ``json.loads``'.
"""

from __future__ import annotations

import json
import json.scanner
from typing import Any, Final, cast

_DECODER: Final = json.JSONDecoder()  # as json.loads' default: no hooks
# What the decoder scans with: (text, index) -> (value, end); StopIteration if no value.
# (typeshed types the argument as a scanner; it is read for the decoder's settings.)
_SCAN: Final = json.scanner.make_scanner(cast(Any, _DECODER))
_JSON_SPACE: Final = " \t\n\r"
_JSON_SPACE_BYTES: Final = _JSON_SPACE.encode()


def loads(raw: bytes | bytearray) -> Any:
    """``json.loads(raw)``, by the short way when ``raw`` is a plain JSON object."""
    body = raw.lstrip(_JSON_SPACE_BYTES)  # as json.loads skips it
    if body[:1] == b"{":
        try:
            text = body.decode("utf-8", "surrogatepass")  # as json.loads decodes UTF-8
            value, end = _SCAN(text, 0)
        except (StopIteration, ValueError):
            pass  # invalid: json.loads below raises its own error for it
        else:
            if end == len(text) or not text[end:].strip(_JSON_SPACE):
                return value
    return json.loads(raw)


def value_at(text: str, start: int) -> Any:
    """The JSON value that starts at ``text[start]``; ``ValueError`` if none does.

    What ``JSONDecoder().raw_decode(text, start)[0]`` returns, without its
    Python layer.
    """
    try:
        return _SCAN(text, start)[0]
    except StopIteration as stop:
        raise json.JSONDecodeError("Expecting value", text, stop.value) from None
