"""An exact per-engine index of cached prefix blocks, built from KV events.

Keys are the gateway's OWN chained hashes of token ids, never the engine's block hashes:
block ``i`` of a prompt is ``hash((hash of block i-1, tuple of its block_size token
ids))``, from ``ROOT`` (or a LoRA's root). The engine's hashes (algorithm and seed are
the engine's business) serve only to find a block again when ``BlockRemoved`` names it
and to find a stored run's parent. So ``chain_hashes(prompt_ids, block_size)`` on the
request side and ``match`` here agree whatever hash the engines use.

Threads: one subscriber thread writes an endpoint's entries; the router reads them on
the event loop. ``match`` only does ``in`` on a set that stays a prefix of every chain
at each step of a change, and a clear swaps in new containers, so a reader never sees
a half-made change (each set operation is atomic under the GIL).

``match`` costs O(log n) lookups: the index keeps apart the blocks reachable from the
root (all ancestors held), which along a prompt's chain form a prefix. It stays exact
when an engine evicts a block before its descendants (vLLM does not, but the index
does not rely on it).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Hashable, Iterable

from .wire import Cleared, Removed, Stored

#: The chain's root: a fixed number, so hashes agree between processes (the hash of a
#: tuple of ints does not depend on PYTHONHASHSEED).
ROOT = 0x5EC7_0C4E_D1A5_7E11

#: Prompts sent to an endpoint kept as hints for its stores of unknown parent (``hint``).
HINTS = 64

#: States of an endpoint's entries.
CONNECTING = "connecting"  # nothing received yet: no knowledge
EXACT = "exact"  # every batch since a known state applied
APPROXIMATE = "approximate"  # batches were lost and not recovered: entries may be wrong


def lora_root(lora: Hashable | None) -> int:
    """The chain's root for blocks of a LoRA adapter (``ROOT`` for the base model)."""
    return ROOT if lora is None else hash((ROOT, lora))


def chain_hashes(
    token_ids: list[int] | tuple[int, ...],
    block_size: int,
    lora: Hashable | None = None,
    known: list[int] | None = None,
) -> list[int]:
    """The chained hashes of the full blocks of ``token_ids`` (a trailing partial block
    has none, as engines cache only full blocks).

    ``known``: the hashes of this prompt's first blocks, already computed (a
    conversation's earlier turn): only the blocks after them are hashed.
    """
    skip = len(known) * block_size if known else 0
    return extend_chain(known or (), token_ids[skip:], block_size, lora)


def extend_chain(
    known: list[int] | tuple[int, ...],
    token_ids: list[int] | tuple[int, ...],
    block_size: int,
    lora: Hashable | None = None,
) -> list[int]:
    """``chain_hashes`` of a prompt given the hashes of its first blocks (``known``) and
    only the tokens after them (``token_ids``): what a next turn costs is its tail."""
    out: list[int] = list(known)
    parent = out[-1] if out else lora_root(lora)
    ids = tuple(token_ids)  # slices of a tuple are tuples
    for i in range(0, len(ids) - block_size + 1, block_size):
        parent = hash((parent, ids[i : i + block_size]))
        out.append(parent)
    return out


def _freeze(x: Any) -> Any:
    if isinstance(x, list):
        return tuple(_freeze(v) for v in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in x.items()))
    return x


class EndpointStats:
    """Counters of one endpoint (read by metrics; written by its subscriber)."""

    __slots__ = (
        "events",
        "batches",
        "lost",
        "replayed",
        "unrecovered",
        "resyncs",
        "disconnects",
        "orphans",
        "adopted",
        "joins",
        "skipped",
        "bad",
        "state",
        "block_size",
    )

    def __init__(self) -> None:
        self.events = 0  # events applied
        self.batches = 0  # batches applied (live and replayed)
        self.lost = 0  # batches missing from the live stream (sequence gaps)
        self.replayed = 0  # batches recovered through the replay endpoint
        self.unrecovered = 0  # gaps the replay could not fill (each made the entries approximate)
        self.resyncs = 0  # approximate -> exact again
        self.disconnects = 0  # the publisher's connection dropped (engine gone or restarted)
        self.orphans = 0  # stored blocks whose parent was unknown, so not indexed
        self.adopted = 0  # blocks known held as the prefix a hint showed of a store's parent
        self.joins = 0  # times the entries started after the engine's first batch (a subset)
        self.skipped = 0  # stored blocks of another medium or group, or malformed
        self.bad = 0  # messages that were not event batches
        self.state = CONNECTING
        self.block_size = 0  # as the engine's events say

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}


