"""istio/inferencepool/ holds together, and parts from istio/ only where it must.

The real tools check these files in ``tests/real/test_inferencepool_manifests.py``
(kustomize, istioctl, a strict dry run on a real API server with the real
CRDs) and ``tests/real/test_inference_pool.py`` (the Role is enough for the
discovery); here, without them: the names that must agree agree, and the
objects shared with the EnvoyFilter path are the same.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from policyd.cli import build_parser
from policyd.extproc.serve_command import check_arguments
from policyd.pool.inference_objects import GROUPS, OBJECTIVES, REWRITES

ISTIO = Path(__file__).resolve().parents[2] / "istio"
POOL_PATH = ISTIO / "inferencepool"


def objects(folder: Path) -> dict[tuple[str, str], dict[str, Any]]:
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    found = {}
    for name in kustomization["resources"]:
        for document in yaml.safe_load_all((folder / name).read_text()):
            if document:
                found[document["kind"], document["metadata"]["name"]] = document
    return found


POOL = objects(POOL_PATH)
ENVOYFILTER = objects(ISTIO)


def one(kind: str) -> dict[str, Any]:
    (found,) = [o for (k, _), o in POOL.items() if k == kind]
    return found


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (found,) = deployment["spec"]["template"]["spec"]["containers"]
    return found


def test_the_deployment_follows_the_pool_the_role_lets_it_read(
    tmp_path: Path, certificates: Any
) -> None:
    deployment, pool, role = one("Deployment"), one("InferencePool"), one("Role")
    parsed = build_parser("serve").parse_args(container(deployment)["args"])
    assert parsed.inference_pool == pool["metadata"]["name"]
    assert parsed.k8s_selector is None and parsed.pods is None
    (tmp_path / "default.yaml").write_text(one("ConfigMap")["data"]["default.yaml"])
    parsed.policy = tmp_path
    # The Secret's files (tests/istio/test_manifests.py checks the mount).
    parsed.tls_cert, parsed.tls_key = certificates.server_cert, certificates.server_key
    parsed.tls_client_ca = certificates.ca
    check_arguments(parsed)  # what `policyd serve` checks before it starts
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"])): r for r in role["rules"]}
    pools = rules[("inference.networking.k8s.io",), ("inferencepools",)]
    assert pools["resourceNames"] == [pool["metadata"]["name"]]
    assert sorted(pools["verbs"]) == ["get", "watch"]
    assert sorted(rules[("",), ("pods",)]["verbs"]) == ["list", "watch"]
    objects = rules[GROUPS, (OBJECTIVES, REWRITES)]
    assert sorted(objects["verbs"]) == ["list", "watch"]  # policyd.pool.inference_objects
    assert len(rules) == 3  # nothing else
    binding = one("RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]


def test_the_pool_picks_through_policyds_service_and_the_route_reaches_the_pool() -> None:
    pool, service, route = one("InferencePool"), one("Service"), one("HTTPRoute")
    picker = pool["spec"]["endpointPickerRef"]
    assert picker["name"] == service["metadata"]["name"]
    (port,) = service["spec"]["ports"]
    assert picker["port"]["number"] == port["port"]
    assert "clusterIP" not in service["spec"]  # the gateways' ext_proc cluster needs one
    ports = {p["name"]: p["containerPort"] for p in container(one("Deployment"))["ports"]}
    assert port["targetPort"] in ports
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [
        {
            "group": "inference.networking.k8s.io",
            "kind": "InferencePool",
            "name": pool["metadata"]["name"],
        }
    ]
    assert route["spec"]["parentRefs"][0]["name"] == one("Gateway")["metadata"]["name"]
    gateway_pods = one("NetworkPolicy")["spec"]["ingress"][0]["from"][0]["podSelector"]
    assert gateway_pods["matchLabels"] == {
        "gateway.networking.k8s.io/gateway-name": one("Gateway")["metadata"]["name"]
    }


def test_what_both_paths_share_is_the_same() -> None:
    for key in (("ServiceAccount", "policyd"), ("ConfigMap", "policyd-policy")):
        assert POOL[key] == ENVOYFILTER[key], key
    deployment = one("Deployment")
    other = ENVOYFILTER["Deployment", "policyd"]
    assert deployment["spec"]["template"]["metadata"] == other["spec"]["template"]["metadata"]
    pod, other_pod = deployment["spec"]["template"]["spec"], other["spec"]["template"]["spec"]
    assert {k: v for k, v in pod.items() if k != "containers"} == {
        k: v for k, v in other_pod.items() if k != "containers"
    }
    mine, theirs = container(deployment), container(other)
    assert {k: v for k, v in mine.items() if k != "args"} == {
        k: v for k, v in theirs.items() if k != "args"
    }
    # the pod source, and the fallback list only an override-host cluster takes
    pod_source = {"--k8s-selector=app=vllm", "--k8s-target-port=8000", "--send-fallbacks"}
    assert [a for a in theirs["args"] if a not in pod_source] == [
        a for a in mine["args"] if not a.startswith("--inference-pool=")
    ]


def test_the_pool_fails_closed_and_the_chart_does_too() -> None:
    """No policyd answering: the gateway fails the request instead of sending it on
    past shedding and flow control (docs/deployment.md, "Failure mode")."""
    picker = one("InferencePool")["spec"]["endpointPickerRef"]
    assert picker["failureMode"] == "FailClose"
    values = yaml.safe_load((ISTIO / "helm" / "policyd" / "values.yaml").read_text())
    assert values["inferencePool"]["failureMode"] == picker["failureMode"]


def test_the_gateway_reaches_policyd_over_mutual_tls() -> None:
    """policyd serves mutual TLS only; the DestinationRule gives Istio's gateway the
    client side for policyd's Service (host and SNI in this namespace)."""
    args = container(one("Deployment"))["args"]
    assert {"--tls-cert", "--tls-key", "--tls-client-ca"} <= {a.split("=")[0] for a in args}
    rule = one("DestinationRule")["spec"]
    service = one("Service")["metadata"]["name"]
    assert rule["host"] == f"{service}.NAMESPACE.svc.cluster.local"
    tls = rule["trafficPolicy"]["tls"]
    assert tls == {
        "mode": "MUTUAL",
        "clientCertificate": "/etc/policyd-client/tls.crt",
        "privateKey": "/etc/policyd-client/tls.key",
        "caCertificates": "/etc/policyd-client/ca.crt",
        "sni": f"{service}.NAMESPACE.svc",
    }
    (replacement,) = yaml.safe_load((POOL_PATH / "kustomization.yaml").read_text())["replacements"]
    (target,) = replacement["targets"]
    assert target["select"] == {"kind": "DestinationRule", "name": "policyd"}
    assert sorted(target["fieldPaths"]) == ["spec.host", "spec.trafficPolicy.tls.sni"]


def test_the_gateway_edge_is_the_envoyfilter_paths() -> None:
    """The pool's gateway gets the connection manager patch of istio/envoyfilter.yaml
    (request timeouts, client priority headers removed before the picker sees
    them; tests/istio/test_manifests.py runs it on the real Envoy), on the pods
    of the Gateway the NetworkPolicy admits."""
    (edge,) = ENVOYFILTER["EnvoyFilter", "policyd"]["spec"]["configPatches"][-1:]
    assert edge["applyTo"] == "NETWORK_FILTER"
    spec = one("EnvoyFilter")["spec"]
    assert spec["configPatches"] == [edge]
    gateway_pods = one("NetworkPolicy")["spec"]["ingress"][0]["from"][0]["podSelector"]
    assert spec["workloadSelector"]["labels"] == gateway_pods["matchLabels"]
