"""The router: filters, profile choice, hot-spot guard, visibility (velocity_fast/routing/router.pyx)."""

import time
from collections import Counter
from types import MappingProxyType

import pytest

from tests.support.fleet import make_pool, scrape
from tests.support.fleet import make_router as router
from velocity_fast.fleet.endpoint import Endpoint, Pool
from velocity_fast.metrics.registry import Registry
from velocity_fast.routing.errors import UnknownProfile
from velocity_fast.routing.prefix import BlockHashes
from velocity_fast.routing.route import RouteInfo
from velocity_fast.routing.router import Router
from velocity_fast.routing.session import SessionAffinity
from velocity_fast.routing.settings import PROFILE_HEADER, SESSION_HEADER, RoutingSettings

SYSTEM = "You are a careful assistant. " * 40  # ~1.1 KB: a shared system prompt


def chat(user, system=SYSTEM):
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


# -- filters -------------------------------------------------------------------------


def test_unhealthy_and_at_limit_endpoints_are_never_picked():
    pool = make_pool(4)
    pool.endpoints[0].healthy = False
    r = router(default_profile="batch")
    info = r.route_info("m", {"prompt": "hi"}, {})
    full = {"e1"}
    picks = {r.pick(pool, info, lambda ep: ep.name not in full).name for _ in range(200)}
    assert picks == {"e2", "e3"}


@pytest.mark.parametrize("spill", [True, False])
def test_a_prefix_engine_without_room_is_passed_over_unless_spill_is_off(spill):
    """routing.spill false is pure affinity: the engine holding the prompt's prefix takes
    it even at its limit (where it queues); by default the pick goes where there is room."""
    pool = make_pool(2)
    r = router(hotspot_gap=1e9, hotspot_waiting=1e9, load_weight=0.0, saturation_waiting=1e9, spill=spill)
    info = r.route_info("m", chat("first question"), {})
    owner = r.pick(pool, info)
    r.on_dispatch(owner, info)  # sent there: the prefix is the owner's now
    info = r.route_info("m", chat("a second question"), {})
    picks = {r.pick(pool, info, lambda ep: ep is not owner) for _ in range(20)}
    assert picks == ({owner} if not spill else set(pool.endpoints) - {owner})


def test_excluded_endpoints_are_not_picked_again():
    pool = make_pool(3)
    r = router()
    info = r.route_info("m", chat("x"), {})
    tried = [pool.endpoints[0], pool.endpoints[2]]
    assert {r.pick(pool, info, None, tried).name for _ in range(30)} == {"e1"}
    assert r.pick(pool, info, None, pool.endpoints) is None


def test_no_endpoint_when_none_is_healthy_with_room():
    pool = make_pool(2)
    r = router()
    info = r.route_info("m", chat("x"), {})
    assert r.pick(pool, info, lambda ep: False) is None
    for ep in pool.endpoints:
        ep.healthy = False
    assert r.pick(pool, info) is None
    assert r.stats()["no_endpoint"] == 2


def test_saturated_endpoints_are_filtered_out():
    pool = make_pool(3)
    scrape(pool.endpoints[0], waiting=9)  # queue past 5
    scrape(pool.endpoints[1], kv=0.95)  # KV past 0.8
    scrape(pool.endpoints[2], waiting=1, kv=0.5)
    r = router(default_profile="batch")
    info = r.route_info("m", {"prompt": "hi"}, {})
    assert {r.pick(pool, info).name for _ in range(50)} == {"e2"}
    assert r.stats()["fail_open"] == 0


def test_filter_fails_open_when_saturation_would_remove_every_endpoint():
    pool = make_pool(3)
    scrape(pool.endpoints[0], waiting=20)
    scrape(pool.endpoints[1], waiting=6)
    scrape(pool.endpoints[2], kv=0.99, waiting=12)
    r = router(default_profile="batch")
    info = r.route_info("m", {"prompt": "hi"}, {})
    ep = r.pick(pool, info)
    assert ep is pool.endpoints[1]  # the shortest queue among the saturated
    assert r.stats()["fail_open"] == 1
    # Failing open never brings back an endpoint that is at its limit or unhealthy.
    assert r.pick(pool, info, lambda e: e.name == "e0") is pool.endpoints[0]
    pool.endpoints[0].healthy = False
    assert r.pick(pool, info, lambda e: e.name == "e0") is None


