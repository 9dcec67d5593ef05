"""Attack (or accident): a policy file caught half-written replaces the serving policy.

A writer that is cut off, or slow, leaves a prefix of the new file on disk.
Many prefixes are valid policies (``name: ra`` of ``name: random``, a
threshold cut from ``50`` to ``5``), so the guarded reload ``policyd serve``
uses loaded them. A file that now ends mid-line where the serving version
ended with a line break is refused (a cut exactly at a line end stays the
settle time's to catch: ``--policy-settle-seconds``).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from policyd.policy import PolicyStore, Router
from tests.policy.helpers import RULES, pod, request

SHIPPED = {
    p.name: p.read_text() for p in sorted(RULES.glob("*.yaml")) if not p.name.endswith(".test.yaml")
}
PODS = [pod("a", waiting_queue=1), pod("b", waiting_queue=9, kv_cache=0.5)]


@settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(st.sampled_from(sorted(SHIPPED)), st.floats(min_value=0.0, max_value=1.0))
@example("random.yaml", SHIPPED["random.yaml"].index("name: random") / len(SHIPPED["random.yaml"]))
def test_a_shipped_policy_cut_mid_line_never_replaces_the_serving_one(
    name: str, fraction: float
) -> None:
    text = SHIPPED[name]
    cut = min(int(fraction * len(text)) + len("name: ra"), len(text) - 1)
    while text[cut - 1] == "\n":  # a cut mid-line: move past a line end
        cut += 1
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / name
        path.write_text(text)
        store = PolicyStore.open(path, refuse_new_warnings=True)  # as `policyd serve`
        serving = store.current
        before = Router(store).decide(request(), PODS)
        path.write_text(text[:cut])
        result = store.reload()
        assert store.current is serving and not result.changed
        assert result.error is not None
        after = Router(store).decide(request(), PODS)
        assert after.policy == before.policy and after.outcome == before.outcome
