"""How the sim engine schedules, seen from outside as a router sees it: batch limit,
KV exhaustion, prefix caching, disconnects, time scale. Real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import time

from tests.support.sim import http_request, open_request, sim_engine


async def snapshot(eng) -> dict[str, float]:
    """Every unlabelled-or-summed sample of one /metrics scrape, by sample name."""
    r = await http_request(eng.port, "GET", "/metrics")
    out: dict[str, float] = {}
    for line in r.body.decode().splitlines():
        if line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        sample = head.partition("{")[0]
        out[sample] = out.get(sample, 0.0) + float(value)
    return out


async def metric(eng, name: str, **labels) -> float:
    r = await http_request(eng.port, "GET", "/metrics")
    total, found = 0.0, False
    for line in r.body.decode().splitlines():
        if line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        sample, _, lab = head.partition("{")
        if sample == name and all(f'{k}="{v}"' in lab for k, v in labels.items()):
            total += float(value)
            found = True
    assert found, name
    return total


async def wait_for_metric(eng, name: str, pred, timeout: float = 5.0, **labels) -> float:
    deadline = time.monotonic() + timeout
    while True:
        v = await metric(eng, name, **labels)
        if pred(v):
            return v
        assert time.monotonic() < deadline, f"{name} stayed at {v}"
        await asyncio.sleep(0.01)


async def run_stream(port: int, body: dict) -> tuple[float, float, list[str]]:
    """(time to first content chunk, total time, token texts) of one streamed request."""
    t0 = time.monotonic()
    ttft = None
    texts: list[str] = []
    s = await open_request(port, "POST", "/v1/completions", {**body, "stream": True})
    try:
        assert s.status == 200
        async for ev in s.events():
            if ev == "[DONE]":
                break
            c = json.loads(ev)
            if c["choices"] and c["choices"][0]["text"]:
                if ttft is None:
                    ttft = time.monotonic() - t0
                texts.append(c["choices"][0]["text"])
    finally:
        await s.close()
    return ttft, time.monotonic() - t0, texts


async def test_at_most_max_num_seqs_run_at_once():
    with sim_engine("--max-num-seqs", "3", time_scale=10) as eng:
        tasks = [
            asyncio.create_task(run_stream(eng.port, {"prompt": f"request {i}", "max_tokens": 40})) for i in range(8)
        ]
        try:
            seen = []
            while not all(t.done() for t in tasks) and len(seen) < 500:
                m = await snapshot(eng)
                seen.append((m["vllm:num_requests_running"], m["vllm:num_requests_waiting"]))
                await asyncio.sleep(0.005)
            results = await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
        assert max(r for r, _ in seen) == 3
        assert max(w for _, w in seen) >= 3  # the others queue
        assert all(len(r[2]) == 40 for r in results)
        assert await metric(eng, "vllm:request_success_total", finished_reason="length") == 8


async def test_kv_exhaustion_makes_requests_wait():
    # 56 blocks of 16 tokens; each prompt is 300 tokens (19 blocks with the slot for its
    # first output token), growing to 25 blocks by its 100th token. Two fit; the third
    # waits for blocks although batch slots are free.
    with sim_engine("--num-gpu-blocks", "56", "--max-model-len", "896", time_scale=10) as eng:
        prompts = [chr(ord("a") + i) * 1200 for i in range(3)]
        tasks = [asyncio.create_task(run_stream(eng.port, {"prompt": p, "max_tokens": 100})) for p in prompts]
        try:
            seen = []
            while not all(t.done() for t in tasks) and len(seen) < 1000:
                m = await snapshot(eng)
                seen.append(
                    (m["vllm:num_requests_running"], m["vllm:num_requests_waiting"], m["vllm:kv_cache_usage_perc"])
                )
                await asyncio.sleep(0.005)
            results = await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
        assert any(r == 2 and w == 1 and kv > 0.6 for r, w, kv in seen), seen[:20]
        assert max(r for r, _, _ in seen) <= 2
        assert all(len(r[2]) == 100 for r in results)
        assert await metric(eng, "vllm:num_preemptions_total") == 0
        assert await wait_for_metric(eng, "vllm:kv_cache_usage_perc", lambda v: v == 0) == 0


async def test_prefix_cache_hit_lowers_ttft_and_counts_hits():
    # 2000-token prompt at 5000 tok/s prefill: ~0.4 s cold (0.2 s at time scale 2);
    # the second time all but the last block comes from the cache.
    prompt = "".join(f"line {i:05d} of a long shared system prompt.\n" for i in range(200))[:8000]
    with sim_engine(time_scale=2) as eng:
        cold, _, _ = await run_stream(eng.port, {"prompt": prompt, "max_tokens": 2})
        hits_before = await metric(eng, "vllm:prefix_cache_hits_total")
        warm, _, _ = await run_stream(eng.port, {"prompt": prompt, "max_tokens": 2})
        hits_after = await metric(eng, "vllm:prefix_cache_hits_total")
        other, _, _ = await run_stream(eng.port, {"prompt": "X" + prompt[1:], "max_tokens": 2})
        hits_other = await metric(eng, "vllm:prefix_cache_hits_total")
        queries = await metric(eng, "vllm:prefix_cache_queries_total")
    assert hits_before == 0
    assert hits_after - hits_before >= 1900
    assert hits_other == hits_after  # a different first block shares nothing
    assert queries >= 3 * 2000
    assert warm * 3 < cold, (cold, warm)
    assert other * 3 > cold, (cold, other)


async def test_prefix_caching_can_be_turned_off():
    prompt = "z" * 4000
    with sim_engine("--no-enable-prefix-caching", time_scale=5) as eng:
        for _ in range(2):
            await run_stream(eng.port, {"prompt": prompt, "max_tokens": 1})
        assert await metric(eng, "vllm:prefix_cache_hits_total") == 0


async def test_stream_disconnect_aborts_and_frees_blocks():
    with sim_engine(time_scale=10) as eng:
        s = await open_request(
            eng.port, "POST", "/v1/completions", {"prompt": "p" * 400, "max_tokens": 2000, "stream": True}
        )
        got = 0
        async for ev in s.events():
            got += 1
            if got == 3:
                break
        assert await metric(eng, "vllm:num_requests_running") == 1
        assert await metric(eng, "vllm:kv_cache_usage_perc") > 0
        s.abort()
        await wait_for_metric(eng, "vllm:num_requests_running", lambda v: v == 0)
        assert await metric(eng, "vllm:kv_cache_usage_perc") == 0
        assert await metric(eng, "vllm:request_success_total", finished_reason="abort") == 1
        # tokens stop: the generation counter no longer moves
        g1 = await metric(eng, "vllm:generation_tokens_total")
        await asyncio.sleep(0.05)
        assert await metric(eng, "vllm:generation_tokens_total") == g1


async def test_non_streaming_disconnect_aborts():
    with sim_engine(time_scale=10) as eng:
        # open_request waits for the head, which a non-streamed answer sends only at the
        # end; so write the request by hand and drop the connection mid-generation.
        reader, writer = await asyncio.open_connection("127.0.0.1", eng.port)
        body = json.dumps({"prompt": "q" * 400, "max_tokens": 2000}).encode()
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        await wait_for_metric(eng, "vllm:num_requests_running", lambda v: v == 1)
        writer.transport.abort()
        await wait_for_metric(eng, "vllm:num_requests_running", lambda v: v == 0)
        assert await metric(eng, "vllm:kv_cache_usage_perc") == 0
        assert await metric(eng, "vllm:request_success_total", finished_reason="abort") == 1


async def test_disconnect_while_waiting_and_during_prefill():
    # One slot; a slow prefill (100 tok/s) keeps the first request in prefill while the
    # second waits. Dropping both empties the engine.
    with sim_engine("--max-num-seqs", "1", "--prefill-tps", "100", time_scale=10) as eng:
        a = await open_request(
            eng.port, "POST", "/v1/completions", {"prompt": "a" * 4000, "max_tokens": 5, "stream": True}
        )
        b = await open_request(
            eng.port, "POST", "/v1/completions", {"prompt": "b" * 40, "max_tokens": 5, "stream": True}
        )
        await wait_for_metric(eng, "vllm:num_requests_waiting", lambda v: v == 1)
        assert await metric(eng, "vllm:num_requests_running") == 1
        b.abort()
        await wait_for_metric(eng, "vllm:num_requests_waiting", lambda v: v == 0)
        a.abort()
        await wait_for_metric(eng, "vllm:num_requests_running", lambda v: v == 0)
        assert await metric(eng, "vllm:kv_cache_usage_perc") == 0
        assert await metric(eng, "vllm:generation_tokens_total") == 0  # a never left prefill
        assert await metric(eng, "vllm:request_success_total", finished_reason="abort") == 2


async def test_time_scale_speeds_everything_proportionally():
    body = {"prompt": "t" * 8000, "max_tokens": 50}
    # 2000 prompt tokens at 5000 tok/s + 50 tokens at 50 tok/s: ~1.4 s of simulated
    # time, of which ~0.4 s before the first token. Time scales 2 and 8: 4x apart.
    with sim_engine(time_scale=2) as slow:
        ttft_slow, total_slow, _ = await run_stream(slow.port, body)
    with sim_engine(time_scale=8) as fast:
        ttft_fast, total_fast, _ = await run_stream(fast.port, body)
    assert 0.5 < total_slow < 2.0, total_slow
    assert 2.0 < total_slow / total_fast < 8.0, (total_slow, total_fast)
    assert 2.0 < ttft_slow / ttft_fast < 8.0, (ttft_slow, ttft_fast)  # prefill scales too


async def test_preemption_when_running_sequences_outgrow_the_cache():
    # 20 blocks; two sequences start small and grow past what both can hold, so the
    # newer one is preempted (recomputed later) and both still finish in full.
    with sim_engine("--num-gpu-blocks", "20", "--max-model-len", "320", time_scale=20) as eng:
        results = await asyncio.gather(
            *(run_stream(eng.port, {"prompt": f"{i}" * 40, "max_tokens": 250}) for i in range(2))
        )
        assert [len(r[2]) for r in results] == [250, 250]
        assert await metric(eng, "vllm:num_preemptions_total") >= 1
        assert await metric(eng, "vllm:kv_cache_usage_perc") == 0
