"""Reading an engine's /metrics (docs/design.md, "Where each contract lives"): the three gauges by configurable
names, data-parallel ranks, the cache config labels, and text that is not quite clean."""

from __future__ import annotations

import pytest

from velocity_fast.fleet.scrape import MetricNames, pace_between, parse_engine_metrics

VLLM_TEXT = b"""\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B"} 4.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B"} 2.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B"} 0.6
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B"} 0.2
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",num_gpu_blocks="27648"} 1.0
# HELP vllm:num_requests_running_total not a gauge we read, a longer name sharing the prefix
vllm:num_requests_running_total 999.0
vllm:prefix_cache_hits_total{engine="0",model_name="meta-llama/Llama-3.1-8B"} 1234.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="m"} 7.0
"""


def test_vllm_exposition_summed_over_ranks():
    m = parse_engine_metrics(VLLM_TEXT, MetricNames())
    assert m.running == 7.0
    assert m.waiting == 2.0
    assert m.kv_usage == pytest.approx(0.4), "a fraction per rank: averaged, not summed"
    assert (m.block_size, m.num_gpu_blocks) == (16, 27648)
    assert m.found == 3


def test_older_kv_name_and_first_alternative_wins():
    old = b"vllm:gpu_cache_usage_perc 0.9\nvllm:num_requests_running 1\n"
    m = parse_engine_metrics(old, MetricNames())
    assert m.kv_usage == pytest.approx(0.9) and m.found == 2
    both = b"vllm:gpu_cache_usage_perc 0.9\nvllm:kv_cache_usage_perc 0.3\nvllm:gpu_cache_usage_perc 0.8\n"
    assert parse_engine_metrics(both, MetricNames()).kv_usage == pytest.approx(0.3), "not counted twice"


def test_configurable_names():
    names = MetricNames(
        running=["sglang:num_running_reqs"],
        waiting=["sglang:num_queue_reqs"],
        kv_usage=["sglang:token_usage"],
        cache_config=[],
    )
    text = (
        b'sglang:num_running_reqs{tp_rank="0"} 5\nsglang:num_queue_reqs{tp_rank="0"} 8\n'
        b'sglang:token_usage{tp_rank="0"} 0.75\nvllm:num_requests_running 100\n'
    )
    m = parse_engine_metrics(text, names)
    assert (m.running, m.waiting, m.kv_usage, m.found) == (5.0, 8.0, 0.75, 3)


def test_missing_gauges_are_not_found():
    m = parse_engine_metrics(b"# nothing here\nother_metric 1\n", MetricNames())
    assert m.found == 0 and (m.running, m.waiting, m.kv_usage) == (0.0, 0.0, 0.0)
    assert m.num_gpu_blocks is None and m.block_size is None
    assert parse_engine_metrics(b"", MetricNames()).found == 0


def test_timestamps_crlf_spaces_in_labels_and_scientific_values():
    text = (
        b'vllm:num_requests_running{model_name="my model"} 3 1700000000000\r\n'
        b"vllm:num_requests_waiting  1.2e1\r\n"
        b'vllm:kv_cache_usage_perc{engine="0"} 5e-1 1700000000000'
    )
    m = parse_engine_metrics(text, MetricNames())
    assert (m.running, m.waiting, m.kv_usage) == (3.0, 12.0, 0.5)


def test_unusable_samples_are_skipped():
    text = (
        b"vllm:num_requests_running NaN\nvllm:num_requests_waiting +Inf\n"
        b"vllm:kv_cache_usage_perc garbage\nvllm:kv_cache_usage_perc{engine=\"1\"} 0.4\n"
        b"vllm:num_requests_running\n"
    )
    m = parse_engine_metrics(text, MetricNames())
    assert m.running == 0.0 and m.waiting == 0.0
    assert m.kv_usage == pytest.approx(0.4)
    assert m.found == 1


def test_cache_config_with_float_labels_and_without_labels():
    m = parse_engine_metrics(b'vllm:cache_config_info{num_gpu_blocks="512.0",block_size="32"} 1\n', MetricNames())
    assert (m.block_size, m.num_gpu_blocks) == (32, 512)
    m = parse_engine_metrics(b"vllm:cache_config_info 1\n", MetricNames())
    assert m.num_gpu_blocks is None


def test_metric_names_refuse_unknown_keys():
    import msgspec

    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"runing": ["x"]}, MetricNames)


ITL = b"""\
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.025",model_name="m"} 90.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 2.5
vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 100.0
vllm:inter_token_latency_seconds_sum{engine="1",model_name="m"} 1.5
vllm:inter_token_latency_seconds_count{engine="1",model_name="m"} 50.0
vllm:time_per_output_token_seconds_sum 99.0
vllm:time_per_output_token_seconds_count 1.0
"""


def test_the_inter_token_latency_histogram_sum_and_count_over_ranks_current_name_first():
    m = parse_engine_metrics(ITL, MetricNames())
    assert (m.itl_sum, m.itl_count) == (4.0, 150.0), "the old name beside the new one is not read"
    old = parse_engine_metrics(
        b"vllm:time_per_output_token_seconds_sum 3.0\nvllm:time_per_output_token_seconds_count 100\n", MetricNames()
    )
    assert (old.itl_sum, old.itl_count) == (3.0, 100.0)
    half = parse_engine_metrics(b"vllm:inter_token_latency_seconds_sum 3.0\n", MetricNames())
    assert half.itl_sum is None and half.itl_count is None, "a sum without its count is no pace"
    assert parse_engine_metrics(VLLM_TEXT, MetricNames()).itl_count is None


def test_pace_is_the_sums_growth_over_the_counts():
    assert pace_between((4.0, 150.0), (6.0, 250.0)) == pytest.approx(0.02)
    assert pace_between(None, (6.0, 250.0)) == 0.0  # a first reading
    assert pace_between((6.0, 250.0), (6.0, 250.0)) == 0.0  # no token in between
    assert pace_between((6.0, 250.0), (0.5, 10.0)) == 0.0  # the engine restarted


async def test_each_scrape_gives_the_tokens_decoded_since_the_last():
    """The health checker sets ``ep.decoded``: the inter-token histogram's count grown since
    the scrape before (the tokens the engine decoded: saturation's proof that a step ran);
    -1 on the first reading, after a restart (the count went back) and without the histogram."""
    from velocity_fast.fleet.endpoint import Endpoint
    from velocity_fast.fleet.health import EndpointMonitor, HealthSettings

    def text(count):
        return (
            b"vllm:num_requests_running 2\nvllm:num_requests_waiting 3\n"
            b"vllm:inter_token_latency_seconds_sum 1.0\n"
            b"vllm:inter_token_latency_seconds_count %d\n" % count
        )

    class Upstream:
        body = b""

        async def fetch(self, method, path, timeout=None):
            return 200, self.body

    ep = Endpoint("a", "http://127.0.0.1:1", "m")
    ep.upstream = Upstream()
    mon = EndpointMonitor(HealthSettings(), lambda ep, state: None, lambda ep: None)
    seen = []
    for body in (text(10), text(10), text(26), text(4), b"vllm:num_requests_running 2\n"):
        ep.upstream.body = body
        await mon._scrape(ep)
        seen.append(ep.decoded)
    assert seen == [-1.0, 0.0, 16.0, -1.0, -1.0]
