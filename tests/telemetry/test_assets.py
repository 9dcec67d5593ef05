"""The observability assets parse, and query only metrics and labels policyd really exports.

The dashboard is checked against Grafana's dashboard JSON schema
(``tests/fixtures/grafana``: the schema file alone, from grafana-foundation-sdk,
Apache-2.0). Every PromQL expression of the dashboard and the alerts is read
for its metric selectors, label matchers and grouping labels, and each is
checked against a real scrape of a metrics endpoint serving every family
policyd has (each family exercised, so that each has samples and labels).
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from telemetry_support import write_policies
from test_metrics import FakePool, Snapshot, Stats, served

from policyd.policy import PolicyStore
from policyd.policy.decision import WHEN_TRUE, Decision, NodeTrace, Outcome, Split
from policyd.pool.pod import Pod
from policyd.prefix.index import PreciseIndex
from policyd.telemetry import (
    DecisionMetrics,
    DecisionTelemetry,
    PoolCollector,
    PrefixCollector,
    start_metrics_server,
)

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "telemetry"
RULES = ROOT / "istio" / "helm" / "policyd" / "files" / "prometheus-alerts.yaml"
DOCS = ROOT / "docs" / "observability.md"
SCHEMA = ROOT / "tests" / "fixtures" / "grafana" / "dashboard.jsonschema.json"
# Labels Prometheus attaches to every series of a target (the scrape job, the
# ServiceMonitor's Kubernetes metadata): a policyd label of one of these names
# would be renamed exported_<name> and its panels would show something else.
TARGET_LABELS = frozenset(
    {"job", "instance", "namespace", "pod", "service", "container", "endpoint"}
)
SCRAPE_METRICS = frozenset({"up"})  # made by Prometheus for each target
TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[[^\]]*\]|\{[^}]*\}|[a-zA-Z_:][a-zA-Z0-9_:]*|\S')
MATCHER = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*,?')
LISTS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
AGGREGATIONS = frozenset({"sum", "max", "min", "avg", "count", "topk", "bottomk", "quantile"})
KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "inf", "nan", *LISTS})


@dataclass
class Selector:
    """One metric selector of an expression, and the labels it matches or groups by."""

    expression: str
    name: str
    matchers: list[tuple[str, str, str]] = field(default_factory=list)  # (label, op, value)
    within: tuple[str, ...] = ()  # the functions and aggregations around it, outermost first


@dataclass
class Query:
    expression: str
    selectors: list[Selector]
    grouping: set[str]  # labels of by (...), on (...), ... clauses


def parse(expression: str) -> Query:
    """The selectors and grouping labels of a PromQL expression.

    Enough of PromQL for these files: functions and aggregations (a name
    before ``(``), grouping clauses, range selectors, strings, numbers and
    binary operators; anything else a name is, it is a metric selector.
    Raises ``AssertionError`` for a label matcher block that does not parse.
    """
    tokens = TOKEN.findall(expression)
    selectors: list[Selector] = []
    grouping: set[str] = set()
    around: list[str] = []  # per open parenthesis: the function it calls, or ""
    called = ""
    i = 0
    while i < len(tokens):
        token = tokens[i]
        following = tokens[i + 1] if i + 1 < len(tokens) else ""
        if token in LISTS and following == "(":
            close = tokens.index(")", i)
            grouping.update(t for t in tokens[i + 2 : close] if t != ",")
            i = close + 1
            continue
        if token == "(":
            around.append(called)
            called = ""
        elif token == ")":
            around.pop()
        elif re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", token) and token not in KEYWORDS:
            if following == "(" or following in LISTS:  # a function or an aggregation
                called = token
                i += 1
                continue
            selector = Selector(expression, token, within=tuple(n for n in around if n))
            if following.startswith("{"):
                selector.matchers = matchers_of(following, expression)
                i += 1
            selectors.append(selector)
        i += 1
    return Query(expression, selectors, grouping)


def matchers_of(block: str, expression: str) -> list[tuple[str, str, str]]:
    body = block[1:-1]
    found = [(m[1], m[2], m[3]) for m in MATCHER.finditer(body)]
    assert "".join(m[0] for m in MATCHER.finditer(body)).strip() == body.strip(), (
        f"label matchers that do not parse: {block} in {expression!r}"
    )
    return found


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
            definition = variable["definition"]  # label_values(selector, label)
            inner = definition.removeprefix("label_values(").removesuffix(")")
            yield inner.rpartition(",")[0]


def alert_rules() -> list[dict[str, Any]]:
    rules = yaml.safe_load(RULES.read_text())
    return [rule for group in rules["groups"] for rule in group["rules"]]


@dataclass
class Feed:
    """A stand-in for a KV-event feed's counters (``FeedStats``'s shape).

    Only so that every family has samples; the real feed is
    ``test_prefix_metrics.py``'s.
    """

    batches: int = 3
    gaps: int = 1
    restarts: int = 0
    clears: int = 1
    replayed: int = 2
    malformed: int = 0
    disconnects: int = 0
    lag_seconds: float | None = 0.01


class Feeds:
    def stats(self, pod: str) -> Feed | None:
        return Feed()


@dataclass
class Exposition:
    """A scrape: sample names, the label names seen per sample, the values per label."""

    names: set[str]
    labels: dict[str, set[str]]
    values: dict[tuple[str, str], set[str]]


def exported(tmp_path: Path) -> Exposition:
    """A real scrape of an endpoint serving every family of policyd, each exercised."""
    metrics = DecisionMetrics()
    served(metrics, tmp_path, count=2)
    served(metrics, tmp_path, count=1, busy=True)
    telemetry = DecisionTelemetry(metrics=metrics)
    telemetry.stream_error("rejected", "invalid_json")
    failing = NodeTrace("zone", "keep", 1, (), errors=(("a", "no such key: 'zone'"),))
    metrics.decision(Decision(Outcome.SHED, "live", "1", "m", trace=(failing,)), 0.001)
    metrics.response("live", "m", 503, completed=True, first_body_seconds=None, duration_seconds=1)
    split = Split(True, WHEN_TRUE, "10.0.0.2:8000", "b")
    metrics.decision(Decision(Outcome.ROUTED, "pd", "1", "m", "10.0.0.1:8000", "a", split=split), 0)
    store = PolicyStore.open(write_policies(tmp_path))
    metrics.policies_loaded(store.current)
    metrics.on_reload(store.reload())
    metrics.flow.held("standard", "tenant-a", 1, "m")
    for outcome in ("dispatched", "expired", "evicted", "refused"):
        metrics.flow.outcome("standard", "tenant-a", outcome, 0.5)
    pod = Pod("a", "10.0.0.1:8000", base_model="m")
    pool = FakePool(Snapshot((pod,), (pod,)), {pod.address: Stats(1, 0, 0, 0.01, 1.0)})
    metrics.registry.register(PoolCollector(pool, decisions=metrics))
    snapshot = pool.snapshot
    metrics.registry.register(PrefixCollector(PreciseIndex(), Feeds(), snapshot))  # type: ignore[arg-type]
    server = start_metrics_server("127.0.0.1", 0, metrics.registry)
    try:
        with urllib.request.urlopen(server.url + "/metrics", timeout=5) as response:
            text = response.read().decode()
    finally:
        server.close()
    found = Exposition(set(), {}, {})
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.names.add(sample.name)
            found.labels.setdefault(sample.name, set()).update(sample.labels)
            for label, label_value in sample.labels.items():
                found.values.setdefault((sample.name, label), set()).add(label_value)
    return found


def problems_of(query: Query, exposition: Exposition) -> list[str]:
    problems = []
    known: set[str] = set(TARGET_LABELS)
    for selector in query.selectors:
        name = selector.name
        if name in SCRAPE_METRICS:
            labels = set(TARGET_LABELS)
        elif name not in exposition.names:
            problems.append(f"{name} is not exported (in {query.expression!r})")
            continue
        else:
            labels = exposition.labels[name] | TARGET_LABELS
        known |= labels
        for label, op, text in selector.matchers:
            if label not in labels:
                problems.append(f"{name} has no label {label} (in {query.expression!r})")
            elif op == "=" and label not in TARGET_LABELS:
                seen = exposition.values.get((name, label), set())
                if text not in seen:
                    problems.append(f"{name}{{{label}={text!r}}}: never seen, only {sorted(seen)}")
    missing = query.grouping - known - {"le"}
    if missing:
        problems.append(f"grouping by {sorted(missing)} that no selector has: {query.expression!r}")
    return problems


@pytest.mark.parametrize("source", ["dashboard", "alerts"])
def test_every_queried_metric_and_label_is_exported(tmp_path: Path, source: str) -> None:
    expressions = (
        list(dashboard_queries())
        if source == "dashboard"
        else [rule["expr"] for rule in alert_rules()]
    )
    exposition = exported(tmp_path)
    queries = [parse(expression) for expression in expressions]
    assert all(query.selectors for query in queries), "a query that reads no metric"
    problems = [problem for query in queries for problem in problems_of(query, exposition)]
    assert problems == []


def test_the_check_catches_a_wrong_name_label_value_or_grouping(tmp_path: Path) -> None:
    exposition = exported(tmp_path)
    wrong = [
        "rate(policyd_decision_total[5m])",
        'policyd_pod_waiting_requests{pod_name="a"}',
        'rate(policyd_pod_scrapes_total{result="failed"}[5m])',
        "sum by (model) (rate(policyd_decisions_total[5m]))",
    ]
    for expression in wrong:
        assert problems_of(parse(expression), exposition), expression
    with pytest.raises(AssertionError, match="do not parse"):
        parse('policyd_pool_pods{job=~"x" oops}')


# Gauges of policyd's own work, which each replica counts for itself: summed.
OWN_GAUGES = frozenset(
    {
        "policyd_pod_in_flight_requests",
        "policyd_pod_queued_prefill_tokens",
        "policyd_model_held_requests",
    }
)


def test_what_every_replica_sees_alike_is_not_summed_over_replicas() -> None:
    """A gauge of the pool (its pods, their load, the per-model signals) is the same
    on every replica and worker: a sum over them would double with two replicas."""
    expressions = [*dashboard_queries(), *(rule["expr"] for rule in alert_rules())]
    summed = []
    for expression in expressions:
        for selector in parse(expression).selectors:
            name = selector.name
            shared = name.startswith(("policyd_pool_", "policyd_model_", "policyd_pod_"))
            if not shared or name.endswith("_total") or name in OWN_GAUGES:
                continue
            aggregations = [n for n in selector.within if n in AGGREGATIONS]
            if aggregations and aggregations[-1] in ("sum", "count"):
                summed.append(expression)
    assert summed == []
    assert parse("sum(max by (a) (policyd_pool_pods))").selectors[0].within == ("sum", "max")


def test_no_policyd_label_collides_with_a_scrape_targets_labels(tmp_path: Path) -> None:
    exposition = exported(tmp_path)
    collisions = {
        name: sorted(labels & TARGET_LABELS)
        for name, labels in exposition.labels.items()
        if name.startswith("policyd_") and labels & TARGET_LABELS
    }
    assert collisions == {}


def test_the_alerts_cover_what_operators_page_on() -> None:
    rules = {rule["alert"]: rule for rule in alert_rules()}
    assert {
        "PolicydAbsent",
        "PolicydTargetDown",
        "PolicydAllPodsStale",
        "PolicydScrapePanic",
        "PolicydShedRateHigh",
        "PolicydModelServer5xxRatioHigh",
        "PolicydFlowQueueDropping",
        "PolicydPolicyReloadRejected",
        "PolicydDecisionLatencyHigh",
    } <= set(rules)
    assert rules["PolicydAbsent"]["expr"].startswith("absent(")
    assert parse(rules["PolicydTargetDown"]["expr"]).selectors[0].name == "up"
    anchors = set(re.findall(r"^#### (Policyd\w+)$", DOCS.read_text(), re.MULTILINE))
    for name, rule in rules.items():
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert rule["annotations"]["summary"]
        assert rule["annotations"]["runbook_url"] == f"docs/observability.md#{name.lower()}"
        assert name in anchors, f"{name} has no runbook section in docs/observability.md"


def test_the_docs_count_the_alerts_the_file_holds() -> None:
    counted = re.search(r"ships (\w+) alerts", DOCS.read_text())
    assert counted is not None, "docs/observability.md no longer says how many alerts ship"
    words = "zero one two three four five six seven eight nine ten eleven twelve thirteen"
    numbers = {word: n for n, word in enumerate(words.split())}
    stated = int(counted[1]) if counted[1].isdigit() else numbers[counted[1]]
    assert stated == len(alert_rules())


def test_the_rule_file_of_the_telemetry_folder_is_the_charts() -> None:
    assert (ASSETS / "prometheus-alerts.yaml").resolve() == RULES.resolve()


def test_the_dashboard_is_valid_under_grafanas_dashboard_schema() -> None:
    schema = json.loads(SCHEMA.read_text())
    validator = jsonschema.Draft7Validator(schema)
    board = dashboard()
    assert [e.message for e in validator.iter_errors(board)] == []
    board["panels"][1]["gridPos"]["w"] = "wide"  # the schema does hold the dashboard to it
    assert list(validator.iter_errors(board))


def test_the_dashboard_has_unique_panel_ids_and_namespace_and_job_variables() -> None:
    board = dashboard()
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    assert board["uid"] == "policyd-routing"
    graphs = [p for p in board["panels"] if p["type"] != "row"]
    assert all(p["targets"] and p["datasource"]["uid"] == "${datasource}" for p in graphs)
    variables = [v["name"] for v in board["templating"]["list"]]
    assert {"namespace", "job"} <= set(variables)
    for panel in graphs:
        for target in panel["targets"]:
            for selector in parse(target["expr"]).selectors:
                names = {label for label, _, _ in selector.matchers}
                assert {"namespace", "job"} <= names, f"{panel['title']}: {target['expr']}"


def test_every_exported_family_is_charted(tmp_path: Path) -> None:
    charted = {s.name for e in dashboard_queries() for s in parse(e).selectors}
    families = {
        re.sub(r"_(bucket|count|sum|total)$", "", name)
        for name in exported(tmp_path).names
        if name.startswith("policyd_")
    }
    bases = {re.sub(r"_(bucket|count|sum|total)$", "", name) for name in charted}
    assert sorted(families - bases) == []


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
