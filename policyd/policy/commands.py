"""``policyd check``, ``policyd explain`` and ``policyd test``.

Exit codes: 0 all good, 1 a file is invalid or a policy test failed, 2 bad usage.
Problems print as ``file:line:col: message`` on stdout, like a compiler, so
editors and CI annotate the right line.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from policyd.policy.diagnostics import Diagnostic, PolicyError
from policyd.policy.explain import explain, render_text, to_json
from policyd.policy.inputs import read_pods, read_request
from policyd.policy.loader import is_test_file, load_policy, load_policy_set, read_source
from policyd.policy.source import YNode, parse_yaml
from policyd.policy.testing import failure_diagnostic, policy_tests_path, run_policy_tests

Runner = Callable[[argparse.Namespace], int]


def register(name: str, parser: argparse.ArgumentParser) -> None:
    """Add the arguments of ``name`` (check, explain or test) and its runner."""
    run: Runner
    if name == "check":
        parser.add_argument(
            "paths",
            nargs="+",
            type=Path,
            metavar="PATH",
            help="policy files, or directories loaded as one policy set",
        )
        parser.add_argument("--strict", action="store_true", help="treat warnings as errors")
        run = run_check
    elif name == "explain":
        parser.add_argument("--policy", type=Path, required=True, help="policy file or directory")
        parser.add_argument(
            "--pods", type=Path, required=True, help="pods: JSON or YAML list / mapping"
        )
        parser.add_argument(
            "--request", type=Path, required=True, help="request: JSON or YAML mapping"
        )
        parser.add_argument("--json", action="store_true", help="print JSON for tools")
        parser.add_argument(
            "--seed", type=int, default=0, help="seed for random picks and splits (default 0)"
        )
        run = run_explain
    elif name == "test":
        parser.add_argument(
            "paths",
            nargs="+",
            type=Path,
            metavar="PATH",
            help="test files (*.test.yaml), policies (their tests), or directories",
        )
        parser.add_argument("-v", "--verbose", action="store_true", help="list passing cases too")
        run = run_test
    else:  # pragma: no cover - cli.COMMANDS names only the three above
        raise ValueError(f"unknown command {name}")
    parser.set_defaults(run=run)


def _print(lines: list[Diagnostic] | tuple[Diagnostic, ...], out: TextIO) -> None:
    for diagnostic in lines:
        print(diagnostic, file=out)


def run_check(arguments: argparse.Namespace) -> int:
    out = sys.stdout
    failed = False
    for path in arguments.paths:
        if path.is_file() and is_test_file(path):
            print(f"{path}: skipped: policy tests (run `policyd test {path}`)", file=out)
            continue
        try:
            if path.is_dir():
                policy_set = load_policy_set(path)
                warnings = policy_set.warnings
                summaries = [f"{p.path}: ok: {p.summary}" for p in policy_set.policies]
                summaries.append(
                    f"{path}: ok: policy set of {len(policy_set.policies)} "
                    f"(version {policy_set.version})"
                )
            else:
                policy = load_policy(path)
                warnings = policy.warnings
                summaries = [f"{path}: ok: {policy.summary}"]
        except PolicyError as error:
            _print(error.diagnostics, out)
            failed = True
            continue
        _print(warnings, out)
        if arguments.strict and warnings:
            failed = True
            continue
        for summary in summaries:
            print(summary, file=out)
    return 1 if failed else 0


def run_explain(arguments: argparse.Namespace) -> int:
    out = sys.stdout
    problems: list[Diagnostic] = []
    pods_source = _read_input(arguments.pods, problems)
    request_source = _read_input(arguments.request, problems)
    pods = read_pods(pods_source, problems) if pods_source is not None else ()
    request = read_request(request_source, problems) if request_source is not None else None
    try:
        policies = load_policy_set(arguments.policy)
    except PolicyError as error:
        problems.extend(error.diagnostics)
    if problems or request is None:
        _print(problems, out)
        return 1
    explanation = explain(policies, request, pods, seed=arguments.seed)
    if arguments.json:
        print(json.dumps(to_json(explanation), indent=2), file=out)
    else:
        out.write(render_text(explanation))
    return 0


def _read_input(path: Path, problems: list[Diagnostic]) -> YNode | None:
    try:
        source = read_source(path)
    except PolicyError as error:
        problems.extend(error.diagnostics)
        return None
    node, diagnostics = parse_yaml(source)
    problems.extend(diagnostics)
    if node is None and not diagnostics:
        problems.append(source.diagnostic((1, 1), "empty file"))
    return node


def run_test(arguments: argparse.Namespace) -> int:
    out = sys.stdout
    files: list[Path] = []
    for path in arguments.paths:
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if is_test_file(p))
            if not found:
                print(f"{path}: no policy tests (*.test.yaml) here", file=out)
                return 1
            files.extend(found)
        elif is_test_file(path):
            files.append(path)
        else:
            tests = policy_tests_path(path)
            if not tests.exists():
                print(f"{path}: no tests: expected them in {tests}", file=out)
                return 1
            files.append(tests)
    return _run_test_files(files, verbose=arguments.verbose, out=out)


def _run_test_files(files: list[Path], *, verbose: bool, out: TextIO) -> int:
    passed = failed = 0
    broken = False
    for file in files:
        try:
            suite, results = run_policy_tests(file)
        except PolicyError as error:
            _print(error.diagnostics, out)
            broken = True
            continue
        for result in results:
            if result.passed:
                passed += 1
                if verbose:
                    print(f"{file}: PASS {result.case.name}", file=out)
            else:
                failed += 1
                print(failure_diagnostic(suite, result), file=out)
    print(f"{passed} passed, {failed} failed", file=out)
    return 1 if failed or broken else 0
