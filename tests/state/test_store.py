"""The tenant buckets shared through Redis (state/store.py), in one process against a
real redis-server on a loopback port: the Lua bucket, the replicas' shares, settlements, the local
fallback while the store is unreachable and the reconciliation when it is back."""

from __future__ import annotations

import asyncio
import importlib.util
import time

import pytest

from tests.support.gateway import wait_until
from tests.support.redis_server import redis_server
from velocity_fast.config import ConfigError, TenantConfig, load_settings
from velocity_fast.gateway.identity import Identity
from velocity_fast.metrics.registry import Registry
from velocity_fast.state.bucket import StoreBucket
from velocity_fast.state.store import StateStore, check_url

pytestmark = pytest.mark.timeout(60)


class _Settings:
    def __init__(self, *tenants):
        self.api_key = None
        self.tenants = list(tenants)


@pytest.fixture
def rs():
    with redis_server() as server:
        yield server


def _tenant(**limits) -> _Settings:
    return _Settings(TenantConfig(name="t", **limits))


async def _started(url: str, settings: _Settings, registry: Registry | None = None) -> tuple[StateStore, Identity]:
    """A replica's store and its tenants, their buckets in the store."""
    store = StateStore(url, registry)
    identity = Identity(settings, store)
    store.attach(identity)
    await store.start()
    return store, identity


@pytest.mark.parametrize(
    "url,wrong",
    [
        ("redis://127.0.0.1:6379/0", None),
        ("redis://cache", None),
        ("rediss://h:1/2", None),
        ("http://127.0.0.1:6379", "must be redis://"),
        ("redis://:6379/0", "no host"),
        ("redis://h:99999/0", "not a URL"),
        ("redis://h:1/zero", "must be a number"),
        ("redis://h/0?x=1", "query"),
    ],
)
def test_check_url(url, wrong):
    got = check_url(url)
    assert (got is None) if wrong is None else (wrong in got)


def test_bad_state_store_is_a_config_error_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"state_store: must be redis://"):
        load_settings(None, {"state_store": "memcached://127.0.0.1:11211"}, env={})
    with pytest.raises(ConfigError, match=r"state_store:"):
        load_settings(None, {}, env={"VELOCITY_STATE_STORE": "redis://h:notaport/0"})
    env = {"VELOCITY_STATE_STORE": "redis://h:7000/1"}
    if importlib.util.find_spec("redis") is None:
        with pytest.raises(ConfigError, match=r"state_store: needs the redis package"):
            load_settings(None, {}, env=env)
    else:
        assert load_settings(None, {}, env=env).state_store == "redis://h:7000/1"


async def test_requests_draw_from_a_share_and_the_shared_bucket_bounds_them(rs):
    # Two stores (two replicas) on one bucket of 10 requests that refills at 5 a second:
    # together they admit the burst and then the rate, never each its own.
    sa, a = await _started(rs.url, _tenant(requests_per_second=5, burst=10))
    sb, b = await _started(rs.url, _tenant(requests_per_second=5, burst=10))
    try:
        assert sa.up and sb.up
        ta, tb = a.tenants["t"], b.tenants["t"]
        admitted, waits = 0, []
        start = time.monotonic()
        while time.monotonic() - start < 2.0:
            for t in (ta, tb):
                w = t.take()
                if w == 0.0:
                    admitted += 1
                else:
                    waits.append(w)
            await asyncio.sleep(0.005)
        elapsed = time.monotonic() - start
        # The burst, the refill, less what the two shares hold unused (2 each at most).
        assert 10 + 5 * elapsed - 4 - 1 <= admitted <= 10 + 5 * elapsed + 1, (admitted, elapsed)
        assert waits and all(0 < w <= 1.0 for w in waits)  # Retry-After from the rate, never a wait
    finally:
        await sa.close()
        await sb.close()


async def test_a_refill_no_longer_needed_when_it_goes_still_ends(rs):
    # Credits filled the share between the ask and the round trip: nothing is asked, and
    # the bucket may ask again later.
    store, ident = await _started(rs.url, _tenant(tokens_per_minute=600))
    try:
        b = ident.tenants["t"].token_bucket
        store.ask(b)
        b.held = b.cap  # more than any refill would ask for
        await wait_until(lambda: not b.asking, 2.0, what="the refill done")
        assert b.held == b.cap
    finally:
        await store.close()


