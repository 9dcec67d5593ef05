"""The observability assets parse, and query only metrics policyd really exports."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry
from telemetry_support import write_policies
from test_metrics import FakePool, Snapshot, Stats, served

from policyd.policy import PolicyStore
from policyd.policy.decision import Decision, NodeTrace, Outcome
from policyd.pool.pod import Pod
from policyd.telemetry import DecisionMetrics, DecisionTelemetry, PoolCollector

ASSETS = Path(__file__).resolve().parents[2] / "telemetry"
METRIC = re.compile(r"\b(policyd_[a-zA-Z0-9_]+)\b(\{[^}]*\})?")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((ASSETS / "grafana-dashboard.json").read_text())
    return loaded


def dashboard_queries() -> Iterator[str]:
    board = dashboard()
    for panel in board["panels"]:
        for target in panel.get("targets", ()):
            yield target["expr"]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            yield variable["definition"]


def alert_rules() -> list[dict[str, Any]]:
    rules = yaml.safe_load((ASSETS / "prometheus-alerts.yaml").read_text())
    return [rule for group in rules["groups"] for rule in group["rules"]]


def exported(tmp_path: Path) -> tuple[set[str], dict[str, set[str]]]:
    """Every sample name policyd's registry exposes, and the label names seen per name."""
    metrics = DecisionMetrics()
    served(metrics, tmp_path, count=2)
    served(metrics, tmp_path, count=1, busy=True)
    DecisionTelemetry(metrics=metrics).stream_error("rejected", "invalid_json")
    failing = NodeTrace("zone", "keep", 1, (), errors=(("a", "no such key: 'zone'"),))
    metrics.decision(Decision(Outcome.SHED, "live", "1", "m", trace=(failing,)), 0.001)
    store = PolicyStore.open(write_policies(tmp_path))
    metrics.policies_loaded(store.current)
    metrics.on_reload(store.reload())
    pod = Pod("a", "10.0.0.1:8000")
    pool = FakePool(Snapshot((pod,), (pod,)), {pod.address: Stats(1, 0, 0, 0.01, 1.0)})
    metrics.registry.register(PoolCollector(pool))
    registry: CollectorRegistry = metrics.registry
    names: set[str] = set()
    labels: dict[str, set[str]] = {}
    for family in registry.collect():
        for suffix in SUFFIXES.get(family.type, ("",)):
            names.add(family.name + suffix)
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    return names, labels


def referenced(expressions: list[str]) -> Iterator[tuple[str, str, set[str]]]:
    for expression in expressions:
        for match in METRIC.finditer(expression):
            matchers = set(MATCHER.findall(match.group(2) or ""))
            yield expression, match.group(1), matchers


@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_every_queried_metric_and_label_is_exported(tmp_path: Path, source: str) -> None:
    expressions = (
        list(dashboard_queries())
        if source == "dashboard"
        else [rule["expr"] for rule in alert_rules()]
    )
    names, labels = exported(tmp_path)
    problems = []
    for expression, name, matchers in referenced(expressions):
        if name not in names:
            problems.append(f"{name} is not exported (in {expression!r})")
        elif name not in labels:
            problems.append(f"{name}: the test exercised nothing that records it")
        elif matchers - labels[name]:
            problems.append(f"{name} has no label {sorted(matchers - labels[name])}")
    assert problems == []
    assert all(METRIC.search(e) for e in expressions), "a query that reads no policyd metric"


def test_the_alerts_cover_what_operators_page_on() -> None:
    rules = {rule["alert"]: rule for rule in alert_rules()}
    assert {
        "PolicydAllPodsStale",
        "PolicydScrapePanic",
        "PolicydShedRateHigh",
        "PolicydPolicyReloadRejected",
        "PolicydDecisionLatencyHigh",
    } <= set(rules)
    for rule in rules.values():
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert rule["annotations"]["summary"]


def test_the_dashboard_is_grafana_json_with_unique_panel_ids() -> None:
    board = dashboard()
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    assert board["uid"] == "policyd-routing"
    graphs = [p for p in board["panels"] if p["type"] != "row"]
    assert all(p["targets"] and p["datasource"]["uid"] == "${datasource}" for p in graphs)


def documents(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((ASSETS / name).read_text()) if d is not None]


def jaeger_config() -> dict[str, Any]:
    """Jaeger's own configuration, from the ConfigMap in ``jaeger.yaml``."""
    config_map = next(d for d in documents("jaeger.yaml") if d["kind"] == "ConfigMap")
    (text,) = config_map["data"].values()
    loaded: dict[str, Any] = yaml.safe_load(text)
    return loaded


