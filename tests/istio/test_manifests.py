"""The Kubernetes and Istio manifests in ``istio/`` agree with the code they deploy.

No cluster here, so what can be checked is checked against the real parts:
the Deployment's arguments go through ``policyd serve``'s own parser and
checks, the policy ConfigMap is the shipped policy and loads, the Envoy
configuration the EnvoyFilter patches in equals what ``policyd envoy-config``
generates, and the policy directory reloads when the kubelet swaps a
ConfigMap's files.

The gateway itself runs: the real Envoy on a bootstrap made of what Istio
generates for the Gateway and VirtualService with the EnvoyFilter's patches
applied as Istio applies them (its EDS cluster for the model Service stood in
for by a STATIC one), policyd behind it and test pods, and every claim about
that configuration is shown by its effect: traffic routed, retried, refused,
or what Envoy's admin reports it runs (``/clusters``, ``/config_dump``,
``/runtime``). What is not exercised: Istio itself (how istiod names the
route and cluster, orders filters, renders runtime values) and a CNI
enforcing the NetworkPolicy.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import yaml
from e2e_support import ScriptedRouter, SwappablePool, TestUpstream

from policyd.cli import build_parser
from policyd.extproc.envoy_config import (
    GRACEFUL_CLOSE_FLAG,
    PRIORITY_HEADERS,
    RUNTIME_FLAGS,
    EnvoyConfigOptions,
    PolicydTls,
    bootstrap,
)
from policyd.extproc.envoy_ext_proc import CREDENTIAL_HEADERS
from policyd.extproc.envoy_process import EnvoyProcess, free_port
from policyd.extproc.grpc_server import ExtProcServer, ServerOptions, TlsFiles
from policyd.extproc.replies import DESTINATION_HEADER, PREFILL_HEADER
from policyd.extproc.serve_command import check_arguments
from policyd.extproc.serving import ServingSettings
from policyd.policy import PolicyStore
from policyd.policy.decision import Decision
from policyd.policy.request import Request
from policyd.pool.pod import Pod

REPO = Path(__file__).resolve().parents[2]
ISTIO = REPO / "istio"
NAMESPACE_PLACEHOLDER = "policyd.NAMESPACE.svc.cluster.local"
# Where the gateway pods mount their client certificate for mutual TLS to policyd
# (helm/gateway-values.yaml), and policyd's pods their own (deployment.yaml).
GATEWAY_CLIENT_DIR = Path("/etc/policyd-client")
POLICYD_TLS_DIR = Path("/etc/policyd/tls")


def documents(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((ISTIO / name).read_text()) if d is not None]


def resource(kind: str) -> dict[str, Any]:
    found = [
        d
        for path in sorted(ISTIO.glob("*.yaml"))
        for d in documents(path.name)
        if d["kind"] == kind
    ]
    assert len(found) == 1, f"{len(found)} {kind} resources"
    return found[0]


def container() -> dict[str, Any]:
    pod = resource("Deployment")["spec"]["template"]["spec"]
    assert len(pod["containers"]) == 1
    spec: dict[str, Any] = pod["containers"][0]
    return spec


def patches(apply_to: str) -> list[dict[str, Any]]:
    return [p for p in resource("EnvoyFilter")["spec"]["configPatches"] if p["applyTo"] == apply_to]


def added_cluster(name: str) -> dict[str, Any]:
    (cluster,) = [
        p["patch"]["value"]
        for p in patches("CLUSTER")
        if p["patch"]["operation"] == "ADD" and p["patch"]["value"]["name"] == name
    ]
    assert isinstance(cluster, dict)
    return cluster


def generated() -> dict[str, Any]:
    """``policyd envoy-config``'s bootstrap, pointed at the in-cluster Services."""
    return bootstrap(
        EnvoyConfigOptions(
            policyd_address=NAMESPACE_PLACEHOLDER,
            model_servers=("vllm.NAMESPACE.svc.cluster.local:8000",),
            policyd_tls=PolicydTls(
                GATEWAY_CLIENT_DIR / "ca.crt",
                GATEWAY_CLIENT_DIR / "tls.crt",
                GATEWAY_CLIENT_DIR / "tls.key",
                "policyd.NAMESPACE.svc",
            ),
        )
    )


def generated_cluster(name: str) -> dict[str, Any]:
    (cluster,) = [c for c in generated()["static_resources"]["clusters"] if c["name"] == name]
    return dict(cluster)


def generated_manager() -> dict[str, Any]:
    listener = generated()["static_resources"]["listeners"][0]
    manager: dict[str, Any] = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return manager


def generated_route() -> dict[str, Any]:
    """The route action of envoy-config's route to the chosen pod."""
    (chosen,) = [
        r
        for r in generated_manager()["route_config"]["virtual_hosts"][0]["routes"]
        if r["name"] == "to_chosen_pod"
    ]
    route: dict[str, Any] = chosen["route"]
    return route


# -- shape -------------------------------------------------------------------------------


def test_every_manifest_parses_and_the_kustomization_lists_them_all() -> None:
    files = sorted(p.name for p in ISTIO.glob("*.yaml") if p.name != "kustomization.yaml")
    kustomization = documents("kustomization.yaml")[0]
    assert sorted(kustomization["resources"]) == files
    for name in files:
        for document in documents(name):
            assert {"apiVersion", "kind", "metadata"} <= set(document), name
            assert document["metadata"]["name"]
            # Namespace-agnostic: kustomization.yaml (or kubectl -n) places them.
            assert "namespace" not in document["metadata"], name


