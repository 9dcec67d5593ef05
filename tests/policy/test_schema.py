"""The published JSON Schema: shipped as package data, accepts what the loader accepts."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from policyd.policy import PolicyError
from policyd.policy.kinds import NODE_KINDS, PICKERS, SCORER_KINDS, json_schema
from policyd.policy.loader import load_policy_set, policy_files

from .helpers import RULES, write


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft202012Validator:
    text = resources.files("policyd.policy").joinpath("policy.schema.json").read_text()
    schema = json.loads(text)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.parametrize("path", policy_files(RULES), ids=lambda p: p.name)
def test_every_shipped_policy_validates(
    validator: jsonschema.Draft202012Validator, path: Path
) -> None:
    validator.validate(yaml.safe_load(path.read_text()))


EVERYTHING = """
apiVersion: policyd.dev/v1
kind: RoutingPolicy
name: everything
description: uses every field of the format
match:
  models: [chat, sql-lora]
  headers: {x-pool: blue}
pool:
  labels: {app: vllm}
criticality:
  header: x-priority
  default: sheddable
models:
  chat:
    criticality: critical
    targets: {chat-v1: 3, chat-v2: 1}
params:
  limit: {type: int, value: 10, description: queue limit}
  kv: {type: double, value: 1}
  zones: {type: list<string>, value: [a, b]}
  stale: {type: duration, value: 1m30s}
  owner: {type: string, value: team}
  strict: {type: bool, value: true}
  weights: {type: list<double>, value: [0.5, 1]}
  sizes: {type: list<int>, value: [1, 2]}
  tags: {type: "map<string,string>", value: {a: b}}
variables:
  fresh: pod.metrics_age < params.stale
  zoned: pod.labels["zone"] in params.zones || !params.strict || params.owner == ""
filters:
  priority:
    if: request.criticality == "critical" && size(params.tags) > 0
    then: fresh
    else: roomy
  fresh:
    keep: variables.fresh && variables.zoned
    on_error: pass
    on_success: top
    on_failure: roomy
  top:
    top_k: 3
    lowest: pod.waiting_queue + params.sizes[0]
    next: band
  band:
    band: pod.kv_cache * params.weights[0]
    on_error: drop
  roomy:
    description: only pods with room
    keep: pod.waiting_queue < params.limit && pod.kv_cache < params.kv
    on_failure: shed
  shed:
    shed: no room
score:
  queue:
    weight: 2
    expr: 1.0 - double(pod.waiting_queue) / double(params.limit)
  kv: {expr: 1.0 - pod.kv_cache}
pick:
  strategy: weighted-random
  fallbacks: 1
flow:
  saturated: pod.waiting_queue >= params.limit || pod.in_flight >= 64
  priority: 'request.headers["x-band"]'
  bands:
    gold: {max_wait: 60s, max_requests: 100, max_body_bytes: 1000000}
    bronze: {max_wait: 1.5}
  flows:
    key: 'request.headers["x-tenant"]'
    default: anonymous
    weights: {big: 3, small: 0.5}
  order: deadline
  deadline_header: x-deadline-ms
  max_requests: 1000
  max_body_bytes: 100000000
  when_full: refuse
  answer: {status: 429, retry_after: 2s}
prefill:
  description: a prefill pod for a long uncached prompt
  when: request.prompt_tokens - pod.prefix_tokens >= params.limit * 100 && variables.zoned
  filters:
    room:
      keep: pod.waiting_queue < params.limit
      next: least kv
    least kv:
      band: pod.kv_cache
  score:
    short queue: {weight: 2, expr: 1.0 - double(pod.waiting_queue) / double(params.limit)}
  pick:
    strategy: max-score
