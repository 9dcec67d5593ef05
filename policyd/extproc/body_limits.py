"""What a request body may cost to read: bounds checked on its bytes before it is parsed.

Parsing runs on the event loop, so a body's parse is time every other
request on the worker waits. A normal body is mostly text (a 4 MiB prompt
parses in about 10 ms), but JSON lets a client ask for far more work per
byte: 4 MiB of ``[{},{},...]`` or ``[[1],[1],...]`` is two million Python
objects, seconds of CPU and hundreds of megabytes. So the structure of a
body is counted on its bytes first, with byte counts and one regular
expression that run in C, and a body with more containers or values than
any real request is a 400 before anything is built from it
(:func:`check_shape`). The lists the prompt estimate walks in Python are
capped on their own (``MAX_PROMPT_ITEMS``, checked by ``openai``).

A body must also be text that can be forwarded: UTF-8 without lone
surrogates. JSON's ``\\ud800`` escape names half a UTF-16 pair, which
Python decodes into a string that cannot be encoded again (the rewrite, a
span, the decision log would fail on it), so it is a 400 here too
(:func:`decode`).
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

from policyd.extproc.errors import RequestError

# Objects and arrays in a body. A chat request has a few per message (the
# message, its content parts, a tool call); 32768 is thousands of messages.
MAX_JSON_CONTAINERS: Final = 32_768
# Values in all arrays and objects. Token ids are values: 262144 is a prompt of
# that many token ids, longer than nearly every model's context.
MAX_JSON_VALUES: Final = 262_144
# A body with more strings than values allowed is over the limit without the
# exact count (``check_shape``), which copies it in as many pieces as it has strings.
MAX_COUNTED_STRINGS: Final = MAX_JSON_VALUES
# Items of one prompt list (messages, input items, prompt strings, token-id
# lists): each becomes a Python object and a turn of the prompt estimate.
MAX_PROMPT_ITEMS: Final = 16_384

# A JSON string (escapes included): what the exact count leaves out, since
# brackets and commas inside text are not structure.
_STRING: Final = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
# An escape of a UTF-16 surrogate (half of a pair, or a lone one).
_SURROGATE_ESCAPE: Final = re.compile(rb"\\u[dD][89a-fA-F]")


def check_shape(raw: bytes) -> None:
    """Raise a 400 when ``raw`` holds more JSON containers or values than policyd reads.

    Brackets count the containers and, with commas, bound the values from
    above (each value but a container's first follows a comma). When a count
    is over its limit (long text has many commas) it is made again without
    the strings, exactly, on a copy of the body without them; a body with
    more strings than ``MAX_COUNTED_STRINGS`` is over the limits without that
    count.
    """
    if len(raw) < 2 * MAX_JSON_CONTAINERS or not _over_limits(raw, whole=True):
        return
    strings = (raw.count(b'"') - raw.count(b'\\"')) // 2
    if strings <= MAX_COUNTED_STRINGS and not _over_limits(_STRING.sub(b"", raw), whole=False):
        return
    raise RequestError.bad_request(
        f"the request body has more JSON objects and arrays (at most {MAX_JSON_CONTAINERS})"
        f" or values (at most {MAX_JSON_VALUES}) than policyd reads",
        "body_too_complex",
    )


def _over_limits(data: bytes, *, whole: bool) -> bool:
    """Whether ``data``'s brackets and commas are over the limits, each count one pass
    in C. In a ``whole`` body each value takes two bytes with its comma, so one
    shorter than twice the limit on values is not counted for it (the strings
    taken out, a value can take one)."""
    containers = data.count(b"{") + data.count(b"[")
    if containers > MAX_JSON_CONTAINERS:
        return True
    if whole and len(data) < 2 * MAX_JSON_VALUES:
        return False
    return containers + data.count(b",") > MAX_JSON_VALUES


def decode(raw: bytes) -> Any:
    """The JSON document in ``raw`` (checked with :func:`check_shape` first); raises a 400
    for a body that is not UTF-8 JSON (RFC 8259's encoding between systems) or that
    names a lone surrogate."""
    check_shape(raw)
    try:
        # Strictly: Python's own bytes decoding lets an encoded surrogate through.
        # A byte-order mark is skipped, as JSON parsers may.
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise RequestError.bad_request(
            f"the request body is not UTF-8 ({error.reason} at byte {error.start})",
            "invalid_json",
        ) from None
    try:
        document = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise RequestError.bad_request(
            f"the request body is not valid JSON: {error}", "invalid_json"
        ) from None
    if _SURROGATE_ESCAPE.search(raw) is not None:
        # Escaped pairs (an emoji from an ASCII-only encoder) are common and
        # valid; only a lone half fails to encode.
        try:
            json.dumps(document, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise RequestError.bad_request(
                "the request body is not valid JSON: it has a lone UTF-16 surrogate escape"
                " (\\ud800-\\udfff without its pair)",
                "invalid_json",
            ) from None
    return document