def test_the_namespace_replacement_targets_the_service_names_in_the_envoy_filter() -> None:
    (replacement,) = documents("kustomization.yaml")[0]["replacements"]
    assert replacement["source"] == {
        "kind": "Service",
        "name": "policyd",
        "fieldPath": "metadata.namespace",
    }
    (target,) = replacement["targets"]
    values = []
    for field_path in target["fieldPaths"]:
        value: Any = resource("EnvoyFilter")
        for step in field_path.split("."):
            value = value[int(step)] if step.isdigit() else value[step]
        assert value.split(".")[target["options"]["index"]] == "NAMESPACE"
        values.append(value)
    policyd = added_cluster("policyd")
    address = policyd["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"][
        "socket_address"
    ]
    # Every in-cluster name in the EnvoyFilter gets the namespace: policyd's address
    # and TLS server name, the models'.
    assert sorted(values) == sorted(
        [
            address["address"],
            policyd["transport_socket"]["typed_config"]["sni"],
            model_cluster_patch()["match"]["cluster"]["service"],
        ]
    )
    assert address["address"] == NAMESPACE_PLACEHOLDER


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl")
def test_kustomize_writes_the_namespace_into_both_service_names(tmp_path: Path) -> None:
    """What ``kubectl apply -k`` applies: the set in the namespace, and the
    EnvoyFilter's in-cluster names (policyd's address, the model Service) in it."""
    kustomization = documents("kustomization.yaml")[0]
    namespace = kustomization["namespace"]
    built = subprocess.run(
        ["kubectl", "kustomize", str(ISTIO)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    rendered = [d for d in yaml.safe_load_all(built) if d]
    assert len(rendered) == sum(len(documents(name)) for name in kustomization["resources"])
    assert {d["metadata"]["namespace"] for d in rendered} == {namespace}
    (envoy_filter,) = [d for d in rendered if d["kind"] == "EnvoyFilter"]
    text = yaml.safe_dump(envoy_filter)
    assert "NAMESPACE" not in text
    assert f"policyd.{namespace}.svc.cluster.local" in text
    assert f"vllm.{namespace}.svc.cluster.local" in text


def test_the_policy_config_map_is_the_shipped_policy_and_loads(tmp_path: Path) -> None:
    data = resource("ConfigMap")["data"]
    assert data == {"default.yaml": (REPO / "rules" / "default.yaml").read_text()}
    # The Helm chart ships the same policy as its default (helm packages only its own folder).
    chart_policy = ISTIO / "helm" / "policyd" / "files" / "policy" / "default.yaml"
    assert chart_policy.read_text() == data["default.yaml"]
    (tmp_path / "default.yaml").write_text(data["default.yaml"])
    assert PolicyStore.open(tmp_path).current.policies[0].name == "default"


# -- the Deployment runs `policyd serve` with flags it accepts ---------------------------


def serve_arguments() -> list[str]:
    spec = container()
    assert spec["command"] == ["policyd"]
    arguments: list[str] = spec["args"]
    assert arguments[0] == "serve"
    return arguments


def test_the_deployment_arguments_are_accepted_by_policyd_serve(
    tmp_path: Path, certificates: Any
) -> None:
    arguments = serve_arguments()
    parsed = build_parser("serve").parse_args(arguments)  # exits on a stale or unknown flag
    pod = resource("Deployment")["spec"]["template"]["spec"]
    mount, tls_mount = container()["volumeMounts"]
    volume, tls_volume = pod["volumes"]
    # The policy is the ConfigMap, mounted as a directory (a subPath gets no updates).
    assert parsed.policy == Path(mount["mountPath"])
    assert "subPath" not in mount
    assert volume["name"] == mount["name"]
    assert volume["configMap"]["name"] == resource("ConfigMap")["metadata"]["name"]
    # Mutual TLS by default: policyd's certificate, key and the clients' CA, from
    # the Secret mounted where the flags read them.
    assert (tls_volume["name"], tls_volume["secret"]) == (
        tls_mount["name"],
        {"secretName": "policyd-tls"},
    )
    assert Path(tls_mount["mountPath"]) == POLICYD_TLS_DIR and tls_mount["readOnly"]
    assert (parsed.tls_cert, parsed.tls_key, parsed.tls_client_ca) == (
        POLICYD_TLS_DIR / "tls.crt",
        POLICYD_TLS_DIR / "tls.key",
        POLICYD_TLS_DIR / "ca.crt",
    )
    parsed.tls_cert, parsed.tls_key = certificates.server_cert, certificates.server_key
    parsed.tls_client_ca = certificates.ca
    # Pods from Kubernetes, with the RBAC to follow them.
    assert parsed.k8s_selector and parsed.pods is None
    assert pod["serviceAccountName"] == resource("ServiceAccount")["metadata"]["name"]
    # The whole check `policyd serve` runs before starting, with the policy in place.
    (tmp_path / "default.yaml").write_text(resource("ConfigMap")["data"]["default.yaml"])
    parsed.policy = tmp_path
    check_arguments(parsed)
    assert parsed.host == "0.0.0.0"
    assert pod["terminationGracePeriodSeconds"] > parsed.grace_seconds
    # The EnvoyFilter balances the model Service's cluster by override-host, which
    # retries on the fallbacks policyd sends; without them a retry goes to any pod.
    assert parsed.send_fallbacks


def test_ports_and_probes_line_up_with_the_service_and_the_gateway() -> None:
    parsed = build_parser("serve").parse_args(serve_arguments())
    spec = container()
    port, monitoring = spec["ports"]
    assert port["containerPort"] == parsed.port
    assert monitoring["containerPort"] == parsed.monitoring_port
    annotations = resource("Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(parsed.monitoring_port)
    # Kubelet's gRPC probes do not speak TLS: the monitoring port's readiness and
    # liveness pages instead.
    assert spec["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": monitoring["name"]}
    assert spec["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": monitoring["name"]}
    service = resource("Service")["spec"]
    assert service["clusterIP"] == "None"  # one gateway host per ready replica
    (service_port,) = service["ports"]
    assert (service_port["port"], service_port["targetPort"]) == (parsed.port, port["name"])
    labels = resource("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["selector"].items() <= labels.items()
    address = added_cluster("policyd")["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    assert address["endpoint"]["address"]["socket_address"]["port_value"] == parsed.port


def test_the_role_allows_listing_and_watching_pods_and_nothing_more() -> None:
    (role,) = [d for d in documents("rbac.yaml") if d["kind"] == "Role"]
    (binding,) = [d for d in documents("rbac.yaml") if d["kind"] == "RoleBinding"]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "policyd"}]


# -- the EnvoyFilter is policyd envoy-config's configuration ------------------------------


def ext_proc_filter() -> dict[str, Any]:
    (patch,) = [
        p
        for p in patches("HTTP_FILTER")
        if p["patch"]["value"]["name"] == "envoy.filters.http.ext_proc"
    ]
    assert patch["patch"]["operation"] == "INSERT_BEFORE"
    assert patch["match"]["listener"]["filterChain"]["filter"]["subFilter"] == {
        "name": "envoy.filters.http.router"
    }
    value: dict[str, Any] = patch["patch"]["value"]
    return value


def model_cluster_patch() -> dict[str, Any]:
    (patch,) = [p for p in patches("CLUSTER") if p["patch"]["operation"] == "MERGE"]
    assert isinstance(patch, dict)
    return patch


def test_relative_patches_have_a_priority() -> None:
    """istioctl analyze's IST0151 (and IST0155), as Istio's analyzer decides it: a patch
    placed relative to another (INSERT_BEFORE/AFTER, REPLACE, REMOVE) in an EnvoyFilter
    without a priority may apply in any order with other EnvoyFilters' patches."""
    spec = resource("EnvoyFilter")["spec"]
    relative = [
        p
        for p in spec["configPatches"]
        if p["patch"]["operation"] in {"INSERT_BEFORE", "INSERT_AFTER", "REPLACE", "REMOVE"}
    ]
    assert relative  # the ext_proc filter goes before the router
    # Positive: after EnvoyFilters of the default priority, so ext_proc lands right
    # before the router, behind any filter they insert there.
    assert spec.get("priority", 0) > 0


def test_the_ext_proc_filter_and_clusters_are_those_envoy_config_generates() -> None:
    (expected_filter,) = [
        f for f in generated_manager()["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"
    ]
    assert ext_proc_filter() == expected_filter
    assert added_cluster("policyd") == generated_cluster("policyd")
    (listener,) = patches("LISTENER")
    assert listener["patch"]["value"] == {
        "per_connection_buffer_limit_bytes": EnvoyConfigOptions().buffer_limit_bytes
    }
    # The model servers: Istio's cluster for the Service the route names, with
    # envoy-config's override-host balancing and buffer limit merged in.
    model = generated_cluster("model_servers")
    assert model_cluster_patch()["patch"]["value"] == {
        "per_connection_buffer_limit_bytes": model["per_connection_buffer_limit_bytes"],
        "load_balancing_policy": model["load_balancing_policy"],
    }


def manager_patch() -> dict[str, Any]:
    """What the EnvoyFilter merges into the gateway's connection manager."""
    (patch,) = patches("NETWORK_FILTER")
    assert patch["patch"]["operation"] == "MERGE"
    assert patch["match"]["listener"]["filterChain"]["filter"] == {
        "name": "envoy.filters.network.http_connection_manager"
    }
    value: dict[str, Any] = patch["patch"]["value"]["typed_config"]
    return value


def test_client_destination_and_priority_headers_are_removed_as_envoy_config_does() -> None:
    """ext_proc fails open, so the destination must be gone before policyd is asked;
    the priority, deadline and flow headers are the trust model's (docs/serving.md)."""
    expected = generated_manager()["early_header_mutation_extensions"]
    assert manager_patch()["early_header_mutation_extensions"] == expected
    (mutation,) = expected
    assert [m["remove"] for m in mutation["typed_config"]["mutations"]] == [
        DESTINATION_HEADER,
        PREFILL_HEADER,
        *PRIORITY_HEADERS,
    ]


def test_the_request_timeouts_are_envoy_configs() -> None:
    manager = generated_manager()
    assert {k: v for k, v in manager_patch().items() if k.endswith("timeout")} == {
        "request_timeout": manager["request_timeout"],
        "request_headers_timeout": manager["request_headers_timeout"],
    }


def test_the_charts_edge_values_default_to_the_manifests() -> None:
    """The chart renders the header removal and the timeouts from its values
    (``tests/real/test_helm.py`` renders it); their defaults are the manifests'."""
    values = yaml.safe_load((ISTIO / "helm" / "policyd" / "values.yaml").read_text())
    edge = values["envoyFilter"]
    manager = manager_patch()
    assert (edge["requestTimeout"], edge["requestHeadersTimeout"]) == (
        manager["request_timeout"],
        manager["request_headers_timeout"],
    )
    (mutation,) = manager["early_header_mutation_extensions"]
    removed = [m["remove"] for m in mutation["typed_config"]["mutations"]]
    assert removed == [DESTINATION_HEADER, PREFILL_HEADER, *edge["stripClientHeaders"]]
    assert edge["trustedClientHeaders"] == []


def test_the_route_patch_and_the_virtual_service_are_envoy_configs_route() -> None:
    (patch,) = patches("HTTP_ROUTE")
    assert patch["match"]["routeConfiguration"]["vhost"]["route"]["name"] == "inference"
    value = patch["patch"]["value"]
    assert value["match"]["headers"] == [{"name": DESTINATION_HEADER, "present_match": True}]
    chosen = generated_route()
    assert "cluster" not in value["route"]  # the VirtualService's destination stays
    assert value["route"] == {k: chosen[k] for k in ("timeout", "idle_timeout")}
    route, unrouted = resource("VirtualService")["spec"]["http"]
    assert route["name"] == "inference"
    assert istio_retry_policy(route.get("retries")) == chosen["retry_policy"]
    # What the header-matched route does not take gets envoy-config's JSON 503.
    (expected,) = [
        r
        for r in generated_manager()["route_config"]["virtual_hosts"][0]["routes"]
        if r["name"] == "unrouted"
    ]
    assert unrouted["match"] == route["match"]
    assert unrouted["directResponse"] == {
        "status": expected["direct_response"]["status"],
        "body": {"string": expected["direct_response"]["body"]["inline_string"]},
    }
    assert unrouted["headers"] == {"response": {"set": {"content-type": "application/json"}}}
    gateway = resource("Gateway")
    assert resource("VirtualService")["spec"]["gateways"] == [gateway["metadata"]["name"]]
    assert (
        gateway["spec"]["selector"] == resource("EnvoyFilter")["spec"]["workloadSelector"]["labels"]
    )
    # The cluster the EnvoyFilter patches is Istio's for the route's destination.
    (destination,) = route["route"]
    match = model_cluster_patch()["match"]["cluster"]
    assert match["service"] == f"{destination['destination']['host']}.NAMESPACE.svc.cluster.local"
    assert match["portNumber"] == destination["destination"]["port"]["number"]


def istio_retry_policy(retries: dict[str, Any] | None) -> dict[str, Any] | None:
    """The retry policy Istio puts on a route for a VirtualService's ``retries``
    (pilot/pkg/networking/core/route/retry: ``ConvertPolicy``): attempts and retryOn
    over its default policy, which retries on another host (``previous_hosts``,
    five host selections). No ``retries`` at all would be Istio's default, which
    also retries ``unavailable``, ``cancelled`` and 503 answers."""
    assert retries is not None, "without `retries` Istio applies its default retry policy"
    if retries.get("attempts", 0) <= 0:
        return None
    assert set(retries) <= {"attempts", "retryOn"}, "model only what is translated here"
    return {
        "retry_on": retries["retryOn"],
        "num_retries": retries["attempts"],
        "retry_host_predicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts"
                    ".v3.PreviousHostsPredicate"
                },
            }
        ],
        "host_selection_retry_max_attempts": 5,
    }


def test_the_network_policy_lets_only_the_gateway_reach_the_grpc_port() -> None:
    """No cluster here to enforce it: what is checked is that it selects policyd's
    pods, names their ports and admits the gateway's pods (and monitoring) only."""
    spec = resource("NetworkPolicy")["spec"]
    labels = resource("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert spec["podSelector"]["matchLabels"].items() <= labels.items()
    assert spec["policyTypes"] == ["Ingress"]
    ports = {p["name"]: p for p in container()["ports"]}
    admitted = {port["port"]: rule["from"] for rule in spec["ingress"] for port in rule["ports"]}
    assert set(admitted) <= set(ports)
    gateway_pods = resource("EnvoyFilter")["spec"]["workloadSelector"]["labels"]
    assert admitted["grpc"] == [{"podSelector": {"matchLabels": gateway_pods}}]
    assert all("ipBlock" not in peer for peers in admitted.values() for peer in peers)
    assert all(peers for peers in admitted.values())  # no port open to everyone


def gateway_runtime_values() -> dict[str, Any]:
    """The Envoy runtime values the gateway's Helm values give its pods (Istio's
    ProxyConfig ``runtimeValues``, from the ``proxy.istio.io/config`` annotation);
    none when the values file sets none."""
    path = ISTIO / "helm" / "gateway-values.yaml"
    if not path.exists():
        return {}
    values = yaml.safe_load(path.read_text()) or {}
    annotation = (values.get("podAnnotations") or {}).get("proxy.istio.io/config")
    if annotation is None:
        return {}
    runtime: dict[str, Any] = (yaml.safe_load(annotation) or {}).get("runtimeValues") or {}
    return runtime


def test_runtime_values_the_manifests_set_are_typed() -> None:
    """Envoy accepts the string ``"true"`` for a feature flag and does not apply it;
    a boolean applies. Istio takes runtime values only from ProxyConfig's
    ``runtimeValues``, a map of strings, so a manifest cannot set a typed one: it
    must set none. (The live gateway below reads the runtime back from Envoy.)"""
    runtime = gateway_runtime_values()
    strings = {name: value for name, value in runtime.items() if not isinstance(value, bool)}
    assert not strings, (
        f"{strings}: a string validates but does not apply, and Istio's runtimeValues "
        "only carries strings; leave the flag at Envoy's default instead"
    )
    # policyd envoy-config writes its flags as booleans.
    assert all(isinstance(value, bool) for value in RUNTIME_FLAGS.values())


# -- the patched gateway, live: the real Envoy, policyd and pods ---------------------------

ISTIO_MODEL_CLUSTER = "outbound|8000||vllm.inference.svc.cluster.local"


def merge_patch(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """An EnvoyFilter MERGE, as protobuf merges: fields of messages merge, lists
    append, scalars replace."""
    merged = copy.deepcopy(target)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_patch(merged[key], value)
        elif isinstance(value, list) and isinstance(merged.get(key), list):
            merged[key] = merged[key] + copy.deepcopy(value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def gateway_bootstrap(
    *,
    listen_port: int,
    admin_port: int,
    policyd_port: int,
    model_servers: list[str],
    client_dir: Path,
    request_timeout: str = "",
) -> dict[str, Any]:
    """An Envoy bootstrap made of what Istio generates for the Gateway and the
    VirtualService, with the EnvoyFilter's patches applied as Istio applies them
    and the runtime values of the gateway's Helm values. Istio's EDS cluster for
    the model Service is a STATIC cluster of ``model_servers`` here, with the
    settings Istio gives its clusters (least-request, breakers at their maximum).
    ``client_dir`` stands for the gateway pod's mount of its client certificate
    (``GATEWAY_CLIENT_DIR``). ``request_timeout`` replaces the patch's value
    (both request timeouts), as an operator would edit it."""
    (route_patch,) = patches("HTTP_ROUTE")
    (listener_patch,) = patches("LISTENER")
    routes = []
    for route in resource("VirtualService")["spec"]["http"]:
        istio_route: dict[str, Any] = {
            "name": route["name"],
            "match": {"prefix": route["match"][0]["uri"]["prefix"]},
        }
        if "directResponse" in route:
            direct = route["directResponse"]
            istio_route["direct_response"] = {
                "status": direct["status"],
                "body": {"inline_string": direct["body"]["string"]},
            }
            istio_route["response_headers_to_add"] = [
                {
                    "header": {"key": key, "value": value},
                    "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                }
                for key, value in route["headers"]["response"]["set"].items()
            ]
        else:
            action: dict[str, Any] = {"cluster": ISTIO_MODEL_CLUSTER}
            retry = istio_retry_policy(route.get("retries"))
            if retry is not None:
                action["retry_policy"] = retry
            istio_route["route"] = action
        if route["name"] == route_patch["match"]["routeConfiguration"]["vhost"]["route"]["name"]:
            istio_route = merge_patch(istio_route, route_patch["patch"]["value"])
        routes.append(istio_route)
    inserted = [
        p["patch"]["value"]
        for p in patches("HTTP_FILTER")
        if p["patch"]["operation"] == "INSERT_BEFORE"
        and p["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"]
        == "envoy.filters.http.router"
    ]
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network."
        "http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "gateway",
        "route_config": {
            "name": "http.80",
            "virtual_hosts": [
                {
                    "name": "gateway",
                    "domains": ["*"],
                    "routes": routes,
                }
            ],
        },
        "http_filters": [
            *inserted,
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            },
        ],
    }
    for patch in patches("NETWORK_FILTER"):  # MERGEs into the connection manager
        assert patch["patch"]["operation"] == "MERGE"
        manager = merge_patch(manager, patch["patch"]["value"]["typed_config"])
    if request_timeout:
        assert {"request_timeout", "request_headers_timeout"} <= set(manager)
        manager.update(request_timeout=request_timeout, request_headers_timeout=request_timeout)
    listener = {
        "name": "0.0.0.0_80",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen_port}},
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": manager,
                    }
                ]
            }
        ],
    }
    policyd_cluster = mounted(copy.deepcopy(added_cluster("policyd")), client_dir)
    address = policyd_cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    address["address"]["socket_address"].update(address="127.0.0.1", port_value=policyd_port)
    maximum = 4294967295
    istio_model_cluster = {
        "name": ISTIO_MODEL_CLUSTER,
        "type": "STATIC",
        "connect_timeout": "10s",
        "lb_policy": "LEAST_REQUEST",
        "circuit_breakers": {
            "thresholds": [
                {
                    "max_connections": maximum,
                    "max_pending_requests": maximum,
                    "max_requests": maximum,
                    "max_retries": maximum,
                }
            ]
        },
        "load_assignment": {
            "cluster_name": ISTIO_MODEL_CLUSTER,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": {"socket_address": {"address": h, "port_value": int(p)}}
                            }
                        }
                        for h, _, p in (a.rpartition(":") for a in model_servers)
                    ]
                }
            ],
        },
    }
    return {
        "admin": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}
        },
        "layered_runtime": {
            "layers": [
                {"name": "global config", "static_layer": gateway_runtime_values()},
                {"name": "admin", "admin_layer": {}},
            ]
        },
        "static_resources": {
            "listeners": [merge_patch(listener, listener_patch["patch"]["value"])],
            "clusters": [
                policyd_cluster,
                merge_patch(istio_model_cluster, model_cluster_patch()["patch"]["value"]),
            ],
        },
    }


