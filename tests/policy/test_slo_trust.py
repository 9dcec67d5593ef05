"""A latency objective is the client's statement of its need, not a claim to priority:
under the shipped flow control, a request stating the tightest objective is held in the
same band and flow, with the same deadline, as one stating none."""

from __future__ import annotations

from policyd.extproc.openai import parse_body
from policyd.policy import PolicyStore, Router

from .helpers import RULES

BODY = b'{"model": "meta-llama/Llama-3.1-8B-Instruct", "prompt": "hi"}'


def test_an_objective_buys_no_place_in_the_shipped_flow_control() -> None:
    router = Router(PolicyStore.open(RULES / "flow.yaml"))
    plain = parse_body(BODY, "/v1/completions", headers={"x-tenant": "t"}).request
    eager = parse_body(
        BODY,
        "/v1/completions",
        headers={"x-tenant": "t", "x-llm-d-slo-ttft-ms": "0.001", "x-slo-tpot-ms": "0.001"},
    ).request
    assert eager.slo_ttft_ms == 0.001  # stated, and read
    held = [router.admission(request) for request in (plain, eager)]
    assert held[0] is not None and held[1] is not None
    (a, b) = held
    assert (a.band.name, a.key, a.weight) == (b.band.name, b.key, b.weight)
    assert a.flow.deadline_of(a.request, 100.0, a.band) == b.flow.deadline_of(
        b.request, 100.0, b.band
    )
