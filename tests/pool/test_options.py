"""The pool's command-line flags, as every command that runs a pool parses them."""

from __future__ import annotations

import argparse

import pytest

from policyd.pool import StaticFileDiscovery
from policyd.pool.kubernetes_discovery import KubernetesDiscovery
from policyd.pool.metric_names import MetricSpec
from policyd.pool.options import add_arguments, pool_from_arguments, scrape_config_from_arguments


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_a_pod_file_and_default_scraping() -> None:
    pool = pool_from_arguments(parse("--pods", "pods.yaml"))
    assert isinstance(pool._discovery, StaticFileDiscovery)
    assert str(pool._discovery.path) == "pods.yaml"
    config = pool.config
    assert config.interval == 0.1
    assert config.request_timeout == pytest.approx(0.075)
    assert config.stale_threshold == pytest.approx(0.5)
    assert config.metrics.specs["waiting"] == (MetricSpec("vllm:num_requests_waiting"),)
    assert config.metrics.specs["lora-info"] == (MetricSpec("vllm:lora_requests_info"),)
    assert config.filter_families
    assert config.panic  # a round no pod answers keeps the recently heard pods
    assert not scrape_config_from_arguments(
        parse("--pods", "p", "--no-metrics-filter")
    ).filter_families
    assert not config.in_process  # a scraper child process by default
    assert scrape_config_from_arguments(parse("--pods", "p", "--scrape-in-process")).in_process


def test_kubernetes_flags() -> None:
    args = parse(
        "--k8s-selector", "app=vllm", "--k8s-namespace", "ml", "--k8s-target-port", "9000",
        "--kubeconfig", "/k", "--k8s-context", "c",
    )  # fmt: skip
    pool = pool_from_arguments(args)
    assert isinstance(pool._discovery, KubernetesDiscovery)
    options = pool._discovery.options
    assert (options.selector, options.namespace, options.target_port) == ("app=vllm", "ml", 9000)
    assert (options.kubeconfig, options.context) == ("/k", "c")


def test_inference_pool_flags() -> None:
    args = parse("--inference-pool", "llama", "--k8s-namespace", "ml", "--kubeconfig", "/k")
    pool = pool_from_arguments(args)
    assert isinstance(pool._discovery, KubernetesDiscovery)
    options = pool._discovery.options
    assert (options.inference_pool, options.selector, options.namespace) == ("llama", "", "ml")
    assert options.kubeconfig == "/k"
    default = pool_from_arguments(parse("--k8s-selector", "a=b"))._discovery
    assert isinstance(default, KubernetesDiscovery) and default.options.target_port == 8000
    with pytest.raises(ValueError, match="--k8s-target-port goes with --k8s-selector"):
        pool_from_arguments(parse("--inference-pool", "llama", "--k8s-target-port", "9000"))
    with pytest.raises(ValueError, match="the InferencePool's name is empty"):
        pool_from_arguments(parse("--inference-pool", ""))


@pytest.mark.parametrize(
    "argv",
    [
        (),
        ("--pods", "p.yaml", "--k8s-selector", "app=vllm"),
        ("--inference-pool", "llama", "--k8s-selector", "app=vllm"),
        ("--inference-pool", "llama", "--pods", "p.yaml"),
    ],
)
def test_exactly_one_pod_source_is_required(argv: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="exactly one of --pods FILE, --k8s-selector SELECTOR and"):
        pool_from_arguments(parse(*argv))


def test_presets_and_overrides() -> None:
    config = scrape_config_from_arguments(
        parse(
            "--pods", "p.yaml", "--metrics-preset", "triton-trtllm", "--metrics-port", "8002",
            "--metric-kv-cache", "my_kv", "--metric-kv-cache", 'other_kv{gpu="0"}',
            "--metric-lora-info", "my_lora", "--scrape-interval", "0.25", "--stale-after", "2",
            "--include-stale", "--no-panic",
        )
    )  # fmt: skip
    assert config.metrics.specs["waiting"] == (
        MetricSpec("nv_trt_llm_request_metrics", (("request_type", "waiting"),)),
    )
    assert config.metrics.specs["kv-cache"] == (
        MetricSpec("my_kv"),
        MetricSpec("other_kv", (("gpu", "0"),)),
    )
    assert config.metrics.specs["lora-info"] == (MetricSpec("my_lora"),)
    assert (config.metrics_port, config.interval, config.stale_threshold) == (8002, 0.25, 2.0)
    assert config.include_stale
    assert not config.panic


def test_trtllm_serve_scrapes_its_prometheus_path_and_lora_reading_can_be_off() -> None:
    config = scrape_config_from_arguments(
        parse("--pods", "p.yaml", "--metrics-preset", "trtllm-serve")
    )
    assert config.metrics.path == "/prometheus/metrics"
    assert config.metrics.specs["lora-info"] == ()
    off = scrape_config_from_arguments(parse("--pods", "p.yaml", "--metric-lora-info", ""))
    assert off.metrics.specs["lora-info"] == ()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--metric-waiting", "not a name"), "is not a Prometheus metric name"),
        (("--metrics-path", "metrics"), "must start with '/'"),
        (("--scrape-timeout", "1"), "at most the interval"),
    ],
)
def test_bad_values_are_refused_with_a_reason(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        scrape_config_from_arguments(parse("--pods", "p.yaml", *argv))
