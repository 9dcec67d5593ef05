"""InferenceObjectives and InferenceModelRewrites: read, ordered by precedence, and
followed from the wire-level fake API server beside the InferencePool they name."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from policyd.pool.inference_objects import (
    NO_OBJECTS,
    InferenceObjects,
    combine,
    objective_of,
    rules_of,
)
from policyd.pool.kubernetes_discovery import KubernetesDiscovery, KubernetesOptions

from .fake_kube_apiserver import OBJECT_GROUPS, FakeKubeApiServer
from .test_inference_pool_discovery import POOL, pod, pool
from .test_kubernetes_discovery import NAMESPACE, TOKEN, kubeconfig, until

NEW, LEGACY = OBJECT_GROUPS
OBJECTIVES = f"{NEW}/inferenceobjectives"
REWRITES = f"{NEW}/inferencemodelrewrites"


def rewrite(name: str, *rules: dict[str, Any], created: str = "2026-01-01T00:00:00Z") -> Any:
    obj = {
        "metadata": {"name": name, "creationTimestamp": created},
        "spec": {"poolRef": {"name": POOL}, "rules": list(rules)},
    }
    read = rules_of(obj, POOL)
    assert read is not None
    return read


def rule(targets: dict[str, int | None], *models: str) -> dict[str, Any]:
    return {
        "matches": [{"model": {"type": "Exact", "value": m}} for m in models],
        "targets": [
            {"modelRewrite": t} if w is None else {"modelRewrite": t, "weight": w}
            for t, w in targets.items()
        ],
    }


def always(value: float) -> Callable[[], float]:
    return lambda: value


# -- reading and precedence -----------------------------------------------------------------


def test_a_rule_naming_the_model_wins_then_the_oldest_object_then_list_order() -> None:
    objects = combine(
        {},
        {
            "young": rewrite("young", rule({"y": None}, "m"), created="2026-03-01T00:00:00Z"),
            "old": rewrite(
                "old",
                rule({"generic-old": None}),
                rule({"o1": None}, "m"),
                rule({"o2": None}, "m", "n"),
                created="2026-01-01T00:00:00Z",
            ),
            "generic": rewrite("generic", rule({"g": None}), created="2025-06-01T00:00:00Z"),
        },
    )
    assert objects.rewrite("m", always(0.5)) == "o1"  # exact, oldest object, first rule
    assert objects.rewrite("n", always(0.5)) == "o2"
    assert objects.rewrite("other", always(0.5)) == "g"  # the oldest rule for every model
    assert combine({}, {}).rewrite("m", always(0.5)) is None


def test_weights_split_in_proportion_and_unweighted_targets_only_without_weights() -> None:
    split = combine({}, {"s": rewrite("s", rule({"a": 1, "b": 3}, "m"))})
    assert [split.rewrite("m", always(d)) for d in (0.0, 0.24, 0.25, 0.99)] == ["a", "a", "b", "b"]
    mixed = combine({}, {"s": rewrite("s", rule({"a": None, "b": 5}, "m"))})
    assert {mixed.rewrite("m", always(d)) for d in (0.0, 0.5, 0.99)} == {"b"}
    even = combine({}, {"s": rewrite("s", rule({"a": None, "b": None}, "m"))})
    assert [even.rewrite("m", always(d)) for d in (0.0, 0.49, 0.5, 0.99)] == ["a", "a", "b", "b"]


def test_an_objective_gives_its_priority_unset_is_zero_another_pools_is_ignored() -> None:
    def objective(spec: dict[str, Any]) -> tuple[str, int] | None:
        return objective_of({"metadata": {"name": "o"}, "spec": spec}, POOL)

    assert objective({"poolRef": {"name": POOL}, "priority": -3}) == ("o", -3)
    assert objective({"poolRef": {"name": POOL}}) == ("o", 0)
    assert objective({"poolRef": {"name": "other"}, "priority": 5}) is None
    other_group = {"name": POOL, "group": "example.com"}
    assert objective({"poolRef": other_group, "priority": 5}) is None


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ({"poolRef": {"name": POOL}, "priority": "high"}, "spec.priority is not an integer"),
        ({"priority": 1}, "spec.poolRef is missing"),
    ],
)
def test_an_objective_policyd_cannot_use_says_why(spec: dict[str, Any], said: str) -> None:
    with pytest.raises(ValueError, match=said):
        objective_of({"metadata": {"name": "o"}, "spec": spec}, POOL)


@pytest.mark.parametrize(
    ("rules", "said"),
    [
        ([], "spec.rules is missing or empty"),
        ([{"targets": []}], r"spec.rules\[0\].targets is missing or empty"),
        ([rule({"a": 0}, "m")], r"spec.rules\[0\].targets\[0\].weight is not an integer"),
        (
            [
                {
                    "matches": [{"model": {"type": "Prefix", "value": "m"}}],
                    "targets": [{"modelRewrite": "a"}],
                }
            ],
            "is not Exact",
        ),
        ([{"targets": [{"weight": 1}]}], r"targets\[0\].modelRewrite is not a model name"),
    ],
)
def test_a_rewrite_policyd_cannot_use_says_why(rules: list[Any], said: str) -> None:
    obj = {"metadata": {"name": "r"}, "spec": {"poolRef": {"name": POOL}, "rules": rules}}
    with pytest.raises(ValueError, match=said):
        rules_of(obj, POOL)


# -- followed from the API server ----------------------------------------------------------


@pytest.fixture
async def server() -> Any:
    fake = FakeKubeApiServer(token=TOKEN)
    await fake.start()
    yield fake
    await fake.stop()


def following(tmp_path: Path, server: FakeKubeApiServer) -> KubernetesDiscovery:
    return KubernetesDiscovery(
        KubernetesOptions(
            inference_pool=POOL,
            kubeconfig=kubeconfig(tmp_path, server),
            retry_initial=0.05,
            retry_max=0.2,
            request_timeout=5.0,
        )
    )


async def settles(source: KubernetesDiscovery, check: Callable[[InferenceObjects], bool]) -> None:
    async def poll() -> None:
        while not check(source.inference_objects()):
            await asyncio.sleep(0.02)

    await asyncio.wait_for(poll(), 30)


def objective_spec(priority: int, pool_name: str = POOL) -> dict[str, Any]:
    return {
        "poolRef": {"group": "inference.networking.k8s.io", "name": pool_name},
        "priority": priority,
    }


async def test_objectives_and_rewrites_are_followed_as_they_change(
    server: FakeKubeApiServer, tmp_path: Path
) -> None:
    pod(server, "vllm-0", "10.1.0.1")
    pool(server)
    server.put_object(OBJECTIVES, "premium", objective_spec(10), namespace=NAMESPACE)
    server.put_object(OBJECTIVES, "theirs", objective_spec(7, "other-pool"), namespace=NAMESPACE)
    source = following(tmp_path, server)
    updates = source.updates()
    try:
        await until(updates, lambda pods: "vllm-0" in pods)
        await settles(source, lambda o: dict(o.priorities) == {"premium": 10})
        server.put_object(OBJECTIVES, "batch", objective_spec(-1), namespace=NAMESPACE)
        server.put_object(
            REWRITES,
            "alias",
            {"poolRef": {"name": POOL}, "rules": [rule({"v2": None}, "m")]},
            namespace=NAMESPACE,
        )
        await settles(
            source, lambda o: o.rewrite("m", always(0)) == "v2" and "batch" in o.priorities
        )
        server.put_object(OBJECTIVES, "premium", objective_spec(3), namespace=NAMESPACE)
        server.delete_object(REWRITES, "alias", namespace=NAMESPACE)
        await settles(
            source, lambda o: o.priorities.get("premium") == 3 and o.rewrite("m", always(0)) is None
        )
    finally:
        await updates.aclose()  # type: ignore[attr-defined]
    assert server.watches(OBJECTIVES) and server.watches(REWRITES)


async def test_the_legacy_group_is_followed_where_the_new_one_is_not_served(
    server: FakeKubeApiServer, tmp_path: Path
) -> None:
    server.serve_object_groups = {LEGACY}
    pod(server, "vllm-0", "10.1.0.1")
    pool(server)
    server.put_object(
        f"{LEGACY}/inferenceobjectives", "premium", objective_spec(10), namespace=NAMESPACE
    )
    source = following(tmp_path, server)
    updates = source.updates()
    try:
        await until(updates, lambda pods: "vllm-0" in pods)
        await settles(source, lambda o: dict(o.priorities) == {"premium": 10})
    finally:
        await updates.aclose()  # type: ignore[attr-defined]


async def test_without_the_crds_or_the_right_to_list_them_pods_are_still_followed(
    server: FakeKubeApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server.serve_object_groups = set()
    server.forbidden_resources = {REWRITES}
    pod(server, "vllm-0", "10.1.0.1")
    pool(server)
    source = following(tmp_path, server)
    updates = source.updates()
    with caplog.at_level(logging.INFO, logger="policyd.pool.inference_objects"):
        try:
            await until(updates, lambda pods: "vllm-0" in pods)
            server.serve_object_groups = {NEW}  # the CRDs installed later are found
            server.put_object(OBJECTIVES, "premium", objective_spec(10), namespace=NAMESPACE)
            await settles(source, lambda o: dict(o.priorities) == {"premium": 10})
            pod(server, "vllm-1", "10.1.0.2")
            await until(updates, lambda pods: "vllm-1" in pods)
        finally:
            await updates.aclose()  # type: ignore[attr-defined]
    assert source.inference_objects().rewrite("m", always(0)) is None
    assert "inferenceobjectives watch: not served in llm-d.ai/v1alpha2 or " in caplog.text
    assert "HTTP 403" in caplog.text and "routing goes on without them" in caplog.text


def test_a_source_without_a_pool_has_no_objects() -> None:
    options = KubernetesOptions(selector="app=vllm")
    assert KubernetesDiscovery(options).inference_objects() is NO_OBJECTS