class _Entries:
    """One endpoint's blocks.

    ``blocks``: own hash -> engine blocks holding it. ``closed``: the held blocks whose
    ancestors are all held too, i.e. the blocks a prompt reaching them would find
    cached; a block is in it only after its parent, so along any chain it is a prefix
    and ``match`` can binary-search it. ``parent`` and ``kids`` link own hashes, so that
    evicting a block opens its cached descendants and storing it again closes them.
    ``engine``: engine hash -> [own hash, times stored and not yet removed].
    ``inferred``: held blocks known only as a hinted prompt's prefix (no engine hash).
    """

    __slots__ = ("blocks", "closed", "parent", "kids", "engine", "inferred")

    def __init__(self) -> None:
        self.blocks: dict[int, int] = {}
        self.closed: set[int] = set()
        self.parent: dict[int, int | None] = {}
        self.kids: dict[int | None, set[int]] = {}
        self.engine: dict[Any, list] = {}
        self.inferred: set[int] = set()

    def add(self, own: int, parent: int | None) -> None:
        n = self.blocks.get(own, 0)
        self.blocks[own] = n + 1
        if n:
            return
        self.parent[own] = parent
        self.kids.setdefault(parent, set()).add(own)
        if parent is None or parent in self.closed:
            # Close it and its held descendants, each after its parent (readers
            # never see a closed block under an open one).
            stack = [own]
            closed, blocks, kids = self.closed, self.blocks, self.kids
            while stack:
                x = stack.pop()
                if x in blocks and x not in closed:
                    closed.add(x)
                    stack.extend(kids.get(x, ()))

    def drop(self, own: int) -> None:
        n = self.blocks.get(own, 0) - 1
        if n > 0:
            self.blocks[own] = n
            return
        if n < 0:
            return
        del self.blocks[own]
        if own in self.closed:
            # Open it and its closed descendants, deepest first.
            order, stack = [], [own]
            closed, kids = self.closed, self.kids
            while stack:
                x = stack.pop()
                if x in closed:
                    order.append(x)
                    stack.extend(kids.get(x, ()))
            for x in reversed(order):
                closed.discard(x)
        # Unlink it from its parent; its own kids stay linked (they may still be
        # held, and are found again when it is stored again).
        parent = self.parent.pop(own)
        sibs = self.kids.get(parent)
        if sibs is not None:
            sibs.discard(own)
            if not sibs:
                del self.kids[parent]


def leading_in(closed, chain) -> int:
    """How many leading hashes of ``chain`` (a sequence) are in ``closed`` (a set or map)
    that holds whole chains from the root: what it holds of one chain is then a prefix
    of it, and a binary search finds its end."""
    lo, hi = 0, len(chain)
    while lo < hi:
        mid = (lo + hi) >> 1
        if chain[mid] in closed:
            lo = mid + 1
        else:
            hi = mid
    return lo


