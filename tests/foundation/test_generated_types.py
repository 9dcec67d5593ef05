"""The typed classes generated from ``policyd.fields`` are checked in current, and a
prefix field is one declaration."""

from __future__ import annotations

import dataclasses
import sys
import types

import mypy.api
import pytest

from policyd.cel import Duration
from policyd.fields import POD_FIELDS, REQUEST_FIELDS, Field
from policyd.fields.generate import COMMAND, path_of, sources
from policyd.fields.prefix_match import PrefixMatch
from policyd.policy.pods import AsSeen, PolicyPod, Prefixed, StaticPod
from policyd.policy.request import Request
from policyd.pool.exposition import NO_METRICS
from policyd.pool.pod import InFlight, Pod


@pytest.mark.parametrize("module", sorted(sources()))
def test_the_checked_in_module_is_what_the_declarations_generate(module: str) -> None:
    text = path_of(module).read_text(encoding="utf-8")
    assert text == sources()[module], f"{module} is stale: run `{COMMAND}`"


def _value(field: Field) -> object:
    """The declared default as a policy reads it."""
    if field.kind == "duration":
        return Duration.from_seconds(float(str(field.default)))
    return field.default


def test_a_static_pod_has_every_pod_field_with_its_declared_default() -> None:
    pod = StaticPod("a", "a:8000")
    defaults = {f.name: _value(f) for f in POD_FIELDS if f.name not in ("name", "address")}
    assert {name: getattr(pod, name) for name in defaults} == defaults


def test_a_pool_pod_answers_every_pod_field_and_reads_its_load() -> None:
    load = InFlight(3)
    pod = Pod("a", "a:8000", load=load)
    defaults = {
        f.name: _value(f) for f in POD_FIELDS if f.name not in ("name", "address", "in_flight")
    }
    assert {name: getattr(pod, name) for name in defaults} == defaults
    load.count = 5
    assert pod.in_flight == 5
    # The scraped fields follow the identity in Pod's constructor, in PodMetrics' order.
    scraped = Pod("a", "a:8000", {}, "decode", *NO_METRICS._replace(waiting_queue=7, running=2))
    assert (scraped.waiting_queue, scraped.running) == (7, 2)


def test_a_scrape_without_the_lora_series_knows_no_lora_state() -> None:
    assert NO_METRICS.lora_info_known is False
    assert StaticPod("a", "a:8000").lora_info_known is True


def test_the_overlays_replace_their_fields_and_read_the_rest_from_the_pod() -> None:
    pod = Pod("a", "a:8000", {"zone": "b"}, waiting_queue=4, load=InFlight(2))
    prefixed = Prefixed(pod, PrefixMatch(prefix_match=0.5, prefix_tokens=32))
    assert (prefixed.prefix_match, prefixed.prefix_tokens) == (0.5, 32)
    assert (prefixed.name, prefixed.labels, prefixed.waiting_queue) == ("a", {"zone": "b"}, 4)
    assert prefixed.in_flight == 2
    seen = AsSeen(prefixed, 1)
    assert (seen.in_flight, seen.waiting_queue, seen.prefix_match) == (1, 4, 0.5)
    for view in (prefixed, seen):
        assert all(hasattr(view, f.name) for f in POD_FIELDS)


def test_request_takes_the_given_fields_then_the_policys_and_decided_copies() -> None:
    order = [f.name for f in dataclasses.fields(Request)]
    assert sorted(order) == sorted(f.name for f in REQUEST_FIELDS)
    assert order[-2:] == ["target_model", "criticality"]
    request = Request(model="m", headers={"x": "1"}, stream=True, prompt_tokens=9)
    copy = request.decided("t", "critical")
    assert (copy.target_model, copy.criticality) == ("t", "critical")
    assert (request.target_model, request.criticality) == ("", "standard")
    assert dataclasses.replace(copy, target_model="", criticality="standard") == request


def _load(module: str, source: str, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """Run a generated source as ``module`` (in sys.modules for this test only)."""
    loaded = types.ModuleType(module)
    monkeypatch.setitem(sys.modules, module, loaded)
    exec(compile(source, f"<generated {module}>", "exec"), loaded.__dict__)  # the generator's
    return loaded


def test_a_prefix_field_is_one_declaration(monkeypatch: pytest.MonkeyPatch) -> None:
    """Declaring one more field of origin "prefix" puts it in the probe's record, on the
    overlay the router lays over pods, on the protocol and as ``Pod``'s default."""
    added = Field("prefix_blocks", "int", "prefix", "cached KV blocks", 0, logged=False)
    generated = sources((*POD_FIELDS, added))
    record = _load(
        "policyd.fields.prefix_match", generated["policyd.fields.prefix_match"], monkeypatch
    )
    view = _load("policyd.policy.pods", generated["policyd.policy.pods"], monkeypatch)
    pod_types = _load("policyd.pool.pod_types", generated["policyd.pool.pod_types"], monkeypatch)

    match = record.PrefixMatch(prefix_match=0.25, prefix_tokens=16, prefix_blocks=1)
    pod = pod_types.Pod("a", "a:8000")
    assert pod.prefix_blocks == 0
    laid = view.Prefixed(pod, match)
    assert (laid.prefix_match, laid.prefix_tokens, laid.prefix_blocks) == (0.25, 16, 1)
    assert view.AsSeen(laid, 0).prefix_blocks == 1
    assert view.StaticPod("a", "a:8000", prefix_blocks=2).prefix_blocks == 2
    assert "prefix_blocks" in {name for name in dir(view.PolicyPod) if not name.startswith("_")}


def test_the_generated_classes_satisfy_the_policy_pod_protocol() -> None:
    """Structurally, as mypy checks it: every protocol member is an attribute of each."""
    members = {name for name in dir(PolicyPod) if not name.startswith("_")}
    assert members == {f.name for f in POD_FIELDS}
    pod = Pod("a", "a:8000")
    for view in (pod, StaticPod("a", "a:8000"), Prefixed(pod, PrefixMatch()), AsSeen(pod, 0)):
        assert all(hasattr(view, name) for name in members), type(view).__name__


def test_the_type_checker_refuses_changes_to_requests_and_prefix_matches() -> None:
    """They are read-only to mypy rather than frozen at run time (their docstrings say why)."""
    request_fields = [f.name for f in dataclasses.fields(Request)]
    match_fields = [f.name for f in dataclasses.fields(PrefixMatch)]
    program = (
        "from policyd.fields.prefix_match import PrefixMatch\n"
        "from policyd.policy.request import Request\n"
        "request = Request('m')\nmatch = PrefixMatch()\n"
    )
    program += "".join(f"request.{name} = request.{name}\n" for name in request_fields)
    program += "".join(f"match.{name} = match.{name}\n" for name in match_fields)
    report, _, status = mypy.api.run(
        ["--config-file=", "--cache-dir=/dev/null", "--follow-imports=silent", "-c", program]
    )
    errors = [line for line in report.splitlines() if ": error:" in line]
    assert status == 1
    assert len(errors) == len(request_fields) + len(match_fields), report
    assert all("Cannot assign to final attribute" in line for line in errors), report
