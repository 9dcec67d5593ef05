"""A real kube-apiserver on etcd, on loopback (the recipe of ``../shared/tools/README.md``).

No controllers or kubelet run: objects are stored and validated, nothing is
scheduled. That is what ``kubectl apply --dry-run=server`` and ``istioctl
install --dry-run`` need: the API server's schema checks, and a cluster to ask.
"""

from __future__ import annotations

import json
import secrets
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from e2e_support import free_port

# Resources the telemetry files hold: kind -> plural.
PLURALS = {
    "Namespace": "namespaces",
    "ConfigMap": "configmaps",
    "Service": "services",
    "Deployment": "deployments",
    "CustomResourceDefinition": "customresourcedefinitions",
    "Telemetry": "telemetries",
    # and the objects of the Helm chart (istio/helm/policyd)
    "ServiceAccount": "serviceaccounts",
    "Role": "roles",
    "RoleBinding": "rolebindings",
    "NetworkPolicy": "networkpolicies",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "HorizontalPodAutoscaler": "horizontalpodautoscalers",
    "EnvoyFilter": "envoyfilters",
    "Gateway": "gateways",
    "VirtualService": "virtualservices",
    "ServiceMonitor": "servicemonitors",
    # and the Gateway API and its Inference Extension (istio/inferencepool)
    "HTTPRoute": "httproutes",
    "InferencePool": "inferencepools",
    "DestinationRule": "destinationrules",
    "Pod": "pods",
}


@dataclass
class Cluster:
    server: str
    token: str
    kubeconfig: Path
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def apply(self, document: dict[str, Any], *, dry_run: bool) -> tuple[int, str]:
        """Server-side apply, as ``kubectl apply --server-side [--dry-run=server]`` does,
        with unknown fields an error (``fieldValidation=Strict``): the status and message."""
        metadata = document["metadata"]
        version = document["apiVersion"]
        path = "/api/v1" if version == "v1" else f"/apis/{version}"
        if "namespace" in metadata:
            path += f"/namespaces/{metadata['namespace']}"
        path += f"/{PLURALS[document['kind']]}/{metadata['name']}"
        query = "fieldManager=policyd-test&fieldValidation=Strict&force=true"
        if dry_run:
            query += "&dryRun=All"
        request = urllib.request.Request(
            f"{self.server}{path}?{query}",
            data=json.dumps(document).encode(),
            method="PATCH",
            headers={
                "Authorization": f"Bearer {self.token}",
                "Content-Type": "application/apply-patch+yaml",
            },
        )
        try:
            with urllib.request.urlopen(request, context=_insecure(), timeout=30) as response:
                return response.status, ""
        except urllib.error.HTTPError as error:
            return error.code, str(json.loads(error.read()).get("message", ""))

    def create(self, document: dict[str, Any], namespace: str) -> tuple[int, str]:
        """A create (POST) in ``namespace`` as a dry run with unknown fields an error
        (``?dryRun=All&fieldValidation=Strict``): the status and message."""
        version = document["apiVersion"]
        path = "/api/v1" if version == "v1" else f"/apis/{version}"
        path += f"/namespaces/{namespace}/{PLURALS[document['kind']]}"
        request = urllib.request.Request(
            f"{self.server}{path}?dryRun=All&fieldValidation=Strict",
            data=json.dumps(document).encode(),
            method="POST",
            headers={
                "Authorization": f"Bearer {self.token}",
                "Content-Type": "application/json",
            },
        )
        try:
            with urllib.request.urlopen(request, context=_insecure(), timeout=30) as response:
                return response.status, ""
        except urllib.error.HTTPError as error:
            return error.code, str(json.loads(error.read()).get("message", ""))

    def create_when_served(self, document: dict[str, Any], namespace: str) -> tuple[int, str]:
        """``create``, waiting out the moment after a CRD's creation when its
        resources are not served yet (404)."""
        for _ in range(100):
            status, message = self.create(document, namespace)
            if status != 404:
                return status, message
            time.sleep(0.2)
        return status, message

    def call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        content_type: str = "application/json",
    ) -> tuple[int, dict[str, Any]]:
        """One API request as the admin: the status and the JSON answer."""
        request = urllib.request.Request(
            f"{self.server}{path}",
            data=None if body is None else json.dumps(body).encode(),
            method=method,
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": content_type},
        )
        try:
            with urllib.request.urlopen(request, context=_insecure(), timeout=30) as response:
                return response.status, _answer(response.read())
        except urllib.error.HTTPError as error:
            return error.code, _answer(error.read())

    def service_account_token(self, namespace: str, name: str) -> str:
        """A token of the ServiceAccount ``name`` (a TokenRequest), for RBAC checks."""
        status, answer = self.call(
            "POST",
            f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {}},
        )
        assert status == 201, answer
        return str(answer["status"]["token"])

    def kubeconfig_for(self, token: str, path: Path) -> Path:
        """A kubeconfig for this server with ``token`` (insecure TLS, as the admin's)."""
        config = json.loads(self.kubeconfig.read_text())
        config["users"][0]["user"]["token"] = token
        path.write_text(json.dumps(config))
        return path

    def ready(self) -> bool:
        request = urllib.request.Request(
            f"{self.server}/readyz", headers={"Authorization": f"Bearer {self.token}"}
        )
        try:
            with urllib.request.urlopen(request, context=_insecure(), timeout=2) as response:
                return bool(response.read() == b"ok")
        except OSError:
            return False


