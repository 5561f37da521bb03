"""The sim engine publishes KV events as vLLM does (--kv-events-config), read here with a
decoder written from vLLM's field layout (tests/kvevents/vllm_wire.py), not the sim's."""

from __future__ import annotations

import json
import re
import time

import pytest
import zmq

from tests.kvevents import vllm_wire as W
from tests.support.sim import free_port, sim_engine
from velocity_fast.kvevents.index import BlockIndex, chain_hashes
from velocity_fast.kvevents.subscriber import Subscriber

BS = 4
TOPIC = "kv"


def events_config(endpoint: str = "tcp://127.0.0.1:*", replay: str = "tcp://127.0.0.1:*") -> str:
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": endpoint,
            "replay_endpoint": replay,
            "topic": TOPIC,
        }
    )


def sim_flags(cfg: str, blocks: int = 64) -> list[str]:
    return [
        "--kv-events-config",
        cfg,
        "--block-size",
        str(BS),
        "--num-gpu-blocks",
        str(blocks),
        "--max-model-len",
        "200",
    ]


def endpoints(eng) -> tuple[str, str]:
    m = re.search(r"kv events on (\S+) replay (\S+)", eng.stderr_text)
    assert m, eng.stderr_text
    return m.group(1), m.group(2)


def post(eng, path: str, obj: dict) -> tuple[int, bytes]:
    return eng.request("POST", path, json.dumps(obj).encode(), {"content-type": "application/json"})