@pytest.mark.parametrize("profile", ["batch", "chat"])
def test_an_engine_with_its_whole_learned_batch_in_flight_comes_after_one_that_runs_at_once(profile):
    # e0 runs 8 at once (admission learned it) and has 8 in flight: a request sent there
    # waits in the engine behind all 8. e1's 20 in flight are more, but below what it runs.
    pool = make_pool(2)
    e0, e1 = pool.endpoints
    e0.running_cap, e0.inflight = 8.0, 8
    e1.inflight = 20
    r = router(default_profile=profile)
    info = r.route_info("m", chat("x"), {})
    assert {r.pick(pool, info).name for _ in range(30)} == {"e1"}
    assert r.stats()["full"] == 0
    # Below its batch again, e0 is the shorter queue.
    e0.inflight = 7
    assert r.pick(pool, info) is e0
    # Every engine full: the request still goes (admission decided it goes now), counted.
    e0.inflight = 8
    e1.running_cap = 20.0
    assert r.pick(pool, info) is e0
    assert r.stats()["full"] == 1
    # Never past the room filter or health.
    assert r.pick(pool, info, lambda e: e.name == "e1") is e1
    e1.healthy = False
    assert r.pick(pool, info, lambda e: e.name == "e1") is None


def test_stale_metrics_are_ignored_and_do_not_filter():
    pool = make_pool(2)
    scrape(pool.endpoints[0], waiting=50, kv=0.99, at=time.monotonic() - 60)  # a minute old
    pool.endpoints[1].inflight = 3
    r = router(default_profile="batch")
    info = r.route_info("m", {"prompt": "hi"}, {})
    # With the stale gauges ignored e0 is idle (0 in flight) against e1's 3.
    assert r.pick(pool, info) is pool.endpoints[0]
    assert r.stats()["fail_open"] == 0


# -- profiles ------------------------------------------------------------------------


def test_profile_from_header_then_model_config_then_default():
    r = router(default_profile="batch", profiles={"big": "long-context"})
    assert r.route_info("m", chat("x"), {}).profile == "batch"
    assert r.route_info("big", chat("x"), {}).profile == "long-context"
    assert r.route_info("big", chat("x"), {"x-velocity-profile": "Chat"}).profile == "chat"


def test_unknown_profile_header_is_a_clear_400():
    r = router()
    with pytest.raises(UnknownProfile) as ei:
        r.route_info("m", chat("x"), {"x-velocity-profile": "fastest"})
    err = ei.value
    assert isinstance(err, ValueError)
    assert err.status == 400 and err.param == "x-velocity-profile"
    assert "fastest" in str(err) and "long-context" in str(err)


def test_chat_follows_the_prefix_and_spreads_new_prefixes():
    pool = make_pool(4)
    r = router()
    homes = {}
    for g in range(8):
        system = f"group {g}: " + SYSTEM
        info = r.route_info("m", chat("first question", system), {})
        ep = r.pick(pool, info)
        r.on_dispatch(ep, info)
        homes[g] = ep.name
    # New prefixes land on idle endpoints at random: not all on one.
    assert len(set(homes.values())) > 1
    for g in range(8):
        for q in range(5):
            info = r.route_info("m", chat(f"another question {q}", f"group {g}: " + SYSTEM), {})
            ep = r.pick(pool, info)
            r.on_dispatch(ep, info)
            assert ep.name == homes[g]
    st = r.stats()
    assert st["picks"]["chat"]["prefix"] == 40
    assert st["prefix_index"]["hit_ratio"] > 0.6


