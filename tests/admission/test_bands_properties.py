"""Property tests: under random operations nothing is lost or duplicated and the
counts and bytes always match the contents."""

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from velocity_fast.admission.bands import BandQueues

op = st.one_of(
    st.tuples(
        st.just("enq"),
        st.integers(0, 2),
        st.sampled_from("abcd"),
        st.integers(0, 50),
        st.integers(1, 100),
        st.one_of(st.just(math.inf), st.floats(0, 20)),
    ),
    st.tuples(st.just("pop"), st.integers(0, 2)),
    st.tuples(st.just("cancel"), st.integers(0, 60)),
    st.tuples(
        st.just("expire"),
    ),
    st.tuples(st.just("hopeless"), st.floats(0, 5)),
    st.tuples(st.just("tick"), st.floats(0, 2)),
)


def check(q, live):
    items = list(q)
    ids = [i.id for i in items]
    assert len(ids) == len(set(ids))
    assert set(ids) == set(live)
    assert len(q) == len(live)
    assert q.nbytes == sum(i.nbytes for i in items)
    for b in range(q.nbands):
        band = q.band(b)
        mine = [i for i in items if i.band == b]
        assert band.count == len(mine)
        assert band.nbytes == sum(i.nbytes for i in mine)
        assert band.active_tenants == len({i.tenant for i in mine})
    assert q.count <= 30 and q.nbytes <= 600


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(op, max_size=120), edf=st.booleans(), token=st.booleans(), aging=st.sampled_from([0.0, 0.5, 3.0]))
def test_random_operations_conserve_items(ops, edf, token, aging):
    q = BandQueues(
        [(12, 300, 4.0), (12, 0, 0.0), (12, 300, 2.0)],
        capacity=30,
        byte_capacity=600,
        edf=edf,
        token_fair=token,
        aging_step=aging,
    )
    now = 0.0
    live = {}
    seen_out = set()
    created = []
    for o in ops:
        kind = o[0]
        if kind == "enq":
            _, band, tenant, nbytes, tokens, dl = o
            rid = q.enqueue(object(), tenant, band, nbytes, tokens, dl, now)
            if rid > 0:
                assert rid not in live and rid not in seen_out
                live[rid] = band
                created.append(rid)
        elif kind == "pop":
            it = q.pop(o[1], now)
            if it is not None:
                assert it.id in live
                assert it.band == o[1] or q.effective_band(it, now) <= o[1]
                del live[it.id]
                seen_out.add(it.id)
            else:
                # Nothing native is left in that band.
                assert q.band(o[1]).count == 0
        elif kind == "cancel":
            if created:
                rid = created[o[1] % len(created)]
                it = q.cancel(rid)
                assert (it is not None) == (rid in live)
                if it is not None:
                    del live[rid]
                    seen_out.add(rid)
        elif kind == "expire":
            for it in q.expire(now):
                assert it.expires_at <= now
                del live[it.id]
                seen_out.add(it.id)
        elif kind == "hopeless":
            for it in q.pop_hopeless(now, o[1], 0.01):
                del live[it.id]
                seen_out.add(it.id)
        else:
            now += o[1]
        check(q, live)
    # Draining returns every remaining item exactly once.
    drained = []
    for b in range(q.nbands):
        while (it := q.pop(b, now)) is not None:
            drained.append(it.id)
    assert sorted(drained) == sorted(live)
    assert len(q) == 0 and q.nbytes == 0