def mounted(value: Any, client_dir: Path) -> Any:
    """``value`` with every file of GATEWAY_CLIENT_DIR read from ``client_dir`` instead."""
    if isinstance(value, dict):
        return {key: mounted(item, client_dir) for key, item in value.items()}
    if isinstance(value, list):
        return [mounted(item, client_dir) for item in value]
    if isinstance(value, str) and value.startswith(f"{GATEWAY_CLIENT_DIR}/"):
        return str(client_dir / Path(value).relative_to(GATEWAY_CLIENT_DIR))
    return value


class StallingRouter(ScriptedRouter):
    """``x-test-stall: <seconds>`` holds policyd's event loop that long first."""

    def decide(self, request: Request, candidates: Sequence[Pod], prompt: Any = None) -> Decision:
        if "x-test-stall" in request.headers:
            time.sleep(float(request.headers["x-test-stall"]))
        return super().decide(request, candidates)


# The patched gateway's request timeouts, shortened in a second Envoy so a test
# waits a second for them (not a bound on anything).
SHORT_REQUEST_TIMEOUT_S = 1


@dataclass
class LiveGateway:
    url: str
    admin: str
    upstreams: dict[str, TestUpstream]
    dead: str  # the address of a pod that is gone: nothing listens there
    client: aiohttp.ClientSession
    router: StallingRouter
    # The same patched gateway with SHORT_REQUEST_TIMEOUT_S, on the same policyd and pods.
    short_timeout_port: int

    async def admin_json(self, path: str) -> Any:
        async with self.client.get(self.admin + path) as response:
            assert response.status == 200, path
            return await response.json(content_type=None)

    async def counter(self, name: str) -> int:
        async with self.client.get(f"{self.admin}/stats") as response:
            text = await response.text()
        values = [
            v for n, _, v in (line.partition(": ") for line in text.splitlines()) if n == name
        ]
        return int(values[0]) if values else 0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def live(
    tmp_path_factory: pytest.TempPathFactory, certificates: Any
) -> AsyncIterator[LiveGateway]:
    """policyd with the Deployment's mutual TLS (the test CA's certificates in place
    of the Secrets), behind the patched gateway."""
    directory = tmp_path_factory.mktemp("istio-gateway")
    client_dir = directory / "policyd-client"  # the gateway pod's mounted Secret
    client_dir.mkdir()
    for name, source in (
        ("ca.crt", certificates.ca),
        ("tls.crt", certificates.client_cert),
        ("tls.key", certificates.client_key),
    ):
        shutil.copy(source, client_dir / name)
    upstreams = {name: TestUpstream(name) for name in ("pod-a", "pod-b")}
    for upstream in upstreams.values():
        await upstream.start()
    dead = f"127.0.0.1:{free_port()}"
    pods = [Pod(name, u.address) for name, u in upstreams.items()] + [Pod("pod-dead", dead)]
    router = StallingRouter()
    server = ExtProcServer(
        lambda: router,
        SwappablePool(pods).current,
        options=ServerOptions(
            port=0,
            grace_seconds=1.0,
            settings=ServingSettings(send_fallbacks=True),
            tls=TlsFiles(certificates.server_cert, certificates.server_key, certificates.ca),
        ),
    )
    await server.start()
    client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
    envoys = []
    for name, request_timeout in (("gateway", ""), ("short", f"{SHORT_REQUEST_TIMEOUT_S}s")):
        listen_port, admin_port = free_port(), free_port()
        config = directory / f"{name}.yaml"
        config.write_text(
            yaml.safe_dump(
                gateway_bootstrap(
                    listen_port=listen_port,
                    admin_port=admin_port,
                    policyd_port=server.port,
                    model_servers=[p.address for p in pods],
                    client_dir=client_dir,
                    request_timeout=request_timeout,
                )
            )
        )
        envoys.append(
            EnvoyProcess(
                config, admin_port, listen_port=listen_port, log_file=directory / f"{name}.log"
            )
        )
    try:
        for envoy in envoys:
            envoy.start()
            await envoy.wait_ready()
        main, short = envoys
        yield LiveGateway(
            f"http://127.0.0.1:{main.listen_port}",
            f"http://127.0.0.1:{main.admin_port}",
            upstreams,
            dead,
            client,
            router,
            short.listen_port,
        )
    finally:
        for envoy in envoys:
            envoy.stop()
        await client.close()
        await server.stop(0)
        for upstream in upstreams.values():
            await upstream.stop()