def test_ties_are_broken_at_random():
    pool = make_pool(4)
    r = router(default_profile="batch")
    info = r.route_info("m", {"prompt": "hi"}, {})
    counts = Counter(r.pick(pool, info).name for _ in range(400))
    assert set(counts) == {"e0", "e1", "e2", "e3"}
    assert min(counts.values()) > 50


# -- the hot-spot guard -----------------------------------------------------------------


def _affine_setup(gap):
    pool = make_pool(3)
    r = router(hotspot_gap=gap)
    info = r.route_info("m", chat("q"), {})
    r.on_dispatch(pool.endpoints[0], info)  # e0 holds this prompt's blocks
    return pool, r, info


@pytest.mark.parametrize("gap", [4.0, 10.0])
def test_hot_spot_guard_takes_over_past_the_threshold_and_not_before(gap):
    pool, r, info = _affine_setup(gap)
    hot, a, b = pool.endpoints
    a.inflight = 1
    b.inflight = 2
    hot.inflight = int(gap) + 1  # gap to the least loaded (a): exactly the threshold
    assert {r.pick(pool, info).name for _ in range(20)} == {"e0"}
    hot.inflight = int(gap) + 2  # one past it: load wins
    assert {r.pick(pool, info).name for _ in range(20)} == {"e1"}
    picks = r.stats()["picks"]["chat"]
    assert picks == {"prefix": 20, "hotspot": 20}


def test_hot_spot_guard_counts_the_engine_queue_too():
    pool, r, info = _affine_setup(4.0)
    scrape(pool.endpoints[0], waiting=4)  # 4 waiting + 1 in flight = 5 > 0 + 4
    pool.endpoints[0].inflight = 1
    assert r.pick(pool, info) is not pool.endpoints[0]


def test_with_fresh_gauges_the_guard_spills_on_the_engine_queue_not_on_running_requests():
    pool, r, info = _affine_setup(8.0)
    hot, a, b = pool.endpoints
    for ep in pool.endpoints:
        scrape(ep)
    hot.inflight = 12  # past the gap, but all running: no queue
    a.inflight, b.inflight = 1, 2
    assert {r.pick(pool, info).name for _ in range(20)} == {"e0"}
    scrape(hot, waiting=1)  # one waiting: below hotspot_waiting (2)
    assert {r.pick(pool, info).name for _ in range(20)} == {"e0"}
    scrape(hot, waiting=2)  # demand past what it runs: the best cool engine
    assert {r.pick(pool, info).name for _ in range(20)} == {"e1"}
    assert r.stats()["picks"]["chat"] == {"prefix": 40, "hotspot": 20}


def test_a_spilled_prefix_stays_on_the_engines_it_was_spread_over():
    pool, r, info = _affine_setup(8.0)
    hot, a, b = pool.endpoints
    for ep in pool.endpoints:
        scrape(ep)
    scrape(hot, waiting=3)
    hot.inflight, a.inflight, b.inflight = 12, 0, 1
    first = r.pick(pool, info)
    assert first is a  # the least loaded: neither holds the prefix
    r.on_dispatch(a, info)
    a.inflight = 4  # now b is the least loaded, but a holds the prefix
    assert {r.pick(pool, info).name for _ in range(20)} == {"e1"}
    scrape(a, waiting=2)  # a queues too: the prefix grows onto b
    assert {r.pick(pool, info).name for _ in range(20)} == {"e2"}
    scrape(hot)  # e0's queue drained: back to the owner
    assert {r.pick(pool, info).name for _ in range(20)} == {"e0"}


def test_when_every_engine_queues_the_least_loaded_takes_it():
    pool, r, info = _affine_setup(8.0)
    for ep, (w, n) in zip(pool.endpoints, ((3, 9), (2, 3), (4, 1))):
        scrape(ep, waiting=w)
        ep.inflight = n
    # loads (waiting + in flight): 12, 5, 5: the least loaded pair, the affine one first (none)
    assert {r.pick(pool, info).name for _ in range(40)} == {"e1", "e2"}


