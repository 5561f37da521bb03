"""The compiled metric values (metrics/values.pyx) against plain Python, and what a
scrape shows of them."""

from __future__ import annotations

import bisect
import math

from hypothesis import given
from hypothesis import strategies as st

from velocity_fast.metrics.registry import DEFAULT_BUCKETS, Registry

_values = st.one_of(
    st.floats(min_value=-1e6, max_value=1e6),
    st.sampled_from(DEFAULT_BUCKETS),
    st.sampled_from([math.nan, math.inf, -math.inf]),
)


@given(st.lists(_values, max_size=60))
def test_histogram_buckets_count_as_bisect_does(values):
    reg = Registry()
    h = reg.histogram("t_seconds", "t", ("band",))
    child = h.labels("high")
    expect = [0] * (len(DEFAULT_BUCKETS) + 1)
    for v in values:
        child.observe(v)
        expect[bisect.bisect_left(DEFAULT_BUCKETS, v)] += 1
    assert child.counts == expect and child.count == len(values)
    finite = [v for v in values if not math.isnan(v)]
    if len(finite) == len(values) and not any(math.isinf(v) for v in values):
        assert math.isclose(child.sum, math.fsum(values), rel_tol=1e-9, abs_tol=1e-9)


def test_a_scrape_shows_counters_gauges_and_cumulative_buckets():
    reg = Registry()
    c = reg.counter("t_requests_total", "r", ("code",))
    g = reg.gauge("t_inflight", "i")
    h = reg.histogram("t_latency_seconds", "l", buckets=(0.1, 1.0))
    c.labels(200).inc()
    c.labels(200).inc(2)
    g.inc(5)
    g.dec()
    g.set(7)
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    text = reg.render().decode()
    assert 't_requests_total{code="200"} 3.0' in text
    assert "t_inflight 7.0" in text and g.get() == 7.0
    assert 't_latency_seconds_bucket{le="0.1"} 2.0' in text
    assert 't_latency_seconds_bucket{le="1.0"} 3.0' in text
    assert 't_latency_seconds_bucket{le="+Inf"} 4.0' in text
    assert "t_latency_seconds_sum 3.65" in text and "t_latency_seconds_count 4.0" in text
