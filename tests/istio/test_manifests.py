"""The Kubernetes and Istio manifests in ``istio/`` agree with the code they deploy.

No cluster here, so what can be checked is checked against the real parts:
the Deployment's arguments go through ``policyd serve``'s own parser and
checks, the policy ConfigMap is the shipped policy and loads, the Envoy
configuration the EnvoyFilter patches in equals what ``policyd envoy-config``
generates and is accepted by the real Envoy (``envoy --mode validate``), and
the policy directory reloads when the kubelet swaps a ConfigMap's files.
"""

from __future__ import annotations

import copy
import os
import subprocess
from pathlib import Path
from typing import Any

import yaml

from policyd.cli import build_parser
from policyd.extproc.envoy_config import RUNTIME_FLAGS, EnvoyConfigOptions, bootstrap
from policyd.extproc.envoy_process import envoy_binary
from policyd.extproc.health import LIVENESS, READINESS
from policyd.extproc.replies import DESTINATION_HEADER
from policyd.extproc.serve import check_arguments
from policyd.policy import PolicyStore

REPO = Path(__file__).resolve().parents[2]
ISTIO = REPO / "istio"
NAMESPACE_PLACEHOLDER = "policyd.NAMESPACE.svc.cluster.local"


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
        p["patch"]["value"] for p in patches("CLUSTER") if p["patch"]["value"]["name"] == name
    ]
    assert isinstance(cluster, dict)
    return cluster


def generated() -> dict[str, Any]:
    """``policyd envoy-config``'s bootstrap, pointed at the in-cluster Service."""
    return bootstrap(EnvoyConfigOptions(policyd_address=NAMESPACE_PLACEHOLDER))


def generated_cluster(name: str) -> dict[str, Any]:
    (cluster,) = [c for c in generated()["static_resources"]["clusters"] if c["name"] == name]
    return dict(cluster)


def generated_manager() -> dict[str, Any]:
    listener = generated()["static_resources"]["listeners"][0]
    manager: dict[str, Any] = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return manager


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


def test_the_namespace_replacement_targets_the_policyd_cluster_address() -> None:
    (replacement,) = documents("kustomization.yaml")[0]["replacements"]
    assert replacement["source"] == {
        "kind": "Service",
        "name": "policyd",
        "fieldPath": "metadata.namespace",
    }
    (target,) = replacement["targets"]
    (field_path,) = target["fieldPaths"]
    value: Any = resource("EnvoyFilter")
    for step in field_path.split("."):
        value = value[int(step)] if step.isdigit() else value[step]
    assert value == NAMESPACE_PLACEHOLDER
    assert value.split(".")[target["options"]["index"]] == "NAMESPACE"


def test_the_policy_config_map_is_the_shipped_policy_and_loads(tmp_path: Path) -> None:
    data = resource("ConfigMap")["data"]
    assert data == {"default.yaml": (REPO / "rules" / "default.yaml").read_text()}
    (tmp_path / "default.yaml").write_text(data["default.yaml"])
    assert PolicyStore.open(tmp_path).current.policies[0].name == "default"


# -- the Deployment runs `policyd serve` with flags it accepts ---------------------------


def serve_arguments() -> list[str]:
    spec = container()
    assert spec["command"] == ["policyd"]
    arguments: list[str] = spec["args"]
    assert arguments[0] == "serve"
    return arguments


def test_the_deployment_arguments_are_accepted_by_policyd_serve(tmp_path: Path) -> None:
    arguments = serve_arguments()
    parsed = build_parser("serve").parse_args(arguments)  # exits on a stale or unknown flag
    pod = resource("Deployment")["spec"]["template"]["spec"]
    (mount,) = container()["volumeMounts"]
    (volume,) = pod["volumes"]
    # The policy is the ConfigMap, mounted as a directory (a subPath gets no updates).
    assert parsed.policy == Path(mount["mountPath"])
    assert "subPath" not in mount
    assert volume["name"] == mount["name"]
    assert volume["configMap"]["name"] == resource("ConfigMap")["metadata"]["name"]
    # Pods from Kubernetes, with the RBAC to follow them.
    assert parsed.k8s_selector and parsed.pods is None
    assert pod["serviceAccountName"] == resource("ServiceAccount")["metadata"]["name"]
    # The whole check `policyd serve` runs before starting, with the policy in place.
    (tmp_path / "default.yaml").write_text(resource("ConfigMap")["data"]["default.yaml"])
    parsed.policy = tmp_path
    check_arguments(parsed)
    assert parsed.host == "0.0.0.0"
    assert pod["terminationGracePeriodSeconds"] > parsed.grace_seconds


