"""A request as the pool's InferenceObjective and InferenceModelRewrite objects make it.

What the objects say (``policyd.pool.inference_objects``) is applied to the
parsed request before any policy sees it, as the reference endpoint picker
applies them before it schedules:

- the objective header (llm-d's spelling first) naming an InferenceObjective
  policyd follows sets ``request.objective`` and ``request.priority``, which
  the router turns into the criticality (``policyd.policy.router``);
- a rewrite rule matching the body's ``model`` makes the request one for its
  target: the policy serving that model applies, and the body's ``model`` is
  rewritten to what the policy finally routes it as (``Exchange``).

A name that is no objective policyd follows changes nothing, as in the
reference, where it means the default priority.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

from policyd.extproc.openai import InferenceBody
from policyd.policy.client_headers import OBJECTIVE_HEADERS, first_of
from policyd.pool.inference_objects import NO_OBJECTS, InferenceObjects

ObjectsSource = Callable[[], InferenceObjects]


def no_objects() -> InferenceObjects:
    return NO_OBJECTS


def applied(body: InferenceBody, objects: InferenceObjects, rng: random.Random) -> InferenceBody:
    """``body`` with its request named by objective and routed as the rewrite says."""
    if objects is NO_OBJECTS:
        return body
    request = body.request
    name = first_of(request.headers, OBJECTIVE_HEADERS)
    priority = objects.priorities.get(name) if name else None
    model = objects.rewrite(request.model, rng.random)
    if priority is None and model is None:
        return body
    changed = dataclasses.replace(
        request,
        model=model or request.model,
        objective=name if priority is not None else "",
        priority=priority or 0,
    )
    return dataclasses.replace(body, request=changed)
