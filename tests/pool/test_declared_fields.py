"""A pod field declared once reaches policies: scraped from a (simulated) vLLM,
copied into the snapshot's pods, read by CEL; and written by hand for
``policyd test`` / ``explain``. ``num_preemptions`` is the example: it was
added by its declaration in ``policyd.fields`` and its docs line alone.

To add a field, copy these tests for it.
"""

from __future__ import annotations

import re
from pathlib import Path

from policyd.cel import Environment, pod_type
from policyd.fields import METRICS, POD_FIELDS, SCRAPED_POD_FIELDS
from policyd.policy.diagnostics import Diagnostic
from policyd.policy.inputs import StaticPod, read_pods
from policyd.policy.source import Source, parse_yaml
from policyd.pool import Pool, ScrapeConfig, StaticFileDiscovery
from policyd.pool.exposition import NO_METRICS, MetricsParser
from policyd.pool.metric_names import PRESETS, VLLM
from policyd.pool.pod import Pod
from policyd.sim.server import SimServer


async def test_a_scraped_field_reaches_cel_from_the_simulators_metrics(tmp_path: Path) -> None:
    server = SimServer(port=0, time_scale=10, seed=1)
    await server.start()
    try:
        server.driver.engine.stats.preemptions = 7
        pods = tmp_path / "pods.yaml"
        pods.write_text(f"pods:\n  - name: vllm-0\n    address: {server.address}\n")
        pool = Pool(StaticFileDiscovery(pods), ScrapeConfig(interval=0.1, in_process=True))
        await pool.start()
        try:
            assert await pool.wait_ready(timeout=5)
            (pod,) = pool.snapshot().candidates
        finally:
            await pool.stop()
    finally:
        await server.stop()
    assert pod.num_preemptions == 7
    program = Environment({"pod": pod_type()}).compile("pod.num_preemptions > 5")
    assert program.evaluate({"pod": pod}) is True


def test_an_optional_metric_a_preset_lacks_reads_as_its_default() -> None:
    page = b"sglang:num_queue_reqs 1\nsglang:num_running_reqs 2\nsglang:token_usage 0.5\n"
    metrics = MetricsParser(PRESETS["sglang"]).parse(page)
    assert (metrics.waiting_queue, metrics.num_preemptions) == (1, 0)
    # vLLM's counter is summed over its series, as the declaration says.
    page = (
        b"vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:kv_cache_usage_perc 0\n"
        b'vllm:num_preemptions_total{engine="0"} 3\nvllm:num_preemptions_total{engine="1"} 4\n'
    )
    assert MetricsParser(VLLM).parse(page).num_preemptions == 7


def test_a_field_written_by_hand_is_read_and_checked() -> None:
    root, _ = parse_yaml(Source("pods.yaml", "a: {num_preemptions: 3}\nb: {}\n"))
    assert root is not None
    diagnostics: list[Diagnostic] = []
    a, b = read_pods(root, diagnostics)
    assert diagnostics == []
    assert (a.num_preemptions, b.num_preemptions) == (3, 0)
    root, _ = parse_yaml(Source("pods.yaml", "a: {num_preemptions: many}\n"))
    assert root is not None
    read_pods(root, diagnostics)
    assert [str(d) for d in diagnostics] == [
        "pods.yaml:1:22: pod field 'num_preemptions' must be an integer, not a string"
    ]


def test_every_declared_field_is_on_every_pod_type_with_its_default() -> None:
    hand_made = StaticPod("a", "a:8000")
    pooled = Pod("a", "a:8000")
    for field in POD_FIELDS[3:]:  # after name, address, labels
        assert getattr(hand_made, field.name) == getattr(pooled, field.name), field.name
    assert NO_METRICS._fields == tuple(field.name for field in SCRAPED_POD_FIELDS)
    # Every metric is declared with a rule the parser has, for presets that exist.
    for metric in METRICS:
        assert metric.combine in ("sum", "fullest", "lora-info", "info")
        assert set(metric.presets) <= set(PRESETS)


def test_the_documented_presets_are_the_declared_ones() -> None:
    # docs/pool.md's preset table: one column per preset, each cell the metric
    # names in fallback order (or "none published"); its last row the path.
    doc = (Path(__file__).parents[2] / "docs" / "pool.md").read_text()
    section = doc.split("\n## Metric names and presets\n", 1)[1]
    table = section[section.index("\n| field |") + 1 :].split("\n\n", 1)[0].splitlines()
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in table]
    presets = [re.findall(r"`([^`]+)`", cell)[0] for cell in cells[0][1:]]
    assert presets == list(PRESETS)
    documented = {
        (preset, row[0]): re.findall(r"`([^`]+)`", cell)
        for row in cells[2:]
        for preset, cell in zip(presets, row[1:], strict=True)
    }
    rows = [row[0] for row in cells[2:]]
    for metric in METRICS:  # a row naming exactly its metric names under every preset
        assert [
            row
            for row in rows
            if all(documented[(p, row)] == list(metric.presets.get(p, ())) for p in PRESETS)
        ], metric.key
    for preset, names in PRESETS.items():
        assert documented[(preset, "path")][0] == names.path
