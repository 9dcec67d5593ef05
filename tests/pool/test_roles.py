"""``pod.role``: from the role label (``llm-d.ai/role`` unless configured), from every
pod source, or written out in a pod file."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from policyd.fields.roles import ROLE_LABEL, role_of
from policyd.pool import PodIdentity, parse_pod_file
from policyd.pool.datastore import Datastore
from policyd.pool.exposition import PodMetrics
from policyd.pool.kubernetes_discovery import KubernetesDiscovery, KubernetesOptions
from policyd.pool.scraper import ScrapeResult

from .fake_kube_apiserver import FakeKubeApiServer
from .test_kubernetes_discovery import NAMESPACE, TOKEN, kubeconfig


@pytest.fixture
async def server() -> Any:
    fake = FakeKubeApiServer(token=TOKEN)
    await fake.start()
    yield fake
    await fake.stop()


@pytest.mark.parametrize(
    ("value", "role"),
    [
        ("prefill", "prefill"),
        ("decode", "decode"),
        ("both", "both"),
        ("prefill-decode", "both"),  # llm-d's newer spelling of both
        ("encode-prefill-decode", "both"),
        ("encode-prefill", "prefill"),
        (" Decode ", "decode"),
        ("", "both"),
        ("encode", "encode"),  # neither stage: kept as written, for traces and policies
    ],
)
def test_the_role_label_names_a_role_as_llm_d_means_it(value: str, role: str) -> None:
    assert role_of({ROLE_LABEL: value}) == role


def test_a_pod_without_the_label_does_both() -> None:
    assert role_of({"app": "vllm"}) == "both"


def roles(identities: tuple[PodIdentity, ...], **datastore: Any) -> dict[str, str]:
    """The roles the pool publishes for these pods, once scraped."""
    store = Datastore(stale_after=5.0, **datastore)
    store.set_pods(identities)
    store.record([ScrapeResult(i.address, PodMetrics(), None, 0.001) for i in identities])
    return {pod.name: pod.role for pod in store.snapshot.candidates}


def test_the_pool_reads_the_role_label_or_the_one_configured() -> None:
    pods = (
        PodIdentity.of("p", "10.0.0.1:8000", {ROLE_LABEL: "prefill"}),
        PodIdentity.of("d", "10.0.0.2:8000", {ROLE_LABEL: "decode", "tier": "prefill"}),
        PodIdentity.of("b", "10.0.0.3:8000"),
    )
    assert roles(pods) == {"p": "prefill", "d": "decode", "b": "both"}
    assert roles(pods, role_label="tier") == {"p": "both", "d": "prefill", "b": "both"}


def test_a_pod_file_may_write_the_role_out_and_it_wins_over_the_label() -> None:
    text = (
        "pods:\n"
        "  - {name: p, address: 10.0.0.1:8000, role: Prefill}\n"
        f"  - {{name: d, address: 10.0.0.2:8000, labels: {{{ROLE_LABEL}: decode}}}}\n"
        "  - name: x\n    address: 10.0.0.3:8000\n    role: decode\n"
        f"    labels: {{{ROLE_LABEL}: prefill}}\n"
    )
    identities = parse_pod_file(text, "pods.yaml")
    assert [i.role for i in identities] == ["", "prefill", "decode"]
    assert roles(identities) == {"p": "prefill", "d": "decode", "x": "decode"}


@pytest.mark.parametrize("source", ["selector", "inference-pool"])
async def test_kubernetes_pods_take_their_role_from_their_labels(
    server: FakeKubeApiServer, tmp_path: Path, source: str
) -> None:
    server.add_pod("p", namespace=NAMESPACE, labels={"app": "vllm", ROLE_LABEL: "prefill"})
    server.add_pod("d", namespace=NAMESPACE, labels={"app": "vllm", ROLE_LABEL: "decode"})
    server.add_pod("b", namespace=NAMESPACE, labels={"app": "vllm"})
    settings: dict[str, Any] = {"kubeconfig": kubeconfig(tmp_path, server)}
    if source == "selector":
        settings["selector"] = "app=vllm"
    else:
        server.put_pool("llama", namespace=NAMESPACE, match_labels={"app": "vllm"}, ports=(8000,))
        settings["inference_pool"] = "llama"
    updates = KubernetesDiscovery(KubernetesOptions(namespace=NAMESPACE, **settings)).updates()
    try:
        identities = await asyncio.wait_for(anext(updates), 30)
    finally:
        await updates.aclose()  # type: ignore[attr-defined]
    assert roles(identities) == {"p": "prefill", "d": "decode", "b": "both"}