def complete(eng, prompt: str) -> dict:
    status, body = post(eng, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert status == 200, body
    return json.loads(body)


def token_ids(eng, prompt: str) -> list[int]:
    status, body = post(eng, "/tokenize", {"prompt": prompt})
    assert status == 200, body
    return json.loads(body)["tokens"]


class Listener:
    """A SUB socket that is surely subscribed before the test makes events."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        mon = self.sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.sub.connect(endpoint)
        assert mon.poll(5000), "no ZMQ handshake with the sim"
        self.sub.disable_monitor()
        mon.close(linger=0)
        time.sleep(0.2)  # the subscription travels after the handshake
        self.messages: list[list[bytes]] = []

    def drain(self, until, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not until():
            left = deadline - time.monotonic()
            assert left > 0, f"timed out; got {len(self.messages)} batches"
            if self.sub.poll(int(min(left, 0.1) * 1000)):
                self.messages.append(self.sub.recv_multipart())

    def events(self) -> list[dict]:
        return [e for m in self.messages for e in W.decode(m[2])[1]]

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


@pytest.mark.timeout(60)
def test_sim_publishes_vllm_kv_events():
    with sim_engine(*sim_flags(events_config()), time_scale=50) as eng:
        pub, replay = endpoints(eng)
        lis = Listener(pub)
        try:
            # Prompt A: 10 full blocks (4 tokens of 4 bytes each), then one that
            # extends it by 5 blocks: its BlockStored names A's last block as parent.
            a = "".join(f"a{i:03d}" for i in range(40))
            b = a + "".join(f"b{i:03d}" for i in range(20))
            complete(eng, a)
            lis.drain(lambda: any(e["type"] == "BlockStored" for e in lis.events()))
            complete(eng, b)
            lis.drain(lambda: sum(e["type"] == "BlockStored" for e in lis.events()) >= 2)

            # Framing: topic, 8-byte big-endian sequence from 0 up by one, payload.
            seqs = [int.from_bytes(m[1], "big") for m in lis.messages]
            assert all(len(m) == 3 and m[0] == TOPIC.encode() and len(m[1]) == 8 for m in lis.messages)
            assert seqs == list(range(len(seqs))) and seqs[0] == 0
            ts, _, rank = W.decode(lis.messages[0][2])
            assert rank == 0 and abs(ts - time.time()) < 60

            st = [e for e in lis.events() if e["type"] == "BlockStored"]
            # Field names and order as vLLM declares them (defaults left out).
            assert list(st[0]) == W.STORED_KEYS[: len(st[0])] and len(st[0]) >= 7
            assert st[0]["block_size"] == BS and st[0]["medium"] == "GPU" and st[0]["parent_block_hash"] is None
            ids_a, ids_b = token_ids(eng, a), token_ids(eng, b)
            assert st[0]["token_ids"] == ids_a[:40] and len(st[0]["block_hashes"]) == 10
            assert st[1]["parent_block_hash"] == st[0]["block_hashes"][-1]
            assert st[1]["token_ids"] == ids_b[40:60] and len(st[1]["block_hashes"]) == 5
            assert all(isinstance(h, int) and 0 <= h < 2**64 for h in st[0]["block_hashes"])

            # A working set larger than the cache (64 blocks): blocks are evicted, one
            # BlockRemoved each, naming blocks stored before.
            for i in range(8):
                complete(eng, "".join(f"{i}x{j:02d}" for j in range(40)))
            lis.drain(lambda: any(e["type"] == "BlockRemoved" for e in lis.events()))
            rm = [e for e in lis.events() if e["type"] == "BlockRemoved"]
            assert list(rm[0]) == W.REMOVED_KEYS[: len(rm[0])]
            stored_hashes = {h for e in lis.events() if e["type"] == "BlockStored" for h in e["block_hashes"]}
            assert all(len(e["block_hashes"]) == 1 and e["block_hashes"][0] in stored_hashes for e in rm)

            # A reset empties the cache: AllBlocksCleared.
            status, _ = post(eng, "/reset_prefix_cache", {})
            assert status == 200
            lis.drain(lambda: lis.events()[-1]["type"] == "AllBlocksCleared")
            assert lis.events()[-1] == {"type": "AllBlocksCleared"}
            seqs = [int.from_bytes(m[1], "big") for m in lis.messages]
            assert seqs == list(range(len(seqs)))

            # Replay: from a sequence number, the same batches again, then the end mark,
            # framed as vLLM 0.32 frames them (the topic before the number, empty at the end).
            ctx = zmq.Context()
            d = ctx.socket(zmq.DEALER)
            try:
                d.connect(replay)
                d.send_multipart((b"", (2).to_bytes(8, "big")))
                got = []
                while True:
                    assert d.poll(5000), "no replay answer"
                    frames = d.recv_multipart()
                    assert len(frames) == 4 and frames[0] == b""
                    seq = int.from_bytes(frames[2], "big", signed=True)
                    if seq == -1:
                        assert frames[1] == frames[3] == b""
                        break
                    assert frames[1] == TOPIC.encode()
                    got.append((seq, frames[3]))
            finally:
                d.close(linger=0)
                ctx.term()
            live = [(int.from_bytes(m[1], "big"), m[2]) for m in lis.messages]
            assert got == live[2:]
        finally:
            lis.close()


@pytest.mark.timeout(60)
def test_sim_events_feed_the_index_across_reset_and_restart():
    p1, p2 = free_port(), free_port()
    cfg = events_config(f"tcp://*:{p1}", f"tcp://*:{p2}")
    idx = BlockIndex()
    sub = None
    try:
        with sim_engine(*sim_flags(cfg), time_scale=50) as eng:
            sub = Subscriber(idx, "e1", f"tcp://127.0.0.1:{p1}", f"tcp://127.0.0.1:{p2}", topic=TOPIC).start()
            W.wait_for(lambda: idx.exact("e1"), what="subscriber ready")
            a = "".join(f"p{i:03d}" for i in range(30))  # 7 full blocks and a bit
            complete(eng, a)
            chain = chain_hashes(token_ids(eng, a), BS)
            assert len(chain) == 7
            W.wait_for(lambda: idx.match("e1", chain) == 7, what="the prompt's blocks")
            assert idx.match("e1", chain_hashes(token_ids(eng, a[:40] + "zzzz" * 10), BS)) == 2
            post(eng, "/reset_prefix_cache", {})
            W.wait_for(lambda: idx.size("e1") == 0, what="the reset")
            assert idx.exact("e1")
        # The engine is gone: its entries go with it.
        W.wait_for(lambda: idx.stats("e1").disconnects >= 1, what="the disconnect")
        assert not idx.exact("e1") and idx.size("e1") == 0
        with sim_engine(*sim_flags(cfg), time_scale=50) as eng:
            complete(eng, a)
            W.wait_for(lambda: idx.match("e1", chain) == 7, what="refill after the restart")
            assert idx.exact("e1") and idx.stats("e1").resyncs >= 1
    finally:
        if sub is not None:
            sub.stop()


@pytest.mark.timeout(60)
def test_reset_refuses_while_requests_hold_blocks_unless_told_to_preempt():
    import threading

    with sim_engine(*sim_flags(events_config()), time_scale=1) as eng:
        out = {}
        t = threading.Thread(target=lambda: out.update(r=complete_long(eng)))
        t.start()
        try:
            W.wait_for(lambda: eng.metric("vllm:num_requests_running") == 1, what="a running request")
            status, body = post(eng, "/reset_prefix_cache", {})
            assert status == 409 and json.loads(body)["error"]["message"].startswith("Failed to reset")
            status, _ = post(eng, "/reset_prefix_cache?reset_running_requests=true", {})
            assert status == 200
        finally:
            t.join(30)
        # The preempted request recomputed and finished.
        assert out["r"]["usage"]["completion_tokens"] == 40


def complete_long(eng) -> dict:
    status, body = post(eng, "/v1/completions", {"prompt": "long " * 40, "max_tokens": 40, "ignore_eos": True})
    assert status == 200, body
    return json.loads(body)
