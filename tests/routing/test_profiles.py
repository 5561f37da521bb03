"""The functional suite every routing profile must pass (velocity_fast/routing/profiles/),
through the router; each profile's own tests are beside it in tests/routing/profiles/."""

import random
import re
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.support.fleet import make_pool
from velocity_fast.fleet.endpoint import Endpoint, Pool
from velocity_fast.metrics.registry import Registry
from velocity_fast.routing.profiles import REGISTRY, make_profiles
from velocity_fast.routing.router import Router
from velocity_fast.routing.session import SessionAffinity
from velocity_fast.routing.settings import PROFILES, RoutingSettings


def _pool(n):
    eps = []
    for i in range(n):
        ep = Endpoint(f"e{i}", f"http://127.0.0.1:{9200 + i}", "m")
        ep.healthy = True
        ep.scraped_at = time.monotonic()
        eps.append(ep)
    return Pool("m", eps)


def _setup(profile, n=4):
    r = Router(RoutingSettings(seed=3, default_profile=profile))
    pool = _pool(n)
    info = r.route_info("m", {"prompt": "shared prefix " * 50}, {})
    return r, pool, info


def test_every_profile_is_registered():
    profiles = make_profiles(RoutingSettings(), random.Random(1), SessionAffinity())
    assert tuple(profiles) == PROFILES
    assert all(p.name == name for name, p in profiles.items())


def test_each_profile_is_its_own_module_with_its_test_beside_it():
    root = Path(__file__).resolve().parents[2]
    for name, where in REGISTRY.items():
        module = where.partition(".")[0]
        assert (root / "velocity_fast/routing/profiles" / f"{module}.pyx").exists(), name
        assert (root / "tests/routing/profiles" / f"test_{module}.py").exists(), name


def test_each_profile_has_a_row_in_the_configuration_doc():
    doc = (Path(__file__).resolve().parents[2] / "docs/configuration.md").read_text()
    table = doc.split("\n## Routing profiles\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \|", table, re.M)
    assert tuple(rows) == PROFILES


@pytest.mark.parametrize("profile", PROFILES)
def test_picks_only_among_the_candidates(profile):
    r, pool, info = _setup(profile, 6)
    allowed = {"e1", "e4"}
    for _ in range(50):
        ep = r.pick(pool, info, lambda e: e.name in allowed)
        assert ep.name in allowed
        r.on_dispatch(ep, info)


@pytest.mark.parametrize("profile", PROFILES)
def test_a_single_candidate_is_taken(profile):
    r, pool, info = _setup(profile, 1)
    assert r.pick(pool, info) is pool.endpoints[0]


@pytest.mark.parametrize("profile", PROFILES)
def test_equal_endpoints_share_the_traffic(profile):
    r, pool, info = _setup(profile, 4)
    counts = Counter(r.pick(pool, info).name for _ in range(400))
    assert len(counts) == 4 and min(counts.values()) > 50


# round-robin serves in turn whatever the load (tests/routing/profiles/test_round_robin.py).
@pytest.mark.parametrize("profile", [p for p in PROFILES if p != "round-robin"])
def test_a_clearly_idle_endpoint_wins_over_a_loaded_one_without_affinity(profile):
    r, pool, info = _setup(profile, 2)
    busy, idle = pool.endpoints
    busy.inflight, busy.running, busy.waiting, busy.kv_usage = 30, 25, 4, 0.7
    idle.kv_usage = 0.05
    assert {r.pick(pool, info).name for _ in range(30)} == {"e1"}


@pytest.mark.parametrize("profile", PROFILES)
def test_the_pick_is_counted_under_its_profile(profile):
    r, pool, info = _setup(profile, 3)
    for _ in range(5):
        r.pick(pool, info)
    assert sum(r.stats()["picks"][profile].values()) == 5


def picks(r, pool, info, n, has_room=None):
    return [r.pick(pool, info, has_room).name for _ in range(n)]


def test_chosen_per_model_in_the_config_or_per_request_by_header():
    settings = RoutingSettings.from_config(
        {"seed": 1}, {"rr": {"profile": "round-robin"}, "ll": {"profile": "least-loaded"}}
    )
    r = Router(settings, registry=Registry())
    assert r.route_info("rr", {"prompt": "x"}, {}).profile == "round-robin"
    assert r.route_info("ll", {"prompt": "x"}, {}).profile == "least-loaded"
    assert r.route_info("other", {"prompt": "x"}, {}).profile == "chat"
    info = r.route_info("other", {"prompt": "x"}, {"x-velocity-profile": " Round-Robin "})
    assert info.profile == "round-robin"
    pool = make_pool(3, "other")
    assert picks(r, pool, info, 6) == ["e0", "e1", "e2"] * 2


def test_the_picks_show_in_the_metrics_by_profile_and_basis():
    reg = Registry()
    r = Router(RoutingSettings(default_profile="round-robin", seed=1), registry=reg)
    pool = make_pool(2)
    info = r.route_info("m", {"prompt": "x"}, {})
    picks(r, pool, info, 3)
    ll = r.route_info("m", {"prompt": "x"}, {"x-velocity-profile": "least-loaded"})
    picks(r, pool, ll, 2)
    text = reg.render().decode()
    assert re.search(r'^velocity_route_picks_total\{profile="round-robin",basis="turn"\} 3(\.0)?$', text, re.M)
    assert re.search(r'^velocity_route_picks_total\{profile="least-loaded",basis="load"\} 2(\.0)?$', text, re.M)


def test_the_router_asks_the_profile_whether_it_needs_the_prefix(monkeypatch):
    """What a profile declares decides the hashing, not its name: a profile that says it
    needs no prefix gets no hashes (as batch), whatever it is called."""
    import velocity_fast.routing.router as router_module
    from velocity_fast.routing.profiles.least_loaded import LeastLoadedProfile

    class Hashless(LeastLoadedProfile):
        needs_prefix = False

    real = router_module.make_profiles

    def profiles(settings, rng, sessions):
        out = real(settings, rng, sessions)
        out["least-loaded"] = Hashless(settings, rng, sessions)
        return out

    body = {"prompt": "shared prefix " * 500}
    assert Router(RoutingSettings(seed=3, default_profile="least-loaded")).route_info("m", body, {}).nblocks > 0
    monkeypatch.setattr(router_module, "make_profiles", profiles)
    r = Router(RoutingSettings(seed=3, default_profile="least-loaded"))
    assert r.route_info("m", body, {}).nblocks == 0
    assert r.route_info("m", body, {"x-velocity-profile": "chat"}).nblocks > 0
    assert [n for n in PROFILES if not r._profiles[n].needs_prefix] == ["batch", "least-loaded"]
    assert [n for n in PROFILES if r._profiles[n].precise] == ["chat"]
