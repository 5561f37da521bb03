"""Precise prefix routing from vLLM's own KV events, for a model whose template is ChatML
and one whose template is not (Llama-3-style headers, a BOS token in the template).

- the gateway renders and tokenizes a conversation as vLLM does (vLLM's ``/tokenize``);
- the workload (16 shared system prompts of about 900 tokens, 96 requests at concurrency
  4) through a precise gateway: precise share >= 0.9 of all picks (a group's first waits
  the millisecond or two its tokens take), no group placed on both engines (its requests
  that come while its first is in prefill follow it), and vLLM's own hit rate
  (``vllm:prefix_cache_hits / queries``) above round-robin's, precise and approximate alike;
- the same through a second gateway started after the first had run traffic on the same
  engines: on the ChatML pair it rebuilds from vLLM's replay socket; on the other the
  engines keep 4 batches, so batch 0 is gone and it joins where the buffer starts.

Each phase uses system prompts of its own, so no phase finds another's blocks cached;
the hit rates are the deltas of vLLM's counters over the phase.
"""

from __future__ import annotations

import asyncio
import glob
import random
import time
from pathlib import Path

import pytest

from tests.support.gateway import wait_until
from tests.support.sim import http_request
from tests.vllm.support.gateway import vllm_gateway

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]

CHAT = "/v1/chat/completions"
ROOT = Path(__file__).resolve().parents[2]
# 16 system prompts, about 6 requests each: how a router places a prefix decides how
# often it is prefilled cold (round-robin: on both engines; by prefix: on one).
GROUPS, REQUESTS, CONCURRENCY = 16, 96, 4
NOISE = 0.02  # of vLLM's hit rate, between two routings that place alike (see the test)
# The hot-spot guard spills a group onto the other engine when 2 requests wait on its own
# (vLLM's num_requests_waiting). At concurrency 4 that happens by timing: 0 to 3 groups a
# run, under every routing alike, which moved the hit rates of two routings that place
# alike by up to 0.021 apart. These tests compare how a routing knows where a prefix is,
# so the guard is set beyond this load; it is tested in tests/routing/test_router.py.
GUARD = {"hotspot_waiting": 64}
ROUTINGS = {
    "round-robin": {"default_profile": "round-robin", **GUARD},
    "approximate": {"default_profile": "chat", "prefix": "approximate", **GUARD},
}


def _words() -> list[str]:
    text = " ".join(Path(f).read_text(encoding="utf-8") for f in sorted(glob.glob(str(ROOT / "docs" / "*.md"))))
    return text.split()


WORDS = _words()


def system_prompts(phase: str, n: int = GROUPS, words: int = 520) -> list[str]:
    # The phase and group first: no two prompts share a 128-token block. The texts after
    # them are the same in every phase of a model (seeded by the model's kind), and so is
    # the order of the requests (run_phase): the routings are compared on one workload.
    rng = random.Random(phase.split("-", 1)[0])
    out = []
    for g in range(n):
        start = rng.randrange(len(WORDS) - words)
        out.append(f"{phase} group {g}. " + " ".join(WORDS[start : start + words]))
    return out


def precise_routing(pair) -> dict:
    return {"default_profile": "chat", "prefix": "precise", "tokenizer": pair.model_dir, "seed": 7, **GUARD}


def gateway(pair, routing: dict):
    # Admission's limits at or above the workload's concurrency: an engine at its limit
    # sends a group's request to the other, a cold prefill there, whichever engine the
    # routing chose; these tests compare the choosing.
    return vllm_gateway(pair.engines, kv_events=True, routing=routing, admission={"aimd_min": CONCURRENCY})


def counters(pair) -> tuple[float, float]:
    q = sum(e.metric("vllm:prefix_cache_queries_total") for e in pair.engines)
    h = sum(e.metric("vllm:prefix_cache_hits_total") for e in pair.engines)
    return q, h


async def run_phase(port: int, pair, phase: str, prompts_of: str | None = None) -> tuple[float, int]:
    """The workload with this phase's prompts (or those of phase ``prompts_of``, other
    questions); vLLM's hit rate over it, and the groups it placed twice: requests of a
    group sent to both engines, a second cold prefill of its prompt."""
    prompts = system_prompts(prompts_of or phase)
    rng = random.Random(phase.split("-", 1)[0] + "/order")
    order = [rng.randrange(GROUPS) for _ in range(REQUESTS)]
    q0, h0 = await asyncio.to_thread(counters, pair)
    sem = asyncio.Semaphore(CONCURRENCY)
    where: dict[int, set] = {}

    async def one(i: int, g: int) -> None:
        body = {
            "model": pair.model,
            "max_tokens": 2,
            "temperature": 0,
            "messages": [
                {"role": "system", "content": prompts[g]},
                {"role": "user", "content": f"question {i}: what does {WORDS[i * 7]} mean?"},
            ],
        }
        async with sem:
            r = await http_request(port, "POST", CHAT, body, timeout=120)
        assert r.status == 200, r.body
        where.setdefault(g, set()).add(r.headers["x-velocity-endpoint"])

    await asyncio.gather(*(one(i, g) for i, g in enumerate(order)))
    # vLLM's counters are scraped from its last step's stats: wait until they settle.
    await asyncio.sleep(1.0)
    q1, h1 = await asyncio.to_thread(counters, pair)
    return (h1 - h0) / (q1 - q0), sum(len(v) - 1 for v in where.values())