async def complete(
    live: LiveGateway, headers: dict[str, str], body: bytes | None = None
) -> tuple[int, dict[str, Any]]:
    data = body if body is not None else b'{"model": "m", "prompt": "p"}'
    async with live.client.post(
        live.url + "/v1/completions",
        data=data,
        headers={"content-type": "application/json", **headers},
    ) as response:
        text = await response.text()
        return response.status, {
            "body": text,
            "upstream": response.headers.get("x-test-upstream"),
            "content-type": response.headers.get("content-type"),
        }


@pytest.mark.e2e
@pytest.mark.asyncio(loop_scope="module")
async def test_the_gateway_sends_each_request_to_the_pod_policyd_named(live: LiveGateway) -> None:
    """The ext_proc filter asks policyd; override-host balancing on Istio's cluster
    honours its pick, not least-request (both pods, many requests, always pod-b)."""
    answers = [await complete(live, {"x-test-pick": "pod-b"}) for _ in range(8)]
    assert [(status, seen["upstream"]) for status, seen in answers] == [(200, "pod-b")] * 8
    # A client naming the destination itself is overruled by policyd's pick.
    spoofed = {"x-test-pick": "pod-a", DESTINATION_HEADER: live.upstreams["pod-b"].address}
    status, seen = await complete(live, spoofed)
    assert (status, seen["upstream"]) == (200, "pod-a")


