"""docs/deployment.md's commands agree with what they deploy.

No cluster, Istio or container runtime here, so each step of "From zero" is checked
against the files it names: the image tag is the chart's appVersion and its default,
every ``--set`` of the ``helm install`` is a value the chart's schema accepts (the same
command in the chart's README and in "Helm"), the model servers are what the chart's
defaults select and their arguments parse, the smoke test's request is one the
simulated pods serve, and "The Deployment"'s block is deployment.yaml's container.
``tests/real/test_deployment_doc.py`` runs what the real tools allow (``openssl``,
``helm``).
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from policyd.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "deployment.md"
CHART = ROOT / "istio" / "helm" / "policyd"
NAMESPACE = "inference"


def section(title: str) -> str:
    text = DOC.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.DOTALL)


def commands(text: str) -> list[list[str]]:
    """The shell commands of the section's ``sh`` blocks, continuation lines joined, each
    split into words (here-documents left out: they are checked as YAML)."""
    found = []
    for block in blocks(text, "sh"):
        shell = re.sub(r"<<'EOF'\n.*?\nEOF\n", "", block, flags=re.DOTALL)
        for line in shell.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                found.append(shlex.split(line.rstrip(" &")))
    return found


def values() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    return loaded


def app_version() -> str:
    version: str = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    return version


def helm_install(text: str) -> list[str]:
    (install,) = [c for c in commands(text) if c[:3] == ["helm", "install", "policyd"]]
    return install


def set_values(install: list[str]) -> dict[str, str]:
    pairs = [install[i + 1] for i, word in enumerate(install) if word == "--set"]
    return dict(pair.split("=", 1) for pair in pairs)


def test_the_helm_install_sets_values_the_schema_accepts() -> None:
    install = helm_install(section("From zero"))
    assert install[3:6] == ["istio/helm/policyd", "-n", NAMESPACE]
    assert (ROOT / install[3] / "Chart.yaml").is_file()
    merged = copy.deepcopy(values())
    for key, value in set_values(install).items():
        node = merged
        *parents, leaf = key.split(".")
        for parent in parents:
            node = node[parent]  # a KeyError is a value the chart does not have
        assert leaf in node, key
        node[leaf] = type(node[leaf])(value) if not isinstance(node[leaf], str) else value
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator(schema).validate(merged)


def test_the_schema_check_above_can_fail() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    wrong = {**values(), "serve": {**values()["serve"], "k8sTargetport": 8000}}
    errors = list(jsonschema.Draft7Validator(schema).iter_errors(wrong))
    assert errors


def test_the_same_helm_install_in_the_chart_readme_and_in_helm() -> None:
    step = helm_install(section("From zero"))
    assert helm_install(section("Helm")) == step
    readme = (CHART / "README.md").read_text()
    (indented,) = re.findall(r"\n    (helm install policyd .*?)\n\n", readme, flags=re.DOTALL)
    assert shlex.split(indented.replace("\\\n", " ")) == step


def test_the_image_is_the_charts_default_and_its_app_version() -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert app_version() == version
    every = commands(section("From zero"))
    (build,) = [c for c in every if c[:2] == ["docker", "build"]]
    (push,) = [c for c in every if c[:2] == ["docker", "push"]]
    image = build[build.index("-t") + 1]
    assert push[2] == image and build[-1] == "."  # the repository root: its Dockerfile
    repository, tag = image.rsplit(":", 1)
    assert tag == app_version() and values()["image"]["tag"] == ""  # the default tag
    assert set_values(helm_install(section("From zero")))["image.repository"] == repository


def test_the_model_servers_are_what_the_chart_selects() -> None:
    text = section("From zero")
    (manifest,) = re.findall(r"<<'EOF'\n(.*?)\nEOF\n", text, flags=re.DOTALL)
    objects = {o["kind"]: o for o in yaml.safe_load_all(manifest)}
    chart, settings = values(), set_values(helm_install(text))
    selector = dict([settings["serve.k8sSelector"].split("=", 1)])
    assert selector == dict([chart["serve"]["k8sSelector"].split("=", 1)])
    pod = objects["Deployment"]["spec"]["template"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    port = container["ports"][0]
    assert port["containerPort"] == int(settings["serve.k8sTargetPort"])
    assert port["containerPort"] == chart["serve"]["k8sTargetPort"]
    service = objects["Service"]
    assert service["metadata"]["name"] == settings["modelServers.service"]
    assert service["metadata"]["name"] == chart["modelServers"]["service"]
    assert service["spec"]["selector"] == selector
    assert service["spec"]["ports"][0]["port"] == chart["modelServers"]["port"]
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]
    # the image's entry point is policyd: the arguments are a `policyd sim` command line
    (build,) = [c for c in commands(text) if c[:2] == ["docker", "build"]]
    assert container["image"] == build[build.index("-t") + 1]
    parsed = build_parser("sim").parse_args(container["args"])
    assert (parsed.pods, parsed.base_port, parsed.host) == (1, port["containerPort"], "0.0.0.0")


def test_the_smoke_test_asks_for_a_model_the_simulated_pods_serve() -> None:
    (request,) = [c for c in commands(section("From zero")) if "/v1/completions" in " ".join(c)]
    body = json.loads(request[request.index("-d") + 1])
    adapters = build_parser("sim").parse_args(["sim"]).adapters
    assert re.fullmatch(r"adapter-\d+", body["model"])
    assert int(body["model"].split("-")[1]) < adapters
    (traceparent,) = [w for w in request if w.startswith("traceparent:")]
    assert traceparent.endswith("-01")  # sampled: the parent-based sampler keeps the span
    forward = [
        c for c in commands(section("From zero")) if c[:1] == ["kubectl"] and "port-forward" in c
    ]
    assert forward[0][1:] == [
        "-n",
        NAMESPACE,
        "port-forward",
        "service/inference-gateway",
        "8080:80",
    ]


def test_the_deployment_block_is_deployment_yamls_container() -> None:
    (block,) = blocks(section("The Deployment"), "yaml")
    shown = yaml.safe_load(block)
    deployment = yaml.safe_load((ROOT / "istio" / "deployment.yaml").read_text())
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert shown == {"command": container["command"], "args": container["args"]}


def test_every_istio_floor_is_the_same() -> None:
    floors = set()
    for path in [DOC, ROOT / "istio" / "README.md", ROOT / "istio" / "envoyfilter.yaml",
                 CHART / "templates" / "envoyfilter.yaml"]:  # fmt: skip
        floors |= set(re.findall(r"Istio (?:>= ?)?(1\.\d+)(?: or later)?", path.read_text()))
        assert re.search(r"Istio (>= ?1\.27|1\.27 or later)", path.read_text()), path
    assert "1.22" not in floors
