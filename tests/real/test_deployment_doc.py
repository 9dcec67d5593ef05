"""docs/deployment.md's "From zero", run as far as the real tools allow here: step 5's
``openssl`` commands as written, in a scratch directory, and the certificates they make
checked with ``openssl`` itself (the chain, the names, the key usages the two sides of
the mutual TLS need); step 7's ``helm install``, rendered by the real ``helm`` with the
same arguments (``helm template``: no cluster), naming the image of step 3 and the
Secret of step 5. Istio, the gateway chart, ``kubectl`` and ``docker`` do not run here
(tests/docs/test_deployment_doc.py checks those steps against the repository)."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "deployment.md"


def from_zero() -> str:
    text = DOC.read_text()
    start = text.index("\n## From zero\n")
    return text[start : text.index("\n## ", start + 1)]


def step(number: int) -> str:
    """The ``sh`` block of step ``number``."""
    text = from_zero()
    start = text.index(f"**{number}. ")
    block = text.index("```sh\n", start) + len("```sh\n")
    return text[block : text.index("```", block)]


def test_step_5_makes_certificates_for_both_sides(
    tool: Callable[[str], str], tmp_path: Path
) -> None:
    openssl = tool("openssl")
    lines = [line for line in step(5).replace("\\\n", " ").splitlines() if line.strip()]
    made = [line for line in lines if line.startswith(("openssl ", "printf "))]
    assert len(made) == len(lines) - 2  # the rest: the two kubectl create secret
    script = "set -e\n" + "\n".join(made).replace("openssl ", f"{openssl} ") + "\n"
    ran = subprocess.run(
        ["sh", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False
    )
    assert ran.returncode == 0, ran.stderr

    def verify(certificate: str, purpose: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [openssl, "verify", "-CAfile", "ca.crt", "-purpose", purpose, certificate],
            cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip

    assert verify("policyd.crt", "sslserver").returncode == 0
    assert verify("gateway.crt", "sslclient").returncode == 0
    assert verify("gateway.crt", "sslserver").returncode != 0  # the check can fail

    def text_of(certificate: str) -> str:
        return subprocess.run(
            [openssl, "x509", "-in", certificate, "-noout", "-text"],
            cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True,
        ).stdout  # fmt: skip

    assert "DNS:policyd.inference.svc" in text_of("policyd.crt")  # the chart's SNI
    # every file the Secrets take exists
    for line in lines:
        if line.startswith("kubectl"):
            for name in re.findall(r"--from-file=(?:[\w.]+=)?([\w.]+)", line):
                assert (tmp_path / name).is_file(), name


def test_step_7_renders_with_the_image_of_step_3_and_the_secret_of_step_5(
    tool: Callable[[str], str],
) -> None:
    (install,) = [
        line for line in step(7).replace("\\\n", " ").splitlines() if line.startswith("helm")
    ]
    words = install.split()
    assert words[:3] == ["helm", "install", "policyd"]
    rendered = subprocess.run(
        [tool("helm"), "template", *words[2:]],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert rendered.returncode == 0, rendered.stderr
    objects = {
        (o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(rendered.stdout) if o
    }
    pod = objects["Deployment", "policyd"]["spec"]["template"]["spec"]
    image = re.search(r"docker build -t (\S+) \.", step(3))
    assert image is not None
    assert pod["containers"][0]["image"] == image.group(1)
    assert {"name": "tls", "secret": {"secretName": "policyd-tls"}} in pod["volumes"]
    assert "policyd-tls" in step(5) and "policyd-client-tls" in step(5)
    assert "--k8s-selector=app=vllm" in pod["containers"][0]["args"]