@pytest.mark.e2e
@pytest.mark.asyncio(loop_scope="module")
async def test_a_request_policyd_does_not_route_reaches_no_pod(live: LiveGateway) -> None:
    before = sum(len(u.received) for u in live.upstreams.values())
    status, seen = await complete(live, {"x-test-outcome": "shed"})
    assert status == 429 and "request_shed" in seen["body"]
    assert sum(len(u.received) for u in live.upstreams.values()) == before


@pytest.mark.e2e
@pytest.mark.asyncio(loop_scope="module")
async def test_a_pod_that_refuses_is_retried_on_the_next_pod_policyd_named(
    live: LiveGateway,
) -> None:
    """The VirtualService's retries, on the cluster the EnvoyFilter balances: policyd
    picks the dead pod, then lists pod-a and pod-b; Envoy's connection is refused
    and the retry goes to pod-a, the next in policyd's list."""
    retried = await live.counter(f"cluster.{ISTIO_MODEL_CLUSTER}.upstream_rq_retry_success")
    for _ in range(3):
        status, seen = await complete(live, {"x-test-pick": "pod-dead"})
        assert (status, seen["upstream"]) == (200, "pod-a"), seen
    after = await live.counter(f"cluster.{ISTIO_MODEL_CLUSTER}.upstream_rq_retry_success")
    assert after - retried == 3


