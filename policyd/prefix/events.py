"""vLLM's KV-cache events, decoded from the msgpack payloads pods publish.

The wire format (``policyd/sim/kv_events.py`` has it in full): a batch is
``[ts, [event, ...], data_parallel_rank]``, each event an array tagged by its
first element. ``BlockStored`` has grown over vLLM releases, and msgspec omits
trailing defaults, so any length from the tag and five fields on is accepted:
``block_hashes, parent_block_hash, token_ids, block_size, lora_id`` then
``medium``, ``lora_name`` (vLLM PR #27577) and fields policyd does not read
(``extra_keys``, ``group_idx``, ...). Hashes are unsigned 64-bit integers, or
bytes when the pod runs with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``. An
event may also be a map of its field names tagged under ``"type"`` (vLLM PR
#42892; llm-d's inference-sim with ``--use-vllm-map-event-format``): it is read
as the array of the same fields. A parent hash of 0 is no parent: llm-d's
encoders (the inference-sim's array format) write 0, its ``EmptyBlockHash``,
where vLLM writes nil, and a 64-bit block hash is 0 with odds of 2**-64.

Decoding never raises: a payload that is no batch decodes to None, an event of
another shape is skipped (counted in ``EventBatch.skipped``) and the rest of its
batch is kept. Nothing here logs: the subscriber logs per pod, rate-limited and
without the payload's contents (token ids are prompt text). What decoding
allocates is bounded by the payload's length (msgpack's own limits: no
container or string longer than the payload), at most a few dozen bytes of
Python objects per payload byte.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import msgpack

EngineHash = int | bytes  # the pod's name for a block; policyd keys are recomputed from tokens

_STORED_MIN_FIELDS: Final = 6  # the tag and block_hashes .. lora_id
_REMOVED_MIN_FIELDS: Final = 2
# A map-encoded event's fields in their array order (after the tag), as far as read.
_STORED_FIELDS: Final = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
)
_REMOVED_FIELDS: Final = ("block_hashes", "medium")
_NO_PARENT: Final = 0  # llm-d's EmptyBlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Consecutive full blocks of one sequence entered a pod's prefix cache."""

    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None  # the block before the first; None at a sequence's start
    token_ids: tuple[int, ...]  # block_size ids per block
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None  # the adapter's name (vLLM PR #27577); None: the base model
    base_model: str | None = None  # the pod's served model, from its topic (``kv@<ip>@<model>``)

    @property
    def served_as(self) -> str | None:
        """The model name requests for these blocks name: the adapter's, else the base model's.

        None when an adapter is named only by its id (older vLLM): its chain has no known seed.
        """
        if self.lora_name is not None:
            return self.lora_name
        return self.base_model if self.lora_id is None else None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks left a pod's prefix cache (evicted)."""

    block_hashes: tuple[EngineHash, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """A pod's whole prefix cache was reset."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published batch: its timestamp (Unix seconds) and its well-formed events."""

    ts: float
    events: tuple[KvEvent, ...]
    skipped: int = 0  # events of an unknown tag or wrong fields, left out of ``events``


def base_model_of(topic: bytes) -> str | None:
    """The model a topic of llm-d's convention ``kv@<pod>@<model>`` names, else None."""
    parts = topic.decode("utf-8", "replace").split("@", 2)
    if len(parts) == 3 and parts[0] == "kv" and parts[2]:
        return parts[2]
    return None


def decode_batch(payload: bytes, base_model: str | None = None) -> EventBatch | None:
    """A ``KVEventBatch`` payload's events; None when the payload is not one.

    ``base_model`` is what the pod serves without an adapter (from its topic).
    """
    try:
        batch = msgpack.unpackb(payload, use_list=False, strict_map_key=False)
    except Exception:  # msgpack raises several unrelated types on bad input
        return None
    if (
        not isinstance(batch, tuple)
        or len(batch) < 2
        or not isinstance(batch[0], int | float)
        or not isinstance(batch[1], tuple)
    ):
        return None
    events: list[KvEvent] = []
    for raw in batch[1]:
        event = decode_event(raw, base_model)
        if event is not None:
            events.append(event)
    return EventBatch(float(batch[0]), tuple(events), len(batch[1]) - len(events))


def decode_event(raw: Any, base_model: str | None = None) -> KvEvent | None:
    """One event (an array, or a map of field names), or None when it has no known tag or
    its fields have wrong types."""
    if isinstance(raw, dict):
        raw = _as_array(raw)
    if not isinstance(raw, tuple | list) or not raw:
        return None
    tag = raw[0]
    if tag == "BlockStored" and len(raw) >= _STORED_MIN_FIELDS:
        hashes, parent, tokens, block_size, lora_id = raw[1:6]
        medium = raw[6] if len(raw) > 6 else None
        lora_name = raw[7] if len(raw) > 7 else None
        if (
            _hashes(hashes)
            and (parent is None or _is_hash(parent))
            and _ints(tokens)
            and _is_int(block_size)
            and block_size > 0
            and (lora_id is None or _is_int(lora_id))
            and (medium is None or isinstance(medium, str))
            and (lora_name is None or isinstance(lora_name, str))
        ):
            return BlockStored(
                tuple(hashes),
                None if parent == _NO_PARENT else parent,
                tuple(tokens),
                block_size,
                lora_id,
                medium,
                lora_name,
                base_model,
            )
        return None
    if tag == "BlockRemoved" and len(raw) >= _REMOVED_MIN_FIELDS:
        hashes = raw[1]
        medium = raw[2] if len(raw) > 2 else None
        if _hashes(hashes) and (medium is None or isinstance(medium, str)):
            return BlockRemoved(tuple(hashes), medium)
        return None
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def _as_array(raw: dict[Any, Any]) -> tuple[Any, ...] | None:
    """A map-encoded event as its array: the tag, then its fields in order (absent: None)."""
    tag = raw.get("type")
    if tag == "BlockStored":
        return (tag, *(raw.get(name) for name in _STORED_FIELDS))
    if tag == "BlockRemoved":
        return (tag, *(raw.get(name) for name in _REMOVED_FIELDS))
    if tag == "AllBlocksCleared":
        return (tag,)
    return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_hash(value: object) -> bool:
    return _is_int(value) or isinstance(value, bytes)


# msgpack gives exactly ``int`` and ``bytes``; ``type() is`` keeps these per-token checks cheap.
def _hashes(values: object) -> bool:
    return isinstance(values, tuple | list) and all(
        type(value) is int or type(value) is bytes for value in values
    )


def _ints(values: object) -> bool:
    return isinstance(values, tuple | list) and all(type(value) is int for value in values)
