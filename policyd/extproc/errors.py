"""The one place where a request's failure becomes an HTTP answer.

Every error policyd returns to a client goes through :class:`RequestError`:
an HTTP status plus an OpenAI-style JSON body
(``{"error": {"message", "type", "code"}}``) so clients written against the
OpenAI API surface the message instead of choking on an HTML page. The status
mapping follows the Gateway API Inference Extension endpoint-picker protocol:
bad request 400, unknown model 404, shed 429, no ready endpoint 503,
internal 500; policyd's own size limits add 413 (body), 414 (path), 431
(headers) and 429 with ``Retry-After`` (too many body bytes held at once).
"""

from __future__ import annotations

import json
from typing import Final

from policyd.flow import FlowAnswer
from policyd.policy.decision import Decision, Outcome

# OpenAI's error "type" for each status policyd produces.
_ERROR_TYPE: Final[dict[int, str]] = {
    400: "invalid_request_error",
    404: "not_found_error",
    413: "invalid_request_error",
    414: "invalid_request_error",
    431: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "internal_error",
    503: "service_unavailable",
}

# Machine-readable "code" for each non-routed outcome.
_OUTCOME_CODE: Final[dict[Outcome, str]] = {
    Outcome.SHED: "request_shed",
    Outcome.NO_CAPACITY: "no_ready_endpoints",
    Outcome.UNKNOWN_MODEL: "model_not_found",
    Outcome.ERROR: "policy_error",
}

_DEFAULT_MESSAGE: Final[dict[Outcome, str]] = {
    Outcome.SHED: "the request was shed: the pool is too busy for its criticality",
    Outcome.NO_CAPACITY: "no model-server endpoint is ready",
    Outcome.UNKNOWN_MODEL: "no routing policy serves this model",
    Outcome.ERROR: "the routing policy failed on this request",
}


class RequestError(Exception):
    """A request that gets an error answer instead of being forwarded."""

    def __init__(
        self, status: int, message: str, code: str, *, retry_after: int | None = None
    ) -> None:
        """``retry_after``: seconds for a ``Retry-After`` header (a busy server's 429)."""
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.retry_after = retry_after

    @property
    def error_type(self) -> str:
        return _ERROR_TYPE.get(self.status, "error")

    def json_body(self) -> bytes:
        """The OpenAI-style error document sent as the response body."""
        document = {"error": {"message": self.message, "type": self.error_type, "code": self.code}}
        return json.dumps(document, separators=(",", ":")).encode()

    @classmethod
    def bad_request(cls, message: str, code: str = "invalid_request") -> RequestError:
        return cls(400, message, code)

    @classmethod
    def over_limit(cls, status: int, what: str, limit: int, code: str) -> RequestError:
        """A part of the request past one of policyd's size limits, with the limit."""
        return cls(status, f"{what} than policyd accepts ({limit} bytes)", code)

    @classmethod
    def internal(cls, message: str = "internal error in policyd") -> RequestError:
        return cls(500, message, "internal_error")

    @classmethod
    def from_decision(cls, decision: Decision) -> RequestError:
        """The answer for a decision that did not route (shed, no capacity, ...)."""
        message = decision.reason or _DEFAULT_MESSAGE[decision.outcome]
        return cls(decision.outcome.http_status, message, _OUTCOME_CODE[decision.outcome])

    @classmethod
    def from_flow(cls, answer: FlowAnswer) -> RequestError:
        """The answer flow control gave a request it did not let through."""
        return cls(answer.status, answer.message, answer.code, retry_after=answer.retry_after_s)
