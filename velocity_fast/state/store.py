"""Tenant buckets shared across gateway replicas through Redis (``state_store``).

A tenant's request bucket (``requests_per_second``, ``burst``) and token bucket
(``tokens_per_minute``) live in Redis, one hash each, refilled by a Lua script from Redis'
own clock: every replica draws from the same bucket, so N replicas admit what one would.
No request waits on Redis. Each replica holds a *share* of the bucket (about 100 ms of
its rate) taken atomically by the script; a request draws from the share synchronously
(``Tenant`` draws on its ``StoreBucket``, state/bucket.pyx, as C).
The bucket knows the shares held: each replica says what it holds at each round trip
(and every few seconds while it holds one), and the level refills only up to the
bucket's size less them, so that a share held while the bucket refills is not granted a
second time: the total admitted is never more than the bucket grants. A replica that has
not said for ``HOLD_S`` is gone, its share with it (a replica drops a share it could not
confirm that long). A replica alone (no other holds a share) serves a burst past its
share from the level its last answer gave, refilled since: its view is exact, since a
replica that comes is granted nothing until each one there has called again (every
half second while alone) and learnt that it is no longer alone.
When the share runs low a refill is queued for this module's one task, which sends the
refills and the batched token settlements of all buckets in one pipeline; at most one is
queued or in flight per bucket. A share that is empty while its refill is on the way
answers 429 with a Retry-After from the bucket's rate.

Store unreachable: logged once (and once when it is back), counted
(``velocity_state_store_errors_total``, ``velocity_state_store_up``), and each bucket
falls back to a local one that applies the configured limit to this replica alone,
starting from the share it held. What is admitted meanwhile is charged to the shared
bucket when the store answers again, at most emptying it (an outage does not leave a
tenant in debt beyond what its own settlements made). The store is asked again with
backoff (50 ms doubling to 1 s).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from urllib.parse import urlsplit

from velocity_fast.metrics.registry import MAX, SUM
from velocity_fast.state.bucket import SHARE_S, StoreBucket

__all__ = ["StateStore", "StoreBucket", "check_url", "SHARE_S"]

log = logging.getLogger("velocity.statestore")

_TIMEOUT_S = 0.25  # a store slower than this to answer is taken for down
_BACKOFF_S = (0.05, 1.0)  # first and longest wait between attempts while it is down
_KEY = "velocity:tenant:{}:{}"
HOLD_S = 10.0  # a share not confirmed for this long is given back (a replica gone)
_KEEP_S = 3.0  # a replica confirms the shares it holds at least this often
_LONE_S = 0.5  # and this often where it is alone (it draws on its view of the level)

# KEYS[1]: the bucket (hash: level, stamp, and per replica "o:ID" = "held seen joined":
# the share it held when it last said, when, and when it first did). ARGV: rate a second, capacity, units asked,
# debt to settle (negative: a credit), outage consumption to charge, this replica's ID,
# the share it holds now, HOLD_S. Shares of replicas silent for HOLD_S are dropped. The
# level refills from Redis' TIME up to its room (the capacity less every share held),
# (what a share spent since the replica last said comes back at the rate from then on),
# settles the debt (the level may go below 0), charges the outage down to at most 0 (a
# level already below 0 stays), grants min(asked, level) when the level is positive and
# every other replica has called since this one first did (one alone draws on its view).
# Returns {granted, level, replicas holding shares (this one too), room after the grant}
# as strings (Redis would cut Lua numbers to integers). The key expires once it would be
# full again (HOLD_S at least) and a minute more: an absent bucket is full.
LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rate, cap = tonumber(ARGV[1]), tonumber(ARGV[2])
local ask, debt, charge = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local me, held, hold = 'o:' .. ARGV[6], tonumber(ARGV[7]), tonumber(ARGV[8])
local h = redis.call('HGETALL', KEYS[1])
local level, stamp, out, n, was, joined, behind = nil, nil, 0, 1, 0, now, false
for i = 1, #h, 2 do
  local k = h[i]
  if k == 'level' then level = tonumber(h[i + 1])
  elseif k == 'stamp' then stamp = tonumber(h[i + 1])
  elseif k == me then
    local x, _, j = string.match(h[i + 1], '(%S+) (%S+) (%S+)')
    was, joined = tonumber(x), tonumber(j)
  end
end
for i = 1, #h, 2 do
  local k = h[i]
  if k ~= me and string.sub(k, 1, 2) == 'o:' then
    local x, seen = string.match(h[i + 1], '(%S+) (%S+)')
    if now - tonumber(seen) > hold then redis.call('HDEL', KEYS[1], k)
    else
      out = out + tonumber(x); n = n + 1
      -- A replica that has not called since this one came may still think itself alone
      -- and draw on its view of the level: nothing is granted here until it has.
      if tonumber(seen) < joined then behind = true end
    end
  end
end
if level == nil or stamp == nil then level, stamp = cap, now end
-- The refill since the last call, up to the room the shares left then: what a share spent
-- since comes back at the rate from now on, not from a time it was still held.
if now > stamp then level = math.min(cap - out - was, level + (now - stamp) * rate); stamp = now end
local room = cap - out - held
if level > room then level = room end
level = level - debt
if level > room then level = room end
if charge > 0 then level = math.max(level - charge, math.min(level, 0)) end
local grant = 0
if ask > 0 and level > 0 and not behind then grant = math.min(ask, level) end
level = level - grant
held = held + grant
redis.call('HSET', KEYS[1], 'level', tostring(level), 'stamp', tostring(stamp), me,
           tostring(held) .. ' ' .. tostring(now) .. ' ' .. tostring(joined))
redis.call('PEXPIRE', KEYS[1], math.ceil((math.max((cap - level) / rate, hold) + 60) * 1000))
return {tostring(grant), tostring(level), tostring(n), tostring(room - grant)}
"""


