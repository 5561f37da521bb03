"""KV cache events of the sim engine, published as vLLM publishes them.

``--kv-events-config`` takes vLLM's JSON (``KVEventsConfig``)::

    {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
     "replay_endpoint": "tcp://*:5558", "topic": "kv", "buffer_steps": 10000, "hwm": 100000}

The wire is vLLM's (``vllm/distributed/kv_events.py``, docs/kv-events.md):

- a ZMQ PUB socket; an endpoint with ``*`` or ``::`` in it (or ``ipc://``/``inproc://``)
  binds, any other connects;
- one multipart message per batch: ``(topic, sequence as 8-byte big-endian, payload)``,
  sequence numbers from 0 up by one per batch for the life of the process;
- the payload is msgpack: the batch is a positional array ``[ts, events,
  data_parallel_rank]``; each event is a map tagged by ``"type"`` (the class name), with
  defaulted fields left out when at their default (vLLM's structs are
  ``omit_defaults``; events became maps when vLLM dropped ``array_like`` from them);
- a ROUTER socket on the replay endpoint: a client sends ``(b"", start as 8-byte
  big-endian)`` and gets ``(b"", topic, seq, payload)`` for every buffered batch from
  there, then ``(b"", b"", -1 as 8-byte signed big-endian, b"")`` (vLLM 0.32's framing).

Publishing runs on its own thread (as vLLM's), fed by a queue, so the step loop only
appends to a list and puts one object per batch.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from collections import deque
from typing import Any

import msgspec

log = logging.getLogger("velocity.sim")

MEDIUM_GPU = "GPU"
_MASK64 = (1 << 64) - 1


class KVEventsConfig(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's ``--kv-events-config`` (same keys and defaults)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def parse(cls, text: str) -> "KVEventsConfig":
        """Parse the flag's JSON; ValueError naming the problem."""
        try:
            cfg = msgspec.json.decode(text, type=cls)
        except msgspec.DecodeError as e:
            raise ValueError(f"--kv-events-config: {e}") from None
        if cfg.publisher is None:
            cfg.publisher = "zmq" if cfg.enable_kv_cache_events else "null"
        if cfg.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: unknown event publisher {cfg.publisher!r}")
        if cfg.buffer_steps < 1 or cfg.hwm < 0 or cfg.max_queue_size < 1:
            raise ValueError("--kv-events-config: buffer_steps and max_queue_size must be >= 1, hwm >= 0")
        return cfg

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


# -- wire structs (field names, order and defaults as vLLM's) ------------------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events: a map whose ``type`` key is the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


def external_hash(h: int) -> int:
    """An engine block hash as it goes on the wire: an unsigned 64-bit integer."""
    return h & _MASK64


def stored(hashes: list[int], parent: int | None, token_ids: list[int], block_size: int) -> BlockStored:
    """The event for a run of newly cached full blocks (hashes are the sim's own)."""
    return BlockStored(
        block_hashes=[h & _MASK64 for h in hashes],
        parent_block_hash=None if parent is None else parent & _MASK64,
        token_ids=token_ids,
        block_size=block_size,
        lora_id=None,
        medium=MEDIUM_GPU,
        lora_name=None,
        extra_keys=[None] * len(hashes),
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )


def removed(h: int) -> BlockRemoved:
    """The event for one evicted block (vLLM sends one per evicted block)."""
    return BlockRemoved(block_hashes=[h & _MASK64], medium=MEDIUM_GPU, group_idx=0)


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqPublisher:
    """PUB socket plus replay ROUTER on a thread, with vLLM's framing and replay."""

    END_SEQ = (-1).to_bytes(8, "big", signed=True)
    SHUTDOWN_TIMEOUT = 1.0

    def __init__(self, cfg: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        import zmq

        self._zmq = zmq
        self._cfg = cfg
        self._rank = data_parallel_rank
        self._topic = cfg.topic.encode()
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=cfg.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(cfg.hwm)
        self._replay = None
        try:
            if _binds(cfg.endpoint):
                self._pub.bind(cfg.endpoint)
            else:
                self._pub.connect(cfg.endpoint)
            if cfg.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(cfg.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            where = cfg.endpoint + (f" / {cfg.replay_endpoint}" if cfg.replay_endpoint else "")
            raise ValueError(f"--kv-events-config: cannot open {where}: {e}") from None
        #: Where the sockets really are (a ``*`` port resolved), for the startup line.
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or cfg.endpoint
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay is not None else None
        self.published = 0
        self._running = True
        self._thread = threading.Thread(target=self._run, name="sim-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[Any]) -> None:
        """Queue one batch (called from the step loop)."""
        if not self._running:
            return
        try:
            self._queue.put_nowait(EventBatch(ts=time.time(), events=events, data_parallel_rank=self._rank))
        except queue.Full:
            # As a full queue in vLLM's publisher blocks the scheduler, dropping here is
            # the sim's only divergence: the sequence number is not taken, so nothing
            # tells the subscriber; it is logged instead.
            log.warning("kv events queue full; dropped a batch of %d events", len(events))

    def shutdown(self) -> None:
        """Send what is queued (a second at most), then close the sockets."""
        if not self._running:
            return
        self._running = False
        self._queue.put(None)
        self._thread.join(self.SHUTDOWN_TIMEOUT)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        seq = 0
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._serve_replay()
                except Exception:
                    log.exception("kv events replay failed")
            try:
                batch = self._queue.get(timeout=0.02)
            except queue.Empty:
                continue
            if batch is None:
                return
            try:
                payload = encode(batch)
                seq_bytes = seq.to_bytes(8, "big")
                self._pub.send_multipart((self._topic, seq_bytes, payload))
                self._buffer.append((seq, payload))
                seq += 1
                self.published = seq
            except Exception:
                log.exception("kv events publish failed")
                time.sleep(0.1)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("invalid kv events replay request (%d frames)", len(frames))
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", self.END_SEQ, b""))


def open_publisher(text: str | None) -> ZmqPublisher | None:
    """The publisher for a ``--kv-events-config`` value, or None when events are off."""
    if not text:
        return None
    cfg = KVEventsConfig.parse(text)
    if not cfg.active:
        return None
    pub = ZmqPublisher(cfg)
    # Tests that bind to port ``*`` read the real endpoints from this line.
    print(
        f"sim engine kv events on {pub.endpoint}" + (f" replay {pub.replay_endpoint}" if pub.replay_endpoint else ""),
        file=sys.stderr,
        flush=True,
    )
    return pub