"""


def test_a_policy_using_every_field_is_valid_for_both(
    validator: jsonschema.Draft202012Validator, tmp_path: Path
) -> None:
    validator.validate(yaml.safe_load(EVERYTHING))
    loaded = load_policy_set(write(tmp_path, EVERYTHING))
    assert loaded.warnings == ()


@pytest.mark.parametrize(
    "text",
    [
        "apiVersion: policyd.dev/v2\n",
        "kind: Policy\n",
        "filtres: {}\n",
        "filters:\n  a: {keep: 'true', bogus: 1}\n",
        "filters:\n  a: {description: none}\n",
        "filters:\n  a: {keep: 'true', band: pod.kv_cache}\n",
        "filters:\n  a: {keep: 'true', next: b, on_success: b}\n  b: {keep: 'true'}\n",
        "filters:\n  a: {top_k: 0, lowest: pod.kv_cache}\n",
        "filters:\n  a: {top_k: 2}\n",
        "filters:\n  a: {if: [x], then: b}\n  b: {keep: 'true'}\n",
        "filters:\n  a: {shed: stop, next: b}\n  b: {keep: 'true'}\n",
        "filters:\n  a: {keep: 'true', on_error: ignore}\n",
        "params:\n  x: {type: int, value: 1.5}\n",
        "params:\n  x: {type: duration, value: soon}\n",
        "params:\n  x: {type: long, value: 1}\n",
        "params:\n  x: {value: 1}\n",
        "params:\n  bad-name: {type: int, value: 1}\n",
        "variables:\n  bad-name: pod.running\n",
        "match: {models: []}\n",
        "models:\n  m: {criticality: urgent}\n",
        "models:\n  m: {targets: {a: -1}}\n",
        "score:\n  s: {weight: 1}\n",
        "score:\n  s: {expr: '1.0', weight: -2}\n",
        "pick: {strategy: best}\n",
        "pick: {fallbacks: -1}\n",
        "criticality: {default: urgent}\n",
        "flow: {priority: request.criticality}\n",
        "flow: {saturated: 'true', order: lifo}\n",
        "flow: {saturated: 'true', when_full: drop}\n",
        "flow: {saturated: 'true', answer: {status: 500}}\n",
        "flow: {saturated: 'true', bands: {gold: {max_wait: soon}}}\n",
        "flow: {saturated: 'true', flows: {weights: {a: 0}}}\n",
        "flow: {saturated: 'true', max_requests: 0}\n",
        "prefill: {filters: {}}\n",
        "prefill: {when: 'true', pick: {fallbacks: 1}}\n",
        "prefill: {when: 'true', pick: {strategy: best}}\n",
        "prefill: {when: 'true', filters: {a: {keep: 'true', bogus: 1}}}\n",
        "prefill: {when: 'true', score: {s: {weight: 1}}}\n",
        "prefill: {when: 'true', flow: {saturated: 'true'}}\n",
    ],
)
def test_a_bad_shape_is_rejected_by_both_the_schema_and_the_loader(
    validator: jsonschema.Draft202012Validator, tmp_path: Path, text: str
) -> None:
    document: Any = yaml.safe_load(text)
    assert list(validator.iter_errors(document)), "the schema accepted it"
    with pytest.raises(PolicyError):
        load_policy_set(write(tmp_path, text))


def test_the_published_schema_is_the_one_the_registered_kinds_give() -> None:
    """Node kinds, scorer kinds and pickers come from ``policyd.policy.kinds``."""
    text = resources.files("policyd.policy").joinpath("policy.schema.json").read_text()
    published = json.loads(text)
    assert published == json_schema(published), (
        "policy.schema.json is stale: run `python -m policyd.policy.kinds`"
    )


DOCS = (Path(__file__).resolve().parents[2] / "docs" / "policy-language.md").read_text()


@pytest.mark.parametrize("word", [*NODE_KINDS, *SCORER_KINDS])
def test_every_node_and_scorer_kind_has_its_section_in_the_docs(word: str) -> None:
    headings = [line for line in DOCS.splitlines() if line.startswith("#")]
    assert any(f"`{word}`" in heading for heading in headings)


@pytest.mark.parametrize("strategy", PICKERS)
def test_every_picker_has_its_row_in_the_docs(strategy: str) -> None:
    assert f"\n| `{strategy}` |" in DOCS