def test_the_guard_spills_only_a_prefix_past_one_engines_share_of_the_traffic():
    pool = make_pool(2)
    e0, e1 = pool.endpoints
    r = router()
    cold = r.route_info("m", chat("cold question", system="A cold tenant's prompt. " * 60), {})
    r.on_dispatch(e0, cold)
    for ep in pool.endpoints:
        scrape(ep)
    scrape(e0, waiting=3)  # e0 queues
    e0.inflight = 3
    others = [r.route_info("m", chat(f"q{i}", system=f"Tenant {i}'s own prompt. " * 60), {}) for i in range(8)]
    for i in range(20):  # the pool's traffic so far: other prefixes
        r.pick(pool, others[i % 8])
    picks = []
    for i in range(40):  # the cold prefix is one request in five
        if i % 5 == 0:
            picks.append(r.pick(pool, cold).name)
        else:
            r.pick(pool, others[i % 8])
    assert set(picks) == {"e0"}  # within one engine's share: it stays with its cache
    hot = [r.pick(pool, cold).name for _ in range(100)]
    assert "e1" in hot  # now most of the traffic: it spills


def test_within_the_gap_load_still_weighs_against_partial_affinity():
    pool = make_pool(2)
    r = router(hotspot_gap=8.0, load_weight=0.5)
    full = r.route_info("m", chat("q" * 600), {})
    r.on_dispatch(pool.endpoints[0], full)
    r.on_dispatch(pool.endpoints[1], r.route_info("m", chat("z" * 600), {}))
    # The system prompt is ~1/3 of the blocks: e1 shares it, e0 has everything.
    pool.endpoints[0].inflight = 7  # below the gap, but costly: 7/8 * 0.5
    assert r.pick(pool, full) is pool.endpoints[1]
    pool.endpoints[0].inflight = 2
    assert r.pick(pool, full) is pool.endpoints[0]


# -- the index follows the engines -----------------------------------------------------------


def test_index_capacity_comes_from_num_gpu_blocks_when_known():
    pool = make_pool(2)
    r = router(index_capacity=100)
    info = r.route_info("m", {"prompt": "p" * 64 * 300}, {})
    e0, e1 = pool.endpoints
    e0.num_gpu_blocks, e0.block_size = 50, 16  # 50 * 16 tokens * 4 bytes / 64 = 50 blocks
    r.pick(pool, info)
    r.on_dispatch(e0, info)
    r.on_dispatch(e1, info)
    sizes = r.stats()["prefix_index"]["pools"]["m"]["endpoints"]
    # Past its first 64 blocks a chain's keys weigh 16 blocks each (a thinned tail): the
    # index fills to within one such key of its capacity.
    assert sizes["e0"] == {"blocks": 50, "capacity": 50}
    assert sizes["e1"]["capacity"] == 100 and 100 - 16 < sizes["e1"]["blocks"] <= 100
    e0.num_gpu_blocks = 200  # the engine restarted bigger
    r.on_dispatch(e0, info)
    e0_size = r.stats()["prefix_index"]["pools"]["m"]["endpoints"]["e0"]
    assert e0_size["capacity"] == 200 and 200 - 16 < e0_size["blocks"] <= 200


def test_forget_drops_an_endpoint_and_slots_are_reclaimed_from_departed_endpoints():
    pool = make_pool(2)
    r = router()
    info = r.route_info("m", chat("q"), {})
    r.pick(pool, info)
    r.on_dispatch(pool.endpoints[0], info)
    r.forget("e0")
    assert "e0" not in r.stats()["prefix_index"]["pools"]["m"]["endpoints"]
    # 64 slots: endpoints that left the pool give theirs back when a newcomer needs one.
    for i in range(64):
        ep = Endpoint(f"old{i}", "http://127.0.0.1:1", "m")
        r.on_dispatch(ep, info)
    new = Endpoint("new", "http://127.0.0.1:2", "m")
    r.on_dispatch(new, info)
    held = r.stats()["prefix_index"]["pools"]["m"]["endpoints"]
    assert "new" in held and all(not n.startswith("old") for n in held)