def check_url(url: str) -> str | None:
    """What is wrong with a ``state_store`` URL (None: nothing)."""
    try:
        u = urlsplit(url)
        port = u.port
    except ValueError as e:
        return f"not a URL: {e}"
    if u.scheme not in ("redis", "rediss"):
        return f"must be redis://host:port/db (or rediss://), got {url!r}"
    if not u.hostname:
        return f"names no host: {url!r}"
    if port is not None and port == 0:
        return f"port 0 is not a port: {url!r}"
    db = u.path.lstrip("/")
    if db and not db.isdigit():
        return f"the database must be a number (redis://host:port/0), got {db!r}"
    if u.query or u.fragment:
        return f"takes no query or fragment: {url!r}"
    return None


class StateStore:
    """One gateway process's connection to Redis and its buckets (see the module doc)."""

    def __init__(self, url: str, registry=None) -> None:
        try:
            import redis.asyncio as aioredis
        except ImportError:  # config.validate says so first; this is for direct use
            raise RuntimeError("state_store needs the redis package: pip install 'velocityllm[redis]'") from None
        self.url = url
        self._redis = aioredis.from_url(
            url,
            socket_timeout=_TIMEOUT_S,
            socket_connect_timeout=_TIMEOUT_S,
            retry_on_timeout=False,
            retry=None,
            health_check_interval=0,
        )
        from redis.exceptions import NoScriptError

        self._noscript = NoScriptError
        self._sha: str | None = None
        self.replica = uuid.uuid4().hex[:16]  # this replica's name for its shares in the store
        self.buckets: dict[str, StoreBucket] = {}
        self._up = False
        self.errors = 0
        self.calls = 0
        self._pending: dict[StoreBucket, None] = {}  # refills queued (ordered, unique)
        self._owing: dict[StoreBucket, None] = {}  # settlements queued
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._down_logged = False
        self._flush_timer = False
        if registry is not None:
            registry.gauge_fn(
                "velocity_state_store_up",
                "1 while the state store (Redis) answers, else 0: tenant buckets are then local to this replica.",
                lambda: float(self.up),
                merge=MAX,
            )
            registry.counter_fn(
                "velocity_state_store_errors_total",
                "State store calls that failed (unreachable, timed out, refused).",
                lambda: float(self.errors),
                merge=SUM,
            )
            registry.counter_fn(
                "velocity_state_store_calls_total",
                "Round trips to the state store (each a pipeline of bucket refills and settlements).",
                lambda: float(self.calls),
                merge=SUM,
            )

    @property
    def up(self) -> bool:
        """The store answers: the buckets draw from their shares (else from local buckets)."""
        return self._up

    @up.setter
    def up(self, value: bool) -> None:
        self._up = value
        for b in self.buckets.values():
            b.up = value

    # -- the tenants' buckets ------------------------------------------------------------
    def bucket(self, tenant: str, kind: str, rate: float, cap: float) -> StoreBucket:
        """A tenant's bucket of ``kind`` ("requests" or "tokens") in the store (state/bucket.pyx's
        make_bucket asks): the one this store holds already where its limits did not
        change (a reload keeps its share), else a new one."""
        key = _KEY.format(tenant, kind)
        b = self.buckets.get(key)
        if b is not None and (b.rate, b.cap) == (rate, cap):
            return b
        b = StoreBucket(self, key, rate, cap, 2.0 if kind == "requests" else 16.0)
        b.up = self.up
        if not self.up:
            b.to_local()
            b.fallback.level = cap  # a bucket new while the store is down starts full, as a local one
        return b

    def attach(self, identity) -> None:
        """The identity's tenants' buckets are the ones this store serves from now on (at
        start, and again after a reload: the buckets of tenants gone are dropped)."""
        keep: dict[str, StoreBucket] = {}
        for t in identity.tenants.values():
            for b in (t.request_bucket, t.token_bucket):
                if isinstance(b, StoreBucket):
                    keep[b.key] = b
        self.buckets = keep
        for b in keep.values():
            if self.up and not b.asking and b.held <= b.low:
                self.ask(b)

    def ask(self, b: StoreBucket) -> None:
        """Queue a refill of ``b`` (the request path: no wait)."""
        b.asking = True
        self._pending[b] = None
        if self._wake is not None:
            self._wake.set()

    def owe(self, b: StoreBucket) -> None:
        """Queue ``b``'s settlement; it goes with the next round trip (at most SHARE_S on)."""
        self._owing[b] = None
        if self._wake is not None and not self._flush_timer:
            self._flush_timer = True
            asyncio.get_running_loop().call_later(SHARE_S, self._flush_due)

    def _flush_due(self) -> None:
        self._flush_timer = False
        if self._owing and self._wake is not None:
            self._wake.set()

    # -- the task ------------------------------------------------------------------------------
    async def start(self, timeout: float = 0.5) -> None:
        """Reach the store once (at most ``timeout``) and take the first shares, then run the
        task. A store that does not answer leaves the buckets local until it does."""
        self._wake = asyncio.Event()
        for b in self.buckets.values():
            b.to_local()
            b.fallback.level = b.cap
        try:
            await asyncio.wait_for(self._reconcile(), timeout)
        except Exception as e:  # noqa: BLE001 - any failure to reach it: local buckets, said once
            self._went_down(e)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="state-store")

    async def close(self) -> None:
        # Bounded: a shutdown does not wait on a store that does not answer.
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=1.0)
            self._task = None
        try:
            await asyncio.wait_for(self._redis.aclose(), 1.0)
        except Exception:  # noqa: BLE001 - closing a connection to a store that may be gone
            pass

    async def _run(self) -> None:
        backoff = _BACKOFF_S[0]
        while True:
            if not self.up:
                await asyncio.sleep(backoff)
                try:
                    await self._reconcile()
                    backoff = _BACKOFF_S[0]
                except Exception as e:  # noqa: BLE001 - still down
                    self._went_down(e)
                    backoff = min(_BACKOFF_S[1], backoff * 2)
                continue
            wait = self._next_wait()
            keep = _LONE_S if any(b.replicas == 1 for b in self.buckets.values()) else _KEEP_S
            if wait is None or wait > keep:
                wait = keep  # (the shares held are confirmed at least this often)
            if wait > 0:
                try:
                    await asyncio.wait_for(self._wake.wait(), wait)
                except TimeoutError:
                    pass
            self._wake.clear()
            try:
                await self._exchange()
            except Exception as e:  # noqa: BLE001 - the store failed: local buckets from now on
                self._went_down(e)

    def _next_wait(self) -> float | None:
        """Seconds until a queued refill may go (None: nothing queued; wait to be woken)."""
        if not self._pending:
            return None
        now = time.monotonic()
        return max(0.0, min(b.not_before for b in self._pending) - now)

    async def _exchange(self) -> None:
        """One round trip: the refills that are due and every settlement owed."""
        now = time.monotonic()
        refill = [b for b in self._pending if b.not_before <= now]
        for b in refill:
            del self._pending[b]
        for b in self.buckets.values():
            if b.replicas == 1 and now - b.answered >= _LONE_S or b.held > 0 and now - b.answered > _KEEP_S:
                if b.held > 0 and now - b.answered > HOLD_S - _KEEP_S:
                    # Unconfirmed for long enough that the store may have dropped it (the
                    # loop stalled): not drawn on, lest it be granted twice.
                    b.held = 0.0
                self._owing[b] = None  # confirmed, so that the store keeps it held
        owing = [b for b in self._owing if b not in refill]
        self._owing.clear()
        batch = refill + owing
        if not batch:
            return
        sent = []
        for b in batch:
            # While the bucket is full (a burst), a share of an eighth of what it holds: the
            # burst is served at the clients' pace, not one chunk a round trip.
            ask = max(0.0, max(b.chunk, b.shared_level / 8) - b.held) if b in refill else 0.0
            sent.append((b, ask, b.debt, b in refill))
            b.debt = 0.0
        try:
            try:
                replies = await self._eval(sent, [0.0] * len(sent))
            except self._noscript:  # the store restarted between two round trips
                self._sha = None
                replies = await self._eval(sent, [0.0] * len(sent))
        except BaseException:
            for b, _, debt, _ in sent:  # not known to have arrived: still owed
                b.debt += debt
            raise
        self._apply(sent, replies)

    async def _eval(self, sent, charges) -> list:
        """The bucket script for each (bucket, asked, debt, refill) and charge, in one pipeline."""
        if self._sha is None:
            self._sha = await self._redis.script_load(LUA)
            self.calls += 1
        async with self._redis.pipeline(transaction=False) as pipe:
            for (b, ask, debt, _), charge in zip(sent, charges):
                pipe.evalsha(
                    self._sha,
                    1,
                    b.key,
                    repr(b.rate),
                    repr(b.cap),
                    repr(ask),
                    repr(debt),
                    repr(charge),
                    self.replica,
                    repr(max(0.0, b.held)),
                    repr(HOLD_S),
                )
            replies = await pipe.execute()
        self.calls += 1
        return replies

    def _apply(self, sent, replies) -> None:
        now = time.monotonic()
        for (b, ask, _, refill), (grant, level, replicas, room) in zip(sent, replies):
            grant, b.shared_level = float(grant), float(level)
            b.replicas, b.room, b.answered = int(replicas), float(room), now
            b.held += grant
            if refill:
                b.asking = False
                if grant < ask and b.held <= b.low:
                    # The bucket is short: ask again once it would have a draw's worth.
                    b.not_before = now + min(1.0, max(0.005, (max(b.need, 1.0) - b.held) / b.rate))
                    self.ask(b)
                else:
                    b.not_before = 0.0

    async def _reconcile(self) -> None:
        """The store answers (again): charge what the local buckets admitted, take shares,
        and draw from them from now on."""
        buckets = list(self.buckets.values())
        sent = [(b, b.chunk, 0.0, True) for b in buckets]
        charged = [b.spent for b in buckets]
        self._sha = None  # a store back from a restart has forgotten the script
        if buckets:
            replies = await self._eval(sent, [max(0.0, c) for c in charged])
        else:
            await self._redis.ping()
            self.calls += 1
            replies = []
        self._pending.clear()
        self._owing.clear()
        for b, c in zip(buckets, charged):
            # Admitted locally while this round trip was on its way: a settlement to send.
            b.debt = b.spent - c
            b.spent = b.held = 0.0
            b.asking = False
            b.not_before = 0.0
        self._apply(sent, replies)
        for b in buckets:
            if b.debt:
                self.owe(b)
        if self._down_logged:
            log.warning("state store %s answers again: tenant buckets are shared again", self._safe_url())
            self._down_logged = False
        self.up = True

    def _went_down(self, e: BaseException) -> None:
        self.errors += 1
        if self.up or not self._down_logged:
            log.warning(
                "state store %s unreachable (%s): tenant buckets are local to this replica until it answers",
                self._safe_url(),
                type(e).__name__ + (f": {e}" if str(e) else ""),
            )
            self._down_logged = True
        if self.up:
            self.up = False
            for b in self.buckets.values():
                b.to_local()
        self._pending.clear()
        self._owing.clear()

    def _safe_url(self) -> str:
        u = urlsplit(self.url)
        return f"{u.scheme}://{u.hostname}:{u.port or 6379}{u.path}"
