"""vLLM's KV event wire, written here from its published layout (vllm/distributed/kv_events.py),
independently of the sim's structs: plain msgpack lists and maps.

- multipart ``(topic, seq as 8-byte big-endian, payload)``;
- payload ``[ts, events, data_parallel_rank]``; an event is a map whose first key is
  ``"type"`` (current vLLM) or, in older engines, an array ``[tag, field, ...]``;
- replay: a ROUTER answering ``(b"", start)`` with ``(b"", topic, seq, payload)`` frames and
  a final ``(b"", b"", -1, b"")`` (vLLM 0.32; engines before it sent no topic frame).

``Publisher`` is a minimal engine side for the subscriber's tests: it can hold a batch
back from the live stream (a forced gap) while keeping it for replay.
"""

from __future__ import annotations

import threading
import time

import msgspec
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)

#: BlockStored's fields in vLLM's declaration order (maps keep it on the wire).
STORED_KEYS = [
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
]
REMOVED_KEYS = ["type", "block_hashes", "medium", "group_idx"]


def stored(hashes, parent, token_ids, block_size, *, arrays=False, medium="GPU"):
    if arrays:  # the layout before vLLM made events maps
        return ["BlockStored", hashes, parent, token_ids, block_size, None, medium]
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": token_ids,
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
        "extra_keys": [None] * len(hashes),
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }


def removed(hashes, *, arrays=False):
    if arrays:
        return ["BlockRemoved", hashes, "GPU"]
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": 0}


def cleared(*, arrays=False):
    return ["AllBlocksCleared"] if arrays else {"type": "AllBlocksCleared"}


def batch(events, ts=None, rank=0) -> bytes:
    return msgspec.msgpack.encode([time.time() if ts is None else ts, events, rank])


def decode(payload: bytes) -> tuple[float, list, int | None]:
    """A payload as vLLM lays it out: ``(ts, events, data_parallel_rank)``."""
    b = msgspec.msgpack.decode(payload)
    assert isinstance(b, list) and len(b) in (2, 3), b
    return b[0], b[1], (b[2] if len(b) == 3 else None)


class Publisher:
    """PUB + replay ROUTER on 127.0.0.1 ports the OS picks; ``close()`` when done."""

    def __init__(
        self, topic: str = "kv", replay: bool = True, *, replay_topic: bool = True, buffer_steps: int = 10_000
    ) -> None:
        self.ctx = zmq.Context()
        self.topic = topic.encode()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.router = None
        self.replay_endpoint = None
        self.replays = 0
        self.replay_topic = replay_topic  # vLLM 0.32's replay framing, else the older one
        self.buffer_steps = buffer_steps  # batches kept for replay, as vLLM's buffer_steps
        if replay:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.bind("tcp://127.0.0.1:*")
            self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._thread = threading.Thread(target=self._serve, daemon=True)
            self._thread.start()

    def send(self, events, *, live: bool = True) -> int:
        """Publish the next batch; ``live=False`` keeps it for replay only (a lost batch)."""
        payload = batch(events)
        with self._lock:
            seq = self.seq
            self.seq += 1
            self.buffer.append((seq, payload))
            del self.buffer[: -self.buffer_steps]
        if live:
            self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        return seq

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            client, _, start = self.router.recv_multipart()
            start = int.from_bytes(start, "big")
            with self._lock:
                items = [(s, p) for s, p in self.buffer if s >= start]
            head = (client, b"", self.topic) if self.replay_topic else (client, b"")
            for s, p in items:
                self.router.send_multipart(head + (s.to_bytes(8, "big"), p))
            self.router.send_multipart(
                (client, b"", b"") + (END_SEQ, b"") if self.replay_topic else (client, b"", END_SEQ, b"")
            )
            self.replays += 1

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self.router is not None:
            self._thread.join(2)
            self.router.close(linger=0)
        self.pub.close(linger=0)
        self.ctx.term()


def wait_for(cond, timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)
