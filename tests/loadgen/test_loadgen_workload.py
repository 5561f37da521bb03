"""The seeded workload: identical bytes for the same seed, the mix honoured, flags parsed."""

import argparse
from collections import Counter

import msgspec
import orjson
import pytest

from velocity_fast.loadgen.flags import add_loadgen_arguments
from velocity_fast.loadgen.mix import Mix, load_mix, mix_from_args, parse_bands, parse_dist
from velocity_fast.loadgen.workload import WorkloadConfig, build_workload


def args_of(*argv):
    p = argparse.ArgumentParser()
    add_loadgen_arguments(p)
    return p.parse_args(list(argv))


def cfg(**kw):
    base = dict(num_requests=400, pattern="poisson", duration=10.0, seed=42)
    base.update(kw)
    return WorkloadConfig(**base)


MIX = mix_from_args(
    args_of(
        "--bands",
        "high:1:1500,low:3",
        "--tenants",
        "alpha:1,beta:1",
        "--prompt-tokens",
        "uniform:16:64",
        "--output-tokens",
        "normal:50:10",
        "--prefix-groups",
        "2",
        "--prefix-tokens",
        "32",
        "--prefix-share",
        "0.5",
        "--stream-share",
        "0.25",
        "--sessions",
        "5",
    )
)


def test_same_seed_same_bytes_other_seed_other_bytes():
    a = build_workload(cfg(), MIX)
    b = build_workload(cfg(), MIX)
    assert [(s.at, s.wire) for s in a] == [(s.at, s.wire) for s in b]
    c = build_workload(cfg(seed=43), MIX)
    assert [s.wire for s in a] != [s.wire for s in c]


def test_pattern_changes_times_not_bodies():
    a = build_workload(cfg(pattern="poisson"), MIX)
    b = build_workload(cfg(pattern="burst"), MIX)
    assert [s.body for s in a] == [s.body for s in b]
    assert [s.at for s in a] != [s.at for s in b]


def test_mix_is_honoured_in_headers_and_bodies():
    specs = build_workload(cfg(api_key="k1"), MIX)
    bands = Counter(s.headers["x-velocity-priority"] for s in specs)
    assert bands["low"] / len(specs) == pytest.approx(0.75, abs=0.07)
    assert set(Counter(s.headers["x-velocity-tenant"] for s in specs)) == {"alpha", "beta"}
    assert all(s.headers["authorization"] == "Bearer k1" for s in specs)
    # Only the band with its own SLA sends it; the default SLA is not sent.
    assert all(("x-velocity-sla-ms" in s.headers) == (s.band == "high") for s in specs)
    assert all(s.sla_ms == (1500 if s.band == "high" else 3000) for s in specs)
    assert len({s.headers["x-session-id"] for s in specs}) == 5
    streamed = sum(s.stream for s in specs) / len(specs)
    assert streamed == pytest.approx(0.25, abs=0.07)
    for s in specs:
        body = orjson.loads(s.body)
        assert body["stream"] is s.stream
        assert ("stream_options" in body) is s.stream
        assert body.get("max_tokens", 0) == s.max_tokens  # 0: sent without, as most clients
        assert s.wire.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
        assert s.wire.endswith(b"\r\n\r\n" + s.body)
    lens = [len(orjson.loads(s.body)["messages"][0]["content"]) for s in specs if s.prefix_group < 0]
    assert min(lens) >= 16 * 4 - 4 and max(lens) <= 64 * 4 + 4


def test_the_default_mix_writes_bodies_as_real_clients_do():
    """The default mix: a share of the requests sends no max_tokens (nor ignore_eos, so the
    engine ends the reply), a share vLLM's default "priority": 0, a share a temperature and a
    stop list; each share as configured, on its own random stream (the prompts, bands and
    times do not move with it), and all 0 sends the plain bodies."""
    from velocity_fast.loadgen.mix import PLAIN_CLIENTS, Clients
    from velocity_fast.loadgen.workload import STOPS, TEMPERATURES

    specs = build_workload(cfg(), MIX)
    bodies = [orjson.loads(s.body) for s in specs]
    n = len(specs)
    free = [b for b in bodies if "max_tokens" not in b]
    assert len(free) / n == pytest.approx(Mix().clients.no_max_tokens, abs=0.07)
    assert all("ignore_eos" not in b for b in free)
    assert all(s.max_tokens == 0 for s, b in zip(specs, bodies) if "max_tokens" not in b)
    assert all(b["ignore_eos"] is True and b["max_tokens"] >= 1 for b in bodies if "max_tokens" in b)
    zero = [b for b in bodies if "priority" in b]
    assert len(zero) / n == pytest.approx(Mix().clients.priority_zero, abs=0.07)
    assert all(b["priority"] == 0 for b in zero)
    sampled = [b for b in bodies if "temperature" in b]
    assert len(sampled) / n == pytest.approx(Mix().clients.sampling, abs=0.07)
    assert all(b["temperature"] in TEMPERATURES and b["stop"] in STOPS for b in sampled)
    assert all(("stop" in b) == ("temperature" in b) for b in bodies)
    # Each kind on its own: the shares cross.
    assert any("max_tokens" not in b and "priority" in b and "stop" in b for b in bodies)
    plain_mix = msgspec.structs.replace(MIX, clients=PLAIN_CLIENTS)
    plain = build_workload(cfg(), plain_mix)
    for s, p in zip(specs, plain):
        b = orjson.loads(p.body)
        assert set(b) == {"messages", "max_tokens", "stream", "ignore_eos"} | (
            {"stream_options"} if p.stream else set()
        )
        assert b["messages"] == orjson.loads(s.body)["messages"] and (p.at, p.band, p.stream) == (
            s.at,
            s.band,
            s.stream,
        )
    only_free = build_workload(cfg(), msgspec.structs.replace(MIX, clients=Clients(1.0, 0.0, 0.0)))
    assert all("max_tokens" not in orjson.loads(s.body) and s.max_tokens == 0 for s in only_free)
    # /generate is the gateway's own API: its body stays as it was.
    gen = build_workload(cfg(route="generate", num_requests=50), Mix())
    assert all(set(orjson.loads(s.body)) == {"prompt", "max_tokens", "stream"} for s in gen)


