"""Routing end to end: a gateway in front of 4 sim engines with prefix
caching, on real sockets.

The engines' own prefix-cache hit rate is what prefix affinity is for: on a
shared-prefix workload (16 groups, each a long shared system prompt followed by a
varied question) the `chat` profile must earn at least twice the hit rate of `batch`
(shortest queue), on engines whose KV cache holds only a few groups' prompts, so that
where a request runs decides whether its prefix is still cached. Both rates are read
from the engines (`vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`,
deltas over the run, summed over engines), never from the gateway's own index.

The same holds at default flags: `velocityllm serve` with nothing but its endpoints (no
`models:` section, no profile header) routes with prefix affinity under its default
policy, and `chargeVelocity --prefix precise` makes precise picks.

Also: an unknown `x-velocity-profile` is a 400 naming the header, and `x-session-id`
keeps a session on one engine across requests with unrelated prompts (and when its
engine leaves, only that session moves).
"""

from __future__ import annotations

import asyncio
import random
import time
from concurrent.futures import ThreadPoolExecutor

import orjson
import pytest

from tests.support.gateway import gateway_process, real_client, running_gateway, wait_until
from tests.support.sim import http_request, start_sim_engine
from velocity_fast.loadgen.client import Client
from velocity_fast.loadgen.workload import render_request

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

MODEL = "sim-model"
CHAT = "/v1/chat/completions"
ENGINES = 4
GROUPS = 16
REQUESTS = 192
SYSTEM_TOKENS = 512  # about 4 bytes a token, as the sim counts
QUESTION_TOKENS = 48
# 192 blocks of 16 tokens = 3072 tokens: an engine keeps about five groups' system
# prompts (512 tokens each) beside the requests it is running, not all sixteen.
KV_BLOCKS = 192
TIME_SCALE = 8
# The engines: prefix caching, a KV cache that holds a few groups, and replies that end by
# themselves (no max_tokens sent) about as long as the 8 tokens the others ask for.
ENGINE_FLAGS = (
    "--enable-prefix-caching",
    "--num-gpu-blocks",
    str(KV_BLOCKS),
    "--block-size",
    "16",
    "--max-model-len",
    "2048",
    "--natural-output-mean",
    "8",
)
WORDS = (
    "the of and to in is was that for on are with as be at by this had not but from or have an they "
    "which one you were all we her she there been if more when will would who so no model token cache "
    "engine queue batch prefill decode latency tenant band request stream router gateway"
).split()


def _text(rng: random.Random, nbytes: int) -> str:
    out: list[str] = []
    n = 0
    while n < nbytes:
        w = rng.choice(WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:nbytes]


def shared_prefix_workload(seed: int = 7) -> list[tuple[int, bytes]]:
    """(group, body) of each request: one of GROUPS long system prompts, then a question
    of its own. Seeded: every variant sends the same bytes in the same order."""
    rng = random.Random(seed)
    systems = [f"You are assistant number {g}. " + _text(rng, SYSTEM_TOKENS * 4) for g in range(GROUPS)]
    out = []
    for i in range(REQUESTS):
        g = rng.randrange(GROUPS)
        question = f"Question {i}: " + _text(rng, QUESTION_TOKENS * 4)
        body = {
            "model": MODEL,
            "max_tokens": 8,
            "ignore_eos": True,
            "messages": [{"role": "system", "content": systems[g]}, {"role": "user", "content": question}],
        }
        # As ordinary clients write it: a third without max_tokens (the engine ends the
        # reply, about as long: ENGINE_FLAGS), vLLM's priority 0, temperature and stop.
        out.append((g, orjson.dumps(real_client(body, i))))
    return out


def start_engines(n: int, *flags: str) -> list:
    """n sim engines started side by side; all stopped again if one fails to start."""
    with ThreadPoolExecutor(n) as pool:
        futs = [pool.submit(start_sim_engine, *flags, model=MODEL, time_scale=TIME_SCALE) for _ in range(n)]
        engines, errors = [], []
        for f in futs:
            try:
                engines.append(f.result())
            except Exception as e:  # noqa: BLE001 - re-raised below once all are stopped
                errors.append(e)
    if errors:
        stop_engines(engines)
        raise errors[0]
    return engines


