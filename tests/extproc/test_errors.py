"""Every error answer is an OpenAI-style JSON document with the protocol's status."""

from __future__ import annotations

import json

import pytest

from policyd.extproc.errors import RequestError
from policyd.policy.decision import Decision, Outcome


@pytest.mark.parametrize(
    ("outcome", "status", "error_type", "code"),
    [
        (Outcome.SHED, 429, "rate_limit_exceeded", "request_shed"),
        (Outcome.NO_CAPACITY, 503, "service_unavailable", "no_ready_endpoints"),
        (Outcome.UNKNOWN_MODEL, 404, "not_found_error", "model_not_found"),
        (Outcome.ERROR, 500, "internal_error", "policy_error"),
    ],
)
def test_an_unrouted_decision_maps_to_status_type_and_code(
    outcome: Outcome, status: int, error_type: str, code: str
) -> None:
    error = RequestError.from_decision(Decision(outcome, "p", "1", "m"))
    document = json.loads(error.json_body())
    assert error.status == status
    assert document == {"error": {"message": error.message, "type": error_type, "code": code}}
    assert error.message  # a default sentence when the router gave no reason


def test_the_routers_reason_is_the_message() -> None:
    error = RequestError.from_decision(
        Decision(Outcome.SHED, "p", "1", "m", reason="queue above 50 on every pod")
    )
    assert json.loads(error.json_body())["error"]["message"] == "queue above 50 on every pod"


def test_bad_requests_are_invalid_request_errors() -> None:
    document = json.loads(RequestError.bad_request("no model", "missing_model").json_body())
    assert document["error"]["type"] == "invalid_request_error"
