"""``policyd check``: every class of mistake reported at its exact file:line:col."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from policyd.cli import main
from policyd.policy.loader import policy_files
from policyd.policy.version import API_VERSION, KIND

from .helpers import RULES, problems, warnings, write


def check(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str]]:
    code = main(["check", *args])
    out = capsys.readouterr().out.replace(str(tmp_path) + "/", "")
    return code, out.splitlines()


def test_shipped_rules_check_clean_one_summary_line_each(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = sorted(str(p) for p in RULES.glob("*.yaml"))
    code, lines = check(tmp_path, capsys, *files)
    assert code == 0
    policies = [f for f in files if not f.endswith(".test.yaml")]
    assert len(lines) == len(files)
    for file in policies:
        (line,) = [line for line in lines if line.startswith(f"{file}: ")]
        assert line.startswith(f"{file}: ok: policy '")
    assert lines[files.index(str(RULES / "default.yaml"))].endswith(
        "models *, 10 filter nodes, 0 scorers, pick random"
    )


def test_an_invalid_file_exits_1_and_prints_its_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(tmp_path, "filters:\n  a:\n    keep: pod.waiting_qeue < 3\n", "bad.yaml")
    write(tmp_path, "pick: {strategy: random}\n", "good.yaml")
    code, lines = check(tmp_path, capsys, str(tmp_path / "bad.yaml"), str(tmp_path / "good.yaml"))
    assert code == 1
    assert lines[0] == (
        "bad.yaml:3:14: undefined field 'waiting_qeue' not found in struct 'policyd.Pod'; "
        "did you mean 'waiting_queue'?"
    )
    assert lines[1].startswith("good.yaml: ok: policy 'good'")


def test_strict_turns_warnings_into_failure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(tmp_path, "params:\n  unused: {type: int, value: 1}\n")
    code, lines = check(tmp_path, capsys, "--strict", str(tmp_path / "policy.yaml"))
    assert code == 1
    assert lines == ["policy.yaml:2:3: warning: param 'unused' is never used"]
    code, _ = check(tmp_path, capsys, str(tmp_path / "policy.yaml"))
    assert code == 0


def test_a_directory_is_checked_as_one_policy_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(tmp_path, "match: {models: [a]}\n", "a.yaml")
    write(tmp_path, "match: {models: [b]}\n", "b.yaml")
    code, lines = check(tmp_path, capsys, str(tmp_path))
    assert code == 0
    assert lines[-1].startswith(f"{tmp_path}: ok: policy set of 2 (version ")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            "filters:\n  a:\n    keep: pod.waiting_queue < 3\n   bad indent: 1\n",
            [
                "policy.yaml:4:4: invalid YAML: expected <block end>, but found "
                "'<block mapping start>'"
            ],
            id="yaml-syntax",
        ),
        pytest.param(
            "name: x\nfilter:\n  a: {keep: 'true'}\n",
            ["policy.yaml:2:1: unknown field 'filter' in the policy; did you mean 'filters'?"],
            id="unknown-field",
        ),
        pytest.param(
            "filters:\n  a:\n    keep: pod.waiting_queue < 3\n    on_sucess: b\n"
            "  b: {keep: 'true'}\n",
            [
                "policy.yaml:4:5: unknown field 'on_sucess' in node 'a'; "
                "did you mean 'on_success'?",
                "policy.yaml:5:3: warning: node 'b' is never reached from 'a'",
            ],
            id="unknown-node-field",
        ),
        pytest.param(
            "name: x\nname: y\n",
            ["policy.yaml:2:1: duplicate key 'name' (first at line 1)"],
            id="duplicate-key",
        ),
        pytest.param(
            "filters:\n  a:\n    keep: >-\n"
            "      pod.kv_cache < 0.5 &&\n        pod.waiting_qeue < 3\n",
            [
                "policy.yaml:5:12: undefined field 'waiting_qeue' not found in struct "
                "'policyd.Pod'; did you mean 'waiting_queue'?"
            ],
            id="cel-typo-in-folded-block",
        ),
        pytest.param(
            "filters:\n  a:\n    keep: |\n"
            "      pod.kv_cache < 0.5 &&\n      pod.waiting_qeue < 3\n",
            [
                "policy.yaml:5:10: undefined field 'waiting_qeue' not found in struct "
                "'policyd.Pod'; did you mean 'waiting_queue'?"
            ],
            id="cel-typo-in-literal-block",
        ),
        pytest.param(
            'filters:\n  a: {keep: "request.model == \\"x\\" && pod.kv_cach > 0.1"}\n',
            [
                "policy.yaml:2:43: undefined field 'kv_cach' not found in struct "
                "'policyd.Pod'; did you mean 'kv_cache'?"
            ],
            id="cel-typo-in-quoted-string",
        ),
        pytest.param(
            "filters:\n  a:\n    keep: pod.kv_cache > 'high'\n",
            [
                "policy.yaml:3:24: found no matching overload for '_>_' applied to "
                "'(double, string)'"
            ],
            id="cel-type-error",
        ),
        pytest.param(
            "filters:\n  a:\n    keep: pod.waiting_queue\n",
            ["policy.yaml:3:11: node 'a' must be bool, but this expression is int"],
            id="keep-not-bool",
        ),
        pytest.param(
            "filters:\n  a:\n    band: pod.name\n",
            [
                "policy.yaml:3:11: node 'a' must be int or uint or double, "
                "but this expression is string"
            ],
            id="band-not-a-number",
        ),
        pytest.param(
            "filters:\n  a:\n    keep: pod.waiting_queue < params.limt\n"
            "params:\n  limit: {type: int, value: 5}\n",
            [
                "policy.yaml:3:37: undeclared reference to 'params.limt'; did you mean "
                "'limit'? (declared params: limit)",
            ],
            id="missing-param",
        ),
        pytest.param(
            "params:\n  limit: {type: int, value: 0.5}\n",
            ["policy.yaml:2:29: param 'limit' is declared int but the value is a number"],
            id="wrong-param-type",
        ),
        pytest.param(
            "params:\n  wait: {type: duration, value: 5 minutes}\n",
            [
                "policy.yaml:2:33: param 'wait' is declared duration but '5 minutes' is not "
                "a duration like 250ms, 1.5s or 1m30s"
            ],
            id="bad-duration",
        ),
        pytest.param(
            "params:\n  limit: {type: integer, value: 5}\n",
            [
                "policy.yaml:2:17: unknown param type 'integer'; use one of int, double, "
                "string, bool, duration, list<string>, list<int>, list<double>, "
                "map<string,string>"
            ],
            id="unknown-param-type",
        ),
        pytest.param(
            "params:\n  limit: {type: int, value: 5}\nfilters:\n  a:\n"
            "    keep: pod.kv_cache < params.limit\n",
            ["policy.yaml:5:24: found no matching overload for '_<_' applied to '(double, int)'"],
            id="param-type-mismatch-in-cel",
        ),
        pytest.param(
            "filters:\n  a:\n    keep: 'true'\n    next: bb\n  b:\n    keep: 'true'\n",
            [
                "policy.yaml:4:11: unknown node 'bb' in 'next'; did you mean 'b'?",
                "policy.yaml:5:3: warning: node 'b' is never reached from 'a'",
            ],
            id="unknown-node",
        ),
        pytest.param(
            "filters:\n  a: {keep: 'true', next: b}\n  b: {keep: 'true', on_failure: c}\n"
            "  c: {keep: 'true', on_success: a}\n",
            ["policy.yaml:4:33: cycle in the filter tree: a -> b -> c -> a"],
            id="cycle",
        ),
        pytest.param(
            "filters:\n  a: {keep: 'true', next: a}\n",
            ["policy.yaml:2:27: cycle in the filter tree: a -> a"],
            id="self-loop",
        ),
        pytest.param(
            "filters:\n  a: {keep: 'true', next: b, on_failure: b}\n  b: {keep: 'true'}\n",
            [
                "policy.yaml:2:27: node 'a' has 'next' and 'on_success'/'on_failure'; "
                "'next' already covers both"
            ],
            id="next-and-on-failure",
        ),
        pytest.param(
            "filters:\n  a:\n    description: no kind\n",
            ["policy.yaml:2:3: node 'a' needs one of: keep, if, band, top_k, shed"],
            id="node-without-kind",
        ),
        pytest.param(
            "filters:\n  a:\n    keep: 'true'\n    band: pod.kv_cache\n",
            ["policy.yaml:4:5: node 'a' has both 'keep' and 'band'; use one"],
            id="node-with-two-kinds",
        ),
        pytest.param(
            "filters:\n  a:\n    top_k: 2\n",
            ["policy.yaml:3:5: node 'a' needs exactly one of 'lowest' or 'highest'"],
            id="top-k-without-value",
        ),
        pytest.param(
            "filters:\n  a:\n    if: pod.waiting_queue > 3\n",
            [
                "policy.yaml:3:12: undeclared reference to 'pod.waiting_queue': an 'if' "
                "condition runs once per request and sees only request and params (use "
                "'keep' to test pods)"
            ],
            id="condition-uses-pod",
        ),
        pytest.param(
            "variables:\n  a: variables.b + 1\n  b: pod.waiting_queue\n"
            "filters:\n  x: {keep: 'variables.a > 1'}\n",
            [
                "policy.yaml:2:15: undeclared reference to 'variables.b': a variable can use "
                "only the variables declared above it"
            ],
            id="variable-order",
        ),
        pytest.param(
            "match: {models: [llama]}\nmodels:\n  mistral: {criticality: critical}\n",
            ["policy.yaml:3:3: model 'mistral' has settings but 'match.models' does not list it"],
            id="model-settings-not-matched",
        ),
        pytest.param(
            "models:\n  m:\n    criticality: urgent\n",
            [
                "policy.yaml:3:18: 'criticality' must be one of critical, standard, "
                "sheddable, not 'urgent'"
            ],
            id="bad-criticality",
        ),
        pytest.param(
            "pick: {strategy: best}\n",
            [
                "policy.yaml:1:18: 'strategy' must be one of max-score, weighted-random, "
                "round-robin, random, not 'best'"
            ],
            id="bad-strategy",
        ),
        pytest.param(
            "score:\n  s: {weight: -1, expr: '1.0'}\n",
            ["policy.yaml:2:15: the weight of scorer 's' must not be negative"],
            id="negative-weight",
        ),
        pytest.param(
            "- just\n- a list\n",
            ["policy.yaml:1:1: a policy file must be a mapping, not a list"],
            id="not-a-mapping",
        ),
    ],
)
def test_each_mistake_is_reported_at_its_place(
    tmp_path: Path, text: str, expected: list[str]
) -> None:
    assert problems(tmp_path, text) == expected


def test_every_error_in_a_file_is_reported_in_one_run(tmp_path: Path) -> None:
    found = problems(
        tmp_path,
        """
        params:
          limit: {type: int, value: "5"}
        filters:
          a:
            keep: pod.waiting_qeue < 3
            next: nowhere
          b:
            band: pod.kv_cache > 1.0
        """,
    )
    assert [line.split(": ", 1)[0] for line in found] == [
        "policy.yaml:2:29",
        "policy.yaml:5:14",
        "policy.yaml:6:11",
        "policy.yaml:7:3",
        "policy.yaml:8:11",
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            "filters:\n  a: {keep: 'true'}\n  orphan: {keep: 'true'}\n",
            ["policy.yaml:3:3: warning: node 'orphan' is never reached from 'a'"],
            id="unreachable",
        ),
        pytest.param(
            "variables:\n  unused: pod.running\n",
            ["policy.yaml:2:3: warning: variable 'unused' is never used"],
            id="unused-variable",
        ),
        pytest.param(
            "score:\n  s: {expr: '1.0'}\npick: {strategy: round-robin}\n",
            [
                "policy.yaml:3:7: warning: pick 'round-robin' ignores the scores; "
                "they are not computed"
            ],
            id="ignored-scores",
        ),
        pytest.param(
            "pick: {strategy: max-score}\n",
            ["policy.yaml:1:7: warning: pick 'max-score' without scorers picks at random"],
            id="max-score-without-scorers",
        ),
    ],
)
def test_warnings_do_not_reject_the_file(tmp_path: Path, text: str, expected: list[str]) -> None:
    assert warnings(tmp_path, text) == expected


def test_a_missing_file_is_an_error_not_a_crash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, lines = check(tmp_path, capsys, str(tmp_path / "nope.yaml"))
    assert code == 1
    assert lines == ["nope.yaml:1:1: cannot read file: No such file or directory"]


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (
            b"name: cut\x00\x00\x00",
            "policy.yaml:1:10: invalid YAML: character U+0000 (NUL) is not allowed; "
            "is the file complete, and text?",
        ),
        (
            b"name: x\nfilters:\n  a:\n    keep: pod.kv_cache < 0.5\x1b\n",
            "policy.yaml:4:29: invalid YAML: character U+001B (ESC) is not allowed",
        ),
        (
            b"name: x\ndescription: caf\xc3\xa9 \xff\n",
            "policy.yaml:2:19: cannot read file: byte 0xff is not UTF-8 (invalid start byte)",
        ),
    ],
)
def test_a_bad_byte_is_an_error_at_its_place_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], raw: bytes, expected: str
) -> None:
    (tmp_path / "policy.yaml").write_bytes(raw)
    code = main(["check", str(tmp_path / "policy.yaml")])
    captured = capsys.readouterr()
    assert code == 1
    assert captured.out.replace(str(tmp_path) + "/", "").splitlines() == [expected]
    assert captured.err == ""


# -- the format's name: apiVersion and kind ------------------------------------------------


def test_a_file_naming_the_format_and_one_naming_none_load_alike(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    body = "pick: {strategy: random}\n"
    write(tmp_path, "apiVersion: policyd.dev/v1\nkind: RoutingPolicy\n" + body, "named.yaml")
    write(tmp_path, body, "unnamed.yaml")
    code, lines = check(
        tmp_path, capsys, str(tmp_path / "named.yaml"), str(tmp_path / "unnamed.yaml")
    )
    assert code == 0
    assert lines[0].startswith("named.yaml: ok: policy 'named'")
    assert lines[1].startswith("unnamed.yaml: ok: policy 'unnamed'")


@pytest.mark.parametrize(
    ("head", "said"),
    [
        (
            "apiVersion: policyd.dev/v2\n",
            "bad.yaml:1:13: apiVersion 'policyd.dev/v2' is not a policy format this policyd "
            "reads: write 'apiVersion: policyd.dev/v1' (or leave it out)",
        ),
        (
            "apiVersion: policyd.dev/v1\nkind: InferencePool\n",
            "bad.yaml:2:7: kind 'InferencePool' is not a policy format this policyd reads: "
            "write 'kind: RoutingPolicy' (or leave it out)",
        ),
        (
            "kind: [RoutingPolicy]\n",
            "bad.yaml:1:7: kind a list is not a policy format this policyd reads: "
            "write 'kind: RoutingPolicy' (or leave it out)",
        ),
    ],
)
def test_another_format_is_refused_by_its_name_alone(
    head: str, said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its fields would be judged by the wrong rules: the version is its one problem."""
    write(tmp_path, head + "filters: {a: {frobnicate: 1}}\n", "bad.yaml")
    code, lines = check(tmp_path, capsys, str(tmp_path / "bad.yaml"))
    assert code == 1
    assert lines == [said]


def test_every_shipped_policy_names_its_format() -> None:
    for path in policy_files(RULES):
        document = yaml.safe_load(path.read_text())
        assert (document["apiVersion"], document["kind"]) == (API_VERSION, KIND), path
