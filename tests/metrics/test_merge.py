"""metrics/merge.py: how the workers' /metrics add up to the gateway's, each family by the
rule its metric declared where it was registered (the exposition carries it)."""

from __future__ import annotations

import pytest

from velocity_fast.config import EndpointConfig, load_settings
from velocity_fast.gateway.app import Gateway
from velocity_fast.metrics.merge import merge_metrics
from velocity_fast.metrics.registry import Registry, ratio


def _gateway_rules() -> dict[str, str]:
    """Each family's rule as a gateway declares it (what its workers write on ``/metrics?merge``)."""
    settings = load_settings(
        None, {"endpoints": [EndpointConfig(name="e1", url="http://127.0.0.1:9", model="m")]}, env={}
    )
    text = Gateway(settings).registry.render(merge_rules=True).decode()
    return {p[2]: p[3] for line in text.splitlines() if line.startswith("# MERGE ") for p in [line.split(" ", 3)]}


RULES = _gateway_rules()


def _family(name: str, kind: str, help: str, *samples: str) -> list[str]:
    return [f"# MERGE {name} {RULES[name]}", f"# HELP {name} {help}", f"# TYPE {name} {kind}", *samples]


def _worker(requests: float, inflight: float, depth: float, bucket: float, hits: float, blocks: float) -> str:
    return (
        "\n".join(
            [
                *_family(
                    "velocity_requests_total",
                    "counter",
                    "Requests answered, by route, status and band.",
                    f'velocity_requests_total{{route="/v1/completions",status="200",band="normal"}} {requests}',
                ),
                *_family(
                    "velocity_endpoint_inflight",
                    "gauge",
                    "Gateway requests in flight per endpoint.",
                    f'velocity_endpoint_inflight{{endpoint="e1"}} {inflight}',
                ),
                *_family(
                    "velocity_queue_depth",
                    "gauge",
                    "Requests waiting in admission queues, by band.",
                    f'velocity_queue_depth{{band="low"}} {depth}',
                ),
                *_family(
                    "velocity_ttft_seconds",
                    "histogram",
                    "Time to first byte from arrival.",
                    f'velocity_ttft_seconds_bucket{{le="0.1"}} {bucket}',
                    f'velocity_ttft_seconds_bucket{{le="+Inf"}} {bucket + 1}',
                    f"velocity_ttft_seconds_sum {bucket * 0.05}",
                    f"velocity_ttft_seconds_count {bucket + 1}",
                ),
                *_family(
                    "velocity_prefix_hit_blocks_total",
                    "counter",
                    "Leading prompt blocks.",
                    f"velocity_prefix_hit_blocks_total {hits}",
                ),
                *_family(
                    "velocity_prefix_blocks_total",
                    "counter",
                    "Prompt blocks dispatched.",
                    f"velocity_prefix_blocks_total {blocks}",
                ),
                *_family(
                    "velocity_prefix_index_hit_ratio",
                    "gauge",
                    "Prefix-index hit ratio.",
                    f"velocity_prefix_index_hit_ratio {hits / blocks}",
                ),
            ]
        )
        + "\n"
    )


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, v = line.rpartition(" ")
            out[key] = float(v)
    return out


def test_counters_and_histograms_are_summed_gauges_by_their_declared_rule():
    merged = merge_metrics([_worker(3, 5, 2, 4, 1, 10), _worker(4, 7, 1, 6, 9, 10)])
    got = _samples(merged)
    assert got['velocity_requests_total{route="/v1/completions",status="200",band="normal"}'] == 7
    assert got['velocity_endpoint_inflight{endpoint="e1"}'] == 7  # shared: the largest
    assert got['velocity_queue_depth{band="low"}'] == 3  # per worker: summed
    assert got['velocity_ttft_seconds_bucket{le="0.1"}'] == 10
    assert got['velocity_ttft_seconds_bucket{le="+Inf"}'] == 12
    assert got["velocity_ttft_seconds_count"] == 12
    assert abs(got["velocity_ttft_seconds_sum"] - 0.5) < 1e-9
    assert got["velocity_prefix_index_hit_ratio"] == 0.5  # 10 hits of 20 blocks
    assert merged.count("# TYPE velocity_ttft_seconds histogram") == 1
    assert "# MERGE" not in merged  # the rules are for the merge, not for the gateway's scrapers


def test_a_sample_only_one_worker_has_is_kept():
    one = '# TYPE velocity_upstream_errors_total counter\nvelocity_upstream_errors_total{endpoint="e1",kind="connect"} 2\n'
    got = _samples(merge_metrics([one, "# TYPE velocity_upstream_errors_total counter\n"]))
    assert got == {'velocity_upstream_errors_total{endpoint="e1",kind="connect"}': 2}


def test_a_rule_the_merge_does_not_know_is_refused_where_the_metric_is_declared():
    reg = Registry()
    with pytest.raises(ValueError, match="merge rule 'median'"):
        reg.gauge("t_level", "t", merge="median")
    with pytest.raises(ValueError, match="merge rule 'ratio t_hits_total'"):
        reg.gauge_fn("t_ratio", "t", lambda: 0.0, merge="ratio t_hits_total")
    assert reg.names() == []
    reg.gauge_fn("t_ratio", "t", lambda: 0.0, merge=ratio("t_hits_total", "t_total"))
    assert "# MERGE t_ratio ratio t_hits_total t_total\n" in reg.render(merge_rules=True).decode()
    assert "# MERGE" not in reg.render().decode()  # a plain scrape: the text format alone