def stop_engines(engines: list) -> None:
    for e in engines:
        e.stop()


def prefix_counters(engines: list) -> tuple[float, float]:
    """(hits, queries) in tokens, summed over the engines' own /metrics."""
    hits = queries = 0.0
    for e in engines:
        hits += e.metric("vllm:prefix_cache_hits_total")
        queries += e.metric("vllm:prefix_cache_queries_total")
    return hits, queries


async def run_profile(profile: str, workload: list[tuple[int, bytes]]) -> dict:
    """The workload through a fresh gateway and fresh engines with `profile`; the
    engines' hit rate over the run and where the requests went."""
    engines = await asyncio.to_thread(start_engines, ENGINES, *ENGINE_FLAGS)
    try:
        async with running_gateway(*engines, policy="dynamic", max_concurrency=16) as gw:
            await wait_until(
                lambda: all(e.num_gpu_blocks for e in gw.endpoints.values()),
                5.0,
                what="every engine's cache config scraped",
            )
            hits0, queries0 = await asyncio.to_thread(prefix_counters, engines)
            client = Client("127.0.0.1", gw.port, timeout=60)
            gate = asyncio.Semaphore(8)
            headers = {"x-velocity-profile": profile}

            async def one(i: int, body: bytes):
                async with gate:
                    return await client.send(i, render_request("POST", CHAT, "127.0.0.1", headers, body))

            t0 = time.monotonic()
            try:
                results = []
                for start in range(0, len(workload), 8):
                    # Waves of 8 keep the engines busy without a standing queue; the bound
                    # on the run is the test's timeout and the client's.
                    results += await asyncio.gather(
                        *(one(i, body) for i, (_, body) in enumerate(workload[start : start + 8], start))
                    )
            finally:
                client.close()
            took = time.monotonic() - t0
            hits1, queries1 = await asyncio.to_thread(prefix_counters, engines)
            router = gw.router.stats()
    finally:
        await asyncio.to_thread(stop_engines, engines)
    failed = [(r.status, r.reason, r.error) for r in results if not r.ok]
    assert not failed, failed[:5]
    spread: dict[str, int] = {}
    for r in results:
        spread[r.endpoint] = spread.get(r.endpoint, 0) + 1
    queries = queries1 - queries0
    return {
        "hit_rate": (hits1 - hits0) / queries if queries else 0.0,
        "queries": queries,
        "spread": spread,
        "seconds": took,
        "picks": router["picks"],
    }


@pytest.mark.timed  # hit rates that follow in-flight timing
async def test_chat_profile_earns_at_least_twice_the_engine_prefix_cache_hit_rate_of_batch():
    workload = shared_prefix_workload()
    chat = await run_profile("chat", workload)
    batch = await run_profile("batch", workload)
    print(
        f"\nengine prefix-cache hit rate: chat {chat['hit_rate']:.3f} {chat['spread']} in {chat['seconds']:.1f} s, "
        f"batch {batch['hit_rate']:.3f} {batch['spread']} in {batch['seconds']:.1f} s"
    )
    # The workload is real: every prompt token was queried, and even the shortest
    # queue finds some prefixes cached (the same group twice in a row on an engine).
    assert chat["queries"] >= REQUESTS * SYSTEM_TOKENS and batch["queries"] >= REQUESTS * SYSTEM_TOKENS
    assert batch["hit_rate"] >= 0.05, batch
    assert chat["hit_rate"] >= 2.0 * batch["hit_rate"], (chat, batch)
    # Affinity did the work, and it did not pile everything onto one engine.
    assert chat["picks"]["chat"].get("prefix", 0) >= REQUESTS // 2, chat["picks"]
    assert len(chat["spread"]) == ENGINES and max(chat["spread"].values()) <= REQUESTS // 2, chat["spread"]


async def send_waves(port: int, workload: list[tuple[int, bytes]], headers: dict) -> list:
    """The workload in waves of 8 (the engines busy without a standing queue)."""
    client = Client("127.0.0.1", port, timeout=60)
    results = []
    try:
        for start in range(0, len(workload), 8):
            results += await asyncio.gather(
                *(
                    client.send(i, render_request("POST", CHAT, "127.0.0.1", headers, body))
                    for i, (_, body) in enumerate(workload[start : start + 8], start)
                )
            )
    finally:
        client.close()
    return results


