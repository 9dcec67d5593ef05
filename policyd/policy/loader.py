"""Load policy files (one file, or a directory of them) into a ``PolicySet``.

A directory holds a set of policies served side by side: every ``*.yaml`` /
``*.yml`` file except policy tests (``*.test.yaml``) and except the files
other policies name as their *shadows*. A policy's shadows (``shadows:
[file, ...]``, paths relative to the policy) are loaded with it and attached
to it; a shadow must load, must have a name of its own and cannot name shadows
itself. Every problem in every file is collected before anything is rejected,
so one run of ``policyd check`` shows them all.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from policyd.policy.compiler import CompiledPolicy, compile_policy
from policyd.policy.diagnostics import Diagnostic, PolicyError
from policyd.policy.document import read_policy
from policyd.policy.policyset import PolicySet, build_policy_set
from policyd.policy.source import Source

POLICY_SUFFIXES = (".yaml", ".yml")
TEST_SUFFIXES = (".test.yaml", ".test.yml")


def is_test_file(path: Path) -> bool:
    return path.name.endswith(TEST_SUFFIXES)


def policy_files(path: Path) -> list[Path]:
    """The policy files ``path`` stands for: itself, or a directory's policies."""
    if path.is_dir():
        return sorted(
            p for p in path.iterdir() if p.suffix in POLICY_SUFFIXES and not is_test_file(p)
        )
    return [path]


def read_source(path: Path) -> Source:
    """The file's text as a ``Source``; an unreadable file is a ``PolicyError``.

    Bytes that are not UTF-8 are reported at the line and column of the first.
    """
    try:
        data = path.read_bytes()
    except OSError as error:
        reason = error.strerror or str(error)
        raise PolicyError([Diagnostic(str(path), 1, 1, f"cannot read file: {reason}")]) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line_start = data.rfind(b"\n", 0, error.start) + 1
        line = data.count(b"\n", 0, line_start) + 1
        column = len(data[line_start : error.start].decode("utf-8", errors="replace")) + 1
        message = f"cannot read file: byte 0x{data[error.start]:02x} is not UTF-8 ({error.reason})"
        raise PolicyError([Diagnostic(str(path), line, column, message)]) from None
    return Source(str(path), text)


def compile_source(source: Source) -> CompiledPolicy:
    """Compile one policy or raise ``PolicyError`` with every problem (warnings too)."""
    spec, diagnostics = read_policy(source)
    if spec is None:
        raise PolicyError(diagnostics)
    shape_errors = any(d.severity == "error" for d in diagnostics)
    policy, more = compile_policy(spec, shape_errors=shape_errors)  # reports the rest too
    if policy is None:
        raise PolicyError([*diagnostics, *more])
    return policy


def load_policy(path: Path) -> CompiledPolicy:
    """One policy file with its shadows, or ``PolicyError`` with every problem."""
    loader = _Loader()
    return loader.with_shadows(loader.compiled(path))


def load_policy_set(path: Path) -> PolicySet:
    """Load a policy file or a directory of policies, or raise ``PolicyError``."""
    files = policy_files(path)
    if not files:
        raise PolicyError([Diagnostic(str(path), 1, 1, "no policy files (*.yaml) here")])
    loader = _Loader()
    compiled: list[CompiledPolicy] = []
    problems: list[Diagnostic] = []
    for file in files:
        try:
            compiled.append(loader.compiled(file))
        except PolicyError as error:
            problems.extend(error.diagnostics)
    shadow_files = _shadows_of_others(compiled) if path.is_dir() else set()
    policies: list[CompiledPolicy] = []
    for policy in compiled:
        if Path(policy.path).resolve() in shadow_files:
            continue  # named as another policy's shadow: evaluated there, never served
        try:
            policies.append(loader.with_shadows(policy))
        except PolicyError as error:
            problems.extend(error.diagnostics)
    if compiled and not policies and not problems:
        message = "every policy here is named as another's shadow: none would be served"
        problems.append(Diagnostic(str(path), 1, 1, message))
    if problems:
        raise PolicyError(set(problems))  # a broken shadow is reported once
    policy_set, problems = build_policy_set(policies)
    if policy_set is None:
        raise PolicyError(problems)
    return policy_set


def _shadows_of_others(policies: list[CompiledPolicy]) -> set[Path]:
    found: set[Path] = set()
    for policy in policies:
        own = Path(policy.path).resolve()
        named = {shadow_path(policy, file).resolve() for file, _ in policy.shadow_refs}
        found |= named - {own}  # naming itself is an error reported with the policy
    return found


def shadow_path(policy: CompiledPolicy, file: str) -> Path:
    """Where a shadow named in ``policy`` lives: relative to the policy's own file."""
    return Path(policy.path).parent / file


def watched_files(path: Path, policies: PolicySet | None) -> list[Path]:
    """The files whose change means a reload: the policies and their shadows."""
    files = policy_files(path)
    if policies is not None:
        seen = {file.resolve() for file in files}
        for policy in policies.policies:
            for shadow in policy.shadows:
                file = Path(shadow.path)
                if file.resolve() not in seen:
                    seen.add(file.resolve())
                    files.append(file)
    return files


class _Loader:
    """Compiles each file once (a shadow may be shared) and attaches shadows."""

    def __init__(self) -> None:
        self._compiled: dict[Path, CompiledPolicy | PolicyError] = {}

    def compiled(self, path: Path) -> CompiledPolicy:
        key = path.resolve()
        if key not in self._compiled:
            try:
                self._compiled[key] = compile_source(read_source(path))
            except PolicyError as error:
                self._compiled[key] = error
        result = self._compiled[key]
        if isinstance(result, PolicyError):
            raise result
        return result

    def with_shadows(self, policy: CompiledPolicy) -> CompiledPolicy:
        if not policy.shadow_refs:
            return policy
        problems: list[Diagnostic] = []
        shadows: list[CompiledPolicy] = []
        warnings = list(policy.warnings)
        for file, at in policy.shadow_refs:

            def problem(message: str, at: tuple[int, int] = at) -> None:
                problems.append(Diagnostic(policy.path, *at, message))

            path = shadow_path(policy, file)
            if path.resolve() == Path(policy.path).resolve():
                problem("a policy cannot be its own shadow")
                continue
            if not path.is_file():
                problem(f"shadow policy '{file}' not found (looked for {path})")
                continue
            try:
                shadow = self.compiled(path)
            except PolicyError as error:
                problem(f"shadow policy '{file}' does not load (its problems follow)")
                problems.extend(error.diagnostics)
                continue
            if shadow.shadow_refs:
                problems.append(
                    Diagnostic(
                        shadow.path,
                        *(shadow.shadows_at or (1, 1)),
                        f"policy '{shadow.name}' is a shadow of '{policy.name}' "
                        f"({policy.path}); a shadow cannot name shadows of its own",
                    )
                )
            if shadow.name == policy.name:
                problem(
                    f"shadow policy '{file}' is named '{shadow.name}' like this policy; "
                    "give it a name of its own so traces and metrics tell them apart"
                )
            elif any(other.name == shadow.name for other in shadows):
                problem(f"two shadow policies are named '{shadow.name}'")
            shadows.append(shadow)
            warnings.extend(shadow.warnings)
        if problems:
            raise PolicyError(problems)
        return dataclasses.replace(
            policy, shadows=tuple(shadows), warnings=tuple(sorted(set(warnings)))
        )