# -- visibility ----------------------------------------------------------------------------


def test_metrics_and_stats_show_picks_hit_ratio_and_index_size():
    reg = Registry()
    r = Router(RoutingSettings(seed=1), registry=reg)
    pool = make_pool(2)
    for q in range(4):
        info = r.route_info("m", chat(f"question {q}"), {})
        ep = r.pick(pool, info)
        r.on_dispatch(ep, info)
    text = reg.render().decode()
    assert 'velocity_route_picks_total{profile="chat",basis="prefix"} 3.0' in text
    assert 'velocity_route_picks_total{profile="chat",basis="load"} 1.0' in text
    st = r.stats()
    ratio = st["prefix_index"]["hit_ratio"]
    assert 0.5 < ratio < 1.0
    line = next(ln for ln in text.splitlines() if ln.startswith("velocity_prefix_index_hit_ratio "))
    assert float(line.split()[1]) == pytest.approx(ratio, abs=1e-4)
    blocks = st["prefix_index"]["pools"]["m"]["blocks"]
    assert blocks > 0
    assert f'velocity_prefix_index_blocks{{model="m"}} {float(blocks)}' in text


# -- router_core: the request path's typed classes ---------------------------------


def small_pool(n=3):
    eps = []
    for i in range(n):
        ep = Endpoint(f"e{i}", f"http://127.0.0.1:{9300 + i}", "m")
        ep.healthy = True
        eps.append(ep)
    return Pool("m", eps)


def batch_router(**kw):
    kw.setdefault("seed", 5)
    kw.setdefault("default_profile", "batch")
    return Router(RoutingSettings(**kw), registry=Registry())


def test_route_info_fields_are_readable_and_read_only():
    r = batch_router(default_profile="chat")
    info = r.route_info("m", {"prompt": "x" * 640}, {SESSION_HEADER: "  s1  "})
    assert (info.model, info.profile, info.session) == ("m", "chat", "s1")
    assert info.nblocks == len(info.hashes) == 10
    assert info.session_key == SessionAffinity.key("s1")
    assert repr(info) == "<RouteInfo model='m' profile=chat blocks=10 session='s1'>"
    with pytest.raises(AttributeError):
        info.profile = "batch"
    built = RouteInfo("m", "chat", BlockHashes.of([1, 2, 3]), None, None)
    assert built.nblocks == 3 and built.session_key is None
    with pytest.raises(TypeError):
        RouteInfo("m", "chat", [1, 2, 3], None, None)


def test_route_info_reads_any_mapping_of_headers_and_raw_prompt_bytes():
    r = batch_router()
    headers = MappingProxyType({PROFILE_HEADER: " Chat ", SESSION_HEADER: "   "})
    info = r.route_info(None, b"y" * 200, headers)
    assert (info.model, info.profile, info.session, info.session_key) == ("", "chat", None, None)
    for data in (bytearray(b"y" * 200), memoryview(b"y" * 200)):
        assert r.route_info(None, data, headers).hashes.tolist() == info.hashes.tolist()
    # Batch without a session shares one RouteInfo per model: nothing per request in it.
    assert r.route_info("m", {"prompt": "a"}, None) is r.route_info("m", {"prompt": "b"}, {})


def test_the_last_models_route_follows_headers_and_a_new_profile_map():
    r = batch_router(profiles={"chatty": "chat"})
    model = "m"
    first = r.route_info(model, {"prompt": "a"}, None)
    assert first.profile == "batch" and r.route_info(model, {"prompt": "b"}, {}) is first
    # A routing header on the same model is still read: not the remembered answer.
    assert r.route_info(model, {"prompt": "b"}, {PROFILE_HEADER: "chat"}).profile == "chat"
    assert r.route_info("chatty", {"prompt": "b"}, None).profile == "chat"
    assert r.route_info(model, {"prompt": "c"}, None) is first
    # New settings mapping the model elsewhere: the next request follows them.
    r.settings = RoutingSettings(seed=5, default_profile="batch", profiles={"m": "chat"})
    r._configure()
    assert r.route_info(model, {"prompt": "d"}, None).profile == "chat"


