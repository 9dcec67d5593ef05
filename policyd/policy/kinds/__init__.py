"""The registry of policy kinds: every filter node kind, scorer kind and picker.

Each kind is one module here, holding one class that says everything about it:
its YAML word and fields, their JSON Schema, how it is read and compiled, and
what it does on a walk or a decision (see ``policyd.policy.nodes``,
``policyd.policy.scoring``, ``policyd.policy.pickers``). Reading, compiling,
``explain`` and ``policy.schema.json`` (``json_schema``; rewrite the file with
``python -m policyd.policy.kinds``) take the kinds from the tables below, so a
new kind is its module, a line here, and its section in
docs/policy-language.md.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any, Final

from policyd.policy.kinds.band import BandNode
from policyd.policy.kinds.expr import ExprScorer
from policyd.policy.kinds.if_ import IfNode
from policyd.policy.kinds.keep import KeepNode
from policyd.policy.kinds.max_score import MaxScore
from policyd.policy.kinds.rendezvous import RendezvousScore
from policyd.policy.kinds.round_robin import RoundRobin
from policyd.policy.kinds.shed import ShedNode
from policyd.policy.kinds.top_k import TopKNode
from policyd.policy.kinds.uniform_random import UniformRandom
from policyd.policy.kinds.weighted_random import WeightedRandom
from policyd.policy.nodes import NodeKind
from policyd.policy.pickers import Picker
from policyd.policy.scoring import ScorerKind
from policyd.policy.version import API_VERSION, KIND

# By YAML word, in the order error messages and the schema list them.
NODE_KINDS: Final[Mapping[str, NodeKind]] = {
    kind.kind: kind for kind in (KeepNode, IfNode, BandNode, TopKNode, ShedNode)
}
SCORER_KINDS: Final[Mapping[str, ScorerKind]] = {
    kind.kind: kind for kind in (ExprScorer, RendezvousScore)
}
# By ``pick.strategy``: the class, called once per loaded policy.
PICKERS: Final[Mapping[str, Callable[[], Picker]]] = {
    MaxScore.name: MaxScore,
    WeightedRandom.name: WeightedRandom,
    RoundRobin.name: RoundRobin,
    UniformRandom.name: UniformRandom,
}


def json_schema(template: Mapping[str, Any]) -> dict[str, Any]:
    """``template`` (``policy.schema.json``) with the parts the kinds give made afresh."""
    schema = copy.deepcopy(dict(template))
    schema["$defs"]["node"] = {
        "description": "One filter-tree node; its kind is given by which of "
        f"{', '.join(NODE_KINDS)} it has.",
        "oneOf": [kind.schema for kind in NODE_KINDS.values()],
    }
    scorer = schema["properties"]["score"]["additionalProperties"]
    scorer["oneOf"] = [{"required": [word]} for word in SCORER_KINDS]
    scorer["properties"] = {
        "weight": {"type": "number", "minimum": 0, "default": 1},
        **{word: kind.schema for word, kind in SCORER_KINDS.items()},
        "description": {"type": "string"},
    }
    schema["properties"]["pick"]["properties"]["strategy"]["enum"] = list(PICKERS)
    schema["properties"]["apiVersion"]["const"] = API_VERSION
    schema["properties"]["kind"]["const"] = KIND
    return schema
