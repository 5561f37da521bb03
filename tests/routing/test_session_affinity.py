"""Session affinity by rendezvous hashing (velocity_fast/routing/session.py, via the router)."""

import subprocess
import sys
from collections import Counter

from velocity_fast.fleet.endpoint import Endpoint, Pool
from velocity_fast.routing.router import Router
from velocity_fast.routing.session import SessionAffinity
from velocity_fast.routing.settings import RoutingSettings

SESSIONS = [f"user-{i}" for i in range(2000)]


def _pool(n):
    eps = []
    for i in range(n):
        ep = Endpoint(f"engine-{i}", f"http://127.0.0.1:{9300 + i}", "m")
        ep.healthy = True
        eps.append(ep)
    return Pool("m", eps)


def _placement(r, pool, sessions=SESSIONS):
    out = {}
    for sid in sessions:
        info = r.route_info("m", {"prompt": "hello"}, {"x-session-id": sid})
        out[sid] = r.pick(pool, info).name
    return out


def test_sessions_are_sticky_and_spread():
    r = Router(RoutingSettings(seed=1))
    pool = _pool(5)
    first = _placement(r, pool)
    assert _placement(r, pool) == first
    counts = Counter(first.values())
    assert len(counts) == 5 and min(counts.values()) > 2000 / 5 * 0.7
    assert r.stats()["picks"]["chat"]["session"] == 4000


def test_an_endpoint_that_leaves_moves_only_its_own_sessions():
    r = Router(RoutingSettings(seed=1))
    pool = _pool(5)
    before = _placement(r, pool)
    pool.endpoints[2].healthy = False
    after = _placement(r, pool)
    moved = {s for s in SESSIONS if before[s] != after[s]}
    assert moved == {s for s in SESSIONS if before[s] == "engine-2"}
    # Its sessions spread over the others rather than piling onto one.
    assert len({after[s] for s in moved}) == 4
    # When it comes back, exactly those sessions return.
    pool.endpoints[2].healthy = True
    assert _placement(r, pool) == before


def test_a_new_endpoint_takes_only_the_sessions_it_wins():
    r = Router(RoutingSettings(seed=1))
    pool = _pool(4)
    before = _placement(r, pool)
    new = Endpoint("engine-new", "http://127.0.0.1:9399", "m")
    new.healthy = True
    pool.endpoints.append(new)
    after = _placement(r, pool)
    moved = [s for s in SESSIONS if before[s] != after[s]]
    assert all(after[s] == "engine-new" for s in moved)
    assert 2000 / 5 * 0.7 < len(moved) < 2000 / 5 * 1.3


def test_load_guard_sends_a_session_elsewhere_while_its_owner_is_hot():
    r = Router(RoutingSettings(seed=1, session_gap=4.0))
    pool = _pool(3)
    sid = "user-42"
    owner = _placement(r, pool, [sid])[sid]
    ep = next(e for e in pool.endpoints if e.name == owner)
    ep.inflight = 4  # exactly the gap: still the owner
    assert _placement(r, pool, [sid])[sid] == owner
    ep.inflight = 5  # past it: somewhere else, for now
    assert _placement(r, pool, [sid])[sid] != owner
    ep.inflight = 0
    assert _placement(r, pool, [sid])[sid] == owner


def test_owner_at_its_limit_is_skipped_without_remapping_the_session():
    r = Router(RoutingSettings(seed=1))
    pool = _pool(3)
    sid = "user-7"
    owner = _placement(r, pool, [sid])[sid]
    info = r.route_info("m", {"prompt": "hello"}, {"x-session-id": sid})
    assert r.pick(pool, info, lambda e: e.name != owner).name != owner
    assert r.pick(pool, info).name == owner


def test_owner_is_the_same_in_every_process():
    # Gateway replicas must agree on the owner without talking to each other.
    code = (
        "from velocity_fast.routing.session import SessionAffinity\n"
        "class E:\n"
        "    def __init__(self, n): self.name, self.healthy = n, True\n"
        "eps = [E(f'engine-{i}') for i in range(5)]\n"
        "a = SessionAffinity()\n"
        "print([a.owner(a.key(f'user-{i}'), eps).name for i in range(50)])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout.strip()

    class E:
        def __init__(self, n):
            self.name, self.healthy = n, True

    eps = [E(f"engine-{i}") for i in range(5)]
    a = SessionAffinity()
    assert out == str([a.owner(a.key(f"user-{i}"), eps).name for i in range(50)])


def test_no_owner_without_a_healthy_endpoint():
    a = SessionAffinity()
    pool = _pool(2)
    for ep in pool.endpoints:
        ep.healthy = False
    assert a.owner(a.key("s"), pool.endpoints) is None