def test_a_profile_header_is_not_remembered_for_the_next_request_without_one():
    """x-velocity-profile: batch on one request of a chat model: the next request of that
    model without the header routes by the model's profile again."""
    import msgspec

    r = batch_router(default_profile="chat")
    long_raw = msgspec.Raw(b'[{"role":"user","content":"' + b"x" * 200 + b'"}]')

    class Body:
        messages = long_raw

    assert r.route_info("m", Body(), {PROFILE_HEADER: "batch"}).profile == "batch"
    after = r.route_info("m", Body(), None)
    assert after.profile == "chat" and after.nblocks == 3


def test_a_prompt_without_a_full_block_shares_one_route_info_and_a_longer_one_is_hashed():
    """Chat with a prompt shorter than one block: nothing to hash, one RouteInfo per model
    and profile (as batch's); the next longer prompt of the same model is hashed as ever."""
    import msgspec

    r = batch_router(default_profile="chat")

    class Body:
        def __init__(self, raw: bytes) -> None:
            self.messages = msgspec.Raw(raw)

    short = b'[{"role":"user","content":"Say hello."}]'
    exact = b'[{"role":"user","content":"' + b"y" * (64 - 30) + b'"}]'  # 64 bytes: 63 hashed, no block
    assert len(exact) == 64
    a = r.route_info("m", Body(short), None)
    assert a.profile == "chat" and a.nblocks == 0
    assert r.route_info("m", Body(short.replace(b"Say", b"Hey")), None) is a
    assert r.route_info("m", Body(exact), None) is a
    assert r.route_info("m", Body(exact), {}) is a
    # One byte more is a full block of 64 once the last byte is cut: hashed.
    longer = r.route_info("m", Body(exact[:-2] + b'z"}]'), None)
    assert longer is not a and longer.nblocks == 1
    hashed = r.route_info("m", Body(b'[{"role":"user","content":"' + b"q" * 300 + b'"}]'), None)
    assert hashed.nblocks == 5 and r.route_info("m", Body(short), None) is a
    # Rendered bytes: a full block is block_bytes of them; a session is never shared.
    assert r.route_info("m", b"z" * 63, None).nblocks == 0 and r.route_info("m", b"z" * 64, None).nblocks == 1
    with_session = r.route_info("m", Body(short), {SESSION_HEADER: "s"})
    assert with_session is not a and with_session.session == "s"


def test_a_decoded_request_routes_as_any_body_of_the_same_prompt_whatever_came_before():
    """The router reads a decoded request's raw ``messages`` and ``prompt`` at their slots
    (learned from its type on first sight), any other body by attribute: the same prompt
    routes alike either way, in any order of body types, also a prompt-only request."""
    import msgspec

    from velocity_fast.gateway.requests import decode_proxy

    class Body:
        def __init__(self, messages=None, prompt=None) -> None:
            self.messages, self.prompt = messages, prompt

    def decoded(messages: bytes):
        return decode_proxy(b'{"model":"m","messages":' + messages + b"}", chat=True)

    short = b'[{"role":"user","content":"Say hello."}]'
    long = b'[{"role":"user","content":"' + b"q" * 300 + b'"}]'
    r = batch_router(default_profile="chat")
    a = r.route_info("m", decoded(short), None)
    assert a.nblocks == 0 and r.route_info("m", Body(msgspec.Raw(short)), None) is a
    for body in (decoded(long), Body(msgspec.Raw(long)), {"messages": None}, decoded(long)):
        info = r.route_info("m", body, None)
        if isinstance(body, dict):
            assert info.nblocks == 0  # a dict's prompt is rendered: none here
            continue
        same = r.route_info("m", Body(msgspec.Raw(long)), None)
        assert info.nblocks == 5 and info.hashes.tolist() == same.hashes.tolist()
    completion = decode_proxy(b'{"model":"m","prompt":"' + b"p" * 300 + b'"}', chat=False)
    assert (
        r.route_info("m", completion, None).nblocks
        == r.route_info("m", Body(prompt=msgspec.Raw(b'"' + b"p" * 300 + b'"')), None).nblocks
        > 0
    )


