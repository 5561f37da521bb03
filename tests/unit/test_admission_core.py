"""The compiled pieces of admission's request path (admission/controller.pyx) through their
Python faces: estimators, windows, leases, tickets and the clock they read."""
import time

import pytest

from velocity_fast.admission.controller import Admission, Ticket
from velocity_fast.admission.settings import AdmissionSettings
from velocity_fast.admission.estimators import Ewma, ServiceEstimate
from velocity_fast.admission.telemetry import percentiles
from velocity_fast.admission.telemetry import Window
from velocity_fast.metrics.registry import Registry
from velocity_fast.fleet.endpoint import Endpoint, Pool


def make(clock=time.monotonic, policy="dynamic"):
    ep = Endpoint("e0", "http://127.0.0.1:9000", "m")
    ep.healthy = True
    adm = Admission(AdmissionSettings(aimd_max=4, aimd_min=1), {"m": Pool("m", [ep])}, policy=policy,
                    registry=Registry(), clock=clock)
    return adm, ep


def test_ewma_is_unknown_until_its_first_sample_then_moves_by_alpha():
    e = Ewma(0.5)
    assert e.value is None and e.samples == 0
    e.observe(2.0)
    assert e.value == 2.0
    e.observe(4.0)
    assert e.value == 3.0 and e.samples == 2


def test_service_estimate_predicts_nothing_until_it_has_seen_a_request():
    s = ServiceEstimate(1.0)
    assert not s.known and s.predict(10) is None
    assert s.snapshot() == {"ttft_ms": None, "tpot_ms": None, "service_ms": None, "samples": 0}
    s.observe(None, 0.5, 10)           # no first byte seen: whole service time only
    assert s.known and s.predict(10) == 0.5 and s.tpot.value is None
    s.observe_first_byte(0.1)
    s.observe(0.1, 1.0, 10)            # 0.9 s over 9 tokens after the first
    assert s.predict(11) == pytest.approx(0.1 + 10 * 0.1)
    s.observe_first_byte(-1.0)         # a negative time is not learned
    assert s.ttft.samples == 1


def test_window_keeps_the_last_samples_oldest_first():
    w = Window(3)
    for x in range(5):
        w.append(float(x))
    assert list(w) == [2.0, 3.0, 4.0] and len(w) == 3
    assert percentiles(w, (50,)) == {"p50": 3000.0}
    empty = Window(0)
    empty.append(1.0)
    assert list(empty) == [] and percentiles(empty) == {}


async def test_a_release_with_an_unknown_outcome_is_refused_and_the_lease_stays_held():
    adm, ep = make()
    lease = await adm.admit(Ticket())
    lease.bind(ep)
    with pytest.raises(ValueError, match="outcome must be one of"):
        lease.release("maybe")
    assert not lease.done and ep.inflight == 1
    lease.release("cancelled")
    assert lease.done and ep.inflight == 0
    assert adm.stats()["counters"]["cancelled"] == 1


def test_ticket_defaults_count_as_vllm_does():
    t = Ticket(max_tokens=None, prompt_bytes=None)
    assert (t.band, t.tenant, t.sla_ms, t.max_tokens, t.prompt_bytes, t.model) == (None, None, None, 16, 0, None)
    with pytest.raises(ValueError):
        Ticket(max_tokens="many")


async def test_the_compiled_clock_is_the_process_monotonic_clock():
    # With time.monotonic the request path reads the clock in C: its readings must fall
    # between Python's, or queue times and TTFTs would mix two clocks.
    adm, ep = make()
    before = time.monotonic()
    lease = await adm.admit(Ticket())
    lease.bind(ep)
    lease.first_byte()
    after = time.monotonic()
    assert before <= lease.arrived_at <= lease.bound_at <= lease.first_byte_at <= after
    lease.release()


async def test_a_hand_driven_clock_is_still_obeyed():
    t = [500.0]
    adm, ep = make(clock=lambda: t[0])
    lease = await adm.admit(Ticket(sla_ms=100))
    assert lease.arrived_at == 500.0 and lease.deadline == pytest.approx(500.1)
    lease.bind(ep)
    t[0] = 500.25
    lease.first_byte()
    lease.release(tokens=4)
    stats = adm.stats()
    assert stats["sla"] == {"met": 0, "missed": 1, "compliance": 0.0}
    assert stats["latency_ms"]["ttft"]["p50"] == pytest.approx(250.0)