def test_client_shares_come_from_flags_and_files_and_are_checked(tmp_path):
    m = mix_from_args(args_of("--no-max-tokens-share", "0.5", "--priority-zero-share", "0", "--sampling-share", "1"))
    assert (m.clients.no_max_tokens, m.clients.priority_zero, m.clients.sampling) == (0.5, 0.0, 1.0)
    f = tmp_path / "mix.yaml"
    f.write_text("clients: {no_max_tokens: 0.9}\n")
    m = mix_from_args(args_of("--mix", str(f), "--sampling-share", "0"))
    assert (m.clients.no_max_tokens, m.clients.priority_zero, m.clients.sampling) == (0.9, 0.3, 0.0)
    with pytest.raises(ValueError, match="clients.no_max_tokens must be within"):
        mix_from_args(args_of("--no-max-tokens-share", "1.5"))
    f.write_text("clients: {no_max_token: 0.9}\n")
    with pytest.raises(ValueError, match="no_max_token"):
        load_mix(str(f))


def test_prefix_groups_share_exact_leading_bytes_and_nothing_else():
    specs = build_workload(cfg(), MIX)
    content = {s.index: orjson.loads(s.body)["messages"][0]["content"] for s in specs}
    groups = {}
    for s in specs:
        if s.prefix_group >= 0:
            groups.setdefault(s.prefix_group, []).append(content[s.index])
    assert set(groups) == {0, 1}
    for texts in groups.values():
        prefix = texts[0][: 32 * 4]
        assert all(t.startswith(prefix) for t in texts)
    assert groups[0][0][:64] != groups[1][0][:64]
    plain = [content[s.index] for s in specs if s.prefix_group < 0]
    assert len({t[:40] for t in plain}) == len(plain)


def test_routes_and_model():
    comp = build_workload(cfg(route="completions", model="m1", num_requests=3), Mix())
    assert orjson.loads(comp[0].body)["model"] == "m1"
    assert "prompt" in orjson.loads(comp[0].body)
    gen = build_workload(cfg(route="generate", num_requests=3, base_path="/api"), Mix())
    assert gen[0].path == "/api/generate"
    assert set(orjson.loads(gen[0].body)) == {"prompt", "max_tokens", "stream"}


def test_distribution_flags():
    assert parse_dist("100").dist == "constant"
    d = parse_dist("uniform:10:20")
    import random

    rng = random.Random(0)
    assert all(10 <= d.sample(rng) <= 20 for _ in range(200))
    ln = parse_dist("lognormal:200:0.5")
    vals = sorted(ln.sample(rng) for _ in range(2001))
    assert vals[1000] == pytest.approx(200, rel=0.15)
    for bad in ("uniform:5", "zipf:3", "normal:a:b", "uniform:9:1"):
        with pytest.raises(ValueError):
            parse_dist(bad)
    with pytest.raises(ValueError):
        parse_bands("high:x")


def test_mix_yaml_and_flag_override(tmp_path):
    f = tmp_path / "mix.yaml"
    f.write_text(
        "bands: {high: 1, low: 4}\n"
        "tenants: [{name: alpha, api_key: key-alpha}]\n"
        "output_tokens: {dist: uniform, low: 8, high: 16}\n"
        "prefix: {groups: 1, tokens: 8, share: 1.0}\n"
        "stream_share: 0.5\n"
    )
    mix = load_mix(str(f))
    assert [b.name for b in mix.bands] == ["high", "low"]
    specs = build_workload(cfg(api_key="global"), mix)
    assert all(s.headers["authorization"] == "Bearer key-alpha" for s in specs)
    assert all(8 <= s.max_tokens <= 16 for s in specs if s.max_tokens)  # 0: sent without one
    over = mix_from_args(args_of("--mix", str(f), "--stream", "--output-tokens", "5"))
    assert over.stream_share == 1.0 and over.output_tokens.value == 5
    assert [b.name for b in over.bands] == ["high", "low"]


@pytest.mark.parametrize(
    "text,word",
    [
        ("bandz: []\n", "bandz"),
        ("stream_share: 2\n", "stream_share"),
        ("prompt_tokens: {dist: zipf}\n", "zipf"),
        ("prefix: {share: 0.5}\n", "prefix"),
    ],
)
def test_bad_mix_file_names_the_problem(tmp_path, text, word):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(ValueError, match=word):
        load_mix(str(f))