async def precise_phase(pair, phase: str, prompts_of: str | None = None) -> tuple[tuple[float, int], float, dict]:
    async with gateway(pair, precise_routing(pair)) as gw:
        await wait_until(lambda: all(gw.kv.index.exact(e.name) for e in pair.engines), 15.0, what="exact indexes")
        hit = await run_phase(gw.port, pair, phase, prompts_of)
        st = gw.kv.stats()
        picks = {k[1]: v.value for k, v in gw.registry.get("velocity_prefix_precise_picks_total").children()}
        print(phase, "picks", picks, "share", st["precise"]["share"])
        # A group's first request brings a prompt new to the token cache: its pick waits
        # for its tokens (routing.precise_token_wait_ms), so it too is precise.
        total = sum(picks.values())
        return hit, picks.get("precise", 0.0) / total, st["endpoints"]


def tokens_as_vllm(pair) -> None:
    """The gateway's rendering and tokens of a conversation are vLLM's."""
    import json
    import urllib.request

    from velocity_fast.routing.precise.template import load_renderer, load_tokenizer, message_texts

    msgs = [
        {"role": "system", "content": "be brief."},
        {"role": "user", "content": "how is a request routed?"},
        {"role": "assistant", "content": "by its prefix."},
        {"role": "user", "content": "and then?"},
    ]
    body = json.dumps({"model": pair.model, "messages": msgs}).encode()
    req = urllib.request.Request(pair.engines[0].url + "/tokenize", body, {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        theirs = json.loads(r.read())["tokens"]
    tok = load_tokenizer(pair.model_dir)
    ours = tok.encode(load_renderer(pair.model_dir).render(message_texts(msgs)), add_special_tokens=False).ids
    assert ours == theirs


@pytest.mark.parametrize("kind", ["chatml", "llama3"])
async def test_precise_routing_from_vllms_events(kind, vllm_pairs):
    pair = vllm_pairs.get(kind)
    await asyncio.to_thread(tokens_as_vllm, pair)

    runs = {}
    for name, routing in ROUTINGS.items():
        async with gateway(pair, routing) as gw:
            runs[name] = await run_phase(gw.port, pair, f"{kind}-{name}")
    runs["precise"], share, _ = await precise_phase(pair, f"{kind}-precise")
    # A gateway that joins engines that have run traffic (a restart, a second replica),
    # with the prompts the engines already hold (other questions).
    runs["joined"], joined_share, eps = await precise_phase(pair, f"{kind}-joined", f"{kind}-precise")
    hits = {k: v[0] for k, v in runs.items()}
    twice = {k: v[1] for k, v in runs.items()}
    print(
        f"{kind}: vLLM hit rate {', '.join(f'{k} {v:.3f}' for k, v in hits.items())}; "
        f"groups placed twice {twice}; "
        f"precise share {share:.3f}, joined {joined_share:.3f}; joined endpoints "
        f"{ {k: {f: v[f] for f in ('joins', 'replayed', 'adopted', 'orphans')} for k, v in eps.items()} }"
    )
    assert share >= 0.9 and joined_share >= 0.9, (share, joined_share)
    # Both prefix routings place each group on one engine (its requests that come while
    # the first is still in prefill follow it there); round-robin nearly every group on both.
    assert twice["precise"] == twice["approximate"] == twice["joined"] == 0 and twice["round-robin"] >= 10, twice
    # So they tie on vLLM's hit rate, but for what timing moves: a request that meets its
    # group's first still in prefill prefills too. Precise must not fall behind by more
    # than that; round-robin, which prefills each group on both, is 15 % behind.
    assert hits["precise"] >= hits["approximate"] - NOISE and hits["approximate"] > hits["round-robin"], hits
    assert hits["precise"] >= 1.15 * hits["round-robin"], hits
    assert hits["joined"] >= hits["precise"], hits  # its prompts were cached: none placed cold again
    if kind == "chatml":
        # vLLM's buffer still holds batch 0: the joining gateway rebuilt from its replay socket.
        assert all(v["replayed"] > 0 and v["joins"] == 0 for v in eps.values()), eps
    else:
        # 4 batches kept: batch 0 was gone, and it joined where the buffer started.
        assert all(v["joins"] >= 1 for v in eps.values()), eps


async def test_an_engine_killed_and_restarted_leaves_no_stale_blocks(vllm_pairs):
    # Last in the session (it restarts an engine of the pair the tests above used).
    pair = vllm_pairs.get("llama3")
    e1 = pair.engines[0]
    async with gateway(pair, precise_routing(pair)) as gw:
        await wait_until(lambda: gw.kv.index.exact(e1.name), 15.0, what="an exact index")
        await run_phase(gw.port, pair, "llama3-restart")
        # (Its blocks may have been dropped already: a health check that failed under the
        # load resyncs the index from a 4-batch buffer. Events were applied in any case.)
        assert gw.kv.index.stats(e1.name).events > 0
        await asyncio.to_thread(e1.stop)
        await wait_until(
            lambda: gw.kv.index.size(e1.name) == 0 and not gw.kv.index.exact(e1.name),
            10.0,
            what="the dead engine's blocks dropped",
        )
        e1.spawn()
        await asyncio.to_thread(e1.wait_ready, time.monotonic() + 240)
        await asyncio.to_thread(e1.warm_up)
        # The new engine's stream starts at batch 0: exact again, holding only what it
        # has stored since (the warm-up's prompt is shorter than one block: nothing).
        await wait_until(lambda: gw.kv.index.exact(e1.name), 15.0, what="the index resynced")
        assert gw.kv.index.size(e1.name) == 0
        hit, _ = await run_phase(gw.port, pair, "llama3-restart")
        assert gw.kv.index.size(e1.name) > 0 and hit > 0
