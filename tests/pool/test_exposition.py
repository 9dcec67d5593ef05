"""The hand-written exposition parser: what it reads, what it refuses, and where."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from policyd.pool.exposition import (
    ExpositionError,
    MetricsParser,
    PodMetrics,
    parse_labels,
)
from policyd.pool.metric_names import PRESETS, SGLANG, TRITON_TRTLLM, VLLM, MetricSpec

from .model_server import VLLM_SAMPLE

vllm = MetricsParser(VLLM)


def parse(text: str) -> PodMetrics:
    return vllm.parse(text.encode())


def test_the_vllm_sample_gives_every_field() -> None:
    metrics = parse(VLLM_SAMPLE)
    assert (metrics.waiting_queue, metrics.running, metrics.kv_cache) == (0, 3, 0.1234)
    assert metrics.max_loras == 4
    # Both LoRA series carry the same timestamp: the first of them is taken.
    assert metrics.active_loras == ("adapter-1", "adapter-3")
    assert metrics.waiting_loras == ()


BASE = """\
vllm:num_requests_running 1
vllm:num_requests_waiting 2
vllm:kv_cache_usage_perc 0.5
"""


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1), (1, 2, 0)])
def test_the_lora_series_with_the_newest_timestamp_is_current(order: tuple[int, ...]) -> None:
    series = [
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="old",'
        'waiting_lora_adapters=""} 1700000100.5',
        'vllm:lora_requests_info{max_lora="3",running_lora_adapters="new-a, new-b",'
        'waiting_lora_adapters="queued"} 1700000300.25',
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="older",'
        'waiting_lora_adapters="x"} 1700000000',
    ]
    text = BASE + "".join(series[i] + "\n" for i in order)
    metrics = parse(text)
    assert metrics.active_loras == ("new-a", "new-b")
    assert metrics.waiting_loras == ("queued",)
    assert metrics.max_loras == 3


def test_empty_lora_label_values_mean_no_adapters() -> None:
    text = BASE + (
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="",'
        'waiting_lora_adapters=""} 1.7e9\n'
    )
    metrics = parse(text)
    assert (metrics.active_loras, metrics.waiting_loras, metrics.max_loras) == ((), (), 4)
    assert metrics.lora_info_known


def test_no_lora_series_means_the_lora_state_is_unknown() -> None:
    # A vLLM that has not logged its stats yet prints no series: nothing is
    # known, which is not the same as a pod with no free adapter slot.
    metrics = vllm.parse(BASE.encode())
    assert (metrics.active_loras, metrics.waiting_loras, metrics.max_loras) == ((), (), 0)
    assert metrics.lora_info_known is False
    assert MetricsParser(SGLANG).parse(
        b"sglang:num_queue_reqs 1\nsglang:num_running_reqs 2\nsglang:token_usage 0.5\n"
    ) == PodMetrics(1, 2, 0.5, lora_info_known=False)


def test_a_lora_series_makes_the_state_known_until_it_goes_away() -> None:
    lora = (
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a",waiting_lora_adapters=""}'
    )
    assert vllm.parse(BASE.encode()).lora_info_known is False
    for _ in range(2):  # read, then from the label sets read before
        metrics = vllm.parse((BASE + lora + " 1.7e9\n").encode())
        assert (metrics.active_loras, metrics.max_loras, metrics.lora_info_known) == (
            ("a",),
            2,
            True,
        )
    assert vllm.parse(BASE.encode()).lora_info_known is False  # the series went away


def test_kv_cache_falls_back_to_the_older_vllm_name() -> None:
    text = (
        "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
        'vllm:gpu_cache_usage_perc{model_name="m"} 0.75\n'
    )
    assert parse(text).kv_cache == 0.75


def test_the_newer_kv_cache_name_wins_when_both_are_printed() -> None:
    text = BASE.replace("0.5", "0.25") + "vllm:gpu_cache_usage_perc 0.9\n"
    assert parse(text).kv_cache == 0.25


def test_counts_are_summed_and_kv_cache_is_the_fullest_across_engines() -> None:
    text = """\
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 4.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.6
"""
    metrics = parse(text)
    assert (metrics.running, metrics.waiting_queue, metrics.kv_cache) == (7, 1, 0.6)


def test_families_that_merely_share_a_prefix_are_not_read() -> None:
    text = """\
