"""Attack: a rule converting a header makes the client's credential show up in telemetry.

A CEL conversion error used to quote the value it could not convert, and the
error text goes into the decision's trace, its span (``policyd.walk.first_error``)
and the decision log. The errors now name the field and the kind, never the
value.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from policyd.cel import CelEvalError, Environment, pod_type, request_type
from policyd.policy.request import Request
from policyd.telemetry.attributes import first_error, walk_summary
from tests.policy.helpers import pod, router

SECRET = "Bearer s3cr3t-T0KEN"
REQUEST = Request(model="m", headers={"authorization": SECRET})
ENVIRONMENT = Environment({"pod": pod_type(), "request": request_type()})
HEADER = 'request.headers["authorization"]'


@pytest.mark.parametrize(
    ("source", "kind"),
    [
        (f"int({HEADER}) > 0", "to int"),
        (f"uint({HEADER}) > 0u", "to uint"),
        (f"double({HEADER}) > 0.0", "to double"),
        (f"bool({HEADER})", "to bool"),
        (f"timestamp({HEADER}) > timestamp(0)", "to timestamp"),
        (f'duration({HEADER}) > duration("1s")', "to duration"),
    ],
)
def test_conversion_errors_name_the_field_and_kind_but_not_the_value(
    source: str, kind: str
) -> None:
    with pytest.raises(CelEvalError) as error:
        ENVIRONMENT.compile(source).evaluate({"request": REQUEST, "pod": None})
    message = str(error.value)
    assert "s3cr3t" not in message
    assert message.startswith(f"{HEADER}: cannot convert string {kind}")


@pytest.mark.parametrize(
    "source",
    [
        f'pod.labels[{HEADER}] == "x"',
        f"{{{HEADER}: 1, {HEADER}: 2}}.size() > 0",
        f"timestamp(0).getHours({HEADER}) > 0",
        f'request.model.matches("(" + {HEADER})',
        f"[{HEADER}].exists(h, int(h) > 0)",
    ],
)
def test_other_errors_on_request_values_do_not_quote_them(source: str) -> None:
    with pytest.raises(CelEvalError) as error:
        ENVIRONMENT.compile(source).evaluate({"request": REQUEST, "pod": pod("a")})
    assert "s3cr3t" not in str(error.value)


def test_the_span_and_the_trace_of_a_decision_carry_no_credential(tmp_path: Path) -> None:
    policy = router(
        tmp_path,
        f"""
        name: tenant
        match: {{models: ["*"]}}
        filters:
          tenant tier:
            keep: int({HEADER}) > 2
        """,
    )
    decision = policy.decide(REQUEST, [pod("a"), pod("b")])
    errors = [message for step in decision.trace for _, message in step.errors]
    assert errors, "the conversion fails on every pod"
    for text in (*errors, first_error(decision.trace), walk_summary(decision.trace)):
        assert "s3cr3t" not in text
    assert errors[0] == f"{HEADER}: cannot convert string to int: not a decimal integer"
