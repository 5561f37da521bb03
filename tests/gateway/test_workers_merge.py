"""gateway/workers.py: how the workers' /metrics and /stats add up to the gateway's."""
from __future__ import annotations

from velocity_fast.config import EndpointConfig, load_settings
from velocity_fast.gateway.app import Gateway
from velocity_fast.gateway.workers import MERGE, merge_metrics, merge_stats, worker_count, worker_side


def _worker(requests: float, inflight: float, depth: float, bucket: float, hits: float, blocks: float) -> str:
    return "\n".join([
        "# HELP velocity_requests_total Requests answered, by route, status and band.",
        "# TYPE velocity_requests_total counter",
        f'velocity_requests_total{{route="/v1/completions",status="200",band="normal"}} {requests}',
        "# HELP velocity_endpoint_inflight Gateway requests in flight per endpoint.",
        "# TYPE velocity_endpoint_inflight gauge",
        f'velocity_endpoint_inflight{{endpoint="e1"}} {inflight}',
        "# HELP velocity_queue_depth Requests waiting in admission queues, by band.",
        "# TYPE velocity_queue_depth gauge",
        f'velocity_queue_depth{{band="low"}} {depth}',
        "# HELP velocity_ttft_seconds Time to first byte from arrival.",
        "# TYPE velocity_ttft_seconds histogram",
        f'velocity_ttft_seconds_bucket{{le="0.1"}} {bucket}',
        f'velocity_ttft_seconds_bucket{{le="+Inf"}} {bucket + 1}',
        f"velocity_ttft_seconds_sum {bucket * 0.05}",
        f"velocity_ttft_seconds_count {bucket + 1}",
        "# HELP velocity_prefix_hit_blocks_total Leading prompt blocks.",
        "# TYPE velocity_prefix_hit_blocks_total counter",
        f"velocity_prefix_hit_blocks_total {hits}",
        "# HELP velocity_prefix_blocks_total Prompt blocks dispatched.",
        "# TYPE velocity_prefix_blocks_total counter",
        f"velocity_prefix_blocks_total {blocks}",
        "# HELP velocity_prefix_index_hit_ratio Prefix-index hit ratio.",
        "# TYPE velocity_prefix_index_hit_ratio gauge",
        f"velocity_prefix_index_hit_ratio {hits / blocks}",
    ]) + "\n"


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, v = line.rpartition(" ")
            out[key] = float(v)
    return out


def test_counters_and_histograms_are_summed_gauges_by_their_row():
    merged = merge_metrics([_worker(3, 5, 2, 4, 1, 10), _worker(4, 7, 1, 6, 9, 10)])
    got = _samples(merged)
    assert got['velocity_requests_total{route="/v1/completions",status="200",band="normal"}'] == 7
    assert got['velocity_endpoint_inflight{endpoint="e1"}'] == 7      # shared: the largest
    assert got['velocity_queue_depth{band="low"}'] == 3               # per worker: summed
    assert got['velocity_ttft_seconds_bucket{le="0.1"}'] == 10
    assert got['velocity_ttft_seconds_bucket{le="+Inf"}'] == 12
    assert got["velocity_ttft_seconds_count"] == 12
    assert abs(got["velocity_ttft_seconds_sum"] - 0.5) < 1e-9
    assert got["velocity_prefix_index_hit_ratio"] == 0.5               # 10 hits of 20 blocks
    assert merged.count("# TYPE velocity_ttft_seconds histogram") == 1


def test_a_sample_only_one_worker_has_is_kept():
    one = '# TYPE velocity_upstream_errors_total counter\nvelocity_upstream_errors_total{endpoint="e1",kind="connect"} 2\n'
    got = _samples(merge_metrics([one, "# TYPE velocity_upstream_errors_total counter\n"]))
    assert got == {'velocity_upstream_errors_total{endpoint="e1",kind="connect"}': 2}


def test_every_metric_a_gateway_registers_has_a_row():
    settings = load_settings(None, {"endpoints": [EndpointConfig(name="e1", url="http://127.0.0.1:9", model="m")],
                                    "tenants": [{"name": "t", "tokens_per_minute": 100}]}, env={})
    gw = Gateway(settings)
    names = {line.split(" ")[2] for line in gw.registry.render().decode().splitlines()
             if line.startswith("# TYPE ")}
    assert names and sorted(names - set(MERGE)) == [], "metrics without a row in gateway/workers.py MERGE"


def test_stats_sum_numbers_take_the_largest_shared_values_and_merge_endpoints_by_name():
    a = {"policy": "dynamic", "uptime_seconds": 5.0,
         "endpoints": [{"name": "e1", "healthy": True, "inflight": 3, "limit": 8, "served": 10, "errors": 1},
                       {"name": "e2", "healthy": False, "inflight": 0, "limit": 8, "served": 0, "errors": 0}],
         "pools": {"m": ["e1", "e2"]},
         "admission": {"counters": {"admitted": 10, "in_flight": 2}, "bands": {"low": {"depth": 1, "ceiling": 0.8}}},
         "tenants": {"t": {"weight": 2.0, "rejections": {"rate-limit": 1}}}}
    b = {"policy": "dynamic", "uptime_seconds": 6.0,
         "endpoints": [{"name": "e1", "healthy": True, "inflight": 4, "limit": 8, "served": 7, "errors": 0},
                       {"name": "e2", "healthy": True, "inflight": 1, "limit": 9, "served": 2, "errors": 0}],
         "pools": {"m": ["e1", "e2"]},
         "admission": {"counters": {"admitted": 5, "in_flight": 1}, "bands": {"low": {"depth": 2, "ceiling": 0.8}}},
         "tenants": {"t": {"weight": 2.0, "rejections": {"rate-limit": 2, "sla": 1}}}}
    m = merge_stats([a, b])
    assert m["policy"] == "dynamic" and m["uptime_seconds"] == 6.0
    e1, e2 = m["endpoints"]
    assert (e1["name"], e1["served"], e1["errors"], e1["inflight"], e1["limit"]) == ("e1", 17, 1, 4, 8)
    assert (e2["healthy"], e2["served"], e2["limit"]) == (True, 2, 9)
    assert m["pools"] == {"m": ["e1", "e2"]}
    assert m["admission"]["counters"] == {"admitted": 15, "in_flight": 3}
    assert m["admission"]["bands"]["low"] == {"depth": 3, "ceiling": 0.8}
    assert m["tenants"]["t"] == {"weight": 2.0, "rejections": {"rate-limit": 3, "sla": 1}}


def test_worker_count_and_the_workers_orders():
    assert worker_count(load_settings(None, {"workers": "3"}, env={})) == 3
    assert worker_count(load_settings(None, {"workers": "auto"}, env={})) >= 1
    assert worker_side({}) is None
    side = worker_side({"VELOCITY_WORKER": "1", "VELOCITY_SHARED": "/dev/shm/x", "VELOCITY_WORKER_PORT": "8000",
                        "VELOCITY_WORKER_FD": "7"})
    assert (side.index, side.shared, side.port, side.report_fd) == (1, "/dev/shm/x", 8000, 7)