vllm:num_requests_waiting_by_reason{reason="capacity"} 7.0
vllm:num_requests_running_total 50
# HELP vllm:num_requests_waiting Number of requests waiting.
vllm:num_requests_waiting 2
vllm:num_requests_running 1
vllm:kv_cache_usage_perc 0.5
"""
    metrics = parse(text)
    assert (metrics.waiting_queue, metrics.running) == (2, 1)


def test_a_timestamp_after_the_value_and_crlf_line_ends_are_accepted() -> None:
    text = BASE.replace("\n", " 1700000000000\r\n")
    metrics = parse(text)
    assert (metrics.running, metrics.waiting_queue, metrics.kv_cache) == (1, 2, 0.5)


def test_a_family_named_only_in_a_comment_is_missing() -> None:
    text = "# HELP vllm:num_requests_waiting queued\nvllm:num_requests_running 1\n"
    with pytest.raises(ExpositionError, match="no vllm:num_requests_waiting series"):
        parse(text)


def test_a_missing_kv_cache_names_both_spellings() -> None:
    text = "vllm:num_requests_running 1\nvllm:num_requests_waiting 2\n"
    with pytest.raises(ExpositionError) as error:
        parse(text)
    assert "vllm:kv_cache_usage_perc or vllm:gpu_cache_usage_perc" in str(error.value)
    assert error.value.line is None


@pytest.mark.parametrize(
    ("bad_line", "reason"),
    [
        ('vllm:num_requests_waiting{model_name="m"} abc', "value 'abc' is not a number"),
        ('vllm:num_requests_waiting{model_name="m" 3.0', "not closed with '}'"),
        ("vllm:num_requests_waiting", "has no value"),
        ("vllm:num_requests_waiting 1 2 3", "unexpected text after the value"),
        ("vllm:num_requests_waiting NaN", "is not a count"),
        ("vllm:num_requests_waiting -1", "is not a count"),
        ("vllm:kv_cache_usage_perc 1.5", "not a fraction from 0 to 1"),
        ("vllm:kv_cache_usage_perc NaN", "not a fraction from 0 to 1"),
        ("vllm:num_requests_waiting +Inf", "is not a count"),
        ("vllm:num_requests_waiting 1e19", "out of range"),
        ("vllm:num_requests_running 9.3e18", "out of range"),
    ],
)
def test_a_malformed_line_of_a_read_family_is_reported_with_its_line(
    bad_line: str, reason: str
) -> None:
    lines = [
        "# TYPE vllm:num_requests_running gauge",
        "vllm:num_requests_running 1",
        "vllm:num_requests_waiting 0",
        "vllm:kv_cache_usage_perc 0.5",
    ]
    family = bad_line.partition("{")[0].partition(" ")[0]
    at = next(i for i, line in enumerate(lines) if line.startswith(family + " "))
    lines[at] = bad_line
    with pytest.raises(ExpositionError) as error:
        parse("\n".join(lines) + "\n")
    assert error.value.line == at + 1
    assert reason in str(error.value)
    assert str(error.value).startswith(f"line {at + 1}: {family}")


@pytest.mark.parametrize(
    ("labels", "reason"),
    [
        ('max_lora="4",running_lora_adapters=a,waiting_lora_adapters=""', "is not quoted"),
        ('max_lora="4",running_lora_adapters="a', "not closed"),
        ('max_lora="four",running_lora_adapters="a",waiting_lora_adapters=""', "whole number"),
        ('max_lora="4" running_lora_adapters="a"', "expected ','"),
        ('max_lora="4",running_lora_adapters="a\\q"', "unknown escape"),
    ],
)
def test_a_malformed_current_lora_series_is_reported(labels: str, reason: str) -> None:
    text = BASE + f"vllm:lora_requests_info{{{labels}}} 1.7e9\n"
    with pytest.raises(ExpositionError) as error:
        parse(text)
    assert error.value.line == 4
    assert reason in str(error.value)


@pytest.mark.parametrize(
    ("lines", "line", "reason"),
    [
        # Values a CEL int (int64) cannot hold are no counts: the pod is unusable.
        (["vllm:num_requests_waiting 1e19"], 2, "1e+19 is out of range"),
        (["vllm:num_requests_running 9223372036854775808"], 1, "out of range"),
        (
            [
                'vllm:num_requests_waiting{engine="0"} 5e18',
                'vllm:num_requests_waiting{engine="1"} 5e18',
            ],
            2,
            "the series add up to 1e+19, out of range",
        ),
        (
            [
                'vllm:lora_requests_info{max_lora="100000000000000000000",'
                'running_lora_adapters="",waiting_lora_adapters=""} 1.7e9'
            ],
            4,
            "max_lora='100000000000000000000' is out of range",
        ),
        (
            [
                'vllm:lora_requests_info{max_lora="1e20",'
                'running_lora_adapters="",waiting_lora_adapters=""} 1.7e9'
            ],
            4,
            "max_lora='1e20' is not a whole number",
        ),
        (
            [
                'vllm:lora_requests_info{max_lora="2",'
                'running_lora_adapters="a",waiting_lora_adapters=""} 1.7e9',
                'vllm:lora_requests_info{max_lora="2",'
                'running_lora_adapters="b",waiting_lora_adapters=""} NaN',
            ],
            5,
            "nan is not the time a series was set",
        ),
    ],
)
def test_values_out_of_range_fail_the_scrape_with_the_line(
    lines: list[str], line: int, reason: str
) -> None:
    base = BASE.splitlines()
    family = lines[0].partition("{")[0].partition(" ")[0]
    kept = [text for text in base if not text.startswith(family + " ")]
    at = next((i for i, text in enumerate(base) if text.startswith(family + " ")), len(base))
    page = "\n".join([*kept[:at], *lines, *kept[at:]]) + "\n"
    with pytest.raises(ExpositionError) as error:
        vllm.parse(page.encode())
    assert reason in str(error.value)
    assert error.value.line == line


def test_malformed_lines_of_families_that_are_not_read_do_not_matter() -> None:
    text = "vllm:time_to_first_token_seconds_bucket{le= garbage\n" + BASE + "}}} not metrics\n"
    assert parse(text).running == 1


def test_labels_are_unescaped() -> None:
    assert parse_labels('a="x\\"y",b="back\\\\slash",c="new\\nline", d = "spaced"') == {
        "a": 'x"y',
        "b": "back\\slash",
        "c": "new\nline",
        "d": "spaced",
    }
    assert parse_labels("") == {}
    assert parse_labels('a="1",') == {"a": "1"}


def test_a_brace_inside_a_label_value_does_not_end_the_label_set() -> None:
    text = BASE + (
        'vllm:lora_requests_info{max_lora="1",running_lora_adapters="we{ird}",'
        'waiting_lora_adapters=""} 5\n'
    )
    assert parse(text).active_loras == ("we{ird}",)


def test_triton_specs_select_series_by_label() -> None:
    text = """\
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="active",version="1"} 9
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="scheduled",version="1"} 5
nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="waiting",version="1"} 4
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="tensorrt_llm"} 1000
nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction",model="tensorrt_llm"} 0.25
"""
    metrics = MetricsParser(TRITON_TRTLLM).parse(text.encode())
    assert (metrics.waiting_queue, metrics.running, metrics.kv_cache) == (4, 5, 0.25)


def test_sglang_preset_reads_sglang_names_and_no_lora_state() -> None:
    text = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 6.0
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
"""
    metrics = MetricsParser(SGLANG).parse(text.encode())
    assert metrics == PodMetrics(
        waiting_queue=2,
        running=6,
        kv_cache=0.28,
        base_model="meta-llama/Llama-3.1-8B-Instruct",
    )


