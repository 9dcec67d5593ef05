"""The image's file system, built without a container runtime, runs policyd.

The Dockerfile's build stage copies the files its ``COPY`` lines name and runs
``image/install.sh`` into a virtual environment; the final stage copies that
environment onto a distroless Python and starts ``policyd`` from it. Here the
same files, read from the Dockerfile's own ``COPY`` and ``RUN`` lines, go
through the same script into a temporary directory (once per test session: the
install downloads the lock's packages, or takes them from pip's cache), and
the installed ``policyd`` runs from a directory outside the repository, so the
repository's editable install cannot stand in for it.

The Dockerfile itself is not built here (no container runtime); its base
images and the distroless interpreter are not exercised.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
CHART = ROOT / "istio" / "helm" / "policyd"

pytestmark = pytest.mark.timeout(900)  # the session's install, on a cold pip cache


@dataclass(frozen=True)
class Stage:
    base: str
    alias: str  # FROM ... AS alias
    instructions: list[tuple[str, str]]  # (INSTRUCTION, its arguments), continuations joined


def stages() -> list[Stage]:
    """The Dockerfile's stages, in order."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    found: list[Stage] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, arguments = line.partition(" ")
        if instruction.upper() == "FROM":
            words = arguments.split()
            alias = words[2] if len(words) == 3 and words[1].upper() == "AS" else ""
            found.append(Stage(words[0], alias, []))
        else:
            found[-1].instructions.append((instruction.upper(), arguments.strip()))
    return found


def install_command(stage: Stage) -> list[str]:
    """The build stage's ``RUN ... sh SCRIPT SOURCE VENV``, split into words."""
    (run,) = [a for i, a in stage.instructions if i == "RUN" and "image/install.sh" in a]
    return shlex.split(run)


@dataclass(frozen=True)
class ImageTree:
    root: Path  # stands for the build stage's /
    venv: Path  # the environment the final stage copies (under root)


@pytest.fixture(scope="session")
def image_tree(tmp_path_factory: pytest.TempPathFactory) -> ImageTree:
    build, _final = stages()
    root = tmp_path_factory.mktemp("image") / "root"
    for instruction, arguments in build.instructions:
        if instruction != "COPY":
            continue
        *sources, destination = arguments.split()
        for source in sources:
            target = root / destination.lstrip("/")
            if destination.endswith("/"):
                target = target / Path(source).name
            if (ROOT / source).is_dir():
                shutil.copytree(ROOT / source, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(ROOT / source, target)
    words = install_command(build)
    script_at = next(i for i, w in enumerate(words) if w.endswith("image/install.sh"))
    script, source, venv = words[script_at : script_at + 3]
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL"))}
    environment["PYTHON"] = getattr(sys, "_base_executable", sys.executable)  # not this venv
    installed = subprocess.run(
        [
            "sh",
            str(root / script.lstrip("/")),
            str(root / source.lstrip("/")),
            str(root / venv.lstrip("/")),
        ],
        capture_output=True,
        text=True,
        env=environment,
        timeout=840,
        check=False,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return ImageTree(root, root / venv.lstrip("/"))


def run(tree: ImageTree, *arguments: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """A command of the image's environment, as the final stage's PATH finds it."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL"))}
    environment["PATH"] = f"{tree.venv / 'bin'}:/usr/bin:/bin"
    return subprocess.run(
        list(arguments),
        check=False,
        capture_output=True,
        text=True,
        env=environment,
        cwd=cwd,
        timeout=120,
    )


def test_policyd_runs_from_the_image_and_is_the_projects_version(
    image_tree: ImageTree, tmp_path: Path
) -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    shown = run(image_tree, "policyd", "--version", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == f"policyd {version}"
    # The package comes from the image's environment, not from this checkout.
    where = run(
        image_tree, "python", "-c", "import policyd, tokenizers; print(policyd.__file__)",
        cwd=tmp_path,
    )  # fmt: skip
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(image_tree.venv)


@pytest.mark.parametrize(
    "policy", sorted(p.name for p in (ROOT / "rules").glob("*.yaml") if ".test." not in p.name)
)
def test_the_image_checks_each_shipped_policy(
    image_tree: ImageTree, tmp_path: Path, policy: str
) -> None:
    checked = run(image_tree, "policyd", "check", str(ROOT / "rules" / policy), cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_image_reports_a_broken_policy(image_tree: ImageTree, tmp_path: Path) -> None:
    """The check above can fail: a policy with an unknown section is refused."""
    broken = tmp_path / "broken.yaml"
    broken.write_text((ROOT / "rules" / "default.yaml").read_text() + "\nnot_a_section: 1\n")
    checked = run(image_tree, "policyd", "check", str(broken), cwd=tmp_path)
    assert checked.returncode != 0
    assert "broken.yaml" in checked.stdout + checked.stderr


def test_the_image_holds_no_installer(image_tree: ImageTree, tmp_path: Path) -> None:
    assert not (image_tree.venv / "bin" / "pip").exists()
    pip = run(image_tree, "python", "-m", "pip", "--version", cwd=tmp_path)
    assert pip.returncode != 0 and "No module named pip" in pip.stderr


def test_the_final_stage_runs_the_environment_as_the_manifests_user() -> None:
    build, final = stages()
    words = install_command(build)
    venv = words[next(i for i, w in enumerate(words) if w.endswith("image/install.sh")) + 2]
    assert build.alias == "build"
    instructions = dict(final.instructions)
    assert instructions["COPY"] == f"--from=build {venv} {venv}"
    assert "RUN" not in instructions  # nothing is built or installed in the final stage
    assert instructions["ENV"].startswith(f"PATH={venv}/bin:")
    assert instructions["ENTRYPOINT"] == '["policyd"]'
    user, group = instructions["USER"].split(":")
    deployment = yaml.safe_load((ROOT / "istio" / "deployment.yaml").read_text())
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == int(user) != 0
    assert pod["securityContext"]["runAsGroup"] == int(group)
    assert pod["containers"][0]["command"] == ["policyd"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == int(user)


def test_the_build_context_holds_what_the_dockerfile_copies() -> None:
    """.dockerignore lets through exactly the build stage's COPY sources."""
    build, _final = stages()
    copied = {
        source
        for instruction, arguments in build.instructions
        if instruction == "COPY"
        for source in arguments.split()[:-1]
    }
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    allowed = {line[1:] for line in ignore if line.startswith("!")}
    assert copied == allowed


def test_the_chart_and_manifests_name_the_image_the_dockerfile_documents() -> None:
    """The Dockerfile's build command tags REPOSITORY:VERSION; the chart's image
    defaults to that repository and to its appVersion, which is the version; the
    kustomization names the same image."""
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    (tag,) = [w for w in DOCKERFILE.read_text().split() if w.endswith(f"/policyd:{version}")]
    repository = tag.rsplit(":", 1)[0]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert chart["appVersion"] == version
    assert values["image"] == {"repository": repository, "tag": "", "pullPolicy": ""}
    assert (
        "default .Chart.AppVersion .Values.image.tag"
        in (CHART / "templates" / "deployment.yaml").read_text()
    )
    for folder in ("istio", "istio/inferencepool"):
        kustomization = yaml.safe_load((ROOT / folder / "kustomization.yaml").read_text())
        (image,) = kustomization["images"]
        assert (image["newName"], image["newTag"]) == (repository, version), folder
