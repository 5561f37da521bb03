"""fairness: locality in the band queues: among the tenants within the bound of the
least-served one, the request whose prefix an engine with room holds goes first; past
the bound, or in plain token mode, the least-served tenant goes first."""

from __future__ import annotations

import pytest

from velocity_fast.admission.bands import BandQueues


class Waiter:
    def __init__(self, name: str, cached: float) -> None:
        self.name = name
        self.cached = cached

    def prefix_cached(self) -> float:
        return self.cached


def _queues(mode: str, bound: float, ahead: float) -> BandQueues:
    """Tenant "cold" (least served, nothing cached) and "warm" (``ahead`` more served, its
    prefix cached), one request each."""
    q = BandQueues([(0, 0, 0.0)], modes=[mode], locality_bound=bound)
    q.locality_from_waiters()  # each Waiter says how its prefix stands
    q.charge_tenant(0, "warm", ahead)
    q.enqueue(Waiter("cold", 0.0), "cold", 0, 40, 1.0, 1e9, 0.0)
    q.enqueue(Waiter("warm", 1.0), "warm", 0, 40, 1.0, 1e9, 0.0)
    return q


@pytest.mark.parametrize(
    "mode,bound,ahead,first",
    [
        ("locality", 100.0, 50.0, "warm"),  # within the bound: the cached prefix goes first
        ("locality", 100.0, 150.0, "cold"),  # past it: the least served
        ("tokens", 100.0, 50.0, "cold"),  # plain counter: the least served
    ],
)
def test_locality_prefers_a_cached_prefix_within_the_bound(mode, bound, ahead, first):
    q = _queues(mode, bound, ahead)
    assert q.fairness_of(0) == mode
    assert q.pop(0, 0.0).waiter.name == first


def test_locality_holds_fairness_within_its_bound():
    """A tenant whose prefix is always cached is preferred only while its counter is
    within the bound of the other's: the other is never left behind by more."""
    q = BandQueues([(0, 0, 0.0)], modes=["locality"], locality_bound=300.0)
    q.locality_from_waiters()
    served = {"warm": 0, "cold": 0}
    for i in range(200):
        q.enqueue(Waiter("warm", 1.0), "warm", 0, 400, 50.0, 1e9, 0.0)  # each costs 100 + 2 x 50
        q.enqueue(Waiter("cold", 0.0), "cold", 0, 400, 50.0, 1e9, 0.0)
    gap = 0.0
    while len(q):
        it = q.pop(0, 0.0)
        served[it.tenant] += 1
        warm, cold = q.tenant_queue(0, "warm").vtc, q.tenant_queue(0, "cold").vtc
        if q.tenant_queue(0, "warm").count and q.tenant_queue(0, "cold").count:
            gap = max(gap, abs(warm - cold))
    assert gap <= 300.0 + 2 * 200.0
    assert served == {"warm": 200, "cold": 200}


def test_fairness_modes_per_band_and_their_errors():
    q = BandQueues([(0, 0, 0.0), (0, 0, 0.0)], modes=["rr", "locality"])
    assert [q.fairness_of(0), q.fairness_of(1)] == ["rr", "locality"]
    with pytest.raises(ValueError, match="modes"):
        BandQueues([(0, 0, 0.0)], modes=["lottery"])
    with pytest.raises(ValueError, match="locality_bound"):
        BandQueues([(0, 0, 0.0)], modes=["locality"], locality_bound=-1.0)


def test_settings_take_locality_globally_or_per_band_and_name_a_bad_key():
    from velocity_fast.admission.errors import AdmissionConfigError
    from velocity_fast.admission.policies import make_policy
    from velocity_fast.admission.settings import AdmissionSettings, BandSettings

    s = AdmissionSettings(fairness="locality", fairness_locality_bound=500.0).validate()
    q = make_policy("dynamic", s).make_queues(s)
    assert [q.fairness_of(i) for i in range(3)] == ["locality"] * 3 and q.locality_bound == 500.0
    bands = [BandSettings(name="high", ceiling=1.5, fairness="rr"), BandSettings(name="normal", ceiling=1.0)]
    s = AdmissionSettings(bands=bands, fairness="tokens").validate()
    q = make_policy("dynamic", s).make_queues(s)
    assert [q.fairness_of(0), q.fairness_of(1)] == ["rr", "tokens"]
    with pytest.raises(AdmissionConfigError, match=r"bands\[1\]\.fairness"):
        AdmissionSettings(bands=[bands[0], BandSettings(name="n", ceiling=1.0, fairness="lottery")]).validate()
    with pytest.raises(AdmissionConfigError, match="fairness_locality_bound"):
        AdmissionSettings(fairness_locality_bound=-1.0).validate()