def test_the_served_model_and_the_cache_configuration_are_read_from_labels() -> None:
    text = """\
vllm:num_requests_running{engine="0",model_name="m-7b"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m-7b"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="m-7b"} 0.5
vllm:cache_config_info{block_size="32",num_gpu_blocks="1200",sliding_window="None"} 1.0
"""
    metrics = vllm.parse(text.encode())
    assert (metrics.base_model, metrics.kv_cache_blocks, metrics.kv_block_size) == (
        "m-7b",
        1200,
        32,
    )
    without = text.replace('block_size="32",', "")
    assert vllm.parse(without.encode()).kv_block_size == 0  # a missing label: its default
    bad = text.replace('num_gpu_blocks="1200"', 'num_gpu_blocks="many"')
    with pytest.raises(ExpositionError, match=r"line 4: .*num_gpu_blocks='many'"):
        vllm.parse(bad.encode())


def test_metric_specs_parse_and_print() -> None:
    spec = MetricSpec.parse('nv_trt_llm_request_metrics{request_type="waiting", model=m}')
    assert spec == MetricSpec(
        "nv_trt_llm_request_metrics", (("request_type", "waiting"), ("model", "m"))
    )
    assert str(spec) == 'nv_trt_llm_request_metrics{request_type="waiting",model="m"}'
    assert MetricSpec.parse(" vllm:num_requests_waiting ") == MetricSpec(
        "vllm:num_requests_waiting"
    )


