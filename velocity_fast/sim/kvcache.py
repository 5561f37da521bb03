"""KV-cache block accounting with automatic prefix caching, as vLLM v1 keeps it.

Only counts and hashes are kept, no tensors: the pool has ``num_blocks`` blocks; a
block is either held by running sequences (``ref > 0``), free but still holding a
cached prefix (in the LRU, reusable by a later prompt with the same prefix, evicted
oldest first when a fresh block is needed), or free and empty.
"""

from __future__ import annotations

from collections import OrderedDict

from .kvevents import AllBlocksCleared, removed, stored


class Allocation:
    """The blocks one sequence holds: hashed prompt blocks plus anonymous ones."""

    __slots__ = ("hashes", "anon")

    def __init__(self) -> None:
        self.hashes: list[int] = []
        self.anon = 0

    @property
    def num_blocks(self) -> int:
        return len(self.hashes) + self.anon


class KVCache:
    """Block pool of one engine.

    ``lru_capacity`` bounds how many freed blocks keep their prefix content
    (``--prefix-cache-blocks``); vLLM keeps every free block's content until the block
    is reused, which is ``lru_capacity == num_blocks``.
    """

    def __init__(self, num_blocks: int, block_size: int, lru_capacity: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.lru_capacity = max(0, lru_capacity)
        self.enable_prefix_caching = enable_prefix_caching
        self._empty = num_blocks
        # hash -> reference count of blocks held by sequences
        self._held: dict[int, int] = {}
        # hash -> None, oldest first: freed blocks whose content is still reusable
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.used = 0
        self.queries = 0
        self.hits = 0
        #: KV events (``--kv-events-config``) waiting for the engine to publish them;
        #: None when events are off, so the accounting costs nothing extra.
        self.events: list | None = None

    @property
    def free(self) -> int:
        """Blocks a new allocation can take (empty ones plus evictable cached ones)."""
        return self._empty + len(self._lru)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences, as ``vllm:kv_cache_usage_perc``."""
        return self.used / self.num_blocks

    def blocks_for(self, tokens: int) -> int:
        """Blocks a sequence of ``tokens`` tokens holds: ceil(tokens / block_size)."""
        return -(-tokens // self.block_size)

    def cached_prefix(self, block_hashes: list[int]) -> int:
        """How many leading blocks of a prompt are cached (held or in the LRU)."""
        if not self.enable_prefix_caching:
            return 0
        held, lru = self._held, self._lru
        n = 0
        for h in block_hashes:
            if h in held or h in lru:
                n += 1
            else:
                break
        return n

    def allocate_prompt(
        self, block_hashes: list[int], tokens: int, extra: int = 0, token_ids: list[int] | None = None
    ) -> tuple[Allocation, int] | None:
        """Take the blocks for a prompt of ``tokens`` tokens (plus ``extra`` slots for
        the tokens about to be generated), reusing cached ones.

        ``block_hashes`` are the chained hashes of the prompt's full blocks. Returns the
        allocation and the number of prompt tokens served from the cache, or None (and
        changes nothing) when the free blocks do not suffice. With events on, newly
        cached blocks become ``BlockStored`` events carrying ``token_ids``' slices.
        """
        need_total = self.blocks_for(tokens + extra)
        hit_blocks = self.cached_prefix(block_hashes)
        # vLLM always recomputes at least the last prompt token (it needs its logits),
        # so a prompt that is cached whole still costs one block of compute.
        if hit_blocks * self.block_size >= tokens and hit_blocks > 0:
            hit_blocks -= 1
        # Cached blocks sitting in the LRU are taken out of it, so they count against
        # the free blocks too; blocks already held by others cost nothing.
        from_lru = 0
        for h in block_hashes[:hit_blocks]:
            if h not in self._held:
                from_lru += 1
        fresh = need_total - hit_blocks
        if fresh + from_lru > self.free:
            return None
        alloc = Allocation()
        held, lru = self._held, self._lru
        for h in block_hashes[:hit_blocks]:
            if h in held:
                held[h] += 1
            else:
                del lru[h]
                held[h] = 1
                self.used += 1
            alloc.hashes.append(h)
        n_hashed = min(len(block_hashes), need_total) if self.enable_prefix_caching else 0
        ev = self.events if token_ids is not None else None
        run_start = -1
        for i in range(hit_blocks, need_total):
            self._take_empty()
            h = block_hashes[i] if i < n_hashed else None
            if h is not None and h not in held and h not in lru:
                held[h] = 1
                alloc.hashes.append(h)
                if ev is not None and run_start < 0:
                    run_start = i
            else:
                alloc.anon += 1
                if run_start >= 0:
                    self._stored(block_hashes, run_start, i, token_ids)
                    run_start = -1
        if run_start >= 0:
            self._stored(block_hashes, run_start, min(need_total, n_hashed), token_ids)
        if self.enable_prefix_caching:
            self.queries += tokens
            self.hits += hit_blocks * self.block_size
        return alloc, hit_blocks * self.block_size

    def grow(self, alloc: Allocation, n: int = 1) -> bool:
        """Give a running sequence ``n`` more blocks; False when there are not enough."""
        if n > self.free:
            return False
        for _ in range(n):
            self._take_empty()
        alloc.anon += n
        return True

    def release(self, alloc: Allocation) -> None:
        """Free a sequence's blocks; hashed ones stay reusable in the LRU.

        The last block goes into the LRU first, so it is evicted before the blocks it
        extends (vLLM frees a request's blocks in reverse for the same reason): a
        prefix is never cut from under a still cached tail.
        """
        held, lru = self._held, self._lru
        ev = self.events
        for h in reversed(alloc.hashes):
            r = held[h] - 1
            if r:
                held[h] = r
                continue
            del held[h]
            self.used -= 1
            if self.lru_capacity:
                lru[h] = None
                if len(lru) > self.lru_capacity:
                    old, _ = lru.popitem(last=False)
                    self._empty += 1
                    if ev is not None:
                        ev.append(removed(old))
            else:
                self._empty += 1
                if ev is not None:
                    ev.append(removed(h))
        self.used -= alloc.anon
        self._empty += alloc.anon
        alloc.hashes = []
        alloc.anon = 0

    def reset(self) -> bool:
        """Drop every cached prefix (vLLM's ``reset_prefix_cache``); False, changing
        nothing, while running sequences hold blocks."""
        if self.used:
            return False
        self._empty += len(self._lru)
        self._lru.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return True

    def _stored(self, block_hashes: list[int], start: int, end: int, token_ids: list[int]) -> None:
        bs = self.block_size
        self.events.append(
            stored(
                block_hashes[start:end],
                block_hashes[start - 1] if start else None,
                token_ids[start * bs : end * bs],
                bs,
            )
        )

    def _take_empty(self) -> None:
        if self._empty:
            self._empty -= 1
        else:
            # Evict the least recently freed cached block to make room.
            old, _ = self._lru.popitem(last=False)
            if self.events is not None:
                self.events.append(removed(old))
        self.used += 1
