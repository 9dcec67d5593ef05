"""The static pod file: its format, its errors (file:line: reason) and its watch."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from policyd.pool import DiscoveryError, PodIdentity, StaticFileDiscovery, parse_pod_file

GOOD = """\
pods:
  - name: vllm-1
    address: "[fd00::12]:8000"
  - name: vllm-0
    address: 10.0.0.11:8000
    labels:
      model: llama-3-8b
      version: 2
"""


def test_a_pod_file_lists_identities_sorted_by_name() -> None:
    pods = parse_pod_file(GOOD, "pods.yaml")
    assert pods == (
        PodIdentity.of("vllm-0", "10.0.0.11:8000", {"model": "llama-3-8b", "version": "2"}),
        PodIdentity.of("vllm-1", "[fd00::12]:8000"),
    )


def test_an_empty_pod_list_is_a_valid_pool() -> None:
    assert parse_pod_file("pods: []\n", "pods.yaml") == ()


def test_the_shapes_explain_takes_name_the_same_pods() -> None:
    """A list alone, or a mapping from name to fields, as ``explain --pods`` reads them."""
    listed = "- {name: vllm-0, address: 10.0.0.11:8000, labels: {model: llama-3-8b, version: 2}}\n"
    listed += '- {name: vllm-1, address: "[fd00::12]:8000"}\n'
    named = "vllm-1: {address: '[fd00::12]:8000'}\n"
    named += "vllm-0: {address: 10.0.0.11:8000, labels: {model: llama-3-8b, version: 2}}\n"
    expected = parse_pod_file(GOOD, "pods.yaml")
    assert parse_pod_file(listed, "pods.yaml") == expected
    assert parse_pod_file(named, "pods.yaml") == expected


def test_an_explain_snapshot_serves_with_its_measured_fields_ignored_and_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    snapshot = "a: {address: 10.0.0.1:8000, waiting_queue: 60, kv_cache: 0.9}\n"
    with caplog.at_level(logging.WARNING, logger="policyd.pool.file_discovery"):
        pods = parse_pod_file(snapshot, "snap.yaml")
    assert pods == (PodIdentity.of("a", "10.0.0.1:8000"),)
    assert "snap.yaml: ignoring kv_cache, waiting_queue: the pool scrapes them" in caplog.text


@pytest.mark.parametrize(
    ("text", "line", "reason"),
    [
        ("pods:\n  - name: a\n    address: [1.2.3.4:80\n", 4, "not valid YAML"),
        ("", 1, "the file is empty"),
        ("servers: []\n", 1, "a pod must be a mapping"),
        ("just text\n", 1, "expected 'pods:' with a list of pods, a list, or a mapping"),
        ("a: {address: 1.2.3.4:80, name: b}\n", 1, "the pod listed as 'a' is named 'b'"),
        ("a: {waiting_queue: 3}\n", 1, "the pod has no 'address' (ip:port; explain's default"),
        ("pods:\n  name: a\n", 2, "'pods' must be a list"),
        ("pods:\n  - just-a-name\n", 2, "a pod must be a mapping"),
        ("pods:\n  - address: 1.2.3.4:80\n", 2, "the pod has no 'name'"),
        ("pods:\n  - name: a\n", 2, "the pod has no 'address'"),
        ("pods:\n  - name: a\n    adress: 1.2.3.4:80\n", 3, "unknown key 'adress' in a pod"),
        ("pods:\n  - name: a\n    address: pod-a.svc:8000\n", 3, "is not an IP address"),
        ("pods:\n  - name: a\n    address: 1.2.3.4\n", 3, "is not ip:port"),
        ("pods:\n  - name: a\n    address: 1.2.3.4:99999\n", 3, "port must be a number"),
        ("pods:\n  - name: a\n    address: fd00::1:80\n", 3, "write an IPv6 address as [ip]:port"),
        ("pods:\n  - name:\n    address: 1.2.3.4:80\n", 2, "name must be a plain value"),
        ("pods:\n  - name: [a]\n    address: 1.2.3.4:80\n", 2, "name must be a plain value"),
        (
            "pods:\n  - name: a\n    address: 1.2.3.4:80\n    labels: [x]\n",
            4,
            "labels must be a mapping",
        ),
        (
            "pods:\n  - name: a\n    address: 1.2.3.4:80\n    labels:\n      zone: {a: 1}\n",
            5,
            "label 'zone' must be a plain value",
        ),
        (
            "pods:\n  - name: a\n    address: 1.2.3.4:80\n    name: b\n",
            4,
            "'name' appears twice in a pod",
        ),
        (
            "pods:\n  - name: a\n    address: 1.2.3.4:80\n  - name: a\n    address: 1.2.3.5:80\n",
            4,
            "pod name 'a' is used twice",
        ),
        (
            "pods:\n  - name: a\n    address: 1.2.3.4:80\n  - name: b\n    address: 1.2.3.4:80\n",
            4,
            "address 1.2.3.4:80 is used twice",
        ),
    ],
)
def test_a_bad_pod_file_names_file_line_and_reason(text: str, line: int, reason: str) -> None:
    with pytest.raises(DiscoveryError) as error:
        parse_pod_file(text, "conf/pods.yaml")
    assert error.value.line == line
    assert str(error.value).startswith(f"conf/pods.yaml:{line}: ")
    assert reason in str(error.value)


def test_bytes_that_are_not_utf8_are_reported_with_their_line() -> None:
    with pytest.raises(DiscoveryError, match=r"^p.yaml:3: the file is not UTF-8 text$"):
        parse_pod_file(b"pods:\n  - name: a\n    address: \xff\n", "p.yaml")


async def next_set(updates: AsyncIterator[tuple[PodIdentity, ...]]) -> tuple[PodIdentity, ...]:
    return await asyncio.wait_for(anext(updates), timeout=30)


async def until(condition: Callable[[], bool], timeout: float = 2.0) -> None:
    """Poll ``condition`` while the watch runs (bounded): the file is read in a worker
    thread, so how many polls a fixed sleep covers depends on the machine's load."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def test_the_file_is_watched_and_a_bad_edit_keeps_the_last_good_set(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "pods.yaml"
    path.write_text("pods:\n  - name: a\n    address: 10.0.0.1:8000\n")
    source = StaticFileDiscovery(path, poll_interval=0.02)
    updates = source.updates()
    try:
        assert [p.name for p in await next_set(updates)] == ["a"]

        path.write_text(
            "pods:\n  - name: a\n    address: 10.0.0.1:8000\n"
            "  - name: b\n    address: 10.0.0.2:8000\n"
        )
        assert [p.name for p in await next_set(updates)] == ["a", "b"]

        caplog.set_level(logging.ERROR)
        path.write_text(
            "pods:\n  - name: a\n    address: 10.0.0.1:8000\n  - name: c\n    address: oops\n"
        )
        pending = asyncio.ensure_future(anext(updates))
        await until(lambda: source.last_error is not None)
        assert not pending.done()  # the bad edit produced no pod set
        assert str(source.last_error) == f"{path}:5: address 'oops' is not ip:port"
        assert f"{path}:5: address 'oops' is not ip:port; keeping the last 2 pods" in caplog.text

        path.write_text("pods:\n  - name: c\n    address: 10.0.0.3:8000\n")
        assert [p.name for p in await asyncio.wait_for(pending, timeout=30)] == ["c"]
        assert source.last_error is None
    finally:
        await updates.aclose()  # type: ignore[attr-defined]