def _answer(body: bytes) -> dict[str, Any]:
    """A JSON answer, or ``{"text": ...}`` for the plain-text ones (404 page not found)."""
    try:
        answer = json.loads(body or b"{}")
    except ValueError:
        return {"text": body.decode(errors="replace")}
    return answer if isinstance(answer, dict) else {"value": answer}


def _insecure() -> ssl.SSLContext:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # the API server's self-signed test certificate
    return context


def start_cluster(etcd: str, apiserver: str, openssl: str, directory: Path) -> Cluster:
    key, public = directory / "sa.key", directory / "sa.pub"
    subprocess.run([openssl, "genrsa", "-out", str(key), "2048"], check=True, capture_output=True)
    subprocess.run(
        [openssl, "rsa", "-in", str(key), "-pubout", "-out", str(public)],
        check=True,
        capture_output=True,
    )
    token = secrets.token_hex(16)
    (directory / "tokens.csv").write_text(f'{token},admin,admin,"system:masters"\n')
    client, peer, secure = free_port(), free_port(), free_port()
    server = f"https://127.0.0.1:{secure}"
    kubeconfig = directory / "admin.kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "local",
                        "cluster": {"server": server, "insecure-skip-tls-verify": True},
                    }
                ],
                "users": [{"name": "admin", "user": {"token": token}}],
                "contexts": [{"name": "local", "context": {"cluster": "local", "user": "admin"}}],
                "current-context": "local",
            }
        )
    )
    cluster = Cluster(server, token, kubeconfig)
    etcd_command = [
        etcd,
        "--name=dev",
        f"--data-dir={directory / 'etcd'}",
        f"--listen-client-urls=http://127.0.0.1:{client}",
        f"--advertise-client-urls=http://127.0.0.1:{client}",
        f"--listen-peer-urls=http://127.0.0.1:{peer}",
        f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
        f"--initial-cluster=dev=http://127.0.0.1:{peer}",
    ]
    apiserver_command = [
        apiserver,
        f"--etcd-servers=http://127.0.0.1:{client}",
        "--bind-address=127.0.0.1",
        "--advertise-address=127.0.0.1",
        f"--secure-port={secure}",
        f"--cert-dir={directory / 'certs'}",
        f"--token-auth-file={directory / 'tokens.csv'}",
        "--authorization-mode=RBAC",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={public}",
        f"--service-account-signing-key-file={key}",
        "--service-cluster-ip-range=10.96.0.0/16",
        "--endpoint-reconciler-type=none",
    ]
    for name, command in (("etcd", etcd_command), ("apiserver", apiserver_command)):
        with (directory / f"{name}.log").open("wb") as log:
            cluster.processes.append(
                subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
            )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if cluster.ready():
            return cluster
        if any(process.poll() is not None for process in cluster.processes):
            break
        time.sleep(0.5)
    stop_cluster(cluster)
    tail = (directory / "apiserver.log").read_text(errors="replace").splitlines()[-20:]
    raise AssertionError("kube-apiserver did not become ready:\n" + "\n".join(tail))


def stop_cluster(cluster: Cluster) -> None:
    """kube-apiserver first: with etcd gone first, its shutdown hangs."""
    for process in reversed(cluster.processes):
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
