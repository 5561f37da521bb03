"""Endpoint.running_cap: the batch admission learns from an engine's gauges, published
for the router's hot-spot guard (its estimate of the queue this gateway makes there)."""

from __future__ import annotations

import time

import pytest

from velocity_fast.admission.controller import Admission
from velocity_fast.admission.settings import AdmissionSettings
from velocity_fast.fleet.endpoint import Endpoint, Pool

pytestmark = pytest.mark.timeout(30)


def test_running_cap_is_the_batch_admission_learned():
    ep = Endpoint("e0", "http://127.0.0.1:9", "m")
    ep.healthy = True
    adm = Admission(AdmissionSettings(aimd_max=32), {"m": Pool("m", [ep])}, policy="dynamic")
    adm.stats()  # admission takes the pool's endpoints in (as at its first request)

    def scrape(running, waiting):
        ep.running, ep.waiting, ep.kv_usage, ep.scraped_at = running, waiting, 0.1, time.monotonic()
        adm.on_metrics(ep)

    scrape(5, 0)
    assert ep.running_cap == 0  # never seen full: unknown, however much it runs
    scrape(12, 3)
    assert ep.running_cap == 0  # one scrape with a queue may be a burst between steps
    scrape(12, 4)
    assert ep.running_cap == 12  # a queue a scrape later beside 12 running: its batch
    scrape(8, 0)
    assert ep.running_cap == 12  # fewer running, nobody waiting: still 12
    scrape(9, 2)
    assert ep.running_cap == 12  # a wait at fewer (the step's token budget): still 12