def test_ports_and_probes_line_up_with_the_service_and_the_gateway() -> None:
    parsed = build_parser("serve").parse_args(serve_arguments())
    spec = container()
    port, monitoring = spec["ports"]
    assert port["containerPort"] == parsed.port
    assert monitoring["containerPort"] == parsed.monitoring_port
    annotations = resource("Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(parsed.monitoring_port)
    assert spec["readinessProbe"]["grpc"] == {"port": parsed.port, "service": READINESS}
    assert spec["livenessProbe"]["grpc"] == {"port": parsed.port, "service": LIVENESS}
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
    (patch,) = patches("HTTP_FILTER")
    assert patch["patch"]["operation"] == "INSERT_BEFORE"
    assert patch["match"]["listener"]["filterChain"]["filter"]["subFilter"] == {
        "name": "envoy.filters.http.router"
    }
    value: dict[str, Any] = patch["patch"]["value"]
    return value


def test_the_ext_proc_filter_and_clusters_are_those_envoy_config_generates() -> None:
    (expected_filter,) = [
        f for f in generated_manager()["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"
    ]
    assert ext_proc_filter() == expected_filter
    assert added_cluster("model_servers") == generated_cluster("model_servers")
    assert added_cluster("policyd") == generated_cluster("policyd")
    (listener,) = patches("LISTENER")
    assert listener["patch"]["value"] == {
        "per_connection_buffer_limit_bytes": EnvoyConfigOptions().buffer_limit_bytes
    }


def early_header_mutations() -> list[dict[str, Any]]:
    (patch,) = patches("NETWORK_FILTER")
    assert patch["patch"]["operation"] == "MERGE"
    assert patch["match"]["listener"]["filterChain"]["filter"] == {
        "name": "envoy.filters.network.http_connection_manager"
    }
    found: list[dict[str, Any]] = patch["patch"]["value"]["typed_config"][
        "early_header_mutation_extensions"
    ]
    return found


def test_a_client_destination_header_is_removed_before_any_filter_as_envoy_config_does() -> None:
    """ext_proc fails open, so the header must be gone before policyd is asked."""
    assert early_header_mutations() == generated_manager()["early_header_mutation_extensions"]


def test_the_route_goes_to_the_chosen_pod_only_when_policyd_named_it() -> None:
    (patch,) = patches("HTTP_ROUTE")
    assert patch["match"]["routeConfiguration"]["vhost"]["route"]["name"] == "inference"
    value = patch["patch"]["value"]
    assert value["match"]["headers"] == [{"name": DESTINATION_HEADER, "present_match": True}]
    (chosen,) = [
        r
        for r in generated_manager()["route_config"]["virtual_hosts"][0]["routes"]
        if r["name"] == "to_chosen_pod"
    ]
    assert value["route"] == chosen["route"]
    (route,) = resource("VirtualService")["spec"]["http"]
    assert route["name"] == "inference"
    gateway = resource("Gateway")
    assert resource("VirtualService")["spec"]["gateways"] == [gateway["metadata"]["name"]]
    assert (
        gateway["spec"]["selector"] == resource("EnvoyFilter")["spec"]["workloadSelector"]["labels"]
    )


def gateway_runtime_values() -> dict[str, str]:
    """The Envoy runtime values the gateway's Helm values give its pods
    (Istio's ProxyConfig ``runtimeValues``, from the ``proxy.istio.io/config``
    annotation, which Istio reads as YAML)."""
    values = yaml.safe_load((ISTIO / "helm" / "gateway-values.yaml").read_text())
    proxy_config = yaml.safe_load(values["podAnnotations"]["proxy.istio.io/config"])
    runtime: dict[str, str] = proxy_config["runtimeValues"]
    return runtime


def test_the_gateway_pods_get_the_runtime_flags_envoy_config_sets() -> None:
    runtime = gateway_runtime_values()
    # ProxyConfig's runtimeValues is a map of strings.
    assert runtime == {name: str(value).lower() for name, value in RUNTIME_FLAGS.items()}


def gateway_bootstrap(ext_proc: dict[str, Any]) -> dict[str, Any]:
    """An Envoy bootstrap made of the EnvoyFilter's patches, as Istio would apply them,
    with the runtime values the gateway's Helm values set."""
    (listener_patch,) = patches("LISTENER")
    (route_patch,) = patches("HTTP_ROUTE")
    policyd_cluster = copy.deepcopy(added_cluster("policyd"))
    endpoint = policyd_cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    endpoint["address"]["socket_address"]["address"] = "policyd.inference.svc.cluster.local"
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network."
        "http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "gateway",
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "gateway",
                    "domains": ["*"],
                    "routes": [
                        {
                            "name": "inference",
                            "match": {"prefix": "/v1/", **route_patch["patch"]["value"]["match"]},
                            "route": route_patch["patch"]["value"]["route"],
                        }
                    ],
                }
            ]
        },
        "early_header_mutation_extensions": early_header_mutations(),
        "http_filters": [
            ext_proc,
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            },
        ],
    }
    listener = {
        "name": "gateway",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": 18080}},
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
        **listener_patch["patch"]["value"],
    }
    return {
        "layered_runtime": {
            "layers": [{"name": "istio", "static_layer": gateway_runtime_values()}]
        },
        "static_resources": {
            "listeners": [listener],
            "clusters": [policyd_cluster, added_cluster("model_servers")],
        },
    }


def envoy_validates(config: dict[str, Any], directory: Path) -> subprocess.CompletedProcess[str]:
    path = directory / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    return subprocess.run(
        [str(envoy_binary()), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_patched_gateway_configuration_validates_with_the_real_envoy(tmp_path: Path) -> None:
    result = envoy_validates(gateway_bootstrap(ext_proc_filter()), tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_envoy_validation_would_catch_a_broken_patch(tmp_path: Path) -> None:
    broken = copy.deepcopy(ext_proc_filter())
    broken["typed_config"]["processing_mode"]["request_body_mode"] = "BUFFERD"
    result = envoy_validates(gateway_bootstrap(broken), tmp_path)
    assert result.returncode != 0
    assert "BUFFERD" in result.stdout + result.stderr


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
