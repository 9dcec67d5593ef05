"""The Helm chart istio/helm/policyd, with the real ``helm`` and a real API server.

- ``helm lint --strict`` and ``helm template`` are clean for several values sets
  of both modes (defaults, with mutual TLS; TLS off, HPA on, ServiceMonitor
  on, all of them; the InferencePool mode alone, without TLS, with several
  target ports, following a pool made elsewhere), and ``values.schema.json``
  refuses a mode other than ``envoyfilter`` and ``inferencepool``;
- drift: by default the chart renders what the kustomize manifests of istio/
  hold (the Deployment's arguments, ports, probes; the RBAC rules; the
  NetworkPolicy; the EnvoyFilter's patches; the VirtualService and Gateway; the
  policy), and with ``mode=inferencepool`` those of istio/inferencepool/ (the
  InferencePool, HTTPRoute, Gateway API Gateway, the Role naming the pool), so
  the paths cannot part silently;
- every rendered object of every values set passes a server-side dry run with
  strict field validation (``POST ?dryRun=All&fieldValidation=Strict``) on the
  real kube-apiserver of ``kube_cluster.py``, with Istio's CRDs (from
  ``istioctl manifest generate``), the real Gateway API and InferencePool CRDs
  (``crds.py``) and, for the ServiceMonitor, a minimal CRD
  written here (``MINIMAL_SERVICEMONITOR_CRD``: the prometheus-operator CRD is
  not obtainable offline; it declares only the fields the chart sets, with
  their upstream names and types, so a misspelt one is still refused).
"""

from __future__ import annotations

import copy
import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from crds import gateway_api_crds, inference_extension_crds
from kube_cluster import Cluster, start_cluster, stop_cluster

from policyd.extproc.envoy_process import free_port
from policyd.pool.inference_objects import GROUPS, OBJECTIVES, REWRITES

ROOT = Path(__file__).resolve().parents[2]
ISTIO = ROOT / "istio"
CHART = ISTIO / "helm" / "policyd"
NAMESPACE = "inference"  # istio/kustomization.yaml's
POOL_MODE = ["--set", "mode=inferencepool"]

VALUE_SETS: dict[str, list[str]] = {
    "defaults": [],
    "plaintext": ["--set", "tls.enabled=false"],
    "hpa": ["--set", "autoscaling.enabled=true"],
    "servicemonitor": ["--set", "serviceMonitor.enabled=true"],
    "everything": [
        "--set",
        "tls.enabled=true",
        "--set",
        "autoscaling.enabled=true",
        "--set",
        "serviceMonitor.enabled=true",
    ],
    "extensions": [
        "--set",
        "podLabels.team=inference",
        "--set",
        "podAnnotations.example\\.com/owner=ml",
        "--set",
        "priorityClassName=system-cluster-critical",
        "--set-json",
        'topologySpreadConstraints=[{"maxSkew":1,"topologyKey":"kubernetes.io/hostname","whenUnsatisfiable":"ScheduleAnyway","labelSelector":{"matchLabels":{"app.kubernetes.io/name":"policyd"}}}]',
        "--set-json",
        'affinity={"podAntiAffinity":{"preferredDuringSchedulingIgnoredDuringExecution":[{"weight":100,"podAffinityTerm":{"topologyKey":"kubernetes.io/hostname","labelSelector":{"matchLabels":{"app.kubernetes.io/name":"policyd"}}}}]}}',
        "--set-json",
        'extraVolumes=[{"name":"decision-log","emptyDir":{}}]',
        "--set-json",
        'extraVolumeMounts=[{"name":"decision-log","mountPath":"/var/log/policyd"}]',
        "--set",
        "serve.workers=3",
        "--set",
        "serviceMonitor.enabled=true",
    ],
    "openshift": [
        "--set",
        "podSecurityContext.runAsUser=null",
        "--set",
        "podSecurityContext.runAsGroup=null",
    ],
    "precise": [
        "--set",
        "prefix.index=precise",
        "--set",
        "prefix.tokenizer=hf:/etc/policyd/tokenizer",
    ],
    "inferencepool": POOL_MODE,
    "inferencepool-plaintext": [*POOL_MODE, "--set", "tls.enabled=false"],
    "inferencepool-ranks": [*POOL_MODE, "--set", "inferencePool.targetPorts={8000,8001,8002}"],
    "inferencepool-elsewhere": [
        *POOL_MODE,
        "--set",
        "inferencePool.create=false",
        "--set",
        "inferencePool.httpRoute.create=false",
        "--set",
        "gateway.create=false",
    ],
}