async def stats(admin_port: int) -> dict:
    return (await http_request(admin_port, "GET", "/stats", timeout=10)).json()


async def run_serve_defaults(workload: list[tuple[int, bytes]], headers: dict) -> dict:
    """The workload through `velocityllm serve --endpoint ...` (nothing else) in front of
    fresh engines; the engines' hit rate and the gateway's picks."""
    engines = await asyncio.to_thread(start_engines, ENGINES, *ENGINE_FLAGS)
    try:
        eps = [arg for i, e in enumerate(engines, 1) for arg in ("--endpoint", f"e{i}={e.url}={MODEL}")]
        with gateway_process("serve", *eps) as gp:

            async def scraped():
                s = await stats(gp.admin_port)
                return all(e["healthy"] and e["num_gpu_blocks"] for e in s["endpoints"])

            await wait_until(scraped, 10.0, interval=0.1, what="every engine healthy with its cache config scraped")
            hits0, queries0 = await asyncio.to_thread(prefix_counters, engines)
            results = await send_waves(gp.port, workload, headers)
            hits1, queries1 = await asyncio.to_thread(prefix_counters, engines)
            picks = (await stats(gp.admin_port))["routing"]["picks"]
    finally:
        await asyncio.to_thread(stop_engines, engines)
    failed = [(r.status, r.reason, r.error) for r in results if not r.ok]
    assert not failed, failed[:5]
    queries = queries1 - queries0
    return {"hit_rate": (hits1 - hits0) / queries if queries else 0.0, "queries": queries, "picks": picks}


@pytest.mark.timed  # hit rates that follow in-flight timing
async def test_at_default_flags_with_no_models_section_prefix_affinity_is_in_effect():
    """A new user's `serve`: no `models:`, no profile header, the default policy. The
    engines' own hit rate is at least twice that of shortest-queue routing (asked for
    with the header, as the baseline) on the same shared prefixes."""
    workload = shared_prefix_workload(seed=11)
    default = await run_serve_defaults(workload, {})
    batch = await run_serve_defaults(workload, {"x-velocity-profile": "batch"})
    print(
        f"\nengine prefix-cache hit rate at default flags {default['hit_rate']:.3f} {default['picks']}, "
        f"batch {batch['hit_rate']:.3f} {batch['picks']}"
    )
    assert default["queries"] >= REQUESTS * SYSTEM_TOKENS and batch["queries"] >= REQUESTS * SYSTEM_TOKENS
    assert batch["hit_rate"] >= 0.05, batch
    assert default["hit_rate"] >= 2.0 * batch["hit_rate"], (default, batch)
    assert set(default["picks"]) == {"chat"} and default["picks"]["chat"].get("prefix", 0) >= REQUESTS // 2, default
    assert set(batch["picks"]) == {"batch"}, batch


