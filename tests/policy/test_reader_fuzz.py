"""Property: whatever bytes or YAML a policy file holds, reading it either loads
a policy or raises ``PolicyError`` with diagnostics, and never anything else.

The documents are drawn from the policy's own vocabulary (its fields, node
kinds, CEL fragments, the shipped rules cut and spliced), so the examples get
past the YAML parser and into the reader's and compiler's checks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policyd.fields import POD_FIELDS, REQUEST_FIELDS
from policyd.policy import PolicyError, PolicySet, PolicyStore
from policyd.policy.loader import compile_source, load_policy_set
from policyd.policy.source import Source
from policyd.policy.testing import read_policy_tests

from .helpers import REPO, RULES

SCHEMA = REPO / "policyd" / "policy" / "policy.schema.json"

EXAMPLES = int(os.environ.get("POLICY_FUZZ_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

SHIPPED = sorted(p for p in RULES.glob("*.yaml") if not p.name.endswith(".test.yaml"))
SHIPPED_TEXTS = [p.read_text() for p in SHIPPED]

TEST_TEXTS = [p.read_text() for p in sorted(RULES.glob("*.test.yaml"))]


def _property_names(schema: object) -> set[str]:
    """Every field name the policy schema declares, at any depth."""
    if isinstance(schema, dict):
        names = set(schema.get("properties", {}))
        return names.union(*(_property_names(value) for value in schema.values()))
    if isinstance(schema, list):
        return set().union(*(_property_names(value) for value in schema))
    return set()


KEYS = sorted(_property_names(json.loads(SCHEMA.read_text())))
TEST_KEYS = sorted(
    {"policy", "pods", "cases", "request", "expect", "seed", "outcome", "pick", "picks"}
    | {"survivors", "fallbacks", "target_model", "criticality", "reason", "path"}
    | {field.name for field in (*POD_FIELDS, *REQUEST_FIELDS)}
)
CEL = [
    "pod.waiting_queue < 5",
    "request.model in pod.active_loras",
    "pod.kv_cache",
    "true",
    "params.x + 1",
    "variables.v",
    "pod.waiting_qeue",
    "1 +",
    "request.headers['x']",
    "[1,2,3].map(x, x * 2)",
    "int(request.headers['x']) > 1",
    "'a' + 1",
    "",
    "pod.labels.exists(k, k == 'zone')",
    "duration('1s')",
    "size(pod.active_loras)",
]
TYPES = ["int", "double", "string", "bool", "duration", "list<string>", "map<string,string>"]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True),
    st.sampled_from(CEL + TYPES + KEYS),
    st.text(max_size=30),
)
documents = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=5),
        st.dictionaries(
            st.one_of(st.sampled_from(KEYS), st.text(max_size=12)), children, max_size=6
        ),
    ),
    max_leaves=40,
)
policy_shaped = st.fixed_dictionaries(
    {"name": scalars},
    optional={
        "match": documents,
        "params": st.dictionaries(
            st.text(max_size=8),
            st.fixed_dictionaries({"type": st.sampled_from(TYPES), "value": documents}),
            max_size=3,
        ),
        "filters": st.dictionaries(
            st.text(max_size=12),
            st.dictionaries(st.sampled_from(KEYS), st.one_of(st.sampled_from(CEL), documents)),
            max_size=4,
        ),
        "scorers": documents,
        "pick": documents,
        "criticality": documents,
        "variables": st.dictionaries(st.text(max_size=8), st.sampled_from(CEL), max_size=3),
    },
)


def assert_reads_or_refuses(text: str) -> None:
    try:
        compile_source(Source("fuzz.yaml", text))
    except PolicyError as error:
        assert error.errors, "a refusal carries at least one error"


@FUZZ
@given(st.binary(max_size=3000))
def test_arbitrary_bytes_load_or_raise_policy_error(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "fuzz.yaml"
    path.write_bytes(data)
    try:
        assert isinstance(load_policy_set(path), PolicySet)
    except PolicyError as error:
        assert error.errors


@FUZZ
@given(st.one_of(documents, policy_shaped))
def test_arbitrary_yaml_documents_load_or_raise_policy_error(document: object) -> None:
    assert_reads_or_refuses(yaml.safe_dump(document, allow_unicode=True))


@FUZZ
@given(
    st.sampled_from(SHIPPED_TEXTS),
    st.lists(
        st.tuples(
            st.integers(min_value=0), st.integers(min_value=0, max_value=40), st.text(max_size=20)
        ),
        min_size=1,
        max_size=4,
    ),
)
def test_shipped_policies_with_random_edits_load_or_raise_policy_error(
    text: str, edits: list[tuple[int, int, str]]
) -> None:
    for position, deleted, inserted in edits:
        at = position % (len(text) + 1)
        text = text[:at] + inserted + text[at + deleted :]
    assert_reads_or_refuses(text)


GOOD = "name: live\nfilters:\n  short:\n    keep: pod.waiting_queue < 5\n"


@FUZZ
@given(
    st.one_of(
        st.binary(max_size=2000),
        documents.map(lambda d: yaml.safe_dump(d, allow_unicode=True).encode()),
        st.sampled_from(SHIPPED_TEXTS).flatmap(
            lambda text: st.integers(0, len(text)).map(lambda cut: text[:cut].encode())
        ),
    )
)
def test_whatever_is_written_over_a_policy_the_store_serves_a_whole_policy(
    tmp_path: Path, data: bytes
) -> None:
    """A reload either swaps in exactly what loads from the file, or keeps serving."""
    path = tmp_path / "live.yaml"
    path.write_text(GOOD)
    store = PolicyStore.open(path, refuse_new_warnings=True)
    serving = store.current
    path.write_bytes(data)
    result = store.reload()
    if result.changed:
        assert store.current is result.current and result.error is None
        assert {p.name for p in store.current.policies} == {
            p.name for p in load_policy_set(path).policies
        }
    else:
        assert store.current is serving
        assert result.error is not None or data == GOOD.encode()


test_documents = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(
            st.one_of(st.sampled_from(TEST_KEYS), st.text(max_size=10)), children, max_size=5
        ),
    ),
    max_leaves=40,
)


@FUZZ
@given(
    st.one_of(
        test_documents.map(lambda d: yaml.safe_dump(d, allow_unicode=True)),
        st.tuples(st.sampled_from(TEST_TEXTS), st.integers(min_value=0), st.text(max_size=20)).map(
            lambda edit: edit[0][: edit[1] % (len(edit[0]) + 1)] + edit[2]
        ),
    )
)
def test_arbitrary_policy_test_files_read_or_raise_policy_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "fuzz.test.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        read_policy_tests(path)
    except PolicyError as error:
        assert error.errors