MINIMAL_SERVICEMONITOR_CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "servicemonitors.monitoring.coreos.com"},
    "spec": {
        "group": "monitoring.coreos.com",
        "names": {
            "kind": "ServiceMonitor",
            "listKind": "ServiceMonitorList",
            "plural": "servicemonitors",
            "singular": "servicemonitor",
        },
        "scope": "Namespaced",
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "required": ["selector"],
                                "properties": {
                                    "selector": {
                                        "type": "object",
                                        "properties": {
                                            "matchLabels": {
                                                "type": "object",
                                                "additionalProperties": {"type": "string"},
                                            }
                                        },
                                    },
                                    "endpoints": {
                                        "type": "array",
                                        "items": {
                                            "type": "object",
                                            "properties": {
                                                "port": {"type": "string"},
                                                "path": {"type": "string"},
                                                "interval": {"type": "string"},
                                            },
                                        },
                                    },
                                },
                            }
                        },
                    }
                },
            }
        ],
    },
}


def documents(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def helm(tool: Callable[[str], str], *arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("helm"), *arguments], capture_output=True, text=True, timeout=120, check=False
    )


def render(tool: Callable[[str], str], values: list[str]) -> list[dict[str, Any]]:
    rendered = helm(tool, "template", "policyd", str(CHART), "-n", NAMESPACE, *values)
    assert rendered.returncode == 0, rendered.stderr
    return documents(rendered.stdout)


