"""``policyd sim`` as a separate process: a pool on free ports, addresses printed, clean stop."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from policyd.cli import main
from policyd.sim.tokenizer import tokenize


def test_policyd_sim_serves_a_pool_and_stops_on_interrupt() -> None:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "policyd",
            "sim",
            "--pods",
            "2",
            "--base-port",
            "0",
            "--adapters",
            "3",
            "--time-scale",
            "20",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        header = process.stdout.readline()
        assert "2 pods of l4-llama2-7b" in header
        assert "3 adapters (adapter-0..adapter-2)" in header
        pods = [process.stdout.readline().split() for _ in range(2)]
        assert [name for name, _ in pods] == ["vllm-0", "vllm-1"]
        urls = [url for _, url in pods]
        assert len(set(urls)) == 2 and all(u.startswith("http://127.0.0.1:") for u in urls)
        for url in urls:
            with urllib.request.urlopen(url + "/v1/models", timeout=10) as response:
                models = [card["id"] for card in json.load(response)["data"]]
            assert models == ["meta-llama/Llama-2-7b-hf", "adapter-0", "adapter-1", "adapter-2"]
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=20) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_policyd_sim_rejects_nonsense_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--pods", "0"]) == 2
    assert "--pods must be >= 1" in capsys.readouterr().err
    assert main(["sim", "--base-port", "65535", "--pods", "3"]) == 2
    assert "ports 65535..65537 are not all valid" in capsys.readouterr().err
    assert main(["sim", "--kv-events-port-base", "-1"]) == 2
    assert "--kv-events-port-base must be >= 0" in capsys.readouterr().err


def test_policyd_sim_publishes_kv_events_when_asked() -> None:
    import msgpack
    import zmq

    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "policyd", "sim", "--pods", "1", "--base-port", "0"),
            *("--time-scale", "50", "--kv-events-port-base", "0"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    try:
        assert process.stdout is not None
        process.stdout.readline()
        name, url, kv, events, replay, replay_endpoint = process.stdout.readline().split()
        assert (name, kv, replay) == ("vllm-0", "kv-events", "replay")
        assert events.startswith("tcp://127.0.0.1:") and replay_endpoint != events
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVTIMEO, 1_000)
        sub.connect(events)
        # ZMQ's slow joiner: batches published before the subscription reaches the
        # pod are not sent here. Each completion stores one new block, one batch;
        # the first batch that arrives names, by its tokens, the completion it is.
        prompts = [f"attempt{n} " + "a b c " * 6 for n in range(30)]
        for prompt in prompts:
            body = json.dumps(
                {"model": "meta-llama/Llama-2-7b-hf", "prompt": prompt, "max_tokens": 1}
            ).encode()
            request = urllib.request.Request(
                url + "/v1/completions", body, {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=30) as response:
                assert response.status == 200
            try:
                topic, seq, payload = sub.recv_multipart()
                break
            except zmq.Again:
                continue
        else:
            raise AssertionError(f"no KV events after {len(prompts)} completions")
        assert topic.decode() == f"kv@{url.removeprefix('http://')}@meta-llama/Llama-2-7b-hf"
        [event] = msgpack.unpackb(payload)[1]
        number = int.from_bytes(seq, "big")  # batches are numbered from 0, one per completion
        assert event[0] == "BlockStored" and event[3] == tokenize(prompts[number])[:16]
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=20) == 0
    finally:
        sub.close(linger=0)
        context.term()
        if process.poll() is None:
            process.kill()
            process.wait()


def test_policyd_sim_gives_pods_roles_and_writes_their_pod_file(tmp_path: Path) -> None:
    pods_file = tmp_path / "pods.yaml"
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "policyd", "sim", "--pods", "2", "--base-port", "0"),
            *("--profile", "h100-llama3.1-8b", "--roles", "prefill,decode", "--pd-in-process"),
            *("--kv-transfer-gb-per-s", "10", "--pods-file", str(pods_file)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        process.stdout.readline()
        lines = [process.stdout.readline().split() for _ in range(2)]
        assert [line[2:] for line in lines] == [["role", "prefill"], ["role", "decode"]]
        while not pods_file.exists() and process.poll() is None:  # written after the addresses
            time.sleep(0.05)
        pods = yaml.safe_load(pods_file.read_text())["pods"]
        assert [(p["name"], p["address"], p["labels"]["llm-d.ai/role"]) for p in pods] == [
            (name, url.removeprefix("http://"), role) for (name, url, _, role) in lines
        ]
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=20) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--pods", "2", "--roles", "prefill"], "one role per pod"),
        (["--pods", "1", "--roles", "encoder"], "unknown pod role"),
        (["--pods", "1", "--kv-transfer-gb-per-s", "0"], "positive bandwidth"),
    ],
)
def test_policyd_sim_rejects_bad_p_d_arguments(
    capsys: pytest.CaptureFixture[str], arguments: list[str], message: str
) -> None:
    assert main(["sim", "--base-port", "0", *arguments]) == 2
    assert message in capsys.readouterr().err