class BlockIndex:
    """Per endpoint, the set of own chained hashes of the blocks its engine holds."""

    def __init__(self) -> None:
        self._entries: dict[Hashable, _Entries] = {}
        self._stats: dict[Hashable, EndpointStats] = {}
        self._hints: dict[Hashable, deque] = {}
        # endpoint -> own hash -> [stored since watched, watchers]: the blocks the router
        # waits to see stored (``watch``), marked by the events that store them.
        self._watch: dict[Hashable, dict[int, list]] = {}

    # -- the router's side ---------------------------------------------------------
    def match(self, endpoint_key: Hashable, chain: list[int]) -> int:
        """How many leading blocks of ``chain`` (from ``chain_hashes``) the endpoint holds."""
        e = self._entries.get(endpoint_key)
        if e is None:
            return 0
        return leading_in(e.closed, chain)

    def match_exact(self, endpoint_key: Hashable, chain: list[int], block_size: int) -> int:
        """``match`` when the endpoint's entries are exact and of ``block_size`` (or hold no
        block yet), else -1: the router's one call per endpoint."""
        s = self._stats.get(endpoint_key)
        if s is None or s.state != EXACT or (s.block_size and s.block_size != block_size):
            return -1
        e = self._entries.get(endpoint_key)
        if e is None:
            return 0
        return leading_in(e.closed, chain)

    def exact(self, endpoint_key: Hashable) -> bool:
        """True when the endpoint's entries can be trusted (else route approximately)."""
        s = self._stats.get(endpoint_key)
        return s is not None and s.state == EXACT

    def size(self, endpoint_key: Hashable) -> int:
        """Distinct blocks the endpoint holds."""
        e = self._entries.get(endpoint_key)
        return 0 if e is None else len(e.blocks)

    def block_size(self, endpoint_key: Hashable) -> int:
        """The endpoint's block size as its events say (0 before any BlockStored)."""
        s = self._stats.get(endpoint_key)
        return 0 if s is None else s.block_size

    def stats(self, endpoint_key: Hashable) -> EndpointStats:
        """The endpoint's counters (created on first use)."""
        s = self._stats.get(endpoint_key)
        if s is None:
            s = self._stats[endpoint_key] = EndpointStats()
            self._entries[endpoint_key] = _Entries()
        return s

    def hint(self, endpoint_key: Hashable, chain: list[int]) -> None:
        """A prompt's chain was sent to the endpoint (the router's word, on the event
        loop). A store there whose parent the events never named (stored before the
        gateway joined) is looked up in the last ``HINTS`` of these: the prompt whose
        block after the parent is the stored one shows the parent's prefix, which the
        engine then holds (it caches a block only after its whole prefix)."""
        h = self._hints.get(endpoint_key)
        if h is None:
            h = self._hints[endpoint_key] = deque(maxlen=HINTS)
        h.append(chain)

    def watch(self, endpoint_key: Hashable, own: int) -> None:
        """Note whether the endpoint's events store the block ``own`` from now on (``seen``),
        even if they remove it again before anyone looks; ``unwatch`` once per call."""
        w = self._watch.get(endpoint_key)
        if w is None:
            w = self._watch[endpoint_key] = {}
        got = w.get(own)
        if got is None:
            w[own] = [False, 1]
        else:
            got[1] += 1

    def seen(self, endpoint_key: Hashable, own: int) -> bool:
        """True once the endpoint's events stored the watched block ``own``."""
        w = self._watch.get(endpoint_key)
        got = None if w is None else w.get(own)
        return got is not None and got[0]

    def unwatch(self, endpoint_key: Hashable, own: int) -> None:
        w = self._watch.get(endpoint_key)
        got = None if w is None else w.get(own)
        if got is not None:
            got[1] -= 1
            if got[1] <= 0:
                del w[own]

    def endpoints(self) -> list[Hashable]:
        return list(self._stats)

    def remove(self, endpoint_key: Hashable) -> None:
        """Forget an endpoint (it left the fleet)."""
        self._entries.pop(endpoint_key, None)
        self._stats.pop(endpoint_key, None)
        self._hints.pop(endpoint_key, None)
        self._watch.pop(endpoint_key, None)

    # -- the subscriber's side -----------------------------------------------------
    def clear(self, endpoint_key: Hashable) -> None:
        """Drop every entry of the endpoint (a swap: readers keep the old, whole one)."""
        self.stats(endpoint_key)
        self._entries[endpoint_key] = _Entries()

    def set_state(self, endpoint_key: Hashable, state: str) -> None:
        s = self.stats(endpoint_key)
        if state == EXACT and s.state == APPROXIMATE:
            s.resyncs += 1
        s.state = state

    def apply(self, endpoint_key: Hashable, events: Iterable[Stored | Removed | Cleared]) -> None:
        """Apply one batch's events in order."""
        s = self.stats(endpoint_key)
        for ev in events:
            s.events += 1
            if isinstance(ev, Stored):
                self._stored(endpoint_key, s, ev)
            elif isinstance(ev, Removed):
                self._removed(endpoint_key, ev)
            else:
                # The engine's cache is empty now: a known state, whatever was lost.
                self.clear(endpoint_key)
                self.set_state(endpoint_key, EXACT)

    def _stored(self, key: Hashable, s: EndpointStats, ev: Stored) -> None:
        n = len(ev.block_hashes)
        bs = ev.block_size
        if ev.medium not in (None, "GPU") or ev.group_idx not in (None, 0) or bs < 1 or len(ev.token_ids) != n * bs:
            s.skipped += n
            return
        s.block_size = bs
        e = self._entries[key]
        engine = e.engine
        if ev.parent is None:
            parent, link = lora_root(ev.lora), None
        else:
            p = engine.get(ev.parent)
            if p is not None:
                parent = link = p[0]
            elif not (ev.extra_keys and ev.extra_keys[0] is not None) and (
                got := self._adopt(key, s, e, ev.parent, tuple(ev.token_ids[:bs]))
            ):
                parent = link = got
            else:
                s.orphans += n
                return
        extra = ev.extra_keys
        tokens = tuple(ev.token_ids)
        watch = self._watch.get(key)
        for i, eh in enumerate(ev.block_hashes):
            block = tokens[i * bs : (i + 1) * bs]
            x = extra[i] if extra is not None and i < len(extra) else None
            # A block whose hash covers more than its tokens (images, a cache salt)
            # gets a key no plain prompt can produce.
            own = hash((parent, block)) if x is None else hash((parent, block, _freeze(x)))
            got = engine.get(eh)
            if got is None:
                engine[eh] = [own, 1]
                e.add(own, link)
            else:
                got[1] += 1
            if watch and (w := watch.get(own)) is not None:
                w[0] = True
            parent = link = own

    def _removed(self, key: Hashable, ev: Removed) -> None:
        if ev.medium not in (None, "GPU") or ev.group_idx not in (None, 0):
            return
        e = self._entries[key]
        engine = e.engine
        for eh in ev.block_hashes:
            got = engine.get(eh)
            if got is None:
                if e.inferred:
                    # A block the events never named left: it may be one known only by
                    # inference, so none of those is trusted any more.
                    for own in list(e.inferred):
                        e.drop(own)
                    e.inferred.clear()
                continue
            got[1] -= 1
            if got[1] > 0:
                continue
            del engine[eh]
            e.drop(got[0])

    def _adopt(self, key: Hashable, s: EndpointStats, e: _Entries, parent_eh: Any, first: tuple) -> int | None:
        """The own hash of an unknown parent ``parent_eh`` whose stored child block holds
        the tokens ``first``, from the prompts sent to the endpoint (``hint``); its prefix
        is entered as held. None when no hinted prompt has that block."""
        hints = self._hints.get(key)
        if not hints:
            return None
        for chain in reversed(list(hints)):  # (a copy: the event loop appends)
            for k in range(1, len(chain)):
                if hash((chain[k - 1], first)) != chain[k]:
                    continue
                for i in range(k - 1):
                    own = chain[i]
                    if own not in e.blocks:
                        e.inferred.add(own)
                        e.add(own, chain[i - 1] if i else None)
                        s.adopted += 1
                own = chain[k - 1]
                if own in e.inferred:
                    e.inferred.discard(own)  # named by the engine from now on: its removal shows
                else:
                    e.add(own, chain[k - 2] if k > 1 else None)
                    s.adopted += 1
                e.engine[parent_eh] = [own, 1]
                return own
        return None
