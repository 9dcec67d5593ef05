"""``/metrics`` text: parses with prometheus_client and carries vLLM's names and labels."""

from __future__ import annotations

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from policyd.sim.engine import SimRequest
from policyd.sim.exposition import EngineCollector, metrics_registry, render
from policyd.sim.profile import L4_LLAMA2_7B
from policyd.sim.virtual import VirtualLoop, VirtualPod

MODEL = L4_LLAMA2_7B.base_model
EPOCH = 1_750_000_000.0
PROMPT = tuple(range(100, 140))  # 40 tokens: 2 full blocks


def busy_pod() -> tuple[VirtualLoop, VirtualPod]:
    """A pod with five adapters asked for (max_loras 4), stopped mid-run.

    One prefill admits a, b, c, d, the second a and the base-model request
    (e waits), loading four adapters from disk: it ends at 2.068 s. The first
    a request and the base one finish in the next decodes, so a moves behind
    b, c, d in the running order; a late b request hits the prefix cache.
    """
    loop = VirtualLoop()
    pod = VirtualPod(loop, L4_LLAMA2_7B, name="vllm-0")
    for i, adapter in enumerate(["a", "b", "c", "d", "e", "a"]):
        pod.submit(SimRequest(f"r{i}", PROMPT, 750, adapter=adapter, output_length=3 + i))
    pod.submit(SimRequest("base", PROMPT, 750, output_length=2))
    late = SimRequest("late", PROMPT, 750, adapter="b", output_length=50)
    loop.call_at(2.1, lambda: pod.submit(late) and None)
    loop.run(until=2.3)
    return loop, pod


def scrape(pod: VirtualPod) -> tuple[str, dict[str, Metric]]:
    collector = EngineCollector(lambda: pod.engine, MODEL, lambda t: EPOCH + t)
    text = render(metrics_registry(collector)).decode()
    return text, {family.name: family for family in text_string_to_metric_families(text)}


def test_scheduler_gauges_carry_the_model_name_and_the_logged_state() -> None:
    _, pod = busy_pod()
    snapshot = pod.snapshot()
    text, families = scrape(pod)
    expected = {
        "vllm:num_requests_running": snapshot.running,
        "vllm:num_requests_waiting": snapshot.waiting,
        "vllm:kv_cache_usage_perc": snapshot.kv_cache_usage,
        "vllm:gpu_cache_usage_perc": snapshot.kv_cache_usage,
    }
    for name, value in expected.items():
        family = families[name]
        assert family.type == "gauge"
        [sample] = family.samples
        assert sample.name == name
        assert sample.labels == {"model_name": MODEL}
        assert sample.value == value
    assert snapshot.waiting == 1  # adapter e waits: a, b, c, d hold the four slots
    assert f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 1.0\n' in text


def test_lora_requests_info_keeps_one_series_per_state_and_the_newest_is_current() -> None:
    loop, pod = busy_pod()
    _, families = scrape(pod)
    family = families["vllm:lora_requests_info"]
    assert family.type == "gauge"
    samples = family.samples
    assert len(samples) >= 2
    for sample in samples:
        assert set(sample.labels) == {"running_lora_adapters", "max_lora", "waiting_lora_adapters"}
        assert sample.labels["max_lora"] == "4"
        assert EPOCH < sample.value <= EPOCH + loop.now
    newest = max(samples, key=lambda sample: sample.value)
    snapshot = pod.snapshot()
    assert newest.labels["running_lora_adapters"] == ",".join(snapshot.running_adapters)
    assert newest.labels["waiting_lora_adapters"] == ",".join(snapshot.waiting_adapters)
    assert newest.value == EPOCH + snapshot.at
    assert newest.labels["running_lora_adapters"] == "b,c,d,a"
    assert newest.labels["waiting_lora_adapters"] == "e"
    assert any(s.labels["running_lora_adapters"] == "a,b,c,d" for s in samples)


def test_lora_requests_info_lines_look_like_vllm_s() -> None:
    _, pod = busy_pod()
    text, _ = scrape(pod)
    assert "# TYPE vllm:lora_requests_info gauge\n" in text
    current = (
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="b,c,d,a",'
        'waiting_lora_adapters="e"} '
    )
    [line] = [row for row in text.splitlines() if row.startswith(current)]
    assert float(line.removeprefix(current)) == EPOCH + pod.snapshot().at