@pytest.mark.parametrize(
    "text", ["", "9lives", "name{a=1", "name{a}", 'name{a="x}', "bad-name", "name{=1}"]
)
def test_bad_metric_specs_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"metric name|label|must end"):
        MetricSpec.parse(text)


def test_every_preset_has_the_three_required_families() -> None:
    for name, names in PRESETS.items():
        assert all(names.specs[key] for key in ("waiting", "running", "kv-cache")), name


adapter = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_", min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(
    waiting=st.integers(0, 10_000),
    running=st.integers(0, 10_000),
    kv_cache=st.floats(0, 1),
    lora_series=st.lists(
        st.tuples(
            st.lists(adapter, max_size=4, unique=True),
            st.lists(adapter, max_size=3, unique=True),
            st.floats(1e9, 2e9),
        ),
        max_size=5,
        unique_by=lambda series: (tuple(series[0]), tuple(series[1])),
    ),
)
def test_agrees_with_prometheus_client_on_text_it_generates(
    waiting: int,
    running: int,
    kv_cache: float,
    lora_series: list[tuple[list[str], list[str], float]],
) -> None:
    registry = CollectorRegistry()
    labels = ["model_name"]
    Gauge("vllm:num_requests_waiting", "w", labels, registry=registry).labels("m").set(waiting)
    Gauge("vllm:num_requests_running", "r", labels, registry=registry).labels("m").set(running)
    Gauge("vllm:kv_cache_usage_perc", "k", labels, registry=registry).labels("m").set(kv_cache)
    lora = Gauge(
        "vllm:lora_requests_info",
        "l",
        ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        registry=registry,
    )
    for running_names, waiting_names, stamp in lora_series:
        lora.labels("8", ",".join(running_names), ",".join(waiting_names)).set(stamp)
    text = generate_latest(registry)

    ours = vllm.parse(text)

    theirs = {f.name: f.samples for f in text_string_to_metric_families(text.decode())}
    assert ours.waiting_queue == theirs["vllm:num_requests_waiting"][0].value
    assert ours.running == theirs["vllm:num_requests_running"][0].value
    assert math.isclose(ours.kv_cache, theirs["vllm:kv_cache_usage_perc"][0].value)
    samples = theirs.get("vllm:lora_requests_info", [])
    if samples:
        newest = max(samples, key=lambda s: s.value)  # max() keeps the first of equals
        expected = tuple(filter(None, newest.labels["running_lora_adapters"].split(",")))
        assert ours.active_loras == expected
        assert ours.max_loras == 8
    else:
        assert (ours.active_loras, ours.max_loras) == ((), 0)


def test_families_are_found_wherever_the_page_prints_them() -> None:
    lora = "".join(
        f'vllm:lora_requests_info{{max_lora="2",running_lora_adapters="{name}"}} {stamp}\n'
        for name, stamp in (("a", 3), ("b", 1), ("c", 2))
    )
    for page in ("# padding\n" * 50 + BASE + lora, BASE + lora, lora + BASE):
        assert vllm.parse(page.encode()).active_loras == ("a",)  # the newest series
    assert vllm.parse(("# padding\n" * 200 + BASE).encode()).active_loras == ()
    with pytest.raises(ExpositionError, match="no vllm:num_requests_waiting"):
        vllm.parse(b"vllm:num_requests_running 1\n")


def test_a_family_that_gains_series_counts_them_all() -> None:
    page = "# padding\n" * 5 + BASE
    assert vllm.parse(page.encode()).waiting_queue == 2
    below = page.replace(
        "vllm:num_requests_waiting 2\n",
        'vllm:num_requests_waiting 2\nvllm:num_requests_waiting{engine="1"} 3\n',
    )
    assert vllm.parse(below.encode()).waiting_queue == 5
    above = page.replace(
        "vllm:num_requests_waiting 2\n",
        'vllm:num_requests_waiting{engine="12"} 4\nvllm:num_requests_waiting 2\n',
    )
    assert vllm.parse(above.encode()).waiting_queue == 6


