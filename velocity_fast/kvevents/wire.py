"""Decoding vLLM's KV event batches (``vllm/distributed/kv_events.py``).

A batch is msgpack: a positional array ``[ts, events, data_parallel_rank]`` (the rank
is absent in older engines). Each event is either a map tagged by its ``"type"`` key
(vLLM since it dropped ``array_like`` from the event structs) or, from older engines, a
positional array whose first item is the tag. Both are read here, by field name or by
position, and unknown fields are ignored, so an engine that adds fields keeps working.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec

_decode = msgspec.msgpack.Decoder().decode


class Stored(NamedTuple):
    """``BlockStored``: a run of full blocks newly cached, after ``parent``."""

    block_hashes: list
    parent: Any
    token_ids: list[int]
    block_size: int
    lora: Any  # lora_name, else lora_id, else None
    medium: str | None
    group_idx: int | None
    extra_keys: list | None


class Removed(NamedTuple):
    """``BlockRemoved``: blocks evicted."""

    block_hashes: list
    medium: str | None
    group_idx: int | None


class Cleared(NamedTuple):
    """``AllBlocksCleared``: the engine dropped its whole prefix cache."""


class BadBatch(ValueError):
    """A payload that is not a KV event batch."""


# Positions of the fields in the array form (older engines), after the tag.
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


def _fields(ev: Any, names: tuple[str, ...]) -> dict:
    if isinstance(ev, dict):
        return ev
    return dict(zip(names, ev[1:]))


def _event(ev: Any) -> Stored | Removed | Cleared | None:
    if isinstance(ev, dict):
        tag = ev.get("type")
    elif isinstance(ev, list) and ev:
        tag = ev[0]
    else:
        raise BadBatch(f"an event is neither a map nor an array: {type(ev).__name__}")
    if tag == "BlockStored":
        f = _fields(ev, _STORED_FIELDS)
        lora = f.get("lora_name")
        if lora is None:
            lora = f.get("lora_id")
        return Stored(
            f["block_hashes"],
            f.get("parent_block_hash"),
            f["token_ids"],
            f["block_size"],
            lora,
            f.get("medium"),
            f.get("group_idx"),
            f.get("extra_keys"),
        )
    if tag == "BlockRemoved":
        f = _fields(ev, _REMOVED_FIELDS)
        return Removed(f["block_hashes"], f.get("medium"), f.get("group_idx"))
    if tag == "AllBlocksCleared":
        return Cleared()
    return None  # an event kind this index does not use


def decode_batch(payload: bytes) -> tuple[float, list[Stored | Removed | Cleared]]:
    """``(ts, events)`` of one batch payload; BadBatch when it is not one."""
    try:
        batch = _decode(payload)
        ts, raw = batch[0], batch[1]
        events = []
        for ev in raw:
            e = _event(ev)
            if e is not None:
                events.append(e)
    except BadBatch:
        raise
    except (msgspec.DecodeError, KeyError, IndexError, TypeError) as e:
        raise BadBatch(f"not a KV event batch: {e!r}") from None
    return float(ts), events
