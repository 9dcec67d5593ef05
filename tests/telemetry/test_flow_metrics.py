"""Flow control's Prometheus metrics: held per band and flow, outcomes, wait times."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from policyd.telemetry.metrics import MAX_FLOW_LABELS, DecisionMetrics


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    found = registry.get_sample_value(name, labels)
    return 0.0 if found is None else found


def test_held_requests_outcomes_and_waits_are_counted() -> None:
    metrics = DecisionMetrics()
    flow = metrics.flow
    flow.held("standard", "tenant-a", 1, "llama")
    flow.held("standard", "tenant-a", 1, "llama")
    flow.held("standard", "tenant-a", -1, "llama")
    flow.outcome("standard", "tenant-a", "dispatched", 0.3)
    flow.outcome("sheddable", "tenant-b", "expired", 2.0)
    flow.outcome("standard", "tenant-b", "refused", 0.0)
    r = metrics.registry
    assert value(r, "policyd_flow_held_requests", band="standard", flow="tenant-a") == 1
    assert (
        value(
            r, "policyd_flow_requests_total", band="standard", flow="tenant-a", outcome="dispatched"
        )
        == 1
    )
    assert (
        value(r, "policyd_flow_wait_seconds_bucket", band="sheddable", outcome="expired", le="2.5")
        == 1
    )
    assert value(r, "policyd_flow_wait_seconds_count", band="standard", outcome="refused") == 0


def test_flow_names_past_the_cap_share_one_series() -> None:
    metrics = DecisionMetrics()
    for i in range(MAX_FLOW_LABELS + 5):
        metrics.flow.held("standard", f"tenant-{i}", 1, "llama")
    r = metrics.registry
    assert value(r, "policyd_flow_held_requests", band="standard", flow="other") == 5
    assert value(r, "policyd_flow_held_requests", band="standard", flow="tenant-0") == 1


def test_held_requests_per_model_always_balance_under_the_model_cap() -> None:
    """Per model, an increase and its decrease meet whatever the label reads when
    they come: the label is made when Prometheus scrapes, from the raw counts."""
    metrics = DecisionMetrics()
    metrics.models.limit = 1
    flow = metrics.flow
    for model in ("llama", "junk-1", "junk-2", "llama"):
        flow.held("standard", "tenant-a", 1, model)
    r = metrics.registry
    assert value(r, "policyd_model_held_requests", model_name="llama") == 2
    assert value(r, "policyd_model_held_requests", model_name="other") == 2
    for model in ("junk-1", "junk-2", "llama"):
        flow.held("standard", "tenant-a", -1, model)
    assert value(r, "policyd_model_held_requests", model_name="llama") == 1
    assert r.get_sample_value("policyd_model_held_requests", {"model_name": "other"}) is None
