"""Routing policies: the policy file, filter tree, scorers, pickers and the Router.

Public API::

    store = PolicyStore.open(Path("rules/default.yaml"))  # PolicyError if invalid
    router = Router(store)
    decision = router.decide(Request(model="llama"), snapshot.candidates)
    decision.outcome.http_status, decision.endpoint, decision.trace

``store.reload()`` (or the ``store.watch()`` task) swaps a changed policy in
atomically and keeps the old one when the new file does not load.
"""

from policyd.policy.compiler import CompiledPolicy
from policyd.policy.decision import Decision, NodeTrace, Outcome
from policyd.policy.diagnostics import Diagnostic, PolicyError
from policyd.policy.loader import load_policy, load_policy_set
from policyd.policy.policyset import PolicySet
from policyd.policy.request import Request
from policyd.policy.router import Router
from policyd.policy.store import PolicyStore, Reload

__all__ = [
    "CompiledPolicy",
    "Decision",
    "Diagnostic",
    "NodeTrace",
    "Outcome",
    "PolicyError",
    "PolicySet",
    "PolicyStore",
    "Reload",
    "Request",
    "Router",
    "load_policy",
    "load_policy_set",
]