def test_lora_label_sets_read_before_give_the_same_state_and_bad_ones_always_fail() -> None:
    parser = MetricsParser(VLLM)

    def page(labels: str) -> bytes:
        return (BASE + f"vllm:lora_requests_info{{{labels}}} 1\n").encode()

    first = 'max_lora="2",running_lora_adapters="a",waiting_lora_adapters=""'
    second = 'max_lora="3",running_lora_adapters="b, c",waiting_lora_adapters="a"'
    bad = 'max_lora="two",running_lora_adapters="a",waiting_lora_adapters=""'
    for _ in range(2):
        one = parser.parse(page(first))
        assert (one.active_loras, one.waiting_loras, one.max_loras) == (("a",), (), 2)
        two = parser.parse(page(second))
        assert (two.active_loras, two.waiting_loras, two.max_loras) == (("b", "c"), ("a",), 3)
        with pytest.raises(ExpositionError, match="max_lora='two' is not a whole number"):
            parser.parse(page(bad))


family_line = st.sampled_from(
    [
        'vllm:num_requests_waiting{{engine="{0}"}} {0}',
        'vllm:num_requests_running{{engine="{0}"}} {0}',
        'vllm:kv_cache_usage_perc{{engine="{0}"}} 0.{0}',
        'vllm:lora_requests_info{{max_lora="{0}",running_lora_adapters="x{0}"}} {0}',
        "# HELP vllm:num_requests_waiting {0}",
        "other_metric_{0} 1",
    ]
)


def page_of(lines: list[tuple[str, int]]) -> bytes:
    """Lines grouped by family (as the format requires), families in the drawn order."""
    order: dict[str, list[str]] = {}
    for template, n in lines:
        order.setdefault(template, []).append(template.format(n))
    return ("\n".join(line for group in order.values() for line in group) + "\n").encode()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(family_line, st.integers(0, 9)), max_size=20), st.integers(0, 40))
def test_a_page_reads_the_same_wherever_it_sits_in_the_buffer(
    lines: list[tuple[str, int]], padding: int
) -> None:
    # The scraper parses a body in place, in a connection's buffer with other
    # bytes around it: nothing outside the body is looked at.
    body = page_of(lines)
    around = b"vllm:num_requests_waiting 9\n" * padding
    buffer = around + body + around
    try:
        alone: object = vllm.parse(body)
    except ExpositionError as error:
        alone = (error.reason, error.line)
    try:
        inside: object = vllm.parse(buffer, len(around), len(around) + len(body))
    except ExpositionError as error:
        inside = (error.reason, error.line)
    assert inside == alone


def test_the_simulators_changing_pages_read_as_the_engine_logged_them() -> None:
    # A busy simulated vLLM pod: requests come and go, adapters load, the LoRA
    # family grows to the simulator's 32 series.
    from policyd.sim.engine import Engine, SimRequest
    from policyd.sim.exposition import EngineCollector, metrics_registry, render
    from policyd.sim.profile import PROFILES

    engine = Engine(PROFILES["l4-llama2-7b"], seed=1)
    registry = metrics_registry(EngineCollector(lambda: engine, "m", lambda now: 1.7e9 + now))
    rng = random.Random(3)
    parser = MetricsParser(VLLM)
    now = 0.0
    for step in range(400):
        for n in range(rng.randrange(3)):
            prompt = tuple(range(rng.randrange(5, 200)))
            adapter = f"adapter-{rng.randrange(12)}"
            engine.add(SimRequest(f"r{step}-{n}", prompt, rng.randrange(1, 64), adapter), now)
        if engine.has_work and (took := engine.start_step(now)) is not None:
            now += took
            engine.finish_step(now)
        now += 0.01
        page = render(registry)
        metrics, logged = parser.parse(page), engine.snapshot()
        assert (metrics.waiting_queue, metrics.running, metrics.kv_cache) == (
            logged.waiting,
            logged.running,
            logged.kv_cache_usage,
        )
        assert metrics.active_loras == logged.running_adapters
        assert metrics.num_preemptions == engine.stats.preemptions
    assert page.count(b"\nvllm:lora_requests_info{") > 8


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,8}", fullmatch=True),
        st.text(alphabet=st.sampled_from('ab,{} "\\\n=xé'), max_size=8),
        min_size=1,
        max_size=4,
    ),
    st.sampled_from([",", ", ", " , "]),
)
def test_labels_round_trip_through_the_exposition_escapes(
    labels: dict[str, str], separator: str
) -> None:
    def escape(value: str) -> str:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    text = separator.join(f'{name}="{escape(value)}"' for name, value in labels.items())
    assert parse_labels(text) == labels
