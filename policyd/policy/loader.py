"""Load policy files (one file, or a directory of them) into a ``PolicySet``.

A directory holds a set of policies served side by side: every ``*.yaml`` /
``*.yml`` file except policy tests (``*.test.yaml``). Every problem in every
file is collected before anything is rejected, so one run of ``policyd check``
shows them all.
"""

from __future__ import annotations

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
    """The file's text as a ``Source``; an unreadable file is a ``PolicyError``."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) else str(error)
        raise PolicyError([Diagnostic(str(path), 1, 1, f"cannot read file: {reason}")]) from None
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
    return compile_source(read_source(path))


def load_policy_set(path: Path) -> PolicySet:
    """Load a policy file or a directory of policies, or raise ``PolicyError``."""
    files = policy_files(path)
    if not files:
        raise PolicyError([Diagnostic(str(path), 1, 1, "no policy files (*.yaml) here")])
    policies: list[CompiledPolicy] = []
    problems: list[Diagnostic] = []
    for file in files:
        try:
            policies.append(load_policy(file))
        except PolicyError as error:
            problems.extend(error.diagnostics)
    if problems:
        raise PolicyError(problems)
    policy_set, problems = build_policy_set(policies)
    if policy_set is None:
        raise PolicyError(problems)
    return policy_set
