"""The compiled prefix index against a plain-Python model of per-endpoint LRUs."""

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from velocity_fast.routing.prefix import BlockHashes, PrefixIndex


class ModelIndex:
    """What the index must behave like: one OrderedDict LRU per endpoint (most recent last)."""

    def __init__(self, default_capacity):
        self.default = default_capacity
        self.lru: dict[str, OrderedDict] = {}
        self.cap: dict[str, int] = {}

    def _ensure(self, name):
        if name not in self.lru:
            self.lru[name] = OrderedDict()
            self.cap[name] = self.default

    def touch(self, name, keys):
        self._ensure(name)
        lru, cap = self.lru[name], self.cap[name]
        held = 0
        while held < len(keys) and keys[held] in lru:
            held += 1
        for k in reversed(keys):
            if cap == 0:
                break
            if k in lru:
                lru.move_to_end(k)
            else:
                if len(lru) >= cap:
                    lru.popitem(last=False)
                lru[k] = None
        return held

    def set_capacity(self, name, cap):
        self._ensure(name)
        self.cap[name] = cap
        lru = self.lru[name]
        while len(lru) > cap:
            lru.popitem(last=False)

    def remove(self, name):
        self.lru.pop(name, None)
        self.cap.pop(name, None)

    def matched(self, name, keys):
        lru = self.lru.get(name, {})
        n = 0
        while n < len(keys) and keys[n] in lru:
            n += 1
        return n


NAMES = ["a", "b", "c", "d"]
# A small key universe makes endpoints share hashes and probe runs collide; values
# with equal low bits land in the same buckets on purpose.
KEYS = st.one_of(st.integers(1, 300), st.integers(1, 40).map(lambda k: k << 20))
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("touch"), st.sampled_from(NAMES), st.lists(KEYS, max_size=40, unique=True)),
        st.tuples(st.just("cap"), st.sampled_from(NAMES), st.integers(0, 60)),
        st.tuples(st.just("remove"), st.sampled_from(NAMES), st.just(None)),
    ),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(OPS, st.lists(KEYS, max_size=30, unique=True), st.integers(0, 50))
def test_index_behaves_like_per_endpoint_lrus(ops, probe, default_capacity):
    ix = PrefixIndex(default_capacity)
    model = ModelIndex(default_capacity)
    for op, name, arg in ops:
        if op == "touch":
            assert ix.touch(name, BlockHashes.of(arg)) == model.touch(name, arg)
        elif op == "cap":
            ix.set_capacity(name, arg)
            model.set_capacity(name, arg)
        else:
            ix.remove(name)
            model.remove(name)
    for name in NAMES:
        want = list(reversed(model.lru.get(name, {})))
        assert ix.lru_keys(name) == want
        assert ix.size(name) == len(want)
    assert len(ix) == sum(len(v) for v in model.lru.values())
    matched = ix.match(BlockHashes.of(probe))
    for name in NAMES:
        slot = ix.slot_of(name)
        got = matched[slot] if 0 <= slot < len(matched) else 0
        assert got == model.matched(name, probe)


class WeightedModel:
    """Per-endpoint LRUs counted in blocks, touched one key at a time, last key first:
    the order and the evictions the index must give, however it gets there."""

    def __init__(self, capacity):
        self.capacity = capacity
        self.lru: dict[str, OrderedDict] = {}

    def touch(self, name, keys, weights):
        lru = self.lru.setdefault(name, OrderedDict())
        held = 0
        while held < len(keys) and keys[held] in lru:
            held += 1
        for k, w in reversed(list(zip(keys, weights))):
            if w == 0 or w > self.capacity:
                continue
            if k in lru:
                lru.move_to_end(k)
                continue
            while sum(lru.values()) + w > self.capacity and lru:
                lru.popitem(last=False)
            lru[k] = w
        return sum(weights[:held])


def _weights(n, fine, coarse, tail):
    return [1 if i < fine else (tail if tail and i == n - 1 else coarse) for i in range(n)]


# Chains that share their heads, as prompts do (a system prompt, a conversation's earlier
# turns): each is a cut of one of a few bases, then a tail of its own, so that a chain
# often finds its head leading an endpoint's list already and is spliced in behind it.
BASES = [[b * 1000 + i for i in range(1, 41)] for b in range(1, 4)]
CHAIN = st.tuples(st.integers(0, 2), st.integers(0, 40), st.lists(st.integers(500, 560), max_size=6, unique=True))
CHAIN_OPS = st.lists(st.tuples(st.sampled_from(NAMES[:2]), CHAIN), max_size=40)


@settings(max_examples=200, deadline=None)
@given(CHAIN_OPS, st.integers(1, 90), st.sampled_from([(1000, 1), (8, 3), (4, 5)]))
def test_chains_that_share_their_heads_keep_the_order_of_touching_each_key(ops, capacity, thin):
    """A chain whose leading keys head the endpoint's list already leaves them in place and
    goes in behind them (vp_head_run, vp_touch_chain), where no eviction can reach them;
    the order, the blocks held, the evictions and the held count returned are those of
    touching every key, last first, at every step, in blocks as thinned chains weigh."""
    ix = PrefixIndex(capacity)
    model = WeightedModel(capacity)
    after, factor = thin
    for name, (base, cut, own) in ops:
        keys = BASES[base][:cut] + [k for k in own if k not in BASES[base][:cut]]
        hashes = BlockHashes.of(keys)
        if factor > 1:
            hashes = hashes.thinned(after, factor)
        kept = hashes.tolist()
        weights = _weights(len(kept), hashes.fine, hashes.coarse, hashes.tail) if factor > 1 else [1] * len(kept)
        assert ix.touch(name, hashes) == model.touch(name, kept, weights)
        for n in NAMES[:2]:
            want = list(reversed(model.lru.get(n, {})))
            assert ix.lru_keys(n) == want, (n, keys)
            assert ix.size(n) == sum(model.lru.get(n, {}).values())