def by_kind(objects: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def kustomize_objects(folder: Path = ISTIO) -> dict[tuple[str, str], dict[str, Any]]:
    """istio/*.yaml (or istio/inferencepool/*.yaml) as ``kustomize build`` makes them:
    the namespace the replacements put into the EnvoyFilter, and the image of ``images:``."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    objects = []
    for name in kustomization["resources"]:
        text = (folder / name).read_text().replace(".NAMESPACE.", f".{NAMESPACE}.")
        objects.extend(documents(text))
    (image,) = kustomization["images"]
    for o in objects:
        if o["kind"] == "Deployment":
            for container in o["spec"]["template"]["spec"]["containers"]:
                if container["image"] == image["name"]:
                    container["image"] = f"{image['newName']}:{image['newTag']}"
    return by_kind(objects)


@pytest.fixture(scope="module")
def defaults(tool: Callable[[str], str]) -> dict[tuple[str, str], dict[str, Any]]:
    return by_kind(render(tool, []))


# --- helm lint, helm template ---------------------------------------------------------


@pytest.mark.parametrize("name", VALUE_SETS)
def test_helm_lint_strict_is_clean(tool: Callable[[str], str], name: str) -> None:
    linted = helm(tool, "lint", "--strict", str(CHART), *VALUE_SETS[name])
    output = linted.stdout + linted.stderr
    assert linted.returncode == 0, output
    assert "0 chart(s) failed" in output
    assert "[WARNING]" not in output and "[ERROR]" not in output, output


@pytest.mark.parametrize("name", VALUE_SETS)
def test_helm_template_renders(tool: Callable[[str], str], name: str) -> None:
    rendered = helm(tool, "template", "policyd", str(CHART), "-n", NAMESPACE, *VALUE_SETS[name])
    assert rendered.returncode == 0, rendered.stderr
    assert rendered.stderr == "", rendered.stderr
    kinds = {d["kind"] for d in documents(rendered.stdout)}
    assert {"Deployment", "Service", "Role", "NetworkPolicy"} <= kinds
    if name.startswith("inferencepool"):
        assert "VirtualService" not in kinds
        assert "EnvoyFilter" in kinds  # the gateway's edge only
        if name != "inferencepool-elsewhere":
            assert {"InferencePool", "HTTPRoute", "Gateway"} <= kinds
    else:
        assert {"EnvoyFilter", "VirtualService"} <= kinds
        assert not kinds & {"InferencePool", "HTTPRoute"}


def test_the_schema_accepts_the_two_modes_only(tool: Callable[[str], str]) -> None:
    for mode in ("InferencePool", "inferencePool", "gatewayapi", ""):
        refused = helm(tool, "template", "policyd", str(CHART), "--set-string", f"mode={mode}")
        assert refused.returncode != 0
        assert "/mode" in refused.stderr and "inferencepool" in refused.stderr, refused.stderr
    unknown = helm(tool, "template", "policyd", str(CHART), "--set", "tls.enable=true")
    assert unknown.returncode != 0 and "enable" in unknown.stderr  # a misspelt value
    for wrong in (
        "inferencePool.targetPorts={8000,8000}",
        "inferencePool.failureMode=FailSafe",
        "inferencePool.name=Not_A_Name",
        "inferencePool.selectors.app=vllm",
    ):
        refused = helm(tool, "template", "policyd", str(CHART), *POOL_MODE, "--set", wrong)
        assert refused.returncode != 0, wrong
        assert "inferencePool" in refused.stderr, refused.stderr


def test_the_value_sets_change_what_they_say(tool: Callable[[str], str]) -> None:
    tls = by_kind(render(tool, VALUE_SETS["defaults"]))  # mutual TLS by default
    container = tls["Deployment", "policyd"]["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][-3:] == [
        "--tls-cert=/etc/policyd/tls/tls.crt",
        "--tls-key=/etc/policyd/tls/tls.key",
        "--tls-client-ca=/etc/policyd/tls/ca.crt",
    ]
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "monitoring"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "monitoring"}
    assert "grpc" not in container["readinessProbe"] and "grpc" not in container["livenessProbe"]
    volumes = tls["Deployment", "policyd"]["spec"]["template"]["spec"]["volumes"]
    assert {"name": "tls", "secret": {"secretName": "policyd-tls"}} in volumes
    cluster = tls["EnvoyFilter", "policyd"]["spec"]["configPatches"][2]["patch"]["value"]
    socket = cluster["transport_socket"]["typed_config"]
    assert socket["common_tls_context"]["alpn_protocols"] == ["h2"]
    assert socket["sni"] == f"policyd.{NAMESPACE}.svc"

    plaintext = by_kind(render(tool, VALUE_SETS["plaintext"]))
    container = plaintext["Deployment", "policyd"]["spec"]["template"]["spec"]["containers"][0]
    assert not [a for a in container["args"] if a.startswith("--tls-")]
    assert container["readinessProbe"]["grpc"] == {"port": 9002, "service": "readiness"}
    cluster = plaintext["EnvoyFilter", "policyd"]["spec"]["configPatches"][2]["patch"]["value"]
    assert "transport_socket" not in cluster

    hpa = by_kind(render(tool, VALUE_SETS["hpa"]))
    assert "replicas" not in hpa["Deployment", "policyd"]["spec"]
    target = hpa["HorizontalPodAutoscaler", "policyd"]["spec"]["scaleTargetRef"]
    assert target == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "policyd"}

    monitored = by_kind(render(tool, VALUE_SETS["servicemonitor"]))
    metrics = monitored["Service", "policyd-metrics"]
    monitor = monitored["ServiceMonitor", "policyd"]
    assert metrics["spec"]["ports"][0]["name"] == monitor["spec"]["endpoints"][0]["port"]
    labels = metrics["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_the_edge_values_change_the_header_removal_and_the_timeout(
    tool: Callable[[str], str],
) -> None:
    """A header of envoyFilter.trustedClientHeaders is kept (a trusted proxy in front
    sets it); the others of stripClientHeaders are still removed."""
    values = [
        "--set",
        "envoyFilter.trustedClientHeaders={x-tenant}",
        "--set",
        "envoyFilter.requestTimeout=200s",
    ]
    patches = by_kind(render(tool, values))["EnvoyFilter", "policyd"]["spec"]["configPatches"]
    (manager,) = [p for p in patches if p["applyTo"] == "NETWORK_FILTER"]
    typed = manager["patch"]["value"]["typed_config"]
    (mutation,) = typed["early_header_mutation_extensions"]
    assert [m["remove"] for m in mutation["typed_config"]["mutations"]] == [
        "x-gateway-destination-endpoint",
        "x-prefiller-host-port",
        "x-gateway-inference-criticality",
        "x-llm-d-inference-objective",
        "x-gateway-inference-objective",
        "x-llm-d-inference-fairness-id",
        "x-gateway-inference-fairness-id",
        "x-request-deadline-ms",
    ]
    assert typed["request_timeout"] == "200s"


@pytest.mark.parametrize("mode", ["envoyfilter", "inferencepool"])
def test_a_renamed_prefill_header_is_the_one_policyd_sets_and_the_edge_removes(
    tool: Callable[[str], str], mode: str
) -> None:
    """The P/D header's name is one value: policyd names the prefill pod in it, and
    the gateway removes a client's copy of it, not of the default name."""
    values = [
        "--set",
        f"mode={mode}",
        "--set",
        "serve.prefillHeader=x-prefill-from",
        "--set",
        "serve.roleLabel=example.com/pd-role",
    ]
    objects = by_kind(render(tool, values))
    args = objects["Deployment", "policyd"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--prefill-header=x-prefill-from" in args
    assert "--role-label=example.com/pd-role" in args
    removed = [
        m["remove"]
        for filter_ in (o for k, o in objects.items() if k[0] == "EnvoyFilter")
        for patch in filter_["spec"]["configPatches"]
        if patch["applyTo"] == "NETWORK_FILTER"
        for extension in patch["patch"]["value"]["typed_config"]["early_header_mutation_extensions"]
        for m in extension["typed_config"]["mutations"]
    ]
    assert "x-prefill-from" in removed and "x-prefiller-host-port" not in removed

    refused = helm(
        tool, "template", "policyd", str(CHART), "--set",
        "serve.prefillHeader=x-gateway-destination-endpoint",
    )  # fmt: skip
    assert refused.returncode != 0 and "prefillHeader" in refused.stderr


def test_the_inferencepool_mode_changes_what_it_says(tool: Callable[[str], str]) -> None:
    pool = by_kind(render(tool, VALUE_SETS["inferencepool"]))
    args = pool["Deployment", "policyd"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--inference-pool=vllm" in args
    assert not [a for a in args if a.startswith(("--k8s-selector", "--k8s-target-port"))]
    assert "clusterIP" not in pool["Service", "policyd"]["spec"]  # the gateways need one
    picker = pool["InferencePool", "vllm"]["spec"]["endpointPickerRef"]
    assert picker == {"name": "policyd", "port": {"number": 9002}, "failureMode": "FailClose"}

    ranks = by_kind(render(tool, VALUE_SETS["inferencepool-ranks"]))
    ports = ranks["InferencePool", "vllm"]["spec"]["targetPorts"]
    assert ports == [{"number": 8000}, {"number": 8001}, {"number": 8002}]

    tls = by_kind(render(tool, VALUE_SETS["inferencepool"]))  # mutual TLS by default
    assert ("DestinationRule", "policyd") not in by_kind(
        render(tool, VALUE_SETS["inferencepool-plaintext"])
    )
    rule = tls["DestinationRule", "policyd"]["spec"]
    assert rule["host"] == f"policyd.{NAMESPACE}.svc.cluster.local"
    assert rule["trafficPolicy"]["tls"]["mode"] == "MUTUAL"
    assert rule["trafficPolicy"]["tls"]["sni"] == f"policyd.{NAMESPACE}.svc"
    container = tls["Deployment", "policyd"]["spec"]["template"]["spec"]["containers"][0]
    assert "--tls-client-ca=/etc/policyd/tls/ca.crt" in container["args"]

    elsewhere = by_kind(render(tool, VALUE_SETS["inferencepool-elsewhere"]))
    role = elsewhere["Role", "policyd-inference-pool-reader"]
    assert role["rules"][0]["resourceNames"] == ["vllm"]  # the pool it follows, made elsewhere
    assert role["rules"][1] == {  # its objectives and rewrites (policyd.pool.inference_objects)
        "apiGroups": list(GROUPS),
        "resources": [OBJECTIVES, REWRITES],
        "verbs": ["list", "watch"],
    }
    assert not {k for k, _ in elsewhere} & {"InferencePool", "HTTPRoute", "Gateway"}


def test_tracing_samples_one_request_in_ten_by_default(
    defaults: dict[tuple[str, str], dict[str, Any]],
) -> None:
    container = defaults["Deployment", "policyd"]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio"
    assert env["OTEL_TRACES_SAMPLER_ARG"] == "0.1"


# --- drift from the kustomize manifests ------------------------------------------------


def test_the_chart_renders_every_object_of_the_kustomization(
    defaults: dict[tuple[str, str], dict[str, Any]],
) -> None:
    assert set(kustomize_objects()) <= set(defaults)
    extra = set(defaults) - set(kustomize_objects())
    assert extra == {("PodDisruptionBudget", "policyd")}


def test_the_deployment_does_not_drift(defaults: dict[tuple[str, str], dict[str, Any]]) -> None:
    kustomized = kustomize_objects()["Deployment", "policyd"]
    chart = defaults["Deployment", "policyd"]
    assert chart["spec"]["replicas"] == kustomized["spec"]["replicas"]
    pod, kpod = chart["spec"]["template"]["spec"], kustomized["spec"]["template"]["spec"]
    for key in kpod:
        if key != "containers":
            assert pod[key] == kpod[key], key
    (container,), (kcontainer,) = pod["containers"], kpod["containers"]
    for key in kcontainer:
        if key != "env":
            assert container[key] == kcontainer[key], key
    # the chart adds only the sampler (docs/observability.md's recommendation)
    added = [e for e in container["env"] if e not in kcontainer["env"]]
    assert [e["name"] for e in added] == ["OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG"]
    annotations = chart["spec"]["template"]["metadata"]["annotations"]
    assert kustomized["spec"]["template"]["metadata"]["annotations"].items() <= annotations.items()


@pytest.mark.parametrize(
    ("kind", "name"),
    [
        ("Role", "policyd-pod-reader"),
        ("Service", "policyd"),
        ("EnvoyFilter", "policyd"),
        ("VirtualService", "inference"),
        ("Gateway", "inference-gateway"),
        ("ConfigMap", "policyd-policy"),
    ],
)
def test_the_object_does_not_drift(
    defaults: dict[tuple[str, str], dict[str, Any]], kind: str, name: str
) -> None:
    kustomized = copy.deepcopy(kustomize_objects()[kind, name])
    chart = copy.deepcopy(defaults[kind, name])
    if kind == "Service":  # the chart's selector adds app.kubernetes.io/instance
        selector, kselector = chart["spec"].pop("selector"), kustomized["spec"].pop("selector")
        assert kselector.items() <= selector.items()
    for field in ("spec", "rules", "data"):
        assert chart.get(field) == kustomized.get(field), field


def test_the_rolebinding_and_networkpolicy_do_not_drift(
    defaults: dict[tuple[str, str], dict[str, Any]],
) -> None:
    kustomized, chart = kustomize_objects(), defaults
    binding, kbinding = (o["RoleBinding", "policyd-pod-reader"] for o in (chart, kustomized))
    assert binding["roleRef"] == kbinding["roleRef"]
    # kustomize's `namespace:` fills in the subject's namespace
    assert binding["subjects"] == [{**s, "namespace": NAMESPACE} for s in kbinding["subjects"]]
    policy, kpolicy = (o["NetworkPolicy", "policyd"]["spec"] for o in (chart, kustomized))
    assert policy["ingress"] == kpolicy["ingress"]
    assert policy["policyTypes"] == kpolicy["policyTypes"]
    # the chart's selector adds app.kubernetes.io/instance (one release's pods)
    selector = policy["podSelector"]["matchLabels"]
    assert kpolicy["podSelector"]["matchLabels"].items() <= selector.items()
    deployment = chart["Deployment", "policyd"]
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert deployment["spec"]["selector"]["matchLabels"] == selector
    assert chart["Service", "policyd"]["spec"]["selector"] == selector


def test_the_inferencepool_mode_renders_istio_inferencepool(tool: Callable[[str], str]) -> None:
    """Drift from the kustomize manifests of istio/inferencepool/ (the chart adds
    its labels, the PodDisruptionBudget and the trace sampler, as in the other mode)."""
    chart = by_kind(render(tool, VALUE_SETS["inferencepool"]))
    kustomized = kustomize_objects(ISTIO / "inferencepool")
    assert set(kustomized) <= set(chart)
    assert set(chart) - set(kustomized) == {("PodDisruptionBudget", "policyd")}
    for kind, name in (
        ("InferencePool", "vllm"),
        ("HTTPRoute", "inference"),
        ("Gateway", "inference-gateway"),
        ("Role", "policyd-inference-pool-reader"),
        ("ConfigMap", "policyd-policy"),
        ("EnvoyFilter", "policyd"),
        ("DestinationRule", "policyd"),
    ):
        for field in ("spec", "rules", "data"):
            assert chart[kind, name].get(field) == kustomized[kind, name].get(field), (kind, field)
    service, kservice = (
        chart["Service", "policyd"]["spec"],
        kustomized["Service", "policyd"]["spec"],
    )
    assert service["ports"] == kservice["ports"] and "clusterIP" not in service
    policy, kpolicy = (o["NetworkPolicy", "policyd"]["spec"] for o in (chart, kustomized))
    assert policy["ingress"] == kpolicy["ingress"]
    container = chart["Deployment", "policyd"]["spec"]["template"]["spec"]["containers"][0]
    kcontainer = kustomized["Deployment", "policyd"]["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == kcontainer["args"]


def test_the_drift_check_would_catch_a_changed_argument(tool: Callable[[str], str]) -> None:
    changed = by_kind(render(tool, ["--set", "serve.workers=2"]))
    args = changed["Deployment", "policyd"]["spec"]["template"]["spec"]["containers"][0]["args"]
    kustomized = kustomize_objects()["Deployment", "policyd"]
    assert args != kustomized["spec"]["template"]["spec"]["containers"][0]["args"]


# --- strict server-side dry run ---------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(
    tool: Callable[[str], str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    binaries = tool("etcd"), tool("kube-apiserver"), tool("openssl")
    istioctl = tool("istioctl")
    running = start_cluster(*binaries, tmp_path_factory.mktemp("cluster"))
    try:
        generated = subprocess.run(
            [istioctl, "manifest", "generate"],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        crds = [d for d in documents(generated.stdout) if d["kind"] == "CustomResourceDefinition"]
        assert crds
        crds += [*gateway_api_crds(), *inference_extension_crds()]
        for crd in [*crds, MINIMAL_SERVICEMONITOR_CRD]:
            status, message = running.apply(crd, dry_run=False)
            assert status in (200, 201), message
        namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
        status, message = running.apply(namespace, dry_run=False)
        assert status in (200, 201), message
        yield running
    finally:
        stop_cluster(running)


@pytest.mark.parametrize("name", VALUE_SETS)
def test_the_api_server_accepts_every_rendered_object(
    cluster: Cluster, tool: Callable[[str], str], name: str
) -> None:
    results = []
    for document in render(tool, VALUE_SETS[name]):
        status, message = cluster.create_when_served(document, NAMESPACE)
        results.append((f"{document['kind']}/{document['metadata']['name']}", status, message))
    assert results
    assert all(status == 201 for _, status, _ in results), results


def test_the_strict_dry_run_would_catch_a_misspelt_field(
    cluster: Cluster, tool: Callable[[str], str]
) -> None:
    """The dry runs above are not vacuous, for a built-in kind and for each CRD."""
    objects = by_kind(render(tool, VALUE_SETS["everything"]))
    deployment = copy.deepcopy(objects["Deployment", "policyd"])
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinessProbe"]["httpGet"]["paths"] = container["readinessProbe"]["httpGet"].pop(
        "path"
    )
    envoyfilter = copy.deepcopy(objects["EnvoyFilter", "policyd"])
    envoyfilter["spec"]["workloadSelectors"] = envoyfilter["spec"].pop("workloadSelector")
    monitor = copy.deepcopy(objects["ServiceMonitor", "policyd"])
    monitor["spec"]["endpoints"][0]["intervall"] = monitor["spec"]["endpoints"][0].pop("interval")
    pools = by_kind(render(tool, VALUE_SETS["inferencepool"]))
    pool = copy.deepcopy(pools["InferencePool", "vllm"])
    pool["spec"]["targetPort"] = pool["spec"].pop("targetPorts")
    rule = copy.deepcopy(pools["DestinationRule", "policyd"])
    rule["spec"]["trafficPolicy"]["tls"]["sniHost"] = rule["spec"]["trafficPolicy"]["tls"].pop(
        "sni"
    )
    for document in (deployment, envoyfilter, monitor, pool, rule):
        status, message = cluster.create_when_served(document, NAMESPACE)
        assert status >= 400, (document["kind"], status, message)
        assert "unknown field" in message or "not declared in schema" in message, message


# --- extension points, shown by their effect ------------------------------------------


def pod_spec(objects: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = objects["Deployment", "policyd"]["spec"]["template"]["spec"]
    return spec


def test_the_extension_values_reach_the_pod(tool: Callable[[str], str]) -> None:
    objects = by_kind(render(tool, VALUE_SETS["extensions"]))
    deployment = objects["Deployment", "policyd"]
    template = deployment["spec"]["template"]
    assert template["metadata"]["labels"]["team"] == "inference"
    assert "team" not in deployment["spec"]["selector"]["matchLabels"]  # the selector is fixed
    assert template["metadata"]["annotations"]["example.com/owner"] == "ml"
    pod = template["spec"]
    assert pod["priorityClassName"] == "system-cluster-critical"
    (spread,) = pod["topologySpreadConstraints"]
    # the documented label selector matches the chart's own pods
    assert spread["labelSelector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    assert "podAntiAffinity" in pod["affinity"]
    assert {"name": "decision-log", "emptyDir": {}} in pod["volumes"]
    mounts = pod["containers"][0]["volumeMounts"]
    assert {"name": "decision-log", "mountPath": "/var/log/policyd"} in mounts
    assert {m["name"] for m in mounts} == {"policy", "tls", "decision-log"}  # the chart's stay


def test_openshift_leaves_the_uid_to_the_platform(tool: Callable[[str], str]) -> None:
    default = pod_spec(by_kind(render(tool, [])))["securityContext"]
    assert (default["runAsUser"], default["runAsGroup"]) == (65532, 65532)  # the image's user
    assigned = pod_spec(by_kind(render(tool, VALUE_SETS["openshift"])))["securityContext"]
    assert "runAsUser" not in assigned and "runAsGroup" not in assigned
    assert assigned["runAsNonRoot"] is True
    assert assigned["seccompProfile"] == {"type": "RuntimeDefault"}


def readme_example() -> str:
    """The values example of the chart's README ("A tokenizer and a decision log")."""
    text = (CHART / "README.md").read_text()
    start = text.index("```yaml\n", text.index("**A tokenizer and a decision log")) + len(
        "```yaml\n"
    )
    return text[start : text.index("```", start)]


def test_the_readme_example_gives_the_tokenizer_and_the_log_their_volumes(
    tool: Callable[[str], str], tmp_path: Path
) -> None:
    """The decision log's directory is a writable emptyDir on the read-only root file
    system, and the tokenizer's path lies in a volume of its own."""
    values = tmp_path / "values.yaml"
    values.write_text(readme_example())
    pod = pod_spec(by_kind(render(tool, ["-f", str(values)])))
    (container,) = pod["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    args = container["args"]
    (log,) = [a.split("=", 1)[1] for a in args if a.startswith("--decision-log=")]
    (tokenizer,) = [a.split(":", 1)[1] for a in args if a.startswith("--prefix-tokenizer=hf:")]
    volumes = {v["name"]: v for v in pod["volumes"]}

    def mount_of(path: str) -> dict[str, Any]:
        (mount,) = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")
                    or path == m["mountPath"]]  # fmt: skip
        return mount

    log_mount = mount_of(str(Path(log).parent))
    assert "emptyDir" in volumes[log_mount["name"]] and not log_mount.get("readOnly", False)
    tokenizer_mount = mount_of(tokenizer)
    assert "configMap" in volumes[tokenizer_mount["name"]]
    assert container["args"][0] == "serve"


def consecutive_free_ports(count: int) -> int:
    """A port P such that P .. P+count-1 are free now."""
    for _ in range(100):
        first = free_port()
        try:
            for offset in range(1, count):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", first + offset))
        except OSError:
            continue
        return first
    raise AssertionError("no free run of ports")


def test_the_servicemonitor_scrapes_every_worker(
    tool: Callable[[str], str], tmp_path: Path
) -> None:
    """The rendered Deployment's own arguments run (pods from a file instead of the
    Kubernetes API, no TLS); every port the ServiceMonitor names, followed through the
    metrics Service to the container port, is a worker's /metrics."""
    workers, grpc_port = 3, free_port()
    monitoring = consecutive_free_ports(workers)
    values = [
        "--set", f"serve.workers={workers}", "--set", f"serve.port={grpc_port}",
        "--set", f"serve.monitoringPort={monitoring}", "--set", "serviceMonitor.enabled=true",
        "--set", "tls.enabled=false",
    ]  # fmt: skip
    objects = by_kind(render(tool, values))
    (container,) = pod_spec(objects)["containers"]
    container_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    service_ports = {
        p["name"]: p["targetPort"] for p in objects["Service", "policyd-metrics"]["spec"]["ports"]
    }
    endpoints = objects["ServiceMonitor", "policyd"]["spec"]["endpoints"]
    scraped = [container_ports[service_ports[e["port"]]] for e in endpoints]
    assert len(scraped) == workers

    pods = tmp_path / "pods.yaml"
    pods.write_text(f"pods:\n  - {{name: vllm-0, address: '127.0.0.1:{free_port()}'}}\n")
    args = [a for a in container["args"] if not a.startswith(("--k8s-", "--policy=", "--host="))]
    args += [f"--policy={ROOT / 'rules' / 'default.yaml'}", f"--pods={pods}", "--host=127.0.0.1"]
    process = subprocess.Popen(
        [sys.executable, "-m", "policyd", *args], stderr=subprocess.PIPE, text=True
    )
    try:
        answered: set[int] = set()
        deadline = time.monotonic() + 60
        while answered != set(scraped):
            assert process.poll() is None, process.communicate()[1]
            assert time.monotonic() < deadline, f"unanswered: {set(scraped) - answered}"
            for port in set(scraped) - answered:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                        if b"policyd_decisions_total" in r.read() or r.status == 200:
                            answered.add(port)
                except OSError:
                    pass
            time.sleep(0.2)
        # nothing beyond the last worker: the ServiceMonitor names every port there is
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{monitoring + workers}/metrics", timeout=2)
    finally:
        process.terminate()
        process.communicate(timeout=30)


def test_the_httproute_gives_generations_no_route_timeout(tool: Callable[[str], str]) -> None:
    route = by_kind(render(tool, POOL_MODE))["HTTPRoute", "inference"]["spec"]["rules"][0]
    assert route["timeouts"] == {"request": "0s"}
    changed = by_kind(
        render(tool, [*POOL_MODE, "--set", "inferencePool.httpRoute.requestTimeout=1h"])
    )
    assert changed["HTTPRoute", "inference"]["spec"]["rules"][0]["timeouts"] == {"request": "1h"}
    refused = helm(tool, "template", "policyd", str(CHART), *POOL_MODE, "--set",
                   "inferencePool.httpRoute.requestTimeout=600")  # fmt: skip
    assert refused.returncode != 0 and "requestTimeout" in refused.stderr


def test_the_schema_refuses_a_misspelt_extension_value(tool: Callable[[str], str]) -> None:
    for wrong in ("podLabel.team=x", "extraVolume[0].name=x", "podSecurityContext.runAsUser=0"):
        refused = helm(tool, "template", "policyd", str(CHART), "--set", wrong)
        assert refused.returncode != 0, wrong


# --- precise prefix mode, for several replicas ---------------------------------------------


def test_the_schema_refuses_precise_mode_without_the_pods_tokenizer(
    tool: Callable[[str], str],
) -> None:
    for values in (
        ["--set", "prefix.index=precise"],  # estimate's pseudo-ids match no pod's blocks
        ["--set", "prefix.index=precise", "--set", "prefix.tokenizer=estimate"],
        ["--set", "prefix.index=exact"],
        ["--set", "prefix.kvEventsPort=0"],
    ):
        refused = helm(tool, "template", "policyd", str(CHART), *values)
        assert refused.returncode != 0, values
        assert "/prefix/" in refused.stderr, refused.stderr
    args = pod_spec(by_kind(render(tool, [])))["containers"][0]["args"]
    assert not [a for a in args if a.startswith(("--prefix-", "--kv-events"))]  # approximate


def _metric(port: int, name: str, pod: str) -> float | None:
    """One series of a replica's /metrics for ``pod`` (None: not there, or no answer)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            text = response.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name + "{") and f'model_server_endpoint="{pod}"' in line:
            return float(line.rpartition(" ")[2])
    return None


def test_precise_values_make_every_replica_index_the_pods_kv_events(
    tool: Callable[[str], str], tmp_path: Path
) -> None:
    """Two replicas run the rendered Deployment's own arguments (pods from a file instead
    of the Kubernetes API, no TLS) beside a simulated pod that publishes KV events on the
    chart's ports. A prompt sent to the pod directly, routed by neither replica, reaches
    both indexes: each follows the pod's events, not its own routing."""
    events = consecutive_free_ports(2)
    values = [
        "--set", "prefix.index=precise", "--set", "prefix.tokenizer=sim",
        "--set", f"prefix.kvEventsPort={events}",
        "--set", f"prefix.kvEventsReplayPort={events + 1}",
        "--set", "tls.enabled=false", "--set", "replicaCount=2",
    ]  # fmt: skip
    objects = by_kind(render(tool, values))
    assert objects["Deployment", "policyd"]["spec"]["replicas"] == 2
    (container,) = pod_spec(objects)["containers"]
    rendered = container["args"]
    assert "--prefix-index=precise" in rendered and "--prefix-tokenizer=sim" in rendered
    pod_port = free_port()
    pods = tmp_path / "pods.yaml"
    pods.write_text(f"pods:\n  - {{name: vllm-0, address: '127.0.0.1:{pod_port}'}}\n")
    kept = [
        a for a in rendered
        if not a.startswith(("--k8s-", "--policy=", "--host=", "--port=", "--monitoring-port="))
    ]  # fmt: skip
    logs = [tmp_path / name for name in ("sim.log", "policyd-0.log", "policyd-1.log")]
    commands = [
        ["sim", "--pods", "1", "--base-port", str(pod_port), "--host", "127.0.0.1",
         "--time-scale", "10", "--kv-events-port-base", str(events)],
    ]  # fmt: skip
    monitoring = [free_port(), free_port()]
    for port in monitoring:
        commands.append(
            [*kept, f"--policy={ROOT / 'rules' / 'prefix-aware.yaml'}", f"--pods={pods}",
             "--host=127.0.0.1", f"--port={free_port()}", f"--monitoring-port={port}"]
        )  # fmt: skip
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for command, log in zip(commands, logs, strict=True):
            with log.open("wb") as stderr:
                processes.append(
                    subprocess.Popen([sys.executable, "-m", "policyd", *command], stderr=stderr)
                )

        def running() -> bool:
            return all(p.poll() is None for p in processes)

        deadline = time.monotonic() + 60
        while any(_metric(p, "policyd_prefix_index_blocks", "vllm-0") is None for p in monitoring):
            assert running(), [log.read_text() for log in logs]
            assert time.monotonic() < deadline, "a replica's /metrics did not come up"
            time.sleep(0.2)
        assert all(_metric(p, "policyd_prefix_index_blocks", "vllm-0") == 0 for p in monitoring)
        body = json.dumps(
            {"model": "meta-llama/Llama-2-7b-hf", "prompt": "the pool's shared prefix " * 40,
             "max_tokens": 4}
        ).encode()  # fmt: skip
        request = urllib.request.Request(
            f"http://127.0.0.1:{pod_port}/v1/completions",
            data=body,
            headers={"content-type": "application/json"},
        )
        sent = False
        while True:
            if not sent:
                try:
                    with urllib.request.urlopen(request, timeout=10) as response:
                        sent = response.status == 200
                except OSError:
                    pass  # the pod is not up yet
            blocks = [_metric(p, "policyd_prefix_index_blocks", "vllm-0") or 0 for p in monitoring]
            if sent and min(blocks) > 0:
                break
            assert running(), [log.read_text() for log in logs]
            assert time.monotonic() < deadline + 60, f"blocks per replica: {blocks}"
            time.sleep(0.2)
        assert blocks[0] == blocks[1]  # the same events, so the same index
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.communicate(timeout=30)