async def test_a_vanished_file_keeps_the_last_set_until_it_returns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "pods.yaml"
    path.write_text("pods:\n  - name: a\n    address: 10.0.0.1:8000\n")
    updates = StaticFileDiscovery(path, poll_interval=0.02).updates()
    try:
        await next_set(updates)
        path.unlink()
        pending = asyncio.ensure_future(anext(updates))
        await until(lambda: "cannot read the pod file" in caplog.text)
        await asyncio.sleep(0.1)  # several more polls of the missing file
        assert not pending.done()
        assert caplog.text.count("cannot read the pod file") == 1  # said once, not every poll
        replacement = tmp_path / "new.yaml"
        replacement.write_text("pods:\n  - name: z\n    address: 10.0.0.9:8000\n")
        replacement.rename(path)  # an atomic swap, as editors and ConfigMaps do
        assert [p.name for p in await asyncio.wait_for(pending, timeout=30)] == ["z"]
    finally:
        await updates.aclose()  # type: ignore[attr-defined]


async def test_rewriting_the_same_pods_yields_nothing_new(tmp_path: Path) -> None:
    path = tmp_path / "pods.yaml"
    path.write_text("pods:\n  - name: a\n    address: 10.0.0.1:8000\n")
    updates = StaticFileDiscovery(path, poll_interval=0.02).updates()
    try:
        await next_set(updates)
        path.write_text("# same pods, new comment\npods:\n- {name: a, address: 10.0.0.1:8000}\n")
        pending = asyncio.ensure_future(anext(updates))
        await asyncio.sleep(0.2)
        assert not pending.done()
        pending.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pending
    finally:
        await updates.aclose()  # type: ignore[attr-defined]


async def test_a_missing_file_at_start_is_an_error(tmp_path: Path) -> None:
    updates = StaticFileDiscovery(tmp_path / "absent.yaml").updates()
    with pytest.raises(DiscoveryError, match=r"absent.yaml: cannot read the pod file"):
        await anext(updates)
