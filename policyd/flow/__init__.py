"""Flow control: requests held at the gateway while the pool is saturated.

``FlowQueue`` (``queue.py``) holds one policy's requests: priority bands,
weighted fairness between flows, order inside a flow, limits, expiry.
``FlowControl`` (``control.py``) decides per request whether to route now or
hold, and dispatches held requests as pods free up, each decided then.
The policy's ``flow`` section says how (``docs/policy-language.md``).
"""

from policyd.flow.control import FlowAnswer, FlowControl, Pass, Waiter, unwrap
from policyd.flow.queue import FlowQueue, Held

__all__ = ["FlowAnswer", "FlowControl", "FlowQueue", "Held", "Pass", "Waiter", "unwrap"]