def test_staleness_is_judged_on_the_process_monotonic_clock():
    # The compiled path reads CLOCK_MONOTONIC in C: gauges scraped by Python code with
    # time.monotonic must be fresh or stale exactly as metrics_stale_s says.
    pool = small_pool(2)
    e0, e1 = pool.endpoints
    e0.waiting, e0.scraped_at = 9.0, time.monotonic() - 1.0  # fresh and saturated
    e1.inflight = 4
    r = batch_router(metrics_stale_s=2.0)
    info = r.route_info("m", {"prompt": "hi"}, {})
    assert r.pick(pool, info) is e1
    e0.scraped_at = time.monotonic() - 3.0  # stale: its queue is ignored
    assert r.pick(pool, info) is e0
    assert r.stats()["fail_open"] == 0


def test_a_hand_set_clock_is_obeyed_and_monotonic_can_be_restored():
    pool = small_pool(2)
    e0, e1 = pool.endpoints
    e0.waiting, e0.scraped_at = 9.0, 100.0
    e1.inflight = 4
    r = batch_router(metrics_stale_s=2.0)
    info = r.route_info("m", {"prompt": "hi"}, {})
    now = [101.0]
    r._clock = lambda: now[0]
    assert r.pick(pool, info) is e1  # scraped a second ago on this clock: saturated
    now[0] = 103.0
    assert r.pick(pool, info) is e0  # three seconds: stale
    r._clock = time.monotonic
    assert r._clock is time.monotonic
    assert r.pick(pool, info) is e0  # 100.0 is long past on the process clock


def test_has_room_is_asked_only_of_healthy_endpoints_and_its_errors_propagate():
    pool = small_pool(3)
    pool.endpoints[1].healthy = False
    r = batch_router()
    info = r.route_info("m", {"prompt": "hi"}, {})
    asked = []
    ep = r.pick(pool, info, lambda e: asked.append(e.name) or e.name == "e2")
    assert ep is pool.endpoints[2] and asked == ["e0", "e2"]

    def broken(e):
        raise RuntimeError("no room check")

    with pytest.raises(RuntimeError, match="no room check"):
        r.pick(pool, info, broken)
    assert r.stats()["no_endpoint"] == 0


@pytest.mark.parametrize("kind", [tuple, list, set, frozenset])
def test_exclude_accepts_any_container(kind):
    pool = small_pool(3)
    r = batch_router()
    info = r.route_info("m", {"prompt": "hi"}, {})
    skip = kind(pool.endpoints[:2])
    assert {r.pick(pool, info, None, skip).name for _ in range(20)} == {"e2"}
    assert r.pick(pool, info, lambda e: e.name != "e2", skip) is None
    assert r.stats()["no_endpoint"] == 1


def test_pick_and_on_dispatch_refuse_a_missing_route_info():
    pool = small_pool(1)
    r = batch_router()
    with pytest.raises(TypeError):
        r.pick(pool, None)
    with pytest.raises(TypeError):
        r.on_dispatch(pool.endpoints[0], None)


def test_dispatch_counts_blocks_per_pool_even_before_any_pick():
    r = batch_router(default_profile="chat")
    ep = Endpoint("solo", "http://127.0.0.1:9400", "other")
    info = r.route_info("other", {"prompt": "z" * 64 * 5}, {})
    r.on_dispatch(ep, info)
    r.on_dispatch(ep, info)
    st = r.stats()["prefix_index"]
    assert (st["blocks_sent"], st["blocks_hit"]) == (10, 5)
    assert st["pools"]["other"]["endpoints"]["solo"]["blocks"] == 5
