"""Mixed pools: a pod's ``llm-d.ai/engine-type`` label selects its metrics preset.

Stand-in pods on loopback print each engine's exposition; every pool test
runs with the scraper child process and in process.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from policyd.pool import Pool, ScrapeConfig, StaticFileDiscovery
from policyd.pool.discovery import PodIdentity
from policyd.pool.metric_names import PRESET_LABEL, VLLM, preset_named, specs
from policyd.pool.scrape_process import ProcessScraper
from policyd.pool.scraper import pod_presets

from .model_server import MetricsServer, vllm_text
from .test_pool import PushedDiscovery, Scraping, candidate_names, scraping, until

__all__ = ["scraping"]  # the fixture, imported for these tests


def sglang_text(*, waiting: float, running: float, usage: float) -> str:
    return (
        "# TYPE sglang:num_queue_reqs gauge\n"
        f'sglang:num_queue_reqs{{model_name="m"}} {waiting}\n'
        "# TYPE sglang:num_running_reqs gauge\n"
        f'sglang:num_running_reqs{{model_name="m"}} {running}\n'
        "# TYPE sglang:token_usage gauge\n"
        f'sglang:token_usage{{model_name="m"}} {usage}\n'
    )


TRTLLM_TEXT = (
    "# TYPE trtllm_num_requests_waiting gauge\ntrtllm_num_requests_waiting 6\n"
    "# TYPE trtllm_num_requests_running gauge\ntrtllm_num_requests_running 2\n"
    "# TYPE trtllm_kv_cache_utilization gauge\ntrtllm_kv_cache_utilization 0.25\n"
)


async def serve(servers: list[MetricsServer], text: str, path: str = "/metrics") -> MetricsServer:
    server = MetricsServer(text, path)
    await server.start()
    servers.append(server)
    return server


def pod(server: MetricsServer, name: str, engine: str | None = None) -> PodIdentity:
    return PodIdentity.of(name, server.address, {} if engine is None else {PRESET_LABEL: engine})


async def test_a_vllm_pod_and_an_sglang_pod_are_scraped_together(
    servers: list[MetricsServer], scraping: Scraping
) -> None:
    vllm = await serve(servers, vllm_text(waiting=1, running=2, kv_cache=0.3))
    sglang = await serve(servers, sglang_text(waiting=5, running=7, usage=0.75))
    discovery = PushedDiscovery(pod(vllm, "v"), pod(sglang, "s", "sglang"))
    async with Pool(discovery, scraping()) as pool:
        assert await pool.wait_ready(timeout=5)
        snapshot = await until(pool, lambda s: candidate_names(s) == {"v", "s"})
        by_name = {p.name: p for p in snapshot.pods}
        v, s = by_name["v"], by_name["s"]
        assert (v.waiting_queue, v.running, v.kv_cache) == (1, 2, 0.3)
        assert (s.waiting_queue, s.running, s.kv_cache) == (5, 7, 0.75)
        # The label can change: the pod is read with the new preset from then on.
        sglang.text = vllm_text(waiting=9)
        discovery.push(pod(vllm, "v"), pod(sglang, "s", "vllm"))
        await until(pool, lambda s: {p.name: p.waiting_queue for p in s.pods}.get("s") == 9)


async def test_a_pod_whose_label_names_no_preset_is_excluded_with_the_reason(
    servers: list[MetricsServer], scraping: Scraping
) -> None:
    good = await serve(servers, vllm_text(waiting=1))
    odd = await serve(servers, vllm_text(waiting=1))
    discovery = PushedDiscovery(pod(good, "good"), pod(odd, "odd", "llama.cpp"))
    async with Pool(discovery, scraping()) as pool:
        snapshot = await until(pool, lambda s: s.scrape_round >= 2)
        assert candidate_names(snapshot) == {"good"}
        reason = pool.stats[odd.address].last_error
        assert reason is not None
        assert f"label {PRESET_LABEL}='llama.cpp' names no metrics preset" in reason
        assert "sglang" in reason
        assert odd.requests == 0  # never asked: its page would be read wrongly
        # Relabelled to a known preset, it joins.
        discovery.push(pod(good, "good"), pod(odd, "odd", "vllm"))
        await until(pool, lambda s: candidate_names(s) == {"good", "odd"})


async def test_each_preset_is_scraped_on_its_own_path(
    servers: list[MetricsServer], scraping: Scraping
) -> None:
    trtllm = await serve(servers, TRTLLM_TEXT, "/prometheus/metrics")
    vllm = await serve(servers, vllm_text(waiting=3))
    discovery = PushedDiscovery(pod(trtllm, "t", "trtllm-serve"), pod(vllm, "v"))
    async with Pool(discovery, scraping()) as pool:
        assert await pool.wait_ready(timeout=5)
        snapshot = await until(pool, lambda s: candidate_names(s) == {"t", "v"})
        t = {p.name: p for p in snapshot.pods}["t"]
        assert (t.waiting_queue, t.running, t.kv_cache) == (6, 2, 0.25)
        assert trtllm.requests > 0 and vllm.requests > 0


async def test_a_pods_file_with_labels_selects_the_preset(
    servers: list[MetricsServer], scraping: Scraping, tmp_path: Path
) -> None:
    vllm = await serve(servers, vllm_text(waiting=2))
    sglang = await serve(servers, sglang_text(waiting=4, running=1, usage=0.5))
    pods = tmp_path / "pods.yaml"
    pods.write_text(
        "pods:\n"
        f"  - {{name: v, address: '{vllm.address}'}}\n"
        f"  - name: s\n    address: '{sglang.address}'\n"
        f"    labels: {{{PRESET_LABEL}: sglang}}\n"
    )
    async with Pool(StaticFileDiscovery(pods, poll_interval=0.05), scraping()) as pool:
        assert await pool.wait_ready(timeout=5)
        snapshot = await until(pool, lambda s: candidate_names(s) == {"v", "s"})
        assert {p.name: p.waiting_queue for p in snapshot.pods} == {"v": 2, "s": 4}


def test_only_pods_labelled_with_another_preset_are_sent_to_the_scraper() -> None:
    config = ScrapeConfig(preset="sglang")
    labelled = [
        ("a:1", {}),
        ("b:1", {PRESET_LABEL: "sglang"}),  # the process's own: read like unlabelled pods
        ("c:1", {PRESET_LABEL: "vllm"}),
        ("d:1", {PRESET_LABEL: "nope"}),
        ("e:1", {"other": "x"}),
    ]
    assert pod_presets(config, labelled) == {"c:1": "vllm", "d:1": "nope"}
    assert pod_presets(ScrapeConfig(), [("a:1", {}), ("b:1", {"x": "y"})]) == {}


def test_llm_d_names_are_read_as_the_presets() -> None:
    assert preset_named("triton-tensorrt-llm") == "triton-trtllm"
    assert preset_named(" sglang ") == "sglang"
    assert preset_named("llama.cpp") is None


async def test_overrides_apply_to_unlabelled_pods_only(
    servers: list[MetricsServer], scraping: Scraping
) -> None:
    """``--metric-*`` changes the process's preset; a labelled pod reads its preset's names."""
    plain = await serve(servers, vllm_text(waiting=1) + "# TYPE my_waiting gauge\nmy_waiting 8\n")
    sglang = await serve(servers, sglang_text(waiting=4, running=1, usage=0.5))
    config = scraping()
    config = dataclasses.replace(config, metrics=VLLM.replace(waiting=specs("my_waiting")))
    discovery = PushedDiscovery(pod(plain, "p"), pod(sglang, "s", "sglang"))
    async with Pool(discovery, config) as pool:
        assert await pool.wait_ready(timeout=5)
        snapshot = await until(pool, lambda s: candidate_names(s) == {"p", "s"})
        assert {p.name: p.waiting_queue for p in snapshot.pods} == {"p": 8, "s": 4}


@pytest.mark.parametrize("value", ["", "VLLM"])
def test_unusual_label_values_name_no_preset(value: str) -> None:
    assert preset_named(value) is None


async def test_the_child_gets_the_presets_only_when_they_change() -> None:
    scraper = ProcessScraper(ScrapeConfig())
    try:
        assert scraper._presets_to_send({}) is None  # a homogeneous pool sends nothing
        assert scraper._presets_to_send({"a:1": "sglang"}) == {"a:1": "sglang"}
        assert scraper._presets_to_send({"a:1": "sglang"}) is None
        assert scraper._presets_to_send(None) is None
        scraper._forget()  # a new child has none: they go again
        assert scraper._presets_to_send(None) == {"a:1": "sglang"}
        assert scraper._presets_to_send({}) == {}
    finally:
        await scraper.close()
