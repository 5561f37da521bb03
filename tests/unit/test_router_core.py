"""The compiled router path (routing/router.pyx) through its Python faces: RouteInfo, the
clock of staleness, header mappings, and pick's callbacks and exclusions."""
import time
from types import MappingProxyType

import pytest

from velocity_fast.routing.prefix import BlockHashes
from velocity_fast.metrics.registry import Registry
from velocity_fast.fleet.endpoint import Endpoint, Pool
from velocity_fast.routing.settings import PROFILE_HEADER, SESSION_HEADER
from velocity_fast.routing.route import RouteInfo
from velocity_fast.routing.router import Router
from velocity_fast.routing.session import SessionAffinity
from velocity_fast.routing.settings import RoutingSettings


def make_pool(n=3):
    eps = []
    for i in range(n):
        ep = Endpoint(f"e{i}", f"http://127.0.0.1:{9300 + i}", "m")
        ep.healthy = True
        eps.append(ep)
    return Pool("m", eps)


def router(**kw):
    kw.setdefault("seed", 5)
    kw.setdefault("default_profile", "batch")
    return Router(RoutingSettings(**kw), registry=Registry())


def test_route_info_fields_are_readable_and_read_only():
    r = router(default_profile="chat")
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
    r = router()
    headers = MappingProxyType({PROFILE_HEADER: " Chat ", SESSION_HEADER: "   "})
    info = r.route_info(None, b"y" * 200, headers)
    assert (info.model, info.profile, info.session, info.session_key) == ("", "chat", None, None)
    for data in (bytearray(b"y" * 200), memoryview(b"y" * 200)):
        assert r.route_info(None, data, headers).hashes.tolist() == info.hashes.tolist()
    # Batch without a session shares one RouteInfo per model: nothing per request in it.
    assert r.route_info("m", {"prompt": "a"}, None) is r.route_info("m", {"prompt": "b"}, {})



def test_the_last_models_route_follows_headers_and_a_new_profile_map():
    r = router(profiles={"chatty": "chat"})
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

def test_staleness_is_judged_on_the_process_monotonic_clock():
    # The compiled path reads CLOCK_MONOTONIC in C: gauges scraped by Python code with
    # time.monotonic must be fresh or stale exactly as metrics_stale_s says.
    pool = make_pool(2)
    e0, e1 = pool.endpoints
    e0.waiting, e0.scraped_at = 9.0, time.monotonic() - 1.0   # fresh and saturated
    e1.inflight = 4
    r = router(metrics_stale_s=2.0)
    info = r.route_info("m", {"prompt": "hi"}, {})
    assert r.pick(pool, info) is e1
    e0.scraped_at = time.monotonic() - 3.0                     # stale: its queue is ignored
    assert r.pick(pool, info) is e0
    assert r.stats()["fail_open"] == 0


def test_a_hand_set_clock_is_obeyed_and_monotonic_can_be_restored():
    pool = make_pool(2)
    e0, e1 = pool.endpoints
    e0.waiting, e0.scraped_at = 9.0, 100.0
    e1.inflight = 4
    r = router(metrics_stale_s=2.0)
    info = r.route_info("m", {"prompt": "hi"}, {})
    now = [101.0]
    r._clock = lambda: now[0]
    assert r.pick(pool, info) is e1       # scraped a second ago on this clock: saturated
    now[0] = 103.0
    assert r.pick(pool, info) is e0       # three seconds: stale
    r._clock = time.monotonic
    assert r._clock is time.monotonic
    assert r.pick(pool, info) is e0       # 100.0 is long past on the process clock


def test_has_room_is_asked_only_of_healthy_endpoints_and_its_errors_propagate():
    pool = make_pool(3)
    pool.endpoints[1].healthy = False
    r = router()
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
    pool = make_pool(3)
    r = router()
    info = r.route_info("m", {"prompt": "hi"}, {})
    skip = kind(pool.endpoints[:2])
    assert {r.pick(pool, info, None, skip).name for _ in range(20)} == {"e2"}
    assert r.pick(pool, info, lambda e: e.name != "e2", skip) is None
    assert r.stats()["no_endpoint"] == 1


def test_pick_and_on_dispatch_refuse_a_missing_route_info():
    pool = make_pool(1)
    r = router()
    with pytest.raises(TypeError):
        r.pick(pool, None)
    with pytest.raises(TypeError):
        r.on_dispatch(pool.endpoints[0], None)


def test_dispatch_counts_blocks_per_pool_even_before_any_pick():
    r = router(default_profile="chat")
    ep = Endpoint("solo", "http://127.0.0.1:9400", "other")
    info = r.route_info("other", {"prompt": "z" * 64 * 5}, {})
    r.on_dispatch(ep, info)
    r.on_dispatch(ep, info)
    st = r.stats()["prefix_index"]
    assert (st["blocks_sent"], st["blocks_hit"]) == (10, 5)
    assert st["pools"]["other"]["endpoints"]["solo"]["blocks"] == 5