async def test_token_settlements_reach_the_shared_bucket(rs):
    store, ident = await _started(rs.url, _tenant(tokens_per_minute=600))  # 10 tokens a second, 600 in the bucket
    try:
        t = ident.tenants["t"]
        assert t.take_tokens(50) == 0.0
        t.settle_tokens(1000)  # the answer used far more than drawn: a debt of the shared bucket
        await wait_until(lambda: not store._owing and t.token_bucket.debt == 0, 2.0, what="the settlement sent")
        level = float(rs.command("HGET", "velocity:tenant:t:tokens", "level").split(b"\r\n")[1])
        assert level < 0  # in debt, as the one-process bucket would be
        w = t.take_tokens(20)
        assert w > 0  # nothing is granted from a bucket in debt
        assert t.tokens_left() < 0
    finally:
        await store.close()


async def test_an_unreachable_store_falls_back_to_the_local_bucket_and_reconciles(rs):
    reg = Registry()
    store, ident = await _started(rs.url, _tenant(requests_per_second=20, burst=20), reg)
    t = ident.tenants["t"]
    try:
        assert reg.get("velocity_state_store_up") is not None and store.up
        rs.stop()
        # Draw until the refill meets the dead store: from then on the local bucket answers.
        deadline = time.monotonic() + 3.0
        while store.up and time.monotonic() < deadline:
            t0 = time.monotonic()
            t.take()
            assert time.monotonic() - t0 < 0.01  # a draw never waits on the store
            await asyncio.sleep(0.01)
        assert not store.up and store.errors >= 1
        admitted = sum(t.take() == 0.0 for _ in range(100))
        assert 1 <= admitted <= 21  # the configured limit, by this replica alone
        spent = t.request_bucket.spent
        assert spent >= admitted
        rs.start()
        await wait_until(lambda: store.up, 5.0, what="the store back")
        # What was admitted meanwhile was charged: the shared bucket is not full again.
        level = float(rs.command("HGET", "velocity:tenant:t:requests", "level").split(b"\r\n")[1])
        assert level <= 20 - min(spent, 20) + 1
    finally:
        await store.close()


async def test_a_store_that_never_answers_is_not_waited_on(rs):
    store, ident = await _started(rs.url, _tenant(requests_per_second=50, burst=5))
    t = ident.tenants["t"]
    try:
        rs.pause()
        worst = 0.0
        admitted = 0
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            t0 = time.monotonic()
            admitted += t.take() == 0.0
            worst = max(worst, time.monotonic() - t0)
            await asyncio.sleep(0.005)
        assert worst < 0.01
        assert not store.up  # timed out: local from then on
        assert admitted >= 20  # served locally after the timeout, at about 50/s
        rs.resume()
        await wait_until(lambda: store.up, 5.0, what="the store back")
    finally:
        await store.close()


def test_without_the_redis_package_state_store_is_a_config_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "redis" else real(name, *a))
    with pytest.raises(ConfigError, match=r"state_store: needs the redis package"):
        load_settings(None, {"state_store": "redis://127.0.0.1:6379/0"}, env={})
    assert load_settings(None, {}, env={}).state_store is None  # not asked for: not needed


async def test_a_reload_keeps_the_share_of_a_bucket_whose_limits_did_not_change(rs):
    store, old = await _started(
        rs.url, _Settings(TenantConfig(name="t", requests_per_second=10), TenantConfig(name="u", tokens_per_minute=600))
    )
    try:
        share_t, share_u = old.tenants["t"].request_bucket, old.tenants["u"].token_bucket
        assert share_t.held > 0 and share_u.held > 0
        new = Identity(
            _Settings(
                TenantConfig(name="t", requests_per_second=10),
                TenantConfig(name="u", tokens_per_minute=1200),
                TenantConfig(name="v", requests_per_second=5),
            ),
            store,
        )
        store.attach(new)
        assert new.tenants["t"].request_bucket is share_t  # same limits: the same share
        assert new.tenants["u"].token_bucket is not share_u and new.tenants["u"].token_bucket.cap == 1200
        assert isinstance(new.tenants["v"].request_bucket, StoreBucket) and new.tenants["v"].token_bucket is None
        assert set(store.buckets) == {
            "velocity:tenant:t:requests",
            "velocity:tenant:u:tokens",
            "velocity:tenant:v:requests",
        }
        await wait_until(lambda: new.tenants["v"].request_bucket.held > 0, 2.0, what="the new tenant's first share")
    finally:
        await store.close()