def test_cache_config_info_describes_the_kv_cache() -> None:
    _, pod = busy_pod()
    _, families = scrape(pod)
    [sample] = families["vllm:cache_config_info"].samples
    assert sample.value == 1.0
    assert sample.labels["block_size"] == "16"
    assert sample.labels["num_gpu_blocks"] == "700"
    assert sample.labels["enable_prefix_caching"] == "True"
    assert sample.labels["cache_dtype"] == "auto"


def test_counters_and_histograms_use_vllm_names_and_agree_with_the_engine() -> None:
    _, pod = busy_pod()
    stats = pod.engine.stats
    _, families = scrape(pod)
    counters = {
        "vllm:prompt_tokens": stats.prompt_tokens,
        "vllm:generation_tokens": stats.generation_tokens,
        "vllm:num_preemptions": stats.preemptions,
        "vllm:prefix_cache_queries": stats.prefix_cache_queries,
        "vllm:prefix_cache_hits": stats.prefix_cache_hits,
    }
    for name, value in counters.items():
        family = families[name]
        assert family.type == "counter"
        [sample] = family.samples
        assert sample.name == f"{name}_total"
        assert sample.labels == {"model_name": MODEL}
        assert sample.value == value
    assert stats.generation_tokens > 0 and stats.prefix_cache_hits > 0
    success = families["vllm:request_success"]
    assert {s.labels["finished_reason"]: s.value for s in success.samples} == {"stop": 2.0}
    for name, histogram in {
        "vllm:time_to_first_token_seconds": stats.time_to_first_token,
        "vllm:time_per_output_token_seconds": stats.time_per_output_token,
        "vllm:e2e_request_latency_seconds": stats.e2e_request_latency,
    }.items():
        family = families[name]
        assert family.type == "histogram"
        by_name = {sample.name: sample for sample in family.samples if "le" not in sample.labels}
        assert by_name[f"{name}_count"].value == histogram.count
        assert by_name[f"{name}_sum"].value == histogram.total
        buckets = [s for s in family.samples if s.name == f"{name}_bucket"]
        assert buckets[-1].labels == {"le": "+Inf", "model_name": MODEL}
        assert [s.value for s in buckets] == sorted(s.value for s in buckets)
    ttft_buckets = [
        s.labels["le"]
        for s in families["vllm:time_to_first_token_seconds"].samples
        if s.name.endswith("_bucket")
    ]
    assert ttft_buckets[:3] == ["0.001", "0.005", "0.01"] and ttft_buckets[-2] == "10.0"


def test_an_idle_pod_exports_every_family_with_zeros() -> None:
    pod = VirtualPod(VirtualLoop(), L4_LLAMA2_7B, name="idle")
    _, families = scrape(pod)
    assert families["vllm:num_requests_running"].samples[0].value == 0.0
    assert families["vllm:lora_requests_info"].samples == []
    assert families["vllm:e2e_request_latency_seconds"].samples[-1].value == 0.0


def test_an_idle_pod_sets_its_lora_series_when_it_logs_its_stats() -> None:
    # Before its first stats log a pod prints no series (policyd: state unknown);
    # vLLM's periodic log sets one with no adapters and its max_lora.
    pod = VirtualPod(VirtualLoop(), L4_LLAMA2_7B, name="idle")
    pod.engine.log_stats(10.0)
    _, families = scrape(pod)
    [sample] = families["vllm:lora_requests_info"].samples
    assert sample.labels == {
        "running_lora_adapters": "",
        "max_lora": "4",
        "waiting_lora_adapters": "",
    }
    assert sample.value == EPOCH + 10.0


def test_the_periodic_stats_log_leaves_a_busy_engine_to_its_steps() -> None:
    # A busy engine logs after every step; a periodic log then would be stamped
    # later than the end of the step running, and nothing new would show.
    loop, pod = busy_pod()
    before = pod.engine.snapshot()
    series = dict(pod.engine.stats.lora_series)
    pod.engine.log_stats(loop.now + 0.01)
    assert pod.engine.snapshot() is before
    assert pod.engine.stats.lora_series == series
