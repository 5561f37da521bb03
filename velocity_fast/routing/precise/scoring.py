"""Precise prefix routing's scoring: where the chat profile of a precise pool sends a
request, by the engines' own KV events (docs/kv-events.md, "Precise routing in the gateway").

    precise = PrecisePrefix(settings, block_index, registry=reg, block_size=fn)
    router = Router(settings, registry=reg, precise=precise)  # calls attach() and choose()
    ...
    precise.close()

- ``attach(info, body, data)`` gives the request its token side (tokens.py: the token
  cache and the tokenizer thread).
- ``choose(...)``: an endpoint whose index is ``exact`` scores ``BlockIndex.match`` over
  the prompt's token chain; any other, and every endpoint while the request's tokens are
  not ready, scores the approximate index, with the same load balance and hot-spot guard
  as approximate routing (the compiled rule: affinity.pyx).
- ``dispatched`` and ``forget``: prompts sent to an engine count as held there until its
  events report them.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable

from velocity_fast.kvevents.index import BlockIndex
from velocity_fast.metrics.registry import MEAN, SUM, Registry
from velocity_fast.routing.precise.affinity import score
from velocity_fast.routing.precise.tokens import PreciseRequest, TokenSide, adopt, pool_stats
from velocity_fast.routing.prefix import choose_by_affinity
from velocity_fast.routing.settings import RoutingSettings

__all__ = ["PrecisePrefix", "PLACED_TTL_S", "PLACED_MAX"]

#: A prompt routed to an engine counts as on its way there (``_Placed``) until the
#: engine's events report its blocks, or this many seconds at most (a request that was
#: declined, failed or is still queued behind a long prefill), or until this many newer
#: ones on the same engine push it out.
PLACED_TTL_S = 10.0
PLACED_MAX = 64


class _Placed:
    """Prompts routed to one engine whose blocks its events have not reported yet: the
    events come after the prefill, and until then the index alone would see an empty
    cache where the router has just sent work. ``items``: (time, chain, blocks it adds,
    blocks the engine's events showed of it then), oldest first; ``blocks``: the sum of
    the third. The index watches each item's first block it adds (``chain[held]``)."""

    __slots__ = ("blocks", "items")

    def __init__(self) -> None:
        self.items: deque = deque()
        self.blocks = 0


def _common(a: list[int], b: list[int]) -> int:
    """Leading blocks two chains share: chained hashes agree exactly up to where the two
    prompts part, so a binary search finds it."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi) >> 1
        if a[mid] == b[mid]:
            lo = mid + 1
        else:
            hi = mid
    return lo


class PrecisePrefix:
    """The token side of precise pools (``tokens``) and their scoring; see the module doc."""

    def __init__(
        self,
        settings: RoutingSettings,
        index: BlockIndex,
        *,
        registry: Registry | None = None,
        block_size: Callable[[str], int] | None = None,
    ) -> None:
        self.index = index
        reg = registry if registry is not None else Registry()
        self.tokens = TokenSide(settings, registry=reg, block_size=block_size)
        self._settings = settings
        self._picks = adopt(
            reg,
            "counter",
            "velocity_prefix_precise_picks_total",
            "Chat-profile picks in precise pools, by how they were scored: precise (the "
            "engines' KV events), not_ready (tokens not ready: approximate), not_exact (no "
            "candidate's index exact: approximate).",
            ("model", "how"),
            merge=SUM,
        )
        share = self.precise_share
        if reg.get("velocity_prefix_precise_share") is None:
            reg.gauge_fn(
                "velocity_prefix_precise_share",
                "Share of chat-profile picks in precise pools that were scored by the engines' KV events.",
                share,
                merge=MEAN,
            )  # of each worker's own picks
        else:
            reg.get("velocity_prefix_precise_share").fn = share
        self._pick_children: dict[tuple[str, str], Any] = {}
        self._placed: dict[str, _Placed] = {}

    @property
    def settings(self) -> RoutingSettings:
        return self._settings

    @settings.setter
    def settings(self, settings: RoutingSettings) -> None:
        """A reload's settings, read live by the scoring and the token side alike."""
        self._settings = self.tokens.settings = settings

    def attach(self, info: Any, body: Any, data: bytes) -> None:
        """Give ``info`` its token side (``TokenSide.attach``), scored here."""
        self.tokens.attach(self, info, body, data)

    def close(self) -> None:
        """End the tokenizer thread (jobs still queued are left: their requests route
        approximately)."""
        self.tokens.close()

    def choose(
        self,
        req: PreciseRequest,
        cands: list,
        loads: list,
        info: Any,
        state: Any,
        rand: int,
        waits: list | None = None,
        hotspot_waiting: float | None = None,
    ) -> tuple[int, str]:
        """(position in cands, basis), as ``choose_by_affinity``; endpoints whose KV index
        is exact score the engine's own blocks, the others the approximate index. ``waits``
        and ``hotspot_waiting`` are the hot-spot guard's (the settings' by default)."""
        s = self._settings  # (the field, not the property: this is the request path)
        hw = s.hotspot_waiting if hotspot_waiting is None else hotspot_waiting
        chain = req.chain
        if chain is None:
            self._count(info.model, "not_ready")
            return choose_by_affinity(
                state.index, info.hashes, cands, loads, s.hotspot_gap, s.load_weight, rand, waits, hw
            )
        index = self.index
        bs = req.block_size
        n = len(chain)
        now = time.monotonic()
        aff: list[float] = []
        free: list[float] = []  # the share of each engine's cache its events leave free; 0 unknown
        need: list[float] = []  # blocks the prompt would evict there, cold; inf where not exact
        evict: list[float] = []  # the share of the prompt whose prefill there evicts others' blocks
        approx = None
        used = False
        for ep in cands:
            held = index.match_exact(ep.name, chain, bs)
            if held >= 0:
                used = True
                coming = 0
                placed = self._placed.get(ep.name)
                if placed is not None:
                    held = max(held, self._on_way(placed, ep.name, chain, bs, now))
                    coming = placed.blocks
                aff.append(held / n if n else 0.0)
                size = index.size(ep.name) + coming
                cap = ep.num_gpu_blocks
                free.append(max(0.0, 1.0 - size / cap) if cap else 0.0)
                need.append(max(0, size + n - cap) if cap else size)
                evict.append(min(n - held, max(0, size + n - held - cap)) / n if cap and n else 0.0)
                continue
            free.append(0.0)
            need.append(INF)
            evict.append(0.0)
            if approx is None:
                approx = state.index.match(info.hashes) if info.nblocks else []
            slot = state.index.slot_of(ep.name)
            aff.append(approx[slot] / info.nblocks if 0 <= slot < len(approx) else 0.0)
        if not used:
            self._count(info.model, "not_exact")
            return choose_by_affinity(
                state.index, info.hashes, cands, loads, s.hotspot_gap, s.load_weight, rand, waits, hw
            )
        self._count(info.model, "precise")
        if max(aff) == 0.0:
            # No engine holds the prefix or has it on its way, as the events tell. Requests
            # of it picked before their tokens were ready went by the approximate index
            # (which every dispatch feeds): follow them rather than place it cold again,
            # on another engine, for a second cold prefill.
            if info.nblocks:
                if approx is None:
                    approx = state.index.match(info.hashes)
                slots = [state.index.slot_of(ep.name) for ep in cands]
                sent = [approx[i] / info.nblocks if 0 <= i < len(approx) else 0.0 for i in slots]
                if max(sent) > 0.0:
                    return score(sent, loads, s.hotspot_gap, s.load_weight, rand, waits, hw)
            return _place_cold(need, loads, rand, max(2, n // 4)), "kv"
        fw = s.free_cache_weight
        if fw > 0.0:
            # The cache's side: room it has counts for it; the blocks this prompt would
            # push out of a full one count against it. A full engine that kept only part
            # of a prompt (the rest evicted: it holds more than it has room for) then
            # loses it to one with room, instead of evicting again on every request.
            aff = [a + fw * (f - x) for a, f, x in zip(aff, free, evict)]
        return score(aff, loads, s.hotspot_gap, s.load_weight, rand, waits, hw)

    def dispatched(self, name: str, req: PreciseRequest) -> None:
        """The request was sent to the engine ``name`` (the router's on_dispatch). Its
        events report the prompt's blocks only after the prefill; until then they count
        as on their way there: held, for the prompts that share them (a group's next
        requests follow its first instead of each placing it again), and in the cache's
        size, for where cold prompts go."""
        chain = req.chain
        if not chain:
            return
        self.index.hint(name, chain)  # shows the prefix of a store whose parent came before the gateway
        bs = req.block_size
        held = reported = self.index.match_exact(name, chain, bs)
        if held < 0:
            return  # not exact: the approximate index, which on_dispatch touches, stands in
        now = time.monotonic()
        placed = self._placed.get(name)
        if placed is None:
            placed = self._placed[name] = _Placed()
        else:
            held = max(held, self._on_way(placed, name, chain, bs, now))
        if held < len(chain):
            placed.items.append((now, chain, len(chain) - held, reported))
            placed.blocks += len(chain) - held
            self.index.watch(name, chain[reported])
            if len(placed.items) > PLACED_MAX:
                old = placed.items.popleft()
                placed.blocks -= old[2]
                self.index.unwatch(name, old[1][old[3]])

    def forget(self, name: str) -> None:
        """The endpoint left (or its engine restarted): nothing is on its way there. An
        engine name that is gone keeps no chains (endpoints come and go with discovery)."""
        placed = self._placed.pop(name, None)
        if placed is not None:
            for item in placed.items:
                self.index.unwatch(name, item[1][item[3]])

    def _on_way(self, placed: _Placed, name: str, chain: list[int], bs: int, now: float) -> int:
        """The leading blocks of ``chain`` that prompts sent to the engine carry there (0:
        none). A prompt leaves once the engine's events have stored its first block past
        what it held when sent (its prefill is done, or under way in chunks: from then
        the events say what the engine holds of it, even if it has evicted it since), or
        after PLACED_TTL_S."""
        cutoff = now - PLACED_TTL_S
        index = self.index
        match, seen = index.match_exact, index.seen
        live = []
        for item in placed.items:
            first = item[1][item[3]]
            if item[0] >= cutoff and not seen(name, first) and match(name, item[1], bs) <= item[3]:
                live.append(item)
            else:
                index.unwatch(name, first)
        if len(live) != len(placed.items):
            placed.items = deque(live)
            placed.blocks = sum(item[2] for item in live)
        return max((_common(chain, item[1]) for item in live), default=0)

    def _count(self, model: str, how: str) -> None:
        child = self._pick_children.get((model, how))
        if child is None:
            child = self._pick_children[(model, how)] = self._picks.labels(model, how)
        child.inc()

    def precise_share(self) -> float:
        """Precise picks over all picks of precise pools (0 before any)."""
        total = precise = 0.0
        for key, child in self._picks.children():
            total += child.value
            if key[1] == "precise":
                precise += child.value
        return precise / total if total else 0.0

    def stats(self) -> dict:
        return {
            "share": round(self.precise_share(), 4),
            "pools": pool_stats(self.tokens.pools),
            "on_way": {name: p.blocks for name, p in self._placed.items() if p.blocks},
        }


INF = float("inf")


def _place_cold(need: list[float], loads: list, rand: int, slack: float) -> int:
    """A prefix no engine holds goes to the least loaded engine, and among those to one
    where its prefill evicts least (``need``: the blocks it would push out, by the
    engines' events and their ``num_gpu_blocks``; without that, the blocks the engine
    holds; inf where not exact: counted as full). After a restart that is the restarted
    engine, which takes back the prefixes it lost instead of pushing them onto full
    caches. Engines within ``slack`` blocks of the least are equal, and equals are drawn
    at random: full caches differ by a few blocks from one event to the next, and a
    strict order would send every cold prefix to the same one."""
    low = min(loads)
    least = INF
    for i, x in enumerate(need):
        if loads[i] <= low + 1e-9 and x < least:
            least = x
    best = [i for i, x in enumerate(need) if loads[i] <= low + 1e-9 and x <= least + slack]
    return best[rand % len(best)]