def test_charge_velocity_prefix_precise_at_default_flags_makes_precise_picks(tmp_path):
    """`chargeVelocity --prefix precise --tokenizer T` and nothing else (default policy, no
    `models:` section, no profile header): its picks are precise ones, in /stats and
    /metrics."""
    from urllib.request import Request, urlopen

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from tests.support.fakes import free_port_block

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        [" ".join(WORDS)] + [f"You are assistant number {g}. Question {g}:" for g in range(50)],
        trainers.WordLevelTrainer(special_tokens=["[UNK]", "<|im_start|>", "<|im_end|>"]),
    )
    path = str(tmp_path / "tokenizer.json")
    tok.save(path)
    base = free_port_block(2)
    with gateway_process(
        "chargeVelocity",
        "--mock",
        "--engines",
        "2",
        "--engine-base-port",
        str(base),
        "--prefix",
        "precise",
        "--tokenizer",
        path,
        "--sim-args",
        "--time-scale 50 --block-size 16",
        timeout=40,
    ) as gp:

        def get(url):
            with urlopen(url, timeout=10) as r:
                return r.read()

        def ready():
            s = orjson.loads(get(gp.admin_url + "/stats"))
            return (
                sum(e["healthy"] for e in s["endpoints"]) == 2
                and len(s["kv_events"]["endpoints"]) == 2
                and all(e["state"] == "exact" for e in s["kv_events"]["endpoints"].values())
            )

        deadline = time.monotonic() + 20
        while not ready():
            assert time.monotonic() < deadline, get(gp.admin_url + "/stats")
            time.sleep(0.1)
        model = orjson.loads(get(gp.url + "/v1/models"))["data"][0]["id"]
        workload = [w for w in shared_prefix_workload(seed=5) if w[0] < 3][:24]  # groups that recur
        for _, body in workload:
            data = orjson.dumps(dict(orjson.loads(body), model=model))
            with urlopen(
                Request(gp.url + CHAT, data=data, headers={"content-type": "application/json"}), timeout=10
            ) as r:
                assert r.status == 200
        s = orjson.loads(get(gp.admin_url + "/stats"))
        metrics = get(gp.admin_url + "/metrics").decode()
    assert s["kv_events"]["precise"]["share"] > 0.5, s["kv_events"]
    assert s["routing"]["picks"].get("chat"), s["routing"]["picks"]
    line = [
        ln
        for ln in metrics.splitlines()
        if ln.startswith("velocity_prefix_precise_picks_total{") and 'how="precise"' in ln
    ]
    assert line and float(line[0].split()[-1]) >= 12, line


# -- profiles and sessions ---------------------------------------------------------------------


@pytest.fixture
def engines():
    engs = start_engines(ENGINES)
    yield engs
    stop_engines(engs)


def question(rng: random.Random) -> dict:
    # No shared prefix between requests: only the session can keep them together.
    return {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": _text(rng, 400)}]}


async def test_unknown_profile_is_400_naming_the_header(engines):
    async with running_gateway(*engines, policy="dynamic") as gw:
        r = await http_request(gw.port, "POST", CHAT, question(random.Random(1)), {"x-velocity-profile": "fastest"})
        ok = await http_request(
            gw.port, "POST", CHAT, question(random.Random(2)), {"x-velocity-profile": "Long-Context"}
        )
    assert r.status == 400, r.body
    err = r.json()["error"]
    assert err["param"] == "x-velocity-profile" and "fastest" in err["message"], err
    assert ok.status == 200  # a known profile, whatever its case


async def test_session_id_sticks_to_one_engine_and_only_a_departed_engines_sessions_move(engines):
    rng = random.Random(3)
    sessions = [f"user-{k}" for k in range(8)]
    async with running_gateway(*engines, policy="smart") as gw:  # every policy routes with `chat` by default

        async def send(session: str | None) -> str:
            hdrs = {"x-session-id": session} if session else {}
            r = await http_request(gw.port, "POST", CHAT, question(rng), hdrs)
            assert r.status == 200, r.body
            return r.headers["x-velocity-endpoint"]

        placed = {s: {await send(s) for _ in range(5)} for s in sessions}
        unsessioned = {await send(None) for _ in range(20)}

        owner = {s: next(iter(eps)) for s, eps in placed.items()}
        gone = owner[sessions[0]]
        moved_ones = [s for s in sessions if owner[s] == gone]
        kept_ones = [s for s in sessions if owner[s] != gone]
        index = [e.name for e in gw.endpoints.values()].index(gone)
        await asyncio.to_thread(engines[index].stop)
        await wait_until(lambda: not gw.endpoints[gone].healthy, 5.0, what=f"{gone} out of routing")
        after = {s: {await send(s) for _ in range(3)} for s in sessions}

    assert all(len(eps) == 1 for eps in placed.values()), placed
    assert len(set(owner.values())) >= 2, owner  # sessions are spread, not all on one engine
    assert len(unsessioned) >= 2, unsessioned  # without a session the same traffic spreads
    for s in moved_ones:
        assert len(after[s]) == 1 and after[s] != {gone}, (s, after[s])
    for s in kept_ones:
        assert after[s] == {owner[s]}, (s, owner[s], after[s])
