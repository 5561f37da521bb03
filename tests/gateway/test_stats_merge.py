"""gateway/stats_merge.py: how the workers' /stats add up to the gateway's, the numbers
whole in every worker by the keys the parts of /stats declare."""

from __future__ import annotations

from velocity_fast.gateway.app import STATS_WHOLE
from velocity_fast.gateway.stats_merge import merge_stats, take_rules


def test_stats_sum_numbers_take_the_largest_shared_values_and_merge_endpoints_by_name():
    a = {
        "policy": "dynamic",
        "uptime_seconds": 5.0,
        "endpoints": [
            {"name": "e1", "healthy": True, "inflight": 3, "limit": 8, "served": 10, "errors": 1},
            {"name": "e2", "healthy": False, "inflight": 0, "limit": 8, "served": 0, "errors": 0},
        ],
        "pools": {"m": ["e1", "e2"]},
        "admission": {"counters": {"admitted": 10, "in_flight": 2}, "bands": {"low": {"depth": 1, "ceiling": 0.8}}},
        "tenants": {"t": {"weight": 2.0, "rejections": {"rate-limit": 1}}},
    }
    b = {
        "policy": "dynamic",
        "uptime_seconds": 6.0,
        "endpoints": [
            {"name": "e1", "healthy": True, "inflight": 4, "limit": 8, "served": 7, "errors": 0},
            {"name": "e2", "healthy": True, "inflight": 1, "limit": 9, "served": 2, "errors": 0},
        ],
        "pools": {"m": ["e1", "e2"]},
        "admission": {"counters": {"admitted": 5, "in_flight": 1}, "bands": {"low": {"depth": 2, "ceiling": 0.8}}},
        "tenants": {"t": {"weight": 2.0, "rejections": {"rate-limit": 2, "sla": 1}}},
    }
    m = merge_stats([a, b], STATS_WHOLE)
    assert m["policy"] == "dynamic" and m["uptime_seconds"] == 6.0
    e1, e2 = m["endpoints"]
    assert (e1["name"], e1["served"], e1["errors"], e1["inflight"], e1["limit"]) == ("e1", 17, 1, 4, 8)
    assert (e2["healthy"], e2["served"], e2["limit"]) == (True, 2, 9)
    assert m["pools"] == {"m": ["e1", "e2"]}
    assert m["admission"]["counters"] == {"admitted": 15, "in_flight": 3}
    assert m["admission"]["bands"]["low"] == {"depth": 3, "ceiling": 0.8}
    assert m["tenants"]["t"] == {"weight": 2.0, "rejections": {"rate-limit": 3, "sla": 1}}


def test_a_workers_declarations_are_taken_out_of_its_answer():
    answer = {"uptime_seconds": 5.0, "merge": {"largest": ["uptime_seconds", "limit"]}}
    assert take_rules(answer) == {"uptime_seconds", "limit"} and answer == {"uptime_seconds": 5.0}
    assert take_rules({"uptime_seconds": 5.0}) == frozenset()  # a worker that declares nothing: all summed
    assert take_rules({"merge": {"largest": "limit"}}) == frozenset()  # not a list: nothing declared
