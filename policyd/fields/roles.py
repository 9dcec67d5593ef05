"""A pod's role in disaggregated serving, read from one of its labels.

llm-d labels each model-server pod with ``llm-d.ai/role``: ``prefill`` pods
compute prompts' KV caches, ``decode`` pods generate from them, and pods that
do both say ``both`` (or, in llm-d's newer spelling, ``prefill-decode``).
policyd reads the same label by default (``policyd serve --role-label``) and
gives every pod one of three roles in ``pod.role``; a pod without the label
does both, as every pod of a pool that is not disaggregated does. A value
policyd does not know (llm-d's ``encode``) is kept as written, so it shows in
traces and a policy can test it, and such a pod takes neither stage of a
policy with a ``prefill`` section.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

ROLE_LABEL: Final = "llm-d.ai/role"
PREFILL: Final = "prefill"
DECODE: Final = "decode"
BOTH: Final = "both"
ROLES: Final = (PREFILL, DECODE, BOTH)

# llm-d's label values (pkg/epp/framework/plugins/scheduling/filter/bylabel/roles.go)
# and the role each gives a pod here: encode-prefill pods prefill, the combined
# spellings do both.
_SPELLINGS: Final[Mapping[str, str]] = {
    PREFILL: PREFILL,
    "encode-prefill": PREFILL,
    DECODE: DECODE,
    BOTH: BOTH,
    "prefill-decode": BOTH,
    "encode-prefill-decode": BOTH,
}

# The roles each stage of a two-stage policy chooses among.
DECODE_CAPABLE: Final = frozenset({DECODE, BOTH})
PREFILL_CAPABLE: Final = frozenset({PREFILL, BOTH})


def role_of(labels: Mapping[str, str], label: str = ROLE_LABEL) -> str:
    """The role the pod's ``label`` gives it: ``both`` without one."""
    return role_named(labels.get(label, ""))


def role_named(written: str) -> str:
    """The role a label value (or a pod file's ``role:``) names: ``both`` when empty."""
    value = written.strip().lower()
    if not value:
        return BOTH
    return _SPELLINGS.get(value, value)