def test_the_kubernetes_and_istio_manifests_parse_and_fit_together() -> None:
    collector_docs = documents("otel-collector.yaml")
    config_map = next(d for d in collector_docs if d["kind"] == "ConfigMap")
    standalone = yaml.safe_load((ASSETS / "otel-collector-config.yaml").read_text())
    assert yaml.safe_load(config_map["data"]["config.yaml"]) == standalone
    pipeline = standalone["service"]["pipelines"]["traces"]
    assert pipeline["receivers"] == ["otlp"] and "otlp/jaeger" in pipeline["exporters"]

    services = {
        d["metadata"]["name"]: d for d in documents("jaeger.yaml") if d["kind"] == "Service"
    }
    jaeger_endpoint = standalone["exporters"]["otlp/jaeger"]["endpoint"]
    host, port = jaeger_endpoint.rsplit(":", 1)
    assert host.split(".")[0] in services
    assert int(port) in [p["port"] for p in services[host.split(".")[0]]["spec"]["ports"]]

    (operator,) = documents("istio-mesh-tracing.yaml")
    assert operator["kind"] == "IstioOperator"
    (provider,) = operator["spec"]["meshConfig"]["extensionProviders"]
    (telemetry,) = documents("istio-telemetry.yaml")
    assert telemetry["kind"] == "Telemetry"
    assert telemetry["apiVersion"] == "telemetry.istio.io/v1"
    assert telemetry["spec"]["tracing"][0]["providers"] == [{"name": provider["name"]}]
    collector_service = next(d for d in collector_docs if d["kind"] == "Service")
    name = collector_service["metadata"]["name"]
    namespace = collector_service["metadata"]["namespace"]
    assert provider["opentelemetry"]["service"] == f"{name}.{namespace}.svc.cluster.local"
    assert provider["opentelemetry"]["port"] == 4317


def test_jaeger_is_v2_run_by_its_own_configuration() -> None:
    docs = documents("jaeger.yaml")
    config = jaeger_config()
    (container,) = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"][
        "containers"
    ]
    # Jaeger v2 (the v1 all-in-one image and its environment variables are gone).
    image, tag = container["image"].rsplit(":", 1)
    assert image == "jaegertracing/jaeger" and tag.startswith("2.")
    assert "env" not in container
    # It reads the ConfigMap's file.
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    (key,) = config_map["data"]
    (mount,) = container["volumeMounts"]
    (volume,) = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"][
        "volumes"
    ]
    assert volume["name"] == mount["name"]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    assert container["args"] == [f"--config={mount['mountPath']}/{key}"]

    # OTLP in, into the store the query extension reads.
    service = config["service"]
    assert {"jaeger_storage", "jaeger_query"} <= set(service["extensions"])
    assert set(service["extensions"]) <= set(config["extensions"])
    traces = service["pipelines"]["traces"]
    assert traces["receivers"] == ["otlp"]
    assert traces["exporters"] == ["jaeger_storage_exporter"]
    store = config["exporters"]["jaeger_storage_exporter"]["trace_storage"]
    assert store in config["extensions"]["jaeger_storage"]["backends"]
    assert config["extensions"]["jaeger_query"]["storage"]["traces"] == store
    # Not its own query spans into that store (v2 sends them to localhost:4317 by default).
    assert config["extensions"]["jaeger_query"]["enable_tracing"] is False

    # Every port the config listens on is the container's, and the Services reach them.
    listening = {
        "otlp-grpc": config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"],
        "otlp-http": config["receivers"]["otlp"]["protocols"]["http"]["endpoint"],
        "query": config["extensions"]["jaeger_query"]["http"]["endpoint"],
        "query-grpc": config["extensions"]["jaeger_query"]["grpc"]["endpoint"],
        "health": config["extensions"]["healthcheckv2"]["http"]["endpoint"],
    }
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for name, endpoint in listening.items():
        host, port = endpoint.rsplit(":", 1)
        assert host == "0.0.0.0", f"{name} must listen beyond the pod's loopback"
        assert ports[name] == int(port)
    assert container["readinessProbe"]["httpGet"]["port"] in ports
    for service_doc in (d for d in docs if d["kind"] == "Service"):
        for port in service_doc["spec"]["ports"]:
            assert port["targetPort"] in ports


ISTIOCTL_INSTALL = re.compile(r"istioctl install((?: -f [\w./-]+)+)")
KUBECTL_APPLY = re.compile(r"kubectl apply((?: -f [\w./-]+)+)")


def documented_commands() -> Iterator[tuple[str, str, str]]:
    """(source, command, file) for every telemetry file the docs and the assets'
    comments tell to ``istioctl install -f`` or ``kubectl apply -f``."""
    sources = [ASSETS.parent / "docs" / "observability.md", ASSETS / "README.md"]
    sources += sorted(ASSETS.glob("*.yaml"))
    for source in sources:
        text = source.read_text()
        for command, pattern in (("istioctl", ISTIOCTL_INSTALL), ("kubectl", KUBECTL_APPLY)):
            for match in pattern.finditer(text):
                for path in match.group(1).split(" -f ")[1:]:
                    if path.startswith("telemetry/"):
                        yield source.name, command, path.removeprefix("telemetry/")


def test_the_documented_istio_and_kubectl_commands_take_their_files_as_written() -> None:
    seen = set()
    for source, command, name in documented_commands():
        seen.add((command, name))
        assert (ASSETS / name).is_file(), f"{source}: {command} names a missing {name}"
        kinds = [d["kind"] for d in documents(name)]
        if command == "istioctl":
            # istioctl install takes IstioOperator CRs, one per file.
            assert kinds == ["IstioOperator"], f"{source}: istioctl install -f {name}: {kinds}"
        else:
            assert "IstioOperator" not in kinds, f"{source}: kubectl apply -f {name}"
    assert ("istioctl", "istio-mesh-tracing.yaml") in seen
    assert ("kubectl", "istio-telemetry.yaml") in seen
    assert ("kubectl", "jaeger.yaml") in seen
