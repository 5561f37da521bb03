"""One engine's KV event stream into the ``BlockIndex``, on its own thread.

The engine publishes on a ZMQ PUB socket ``(topic, seq as 8-byte big-endian, payload)``
with ``seq`` rising by one per batch from 0 for the life of the engine process, and
serves missed batches on a ROUTER replay socket (docs/kv-events.md). Here:

- **In order**: a batch with the next sequence number is applied.
- **A gap** (a higher number): the missing batches are asked from the replay endpoint
  and applied first; what it cannot give (no replay endpoint, buffer rolled past them,
  no answer within ``replay_timeout``) makes the endpoint ``approximate``.
- **A duplicate** (a lower number, only after a replay overlapped the live stream) is
  dropped.
- **The connection drops** (the engine exited, or restarted): its entries are cleared
  and it is ``approximate``. On (re)connecting the subscriber replays from 0: an engine
  that kept every batch since it started (a fresh or restarted one) makes the entries
  exact again at once.
- **Joining** an engine whose buffer no longer reaches its first batch (it has run
  longer than ``buffer_steps`` batches: the usual case for a restarted gateway or a
  second replica), or one without a replay endpoint: the entries start empty at the
  first batch there is and are ``exact`` from it, as a subset of the engine's blocks:
  each block in them is held (its store and every removal since were seen), blocks
  stored earlier are not known until a prompt sent there shows them (``BlockIndex.hint``).
  Waiting for history from batch 0 would wait for ever.
- **Resync**: ``approximate`` becomes ``exact`` again when the state is known once more:
  an ``AllBlocksCleared`` (the engine's cache emptied), or a full replay from 0.

A thread (not the event loop) because decoding and applying a big batch takes time the
request path must not pay; the router only reads the index.
"""

from __future__ import annotations

import logging
import threading
from typing import Hashable

from .index import APPROXIMATE, CONNECTING, EXACT, BlockIndex
from .wire import BadBatch, decode_batch

log = logging.getLogger("velocity.kvevents")

_END = -1

_ctx = None
_ctx_lock = threading.Lock()


def _context():
    # One ZMQ context for every subscriber of the process; never terminated (sockets
    # close with linger 0, so nothing waits on it).
    global _ctx
    with _ctx_lock:
        if _ctx is None:
            import zmq

            _ctx = zmq.Context()
        return _ctx


