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
