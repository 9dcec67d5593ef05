"""How one request's exchange ended: ``ExchangeEnd``, what a span's ``end`` is handed.

The serving path (``policyd.extproc.exchange``) measures it and every
telemetry sink records it (spans, metrics and the decision log in
``record.py``, several sinks at once in ``fanout.py``, the demo's feed), so
it lives here, in the room both ``extproc`` and ``demo`` import.
"""

from __future__ import annotations

from typing import NamedTuple


class ExchangeEnd(NamedTuple):
    """The response's end as the exchange saw it; times count from the decision.

    ``completed`` is False when the stream ended before the response did
    (client gone, Envoy reset, policyd shutting down). ``first_body_seconds``
    is when the first response body bytes arrived (the time to first token of
    a stream), None when none did. Token counts are the model server's
    ``usage`` when it sent one, else None.

    A named tuple: immutable, so the sinks a ``Fanout`` hands the one record
    cannot change it for each other, and one is built per request at a third of
    a frozen dataclass's cost (whose ``__init__`` sets each field through
    ``object.__setattr__``).
    """

    completed: bool
    duration_seconds: float
    first_body_seconds: float | None
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None = None

    def time_per_output_token(self, streamed: bool) -> float | None:
        """Seconds per output token after the first: a streamed, completed answer of
        more than one token says it; a whole answer's first bytes come with its last,
        so it does not (None)."""
        tokens = self.completion_tokens
        first = self.first_body_seconds
        if not streamed or not self.completed or first is None or tokens is None or tokens < 2:
            return None
        return max(self.duration_seconds - first, 0.0) / (tokens - 1)