@pytest.mark.e2e
@pytest.mark.asyncio(loop_scope="module")
async def test_a_body_over_the_listener_buffer_gets_413_and_reaches_nothing(
    live: LiveGateway,
) -> None:
    limit = EnvoyConfigOptions().buffer_limit_bytes
    prompt = "x" * (limit + 1024)
    body = ('{"model": "m", "prompt": "' + prompt + '"}').encode()
    status, _ = await complete(live, {}, body)
    assert status == 413
    fits = ('{"model": "m", "prompt": "' + "x" * (limit // 2) + '"}').encode()
    status, seen = await complete(live, {"x-test-pick": "pod-b"}, fits)
    assert (status, seen["upstream"]) == (200, "pod-b")


@pytest.mark.e2e
@pytest.mark.asyncio(loop_scope="module")
async def test_envoy_runs_the_policyd_cluster_as_patched(live: LiveGateway) -> None:
    """Read back from Envoy: policyd is health-checked healthy on its readiness
    service over mutual TLS (policyd refuses any other client), with the stream
    cap and breakers the patch sets."""
    clusters = await live.admin_json("/clusters?format=json")
    (policyd,) = [c for c in clusters["cluster_statuses"] if c["name"] == "policyd"]
    (host,) = policyd["host_statuses"]
    assert host["health_status"]["eds_health_status"] == "HEALTHY"
    assert "failed_active_health_check" not in host["health_status"]
    (thresholds, *_) = policyd["circuit_breakers"]["thresholds"]
    assert thresholds["max_requests"] == 50_000
    dump = await live.admin_json("/config_dump?resource=static_clusters")
    (static,) = [c["cluster"] for c in dump["configs"] if c["cluster"]["name"] == "policyd"]
    options = static["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]
    assert (
        options["explicit_http_config"]["http2_protocol_options"]["max_concurrent_streams"]
        == EnvoyConfigOptions().policyd_streams_per_connection
    )


@pytest.mark.e2e
@pytest.mark.asyncio(loop_scope="module")
async def test_envoy_applies_the_runtime_values_the_gateway_pods_get(live: LiveGateway) -> None:
    """Envoy's /runtime holds exactly the values the gateway's Helm values set, each
    as given; a flag they leave out (ext_proc_graceful_grpc_close, which crashed
    Envoy 1.40) is absent, so Envoy runs its default (off)."""
    runtime = await live.admin_json("/runtime")
    expected = {name: str(value).lower() for name, value in gateway_runtime_values().items()}
    assert {name: entry["final_value"] for name, entry in runtime["entries"].items()} == expected
    if GRACEFUL_CLOSE_FLAG not in expected:
        assert GRACEFUL_CLOSE_FLAG not in runtime["entries"]


@pytest.mark.e2e
@pytest.mark.asyncio(loop_scope="module")
async def test_the_gateway_removes_a_clients_priority_deadline_and_flow_headers(
    live: LiveGateway,
) -> None:
    """The trust model (docs/serving.md): a client claiming `critical`, a deadline
    or a fresh tenant reaches policyd and the pod without the claim."""
    claims = {
        "x-gateway-inference-criticality": "Critical",
        "x-llm-d-inference-objective": "premium",
        "x-gateway-inference-objective": "premium",
        "x-llm-d-inference-fairness-id": "fresh-tenant-every-time",
        "x-gateway-inference-fairness-id": "fresh-tenant-every-time",
        "x-request-deadline-ms": "1",
        "x-tenant": "fresh-tenant-every-time",
    }
    assert set(claims) == set(PRIORITY_HEADERS)
    status, seen = await complete(live, {"x-test-pick": "pod-b", **claims})
    assert (status, seen["upstream"]) == (200, "pod-b")
    asked = live.router.seen[-1].headers
    received = {k.lower() for k in live.upstreams["pod-b"].received[-1].headers}
    assert [name for name in claims if name in asked or name in received] == []
    assert asked["x-test-pick"] == "pod-b"  # what is not a claim passes


@pytest.mark.e2e
@pytest.mark.asyncio(loop_scope="module")
async def test_credentials_reach_the_pod_and_never_policyd(live: LiveGateway) -> None:
    credentials = {
        "authorization": "Bearer sk-secret",
        "proxy-authorization": "Basic c2VjcmV0",
        "cookie": "session=secret",
        "x-api-key": "sk-other-secret",
    }
    assert set(credentials) <= set(CREDENTIAL_HEADERS)
    status, seen = await complete(live, {"x-test-pick": "pod-a", **credentials})
    assert (status, seen["upstream"]) == (200, "pod-a")
    assert [name for name in live.router.seen[-1].headers if name in CREDENTIAL_HEADERS] == []
    received = {k.lower(): v for k, v in live.upstreams["pod-a"].received[-1].headers.items()}
    assert {name: received.get(name) for name in credentials} == credentials


async def send_and_read(port: int, sent: bytes) -> bytes:
    """Send ``sent`` on a fresh connection, nothing more; what the gateway answers."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(sent)
        await writer.drain()
        # The gateway's timeout ends the read; wait_for only keeps a broken one
        # from hanging the suite.
        return await asyncio.wait_for(reader.read(), timeout=SHORT_REQUEST_TIMEOUT_S + 30)
    finally:
        writer.close()


@pytest.mark.e2e
@pytest.mark.asyncio(loop_scope="module")
async def test_a_request_whose_body_never_comes_gets_408_and_reaches_no_pod(
    live: LiveGateway,
) -> None:
    before = sum(len(u.received) for u in live.upstreams.values())
    headers_only = (
        b"POST /v1/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
        b"content-length: 1000\r\n\r\n"
    )
    answer = await send_and_read(live.short_timeout_port, headers_only)
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    partial_headers = b"POST /v1/completions HTTP/1.1\r\nhost: gateway\r\n"
    answer = await send_and_read(live.short_timeout_port, partial_headers)
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert sum(len(u.received) for u in live.upstreams.values()) == before


# -- hot reload from a mounted ConfigMap ------------------------------------------------


def kubelet_projects(directory: Path, files: dict[str, str], generation: int) -> None:
    """Write a ConfigMap volume's files the way the kubelet does: a new timestamped
    directory, then one atomic rename of the ``..data`` symlink onto it."""
    data = directory / f"..2026_11_30_00_00_0{generation}.000000000"
    data.mkdir()
    for name, text in files.items():
        (data / name).write_text(text)
        link = directory / name
        if not link.is_symlink():
            link.symlink_to(Path("..data") / name)
    staging = directory / "..data_tmp"
    staging.symlink_to(data.name)
    os.replace(staging, directory / "..data")


def test_a_config_map_update_reloads_the_mounted_policy_directory(tmp_path: Path) -> None:
    seed = resource("ConfigMap")["data"]["default.yaml"]
    kubelet_projects(tmp_path, {"default.yaml": seed}, 1)
    store = PolicyStore.open(tmp_path)
    assert store.current.policies[0].name == "default"
    assert not store.reload().changed  # the kubelet's own entries are not policies
    kubelet_projects(tmp_path, {"default.yaml": seed.replace("name: default", "name: edited")}, 2)
    reload = store.reload()
    assert reload.changed and reload.error is None
    assert store.current.policies[0].name == "edited"


@pytest.mark.e2e
@pytest.mark.asyncio(loop_scope="module")
async def test_a_request_policyd_does_not_answer_in_time_gets_the_json_503(
    live: LiveGateway,
) -> None:
    """ext_proc fails open: past the message timeout the request goes on without a
    destination, misses the `inference` route and meets the VirtualService's
    `unrouted` answer; no pod sees it, not even one the client named."""
    timeout = float(ext_proc_filter()["typed_config"]["message_timeout"].removesuffix("s"))
    before = sum(len(u.received) for u in live.upstreams.values())
    # A destination the client names itself is removed as the request arrives
    # (the connection manager's early header mutation), so it cannot route it.
    stalled = {
        "x-test-stall": str(timeout + 0.5),
        DESTINATION_HEADER: live.upstreams["pod-a"].address,
    }
    status, seen = await complete(live, stalled)
    assert status == 503
    assert json.loads(seen["body"])["error"]["code"] == "no_destination"
    assert seen["content-type"] == "application/json"
    assert sum(len(u.received) for u in live.upstreams.values()) == before
