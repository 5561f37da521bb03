"""Precise prefix routing end to end: a gateway with `prefix: precise` in front of two sim
engines that publish their KV events (--kv-events-config) and tokenize with a real
tokenizer (--tokenizer), on real sockets.

- A prompt goes to the engine whose cache holds its prefix by that engine's own events,
  where the gateway's approximate index (where it sent prompts) says the other one.
- An engine stopped and started again under load: the gateway's index for it empties,
  fills again from the new engine's events, and not one request fails (connect failures
  are retried once on the other engine).
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import orjson
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from tests.support.gateway import running_gateway, wait_until
from tests.support.sim import SimEngine, free_port, http_request
from velocity_fast.config import EndpointConfig, KVEventsConfig

pytestmark = [pytest.mark.e2e]

MODEL = "sim-model"
CHAT = "/v1/chat/completions"
WORDS = (
    "the of and to in is was that for on are with as be at by this had not but from or have an they "
    "which one you were all we her she there been if more when will would who so no model token cache "
    "engine queue batch prefill decode latency tenant band request stream router gateway"
).split()


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        [" ".join(WORDS)] + [f"assistant number {i} question" for i in range(100)],
        trainers.WordLevelTrainer(special_tokens=["[UNK]", "<|im_start|>", "<|im_end|>"]),
    )
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


class Engine:
    """A sim engine on a fixed HTTP port and fixed ipc:// event sockets, so that it can be
    stopped and started again at the same addresses."""

    def __init__(self, name: str, sock_dir, tokenizer: str) -> None:
        self.name = name
        self.port = free_port()
        self.pub = f"ipc://{sock_dir}/{name}.kv"
        self.replay = f"ipc://{sock_dir}/{name}.replay"
        cfg = json.dumps(
            {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": self.pub,
                "replay_endpoint": self.replay,
                "topic": "kv",
            }
        )
        self.flags = (
            "--kv-events-config",
            cfg,
            "--tokenizer",
            tokenizer,
            "--block-size",
            "16",
            "--num-gpu-blocks",
            "512",
            "--max-model-len",
            "4096",
            "--enable-prefix-caching",
        )
        self.sim: SimEngine | None = None

    def start(self) -> "Engine":
        self.sim = SimEngine(*self.flags, model=MODEL, port=self.port, time_scale=10).start()
        return self

    def stop(self) -> None:
        if self.sim is not None:
            self.sim.stop()
            self.sim = None

    def config(self) -> EndpointConfig:
        return EndpointConfig(
            name=self.name,
            url=f"http://127.0.0.1:{self.port}",
            model=MODEL,
            kv_events=KVEventsConfig(endpoint=self.pub, replay_endpoint=self.replay, topic="kv"),
        )


@pytest.fixture
def engines(tmp_path, tokenizer_json):
    made = [Engine("e1", tmp_path, tokenizer_json), Engine("e2", tmp_path, tokenizer_json)]
    try:
        for e in made:
            e.start()
        yield made
    finally:
        for e in made:
            e.stop()


def system_prompt(rng: random.Random, g: int, words: int = 200) -> str:
    return f"assistant number {g} " + " ".join(rng.choice(WORDS) for _ in range(words))


def chat(system: str, question: str) -> dict:
    return {
        "model": MODEL,
        "max_tokens": 4,
        "ignore_eos": True,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
    }


def settings_keys(engines, tokenizer_json) -> dict:
    return {
        "endpoints": [e.config() for e in engines],
        "routing": {"default_profile": "chat", "prefix": "precise", "tokenizer": tokenizer_json, "seed": 5},
    }


async def send(port: int, body: dict):
    r = await http_request(port, "POST", CHAT, orjson.dumps(body), {"content-type": "application/json"}, timeout=30)
    return r


@pytest.mark.timeout(90)
async def test_a_prefix_goes_to_the_engine_that_holds_it(engines, tokenizer_json):
    e1, e2 = engines
    rng = random.Random(1)
    system = system_prompt(rng, 1)
    async with running_gateway(settings=None, **settings_keys(engines, tokenizer_json)) as gw:
        await wait_until(
            lambda: all(gw.kv.index.exact(n) for n in ("e1", "e2")), 10.0, what="both engines' KV indexes exact"
        )
        # The gateway sees the system prompt once (its tokens are cached from then on) ...
        r = await send(gw.port, chat(system, "question 0"))
        assert r.status == 200, r.body
        first = r.headers["x-velocity-endpoint"]
        other = "e2" if first == "e1" else "e1"
        by_name = {"e1": e1, "e2": e2}
        # ... then that engine's cache is emptied and the other engine gets the prompt by
        # another path (not through this gateway): the approximate index says `first`,
        # the engines' events say `other`.
        status, _ = by_name[first].sim.request("POST", "/reset_prefix_cache")
        assert status == 200
        status, _ = by_name[other].sim.request(
            "POST", CHAT, orjson.dumps(chat(system, "question x")), {"content-type": "application/json"}
        )
        assert status == 200
        await wait_until(
            lambda: gw.kv.index.size(other) >= 10 and gw.kv.index.size(first) == 0,
            5.0,
            what="the events of the reset and of the direct request",
        )
        hits0 = by_name[other].sim.metric("vllm:prefix_cache_hits_total")
        went = []
        for i in range(1, 9):
            r = await send(gw.port, chat(system, f"question {i}"))
            assert r.status == 200, r.body
            went.append(r.headers["x-velocity-endpoint"])
        assert went == [other] * 8
        # The engine's own counters agree: it served the prefix from its cache.
        assert by_name[other].sim.metric("vllm:prefix_cache_hits_total") - hits0 >= 8 * 200
        assert gw.kv.precise.precise_share() > 0.5, gw.router.stats()
        r = await http_request(gw.admin_port, "GET", "/metrics")
        text = r.body.decode()
        assert f'velocity_kv_index_blocks{{endpoint="{other}"}}' in text
        assert 'velocity_prefix_precise_picks_total{model="sim-model",how="precise"}' in text
        assert f'velocity_endpoint_prefix_cache_hit_ratio{{endpoint="{other}"}}' in text


@pytest.mark.timeout(90)
async def test_a_prompt_new_to_the_gateway_goes_to_the_engine_that_holds_it(engines, tokenizer_json):
    """Prompts another replica sent (here: straight to each engine) are new to this
    gateway's token cache: the first request of each waits the millisecond or two its
    tokens take (``precise_token_wait_ms``) and goes where the engines' events say the
    prefix is. Picked at once, approximately, it went by load: half of them to the engine
    that holds nothing of it, a cold prefill. Each request's route span says so: the
    engine's own blocks held (its KV events), where the gateway's approximate index knew
    nothing of the prompt."""
    from tests.support.otlp import Receiver, need_otel

    need_otel()
    by_name = {e.name: e for e in engines}
    rng = random.Random(7)
    systems = [system_prompt(rng, 10 + g) for g in range(8)]
    holder = {}
    for g, system in enumerate(systems):
        holder[g] = ("e1", "e2")[g % 2]
        status, _ = by_name[holder[g]].sim.request(
            "POST", CHAT, orjson.dumps(chat(system, "from another replica")), {"content-type": "application/json"}
        )
        assert status == 200
    rx = Receiver().__enter__()
    try:
        keys = settings_keys(engines, tokenizer_json)
        async with running_gateway(settings=None, tracing={"sample_ratio": 1.0, "otlp_endpoint": rx.url}, **keys) as gw:
            await wait_until(
                lambda: all(gw.kv.index.exact(n) and gw.kv.index.size(n) >= 4 * 10 for n in ("e1", "e2")),
                10.0,
                what="both engines' KV indexes exact, with the prompts they hold",
            )
            went, traces = {}, {}
            for g, system in enumerate(systems):
                r = await send(gw.port, chat(system, "question 0"))
                assert r.status == 200, r.body
                went[g] = r.headers["x-velocity-endpoint"]
                traces[g] = r.headers["traceparent"].split("-")[1]
            assert went == holder, (went, holder)
            text = (await http_request(gw.admin_port, "GET", "/metrics")).body.decode()
            assert 'velocity_prefix_precise_picks_total{model="sim-model",how="precise"} 8' in text, text
            assert 'velocity_prefix_token_waits_total{result="ready"} 8' in text
    finally:
        rx.__exit__(None, None, None)
    for g, trace_id in traces.items():
        (route,) = [s for s in rx.spans if s["trace_id"] == trace_id and s["name"] == "route"]
        a = route["attrs"]
        assert a["velocity.endpoint"] == holder[g]
        assert a["velocity.route.prefix_blocks_matched"] == 0  # the approximate index: never sent
        assert 10 <= a["velocity.route.kv_blocks_held"] <= a["velocity.route.kv_blocks"], a


def slow_tokenizer(monkeypatch, delay_s: float) -> None:
    """The tokenizer thread takes ``delay_s`` per prompt (as behind a long queue or a
    busy machine): what the pick does when its tokens come late."""
    from velocity_fast.routing.precise.tokens import TokenSide

    real = TokenSide._tokenize

    def late(self, *job):
        time.sleep(delay_s)
        return real(self, *job)

    monkeypatch.setattr(TokenSide, "_tokenize", late)


@pytest.mark.timeout(90)
async def test_a_pick_waits_for_its_tokens_no_longer_than_the_setting(engines, tokenizer_json, monkeypatch):
    slow_tokenizer(monkeypatch, 0.5)
    keys = settings_keys(engines, tokenizer_json)
    keys["routing"] = {**keys["routing"], "precise_token_wait_ms": 30}
    async with running_gateway(settings=None, **keys) as gw:
        await wait_until(lambda: all(gw.kv.index.exact(n) for n in ("e1", "e2")), 10.0, what="exact indexes")
        t0 = time.monotonic()
        r = await send(gw.port, chat(system_prompt(random.Random(3), 30), "question 0"))
        took = time.monotonic() - t0
        assert r.status == 200, r.body
        assert took < 0.4, f"the pick waited {took:.2f} s for tokens that took 0.5 s"
        text = (await http_request(gw.admin_port, "GET", "/metrics")).body.decode()
        assert 'velocity_prefix_token_waits_total{result="timeout"} 1' in text
        assert 'velocity_prefix_precise_picks_total{model="sim-model",how="not_ready"} 1' in text


@pytest.mark.timeout(90)
async def test_a_client_that_leaves_while_its_pick_waits_frees_its_slot(engines, tokenizer_json, monkeypatch):
    slow_tokenizer(monkeypatch, 0.4)
    keys = settings_keys(engines, tokenizer_json)
    keys["routing"] = {**keys["routing"], "precise_token_wait_ms": 300}
    async with running_gateway(settings=None, **keys) as gw:
        await wait_until(lambda: all(gw.kv.index.exact(n) for n in ("e1", "e2")), 10.0, what="exact indexes")
        sent = [e.sim.metric("vllm:request_success_total") for e in engines]
        body = orjson.dumps(chat(system_prompt(random.Random(4), 40), "question 0"))
        _, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        try:
            writer.write(
                b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                % (CHAT.encode(), len(body))
                + body
            )
            await writer.drain()
            await asyncio.sleep(0.1)  # admitted, its pick waiting for the tokens
            assert gw.admission.stats()["counters"]["in_flight"] == 1
        finally:
            writer.close()
        await wait_until(lambda: gw.admission.stats()["counters"]["in_flight"] == 0, 2.0, what="the lease released")
        await asyncio.sleep(0.5)  # past the wait: nothing is sent to an engine after all
        assert [e.sim.metric("vllm:request_success_total") for e in engines] == sent
        assert sum(e.sim.metric("vllm:num_requests_running") for e in engines) == 0
        r = await send(gw.port, chat(system_prompt(random.Random(4), 41), "question 1"))
        assert r.status == 200, r.body


@pytest.mark.timeout(120)
async def test_an_engine_restarted_under_load_empties_and_refills_its_index(engines, tokenizer_json):
    e1, e2 = engines
    rng = random.Random(2)
    # A few groups with shared system prompts, and a share of prompts never seen before
    # (their tokens are not ready: they go by load), so the restarted engine, which
    # holds nothing and so gets no known prefix from precise routing, gets work too.
    systems = [system_prompt(rng, g, 120) for g in range(6)]
    async with running_gateway(settings=None, **settings_keys(engines, tokenizer_json)) as gw:
        await wait_until(
            lambda: all(gw.kv.index.exact(n) for n in ("e1", "e2")), 10.0, what="both engines' KV indexes exact"
        )
        results: list = []
        stop = asyncio.Event()
        sent = 0

        async def worker(w: int):
            nonlocal sent
            wr = random.Random(w)
            while not stop.is_set() and sent < 2000:  # bounded in count and in time (the test timeout)
                sent += 1
                system = system_prompt(wr, 100 + w, 120) if wr.random() < 0.3 else wr.choice(systems)
                r = await send(gw.port, chat(system, f"question {wr.randrange(50)}"))
                results.append((r.status, r.headers.get("x-velocity-endpoint"), r.body[:200]))

        workers = [asyncio.create_task(worker(w)) for w in range(4)]
        try:
            await wait_until(
                lambda: gw.kv.index.size("e2") > 20 and len(results) > 20,
                20.0,
                what=f"e2's index filled by its events ({gw.kv.stats()}, {[ep for _, ep, _ in results][:50]})",
            )
            await asyncio.to_thread(e2.stop)
            await wait_until(lambda: gw.kv.index.size("e2") == 0, 5.0, what="e2's index emptied")
            assert not gw.kv.index.exact("e2")
            during = len(results)
            await asyncio.sleep(0.5)  # load goes on with e2 away
            await asyncio.to_thread(e2.start)
            await wait_until(lambda: gw.endpoints["e2"].healthy, 10.0, what="e2 back in routing")
            await wait_until(
                lambda: gw.kv.index.exact("e2") and gw.kv.index.size("e2") > 20,
                20.0,
                what=f"e2's index exact and refilled from the new engine's events "
                f"({gw.kv.index.stats('e2').as_dict()}, {gw.kv.index.size('e2')} blocks, "
                f"{[ep for _, ep, _ in results[-40:]]})",
            )
            back = len(results)
            await wait_until(lambda: any(ep == "e2" for _, ep, _ in results[back:]), 20.0, what="requests on e2 again")
        finally:
            stop.set()
            await asyncio.gather(*workers)
    failed = [r for r in results if r[0] != 200]
    assert not failed, failed[:5]
    assert len(results) > during > 20
    assert gw.kv.index.stats("e2").disconnects >= 1  # the subscriber saw the engine go


@pytest.mark.timeout(90)
def test_charge_velocity_starts_its_engines_with_kv_events_when_precise(tokenizer_json):
    """chargeVelocity --prefix precise: its sim engines publish their KV events on sockets
    it chose, with its tokenizer, and the gateway's index of each is exact and fills."""
    from urllib.request import Request, urlopen

    from tests.support.fakes import free_port_block
    from tests.support.gateway import gateway_process

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
        tokenizer_json,
        "--policy",
        "smart",
        "--sim-args",
        "--time-scale 50 --block-size 16",
        timeout=40,
    ) as gp:

        def stats():
            with urlopen(gp.admin_url + "/stats", timeout=10) as r:
                return json.loads(r.read())

        deadline = time.monotonic() + 20
        while not (
            stats()["kv_events"]["endpoints"]
            and sum(e["healthy"] for e in stats()["endpoints"]) == 2
            and all(e["state"] == "exact" for e in stats()["kv_events"]["endpoints"].values())
        ):
            assert time.monotonic() < deadline, stats()
            time.sleep(0.1)
        with urlopen(gp.url + "/v1/models", timeout=10) as r:
            model = json.loads(r.read())["data"][0]["id"]
        rng = random.Random(3)
        system = system_prompt(rng, 7)
        for i in range(6):
            body = dict(chat(system, f"question {i}"), model=model)
            req = Request(gp.url + CHAT, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
            with urlopen(req, timeout=10) as r:
                assert r.status == 200
        kv = stats()["kv_events"]
        assert sorted(kv["endpoints"]) == ["sim-0", "sim-1"]
        assert sum(e["blocks"] for e in kv["endpoints"].values()) >= 200 // 16
        assert kv["precise"]["share"] > 0