class Subscriber:
    """Subscribe to one engine's KV events; ``start()`` runs the thread, ``stop()`` ends it.

    ``endpoint`` and ``replay_endpoint`` are addresses to connect to, such as
    ``tcp://10.0.0.5:5557`` for an engine started with ``"endpoint": "tcp://*:5557"``.
    """

    def __init__(
        self,
        index: BlockIndex,
        key: Hashable,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        *,
        replay_timeout: float = 1.0,
        poll_interval: float = 0.1,
    ) -> None:
        self.index = index
        self.key = key
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.replay_timeout = replay_timeout
        self.poll_interval = poll_interval
        self.stats = index.stats(key)
        self._expected: int | None = None  # next sequence number; None: state unknown
        self._stop = threading.Event()
        self._resync = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self) -> "Subscriber":
        self._thread = threading.Thread(target=self._run, name=f"kv-events {self.endpoint}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        """End the thread (it notices within ``poll_interval``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def resync(self) -> None:
        """Forget the endpoint's entries and rebuild them from the engine's replay buffer
        (done on the subscriber's thread within ``poll_interval``): the gateway's word
        that the engine went down or came back, which may have emptied its cache without
        the event stream showing it."""
        self._resync.set()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- the thread ----------------------------------------------------------------------
    def _run(self) -> None:
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        ctx = _context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        # As deep as vLLM's PUB side: a burst waits here rather than becoming a gap.
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        mon = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(mon, zmq.POLLIN)
        sub.connect(self.endpoint)
        wait_ms = int(self.poll_interval * 1000)
        try:
            while not self._stop.is_set():
                if self._resync.is_set():
                    self._resync.clear()
                    self._disconnected()
                    self.stats.disconnects -= 1  # not a dropped connection: the gateway asked
                    self._rebuild(None)
                ready = dict(poller.poll(wait_ms))
                # Connection changes first: a restart's first batch must not be taken as
                # a continuation of the old stream.
                while mon in ready and mon.poll(0):
                    ev = recv_monitor_message(mon)["event"]
                    if ev == zmq.EVENT_DISCONNECTED:
                        self._disconnected()
                    elif ev == zmq.EVENT_CONNECTED and self._expected is None:
                        self._rebuild(None)
                if sub in ready:
                    for _ in range(1000):
                        try:
                            frames = sub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._message(frames)
        except Exception as e:  # a bug must show, not silently freeze the index
            self._error = e
            log.exception("kv events subscriber for %s failed", self.endpoint)
            self.index.set_state(self.key, APPROXIMATE)
        finally:
            sub.disable_monitor()
            mon.close(linger=0)
            sub.close(linger=0)

    def _disconnected(self) -> None:
        s = self.stats
        s.disconnects += 1
        self.index.clear(self.key)
        if s.state != CONNECTING:
            self.index.set_state(self.key, APPROXIMATE)
        self._expected = None

    def _message(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.stats.bad += 1
            return
        seq = int.from_bytes(frames[1], "big")
        exp = self._expected
        if exp is None:
            # State unknown (no replay on connect, or it failed): a stream that starts
            # here is whole; else rebuild from the engine's first batch if it has it.
            if seq == 0 or not self._rebuild(seq):
                self.index.clear(self.key)
                self.index.set_state(self.key, EXACT)
                if seq:
                    self.stats.joins += 1
                self._expected = seq
        elif seq > exp:
            self.stats.lost += seq - exp
            got = self._replay(exp)
            for rseq, payload in got or ():
                if exp <= rseq < seq and rseq >= self._expected:
                    self._apply(rseq, payload)
                    self.stats.replayed += 1
        if seq < self._expected:
            return  # already applied (a replay overlapped the live stream)
        self._apply(seq, frames[2])

    def _apply(self, seq: int, payload: bytes) -> None:
        if seq != self._expected:
            # A hole nothing filled: the entries may be wrong from here on.
            self.stats.unrecovered += 1
            self.index.set_state(self.key, APPROXIMATE)
        try:
            _, events = decode_batch(payload)
        except BadBatch:
            self.stats.bad += 1
            self.index.set_state(self.key, APPROXIMATE)
        else:
            self.index.apply(self.key, events)
            self.stats.batches += 1
        self._expected = seq + 1

    def _rebuild(self, upto: int | None) -> bool:
        """Start the endpoint's entries again from the engine's replay buffer (the
        batches below ``upto``, or all): exact when the buffer still begins at the
        engine's first batch, else joined at its first batch (exact as a subset). False,
        changing nothing, without an answer."""
        got = self._replay(0)
        if got is None:
            return False
        self.index.clear(self.key)
        self.index.set_state(self.key, EXACT)
        if not got or got[0][0] == 0:
            self._expected = 0
        else:
            self.stats.joins += 1
            self._expected = got[0][0]
        for seq, payload in got:
            if upto is not None and seq >= upto:
                break
            if seq >= self._expected:
                self._apply(seq, payload)
                self.stats.replayed += 1
        return True

    def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """The batches the engine still holds from ``start`` on, in order, or None when
        there is no replay endpoint or it did not answer within ``replay_timeout``."""
        if not self.replay_endpoint:
            return None
        import zmq

        sock = _context().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, bytes]] = []
        try:
            sock.connect(self.replay_endpoint)
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            wait_ms = int(self.replay_timeout * 1000)
            while True:
                if not sock.poll(wait_ms):
                    log.warning("kv events replay from %s timed out", self.replay_endpoint)
                    return None
                frames = sock.recv_multipart()
                # (b"", topic, seq, payload) from vLLM 0.32, as its live stream frames a
                # batch; (b"", seq, payload) from engines before it.
                if len(frames) == 4:
                    del frames[1]
                if len(frames) != 3 or len(frames[1]) != 8:
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq == _END:
                    return out
                if seq >= start:
                    out.append((seq, frames[2]))
        finally:
            sock.close(linger=0)
