"""The gateway's per-request overhead against a direct connection and nginx, in one run.

Method
------
* One fast fixed-response upstream (bench/upstream_fixed.py, an "infinitely fast engine")
  runs in its own process pinned to the LOAD core, together with the load client.
* The proxy under test runs alone on the PROXY core, one at a time:
  - the gateway, `velocityllm serve` with one endpoint and the default settings
    (dynamic admission, routing, metrics: the whole scheduler path);
  - nginx `proxy_pass` with 1 worker and upstream keep-alive, when nginx is installed.
  The direct phase sends the same load to the upstream itself.
* The load client is `wrk` (when installed; 1 thread) or else the closed-loop client of
  bench/lib/load.py (the project's uvloop + httptools client, one request in flight per
  connection), each in its own process. Every request is a keep-alive
  POST /v1/chat/completions with a small body.
* Throughput: requests/s at 64 connections for --duration seconds per phase, after a
  short warm-up; --rounds rounds alternate the targets and the median is reported.
* Latency: p50/p99 at 1 connection; "added" is the target's figure minus direct's.
* CPU us/request: the proxy's own CPU time (utime+stime of every process of it, from
  /proc/PID/stat) over the throughput phase, divided by the requests it served.
* Busy %: how much of each pinned core the phase used (/proc/stat); "waited": the share
  of the phase the proxy was runnable but waiting for its core, which other work held
  (/proc/PID/task/*/schedstat); "others": the share of the load core that went to
  processes not ours (busy minus ours minus interrupts). A load core near 100 % means the
  figure may be bounded by the load side; large "waited" or "others" mean other work on
  the machine took the cores. Then req/s drops but CPU us/request barely moves: its ratio is the firm
  one, and 1e6 / (CPU us/request) estimates a whole core's req/s ("per core").
  --nice -10 (root) makes other work yield to the measured processes.
* --profile SECONDS samples the gateway under the same 64-connection load with py-spy
  (when installed) and prints the functions with the largest self and inclusive share.
* SSE relay (--stream-events N, default 32; 0 skips it; needs wrk): a second upstream
  answers `"stream": true` requests with N token events plus role, usage and [DONE],
  written --stream-interval-ms apart, so that the proxy relays them one read at a time.
  A fresh gateway (max-concurrency = connections: this phase prices the relay, not the
  queue) and nginx with `proxy_buffering off` relay them; reported: streams/s, events/s,
  CPU us per event and events per CPU-second ("per core") of each proxy.
  --stream-body-kb K sends a K KiB chat prompt with each stream (also after --body-kb's
  sweep, with the gateway's --policy: prefix affinity on), so that the relay is priced
  with what a real prompt costs the proxy on the way in.

Every process runs on 127.0.0.1 and is stopped at the end, also on error or Ctrl-C.
Usage::

    python -m bench.overhead [--duration 5] [--rounds 2] [--json out.json] [--profile 5]
    python -m bench.overhead --smoke [--json out.json]   # every phase for about a second: it works

--smoke runs every target and phase at the shortest length (wrk counts whole seconds);
its figures are too short to quote.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import sys
import tempfile
from pathlib import Path

from bench.lib import processes, pyspy
from bench.lib.bodies import BODY, STREAM_BODY, chat_body
from bench.lib.load import run_load
from bench.lib.processes import Procs
from bench.lib.procfs import CLK_TCK, core_times, cpu_model, cpu_ticks, runq_wait_ns
from bench.lib.targets import REPO, Target, nginx_version, start_gateway, start_nginx, start_upstream

# Goals (bench/README.md, "Goals"): the gateway's req/s at least half nginx's (the floor) and at
# least nginx's, its CPU per request at most nginx's.
TARGET_RPS_MIN = 0.5
GOAL_RPS = 1.0
GOAL_CPU = 1.0
LOAD_BOUND_BUSY = 0.9
# --smoke: each phase as short as the load client allows (CI: tests/bench/); flags given still win.
SMOKE = {"duration": 1.0, "rounds": 1, "latency_duration": 1.0, "warmup": 1.0, "stream_events": 8}

# -- phases ---------------------------------------------------------------------------------------------


def throughput(target: Target, args, work: Path, load_pids: list[int], body: bytes = BODY) -> dict:
    """One measured run at --connections against one target, with CPU accounting.

    A run that took far longer than asked (three times, and 5 s more) met a machine that
    stopped: a shared or virtual machine can pause every process for seconds, and the
    load client then counts each request in flight as timed out. Its figures measure the
    pause, not the proxy, so it is run once more, and the pause is recorded
    (``stalled_s``). A second such run stands, errors and all."""
    planned = float(max(1, round(args.duration))) if args.client == "wrk" else float(args.duration)
    out = _throughput_once(target, args, work, load_pids, body)
    if out["seconds"] > max(3 * planned, planned + 5):
        stalled = out["seconds"]
        print(
            f"overhead: a {planned:g} s run against {target.name} took {stalled:.1f} s (the machine paused); "
            "running it again",
            file=sys.stderr,
            flush=True,
        )
        out = _throughput_once(target, args, work, load_pids, body)
        out["stalled_s"] = stalled
    return out


def _throughput_once(target: Target, args, work: Path, load_pids: list[int], body: bytes) -> dict:
    cores0 = core_times()
    proxy0, wait0 = target.cpu_ticks(), target.runq_wait_ns()
    load0, lwait0 = sum(sum(cpu_ticks(p)) for p in load_pids), runq_wait_ns(load_pids)
    r = run_load(args.client, work, target.port, args.connections, args.duration, args.load_cpu, body)
    proxy1, wait1 = target.cpu_ticks(), target.runq_wait_ns()
    load1, lwait1 = sum(sum(cpu_ticks(p)) for p in load_pids), runq_wait_ns(load_pids)
    cores1 = core_times()
    served = r["requests"]
    wall = r["duration_s"]
    user_s = (proxy1[0] - proxy0[0]) / CLK_TCK
    sys_s = (proxy1[1] - proxy0[1]) / CLK_TCK
    proxy_s = user_s + sys_s
    load_s = (load1 - load0) / CLK_TCK + r["client_cpu_s"]
    out = {
        "rps": (served - r["non2xx"]) / wall if wall else 0.0,
        "requests": served,
        "non2xx": r["non2xx"],
        "errors": r["errors"],
        "seconds": round(wall, 3),
        "p50_us": r["p50_us"],
        "p99_us": r["p99_us"],
    }
    if target.pid is not None:
        out["cpu_us_per_req"] = proxy_s / served * 1e6 if served else None
        # The system part is mostly the kernel's socket work, which any proxy pays.
        out["user_us_per_req"] = user_s / served * 1e6 if served else None
        out["sys_us_per_req"] = sys_s / served * 1e6 if served else None
        out["proxy_cpu_share"] = proxy_s / wall if wall else None
    out["load_cpu_share"] = load_s / wall if wall else None
    # Runnable but not running: the share of the phase other work on its core took from the
    # proxy. The upstream's wait is mostly for the client beside it, so it is only recorded.
    if wait0 is not None and wait1 is not None and wall and target.pid is not None:
        out["proxy_runq_wait"] = (wait1 - wait0) / 1e9 / wall
    if lwait0 is not None and lwait1 is not None and wall:
        out["upstream_runq_wait"] = (lwait1 - lwait0) / 1e9 / wall
    for name, cpu, ours in (
        ("proxy_core", args.proxy_cpu, proxy_s if target.pid else 0.0),
        ("load_core", args.load_cpu, load_s),
    ):
        if cpu is None or cpu not in cores0 or (name == "proxy_core" and target.pid is None):
            continue
        busy = (cores1[cpu][0] - cores0[cpu][0]) / CLK_TCK
        irq = (cores1[cpu][1] - cores0[cpu][1]) / CLK_TCK
        total = (cores1[cpu][2] - cores0[cpu][2]) / CLK_TCK
        out[name + "_busy"] = busy / total if total else None
        out[name + "_foreign"] = max(0.0, busy - irq - ours) / total if total else None
    return out


def latency(target: Target, args, work: Path) -> dict:
    r = run_load(args.client, work, target.port, 1, args.latency_duration, args.load_cpu)
    return {
        "p50_us": r["p50_us"],
        "p99_us": r["p99_us"],
        "mean_us": r["mean_us"],
        "requests": r["requests"],
        "non2xx": r["non2xx"],
    }


def _median(rows: list[dict], key: str):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def profile_gateway(target: Target, args, work: Path) -> dict | None:
    """Sample the gateway with py-spy under the throughput load; top functions by self and total share."""
    raw = Path(args.profile_out) if args.profile_out else work / "gateway.prof.txt"
    return pyspy.profile(
        target.pid,
        args.profile,
        lambda: run_load(args.client, work, target.port, args.connections, args.profile, args.load_cpu),
        raw,
        native=args.profile_native,
        cpu=args.load_cpu,
        top=args.profile_top,
        keep=bool(args.profile_out),
    )


# -- report -----------------------------------------------------------------------------------------------


def stream_phase(procs: Procs, args, work: Path, res: dict) -> None:
    """SSE relay: streams of --stream-events events, one event per engine write, through the
    gateway and nginx; events relayed per second and per CPU-second of the proxy."""
    if args.client != "wrk":
        res["warnings"].append("the stream phase needs wrk (apt-get install wrk): skipped")
        return
    n = args.stream_events
    per_req = n + 3  # the role chunk, n tokens, the usage chunk, [DONE]
    kib = args.stream_body_kb
    body = chat_body(kib)[:-1] + b',"stream":true}' if kib else STREAM_BODY
    sdir = work / "stream"
    sdir.mkdir()
    up_p, up_port = start_upstream(
        procs, args.load_cpu, ["--stream-chunks", str(n), "--chunk-interval-ms", str(args.stream_interval_ms)]
    )
    # Admission may hold as many streams as there are connections: this phase prices the
    # relay, not the queue (the request phase above has the default limits).
    gw = start_gateway(
        procs, args.proxy_cpu, up_port, args.policy, sdir, [f"--max-concurrency={args.connections}", *args.gateway_arg]
    )
    targets = [Target("direct", up_port, None), gw]
    if not args.no_nginx:
        ng = start_nginx(procs, args.proxy_cpu, up_port, sdir, stream=True, big_bodies=bool(kib))
        if ng is not None:
            targets.append(ng)
    rows: dict[str, list[dict]] = {t.name: [] for t in targets}
    for t in targets:
        run_load(args.client, sdir, t.port, args.connections, args.warmup, args.load_cpu, body)
    for i in range(args.rounds):
        for t in targets if i % 2 == 0 else targets[::-1]:
            rows[t.name].append(throughput(t, args, sdir, [up_p.pid], body))
    out = {
        "events_per_stream": per_req,
        "interval_ms": args.stream_interval_ms,
        "prompt_bytes": len(body),
        "policy": args.policy,
        "targets": {},
    }
    for t in targets:
        r = rows[t.name]
        rps, cpu = _median(r, "rps"), _median(r, "cpu_us_per_req")
        entry = {
            "streams_per_s": rps,
            "events_per_s": rps * per_req if rps else None,
            "cpu_us_per_event": cpu / per_req if cpu else None,
            "rounds": r,
        }
        entry["events_per_core_s"] = 1e6 / entry["cpu_us_per_event"] if entry["cpu_us_per_event"] else None
        out["targets"][t.name] = entry
        bad = sum(x["non2xx"] + x["errors"] for x in r)
        if bad:
            res["warnings"].append(f"stream phase, {t.name}: {bad} non-2xx answers or transport errors")
    T = out["targets"]
    if "gateway" in T and "nginx" in T and T["gateway"]["cpu_us_per_event"] and T["nginx"]["cpu_us_per_event"]:
        res["ratios"]["gateway_vs_nginx_events_per_core"] = (
            T["gateway"]["events_per_core_s"] / T["nginx"]["events_per_core_s"]
        )
    res["stream"] = out


# -- prompt sizes (--body-kb) ----------------------------------------------------------------------

GOAL_SIZES_CPU = 1.25  # the gateway's CPU per request <= 1.25x nginx's at 16 and 256 KiB
GOAL_SIZES_RPS = 0.9  # and req/s >= 0.9x
GOAL_EXTRA_PER_KIB_US = 0.25  # the gateway's CPU per request may grow at most this much faster per KiB


def _slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys over xs (None with fewer than two distinct xs)."""
    pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
    if len({x for x, _ in pts}) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def _heap_env() -> dict[str, str]:
    """glibc's malloc thresholds as the gateway sets them at start (velocity_fast/server/heap.py),
    for --nginx-heap: nginx allocates each body's buffer with malloc too."""
    from velocity_fast.server.heap import MMAP_THRESHOLD, TRIM_THRESHOLD

    return {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}


def run_sizes(args) -> dict:
    """--body-kb: the gateway (--policy, smart unless given: prefix affinity on) and nginx
    (bodies in memory), each alone on the proxy core, at 64 connections, for chat bodies of
    each size; CPU per request against prompt size, and its slope per KiB."""
    res = _base_result(args)
    if args.client != "wrk":
        raise SystemExit("--body-kb needs wrk (apt-get install wrk): the fallback client sends one small body")
    procs = Procs()
    rows = []
    with tempfile.TemporaryDirectory(prefix="velocity-overhead-") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o755)
        try:
            up_p, up_port = start_upstream(procs, args.load_cpu)
            targets = [start_gateway(procs, args.proxy_cpu, up_port, args.policy, work, args.gateway_arg)]
            if not args.no_nginx:
                ng = start_nginx(procs, args.proxy_cpu, up_port, work, big_bodies=True)
                if ng is not None:
                    targets.append(ng)
                    if args.nginx_heap:
                        targets.append(
                            start_nginx(
                                procs,
                                args.proxy_cpu,
                                up_port,
                                work,
                                big_bodies=True,
                                name="nginx-heap",
                                env=_heap_env(),
                            )
                        )
            for kib in args.body_kb:
                body = chat_body(kib) if kib else BODY  # 0: the one-line request of the phases above
                for t in targets:  # warm-up: connections, the adaptive limit, the prefix index
                    run_load(args.client, work, t.port, args.connections, args.warmup, args.load_cpu, body)
                runs: dict[str, list[dict]] = {t.name: [] for t in targets}
                for i in range(args.rounds):
                    for t in targets if i % 2 == 0 else targets[::-1]:
                        runs[t.name].append(throughput(t, args, work, [up_p.pid], body))
                row = {"kib": kib, "bytes": len(body), "targets": {}}
                for t in targets:
                    r = runs[t.name]
                    row["targets"][t.name] = {
                        k: _median(r, k)
                        for k in (
                            "rps",
                            "cpu_us_per_req",
                            "user_us_per_req",
                            "sys_us_per_req",
                            "proxy_runq_wait",
                            "load_cpu_share",
                        )
                    } | {"rounds": r}
                    bad = sum(x["non2xx"] + x["errors"] for x in r)
                    if bad:
                        res["warnings"].append(f"{kib} KiB, {t.name}: {bad} non-2xx answers or transport errors")
                g = row["targets"].get("gateway")
                for ref, key in (("nginx", ""), ("nginx-heap", "heap_")):  # ratios to each reference
                    n = row["targets"].get(ref)
                    if g and n and n["rps"] and n["cpu_us_per_req"] and g["cpu_us_per_req"]:
                        row[key + "rps_ratio"] = g["rps"] / n["rps"]
                        row[key + "cpu_ratio"] = g["cpu_us_per_req"] / n["cpu_us_per_req"]
                rows.append(row)
            if args.stream_body_kb and args.stream_events > 0:
                stream_phase(procs, args, work, res)
        finally:
            procs.stop_all()
    out = {"policy": args.policy, "rows": rows, "us_per_kib": {}}
    for name in ("gateway", "nginx"):
        ys = [r["targets"].get(name, {}).get("cpu_us_per_req") for r in rows]
        if any(y is not None for y in ys):
            out["us_per_kib"][name] = _slope([r["bytes"] / 1024 for r in rows], ys)
    if out["us_per_kib"].get("gateway") is not None and out["us_per_kib"].get("nginx") is not None:
        out["extra_us_per_kib"] = out["us_per_kib"]["gateway"] - out["us_per_kib"]["nginx"]
    if args.plot:
        out["plot"] = _plot_sizes(rows, Path(args.plot), args.policy, res["warnings"])
    res["body_kb"] = out
    return res


def _plot_sizes(rows: list[dict], path: Path, policy: str, warnings: list[str]) -> str | None:
    """CPU per request against prompt size for each proxy, as a PNG; its path, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.append("matplotlib is not installed (the bench extra has it): no plot")
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, style in (("gateway", "o-"), ("nginx", "s--")):
        pts = [
            (r["bytes"] / 1024, r["targets"][name]["cpu_us_per_req"])
            for r in rows
            if r["targets"].get(name, {}).get("cpu_us_per_req") is not None
        ]
        if pts:
            label = f"gateway (--policy {policy})" if name == "gateway" else "nginx (bodies in memory)"
            ax.plot([x for x, _ in pts], [y for _, y in pts], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks([r["bytes"] / 1024 for r in rows], [str(r["kib"] or f"{r['bytes']} B") for r in rows])
    ax.set_xlabel("chat prompt (KiB of JSON)")
    ax.set_ylabel("CPU us per request (user + system)")
    ax.set_title("Proxy CPU per request against prompt size, 64 connections, one core")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def summarize_sizes(res: dict) -> str:
    h, c, out = res["host"], res["config"], res["body_kb"]
    lines = [
        f"Prompt sizes: chat bodies (a system prompt, then turns of about 1.5 KiB) through the gateway "
        f"(--policy {out['policy']}) and nginx (bodies in memory), each alone on core {h['proxy_cpu']}; "
        f"{c['connections']} connections x {c['duration']} s x {c['rounds']} round(s), client {c['client']}; "
        f"host {h['cpus']} CPU(s) {h['cpu_model']}, load average {h['loadavg']}; "
        f"nginx: {h['nginx'] or 'not installed (reference missing)'}"
    ]
    lines += ["warning: " + w for w in res["warnings"]]
    lines.append("")
    lines.append(
        f"{'KiB':>5} {'gw req/s':>9} {'ng req/s':>9} {'req/s':>6} {'gw CPU us':>9} {'ng CPU us':>9} "
        f"{'CPU':>6} {'gw usr/sys':>10} {'ng usr/sys':>10}"
    )
    for r in out["rows"]:
        g, n = r["targets"].get("gateway", {}), r["targets"].get("nginx", {})

        def split(t):
            return (
                f"{t['user_us_per_req']:.0f}/{t['sys_us_per_req']:.0f}" if t.get("user_us_per_req") is not None else "-"
            )

        lines.append(
            f"{r['kib']:>5} {_f(g.get('rps')):>9} {_f(n.get('rps')):>9} "
            f"{_f(r.get('rps_ratio'), '{:.2f}x'):>6} {_f(g.get('cpu_us_per_req'), '{:.1f}'):>9} "
            f"{_f(n.get('cpu_us_per_req'), '{:.1f}'):>9} {_f(r.get('cpu_ratio'), '{:.2f}x'):>6} "
            f"{split(g):>10} {split(n):>10}"
        )
    lines.append("")
    per = out["us_per_kib"]
    lines.append(
        "CPU us per request per KiB of prompt (least squares over the sizes): "
        + ", ".join(f"{k} {_f(v, '{:.3f}')}" for k, v in per.items())
    )
    if "extra_us_per_kib" in out:
        x = out["extra_us_per_kib"]
        lines.append(
            f"the gateway's extra CPU per KiB: {x:.3f} us (goal: at most {GOAL_EXTRA_PER_KIB_US} us a KiB "
            f"more than nginx: {'met' if x <= GOAL_EXTRA_PER_KIB_US else 'not yet'})"
        )
    for r in out["rows"]:
        if r["kib"] in (16, 256) and "cpu_ratio" in r:
            ok = r["cpu_ratio"] <= GOAL_SIZES_CPU and r["rps_ratio"] >= GOAL_SIZES_RPS
            lines.append(
                f"{r['kib']} KiB: gateway/nginx CPU {r['cpu_ratio']:.2f}x, req/s {r['rps_ratio']:.2f}x "
                f"(goal: CPU <= {GOAL_SIZES_CPU}x nginx's and req/s >= {GOAL_SIZES_RPS}x nginx's: "
                f"{'met' if ok else 'not yet'})"
            )
    for r in out["rows"]:
        nh = r["targets"].get("nginx-heap")
        if nh and "heap_cpu_ratio" in r:
            lines.append(
                f"{r['kib']} KiB, nginx given the gateway's malloc thresholds (--nginx-heap): "
                f"{nh['cpu_us_per_req']:.1f} us ({nh['user_us_per_req']:.0f}/{nh['sys_us_per_req']:.0f}), "
                f"{nh['rps']:.0f} req/s; gateway/that CPU {r['heap_cpu_ratio']:.2f}x, "
                f"req/s {r['heap_rps_ratio']:.2f}x"
            )
    if out.get("plot"):
        lines.append(f"plot: {out['plot']}")
    lines += _stream_lines(res)
    return "\n".join(lines)


def markdown_sizes(res: dict) -> str:
    """--markdown: the sweep as bench/README.md's table. The extra per KiB of a size is the
    gateway's CPU per request less nginx's, above that difference for the smallest
    request of the sweep, over the KiB between them: what each KiB of prompt costs the
    gateway beyond what it costs nginx."""
    rows = res["body_kb"]["rows"]
    small = min(rows, key=lambda r: r["bytes"])

    def gap(r):
        g, n = r["targets"].get("gateway", {}), r["targets"].get("nginx", {})
        if g.get("cpu_us_per_req") is None or n.get("cpu_us_per_req") is None:
            return None
        return g["cpu_us_per_req"] - n["cpu_us_per_req"]

    out = [
        "| prompt | gateway req/s | nginx req/s | req/s ratio | gateway CPU µs | nginx CPU µs | CPU ratio "
        "| extra µs per KiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        g, n = r["targets"].get("gateway", {}), r["targets"].get("nginx", {})
        size = f"{r['kib']} KiB" if r["kib"] else f"{r['bytes']} B"
        extra = "-"
        if r is not small and gap(r) is not None and gap(small) is not None:
            extra = f"{(gap(r) - gap(small)) / ((r['bytes'] - small['bytes']) / 1024):+.3f}"
        out.append(
            f"| {size} | {_f(g.get('rps'))} | {_f(n.get('rps'))} | {_f(r.get('rps_ratio'), '{:.2f}x')} "
            f"| {_f(g.get('cpu_us_per_req'), '{:.1f}')} | {_f(n.get('cpu_us_per_req'), '{:.1f}')} "
            f"| {_f(r.get('cpu_ratio'), '{:.2f}x')} | {extra} |"
        )
    return "\n".join(out)


def _stream_lines(res: dict) -> list[str]:
    st = res.get("stream")
    if not st:
        return []
    c = res["config"]
    lines = [
        "",
        f"SSE relay: {c['connections']} connections, streams of {st['events_per_stream']} events "
        f"written {st['interval_ms']} ms apart by the upstream (one event per read), "
        f"{st.get('prompt_bytes', 0)}-byte prompts, gateway --policy {st.get('policy')}:",
        f"{'target':<8} {'streams/s':>9} {'events/s':>9} {'CPU us/event':>12} {'events/s per core':>17}",
    ]
    for name, t in st["targets"].items():
        lines.append(
            f"{name:<8} {_f(t['streams_per_s']):>9} {_f(t['events_per_s']):>9} "
            f"{_f(t['cpu_us_per_event'], '{:.1f}'):>12} {_f(t['events_per_core_s']):>17}"
        )
    r = res["ratios"].get("gateway_vs_nginx_events_per_core")
    lines.append(f"gateway/nginx SSE events per core: {_f(r, '{:.2f}x')} (goal >= 1.0x)")
    return lines


def _f(v, fmt: str = "{:.0f}") -> str:
    return "-" if v is None else fmt.format(v)


def summarize(res: dict) -> str:
    """The printed report: the method, the host, one row per target, the ratios, warnings, profile."""
    lines = [__doc__.split("Every process runs")[0].strip(), ""]
    h, c = res["host"], res["config"]
    lines.append(
        f"Host: {h['cpus']} CPU(s) {h['cpu_model']}, python {h['python']}, load average {h['loadavg']}; "
        f"proxy core {h['proxy_cpu']}, load core {h['load_cpu']}; client {c['client']}; "
        f"{c['connections']} connections x {c['duration']} s x {c['rounds']} round(s), nice {c['nice']}; "
        f"nginx: {h['nginx'] or 'not installed (reference missing)'}"
    )
    # Warnings before the table and the ratios last, so that a log's tail holds the figures.
    lines += ["warning: " + w for w in res["warnings"]]
    lines.append("")
    hdr = (
        f"{'target':<10} {'req/s@64':>9} {'CPU us/req':>10} {'usr/sys':>9} {'p50@1 us':>9} {'p99@1 us':>9} "
        f"{'+p50 us':>8} {'+p99 us':>8} {'proxy core':>10} {'load core':>9} {'waited':>7} {'others':>7}"
        f"  rounds req/s"
    )
    lines.append(hdr)
    direct = res["targets"].get("direct")
    for name, t in res["targets"].items():
        lat = t["latency"]
        add50 = lat["p50_us"] - direct["latency"]["p50_us"] if name != "direct" else None
        add99 = lat["p99_us"] - direct["latency"]["p99_us"] if name != "direct" else None
        waited = _f(t.get("proxy_runq_wait"), "{:.0%}")
        others = _f(t.get("load_core_foreign"), "{:.0%}")
        split = f"{t['user_us_per_req']:.0f}/{t['sys_us_per_req']:.0f}" if t.get("user_us_per_req") is not None else "-"
        lines.append(
            f"{name:<10} {_f(t['rps']):>9} {_f(t.get('cpu_us_per_req'), '{:.1f}'):>10} {split:>9} "
            f"{_f(lat['p50_us']):>9} {_f(lat['p99_us']):>9} {_f(add50):>8} {_f(add99):>8} "
            f"{_f(t.get('proxy_core_busy'), '{:.0%}'):>10} {_f(t.get('load_core_busy'), '{:.0%}'):>9} "
            f"{waited:>7} {others:>7}  {' '.join(_f(r['rps']) for r in t['rounds'])}"
        )
    lines.append("")
    ratios = res["ratios"]
    lines.append(f"gateway/direct req/s: {_f(ratios.get('gateway_vs_direct_rps'), '{:.2f}x')}")
    per_core = [f"{n} {1e6 / t['cpu_us_per_req']:.0f}" for n, t in res["targets"].items() if t.get("cpu_us_per_req")]
    if per_core:
        lines.append("req/s per core from CPU time: " + ", ".join(per_core))
    if "gateway_vs_nginx_rps" in ratios:
        r_rps, r_cpu = ratios["gateway_vs_nginx_rps"], ratios.get("gateway_vs_nginx_cpu")
        lines.append(
            f"gateway/nginx req/s: {r_rps:.2f}x  (floor: gateway req/s >= {TARGET_RPS_MIN}x nginx's: "
            f"{'met' if r_rps >= TARGET_RPS_MIN else 'NOT met'}; goal: gateway req/s >= {GOAL_RPS}x nginx's: "
            f"{'met' if r_rps >= GOAL_RPS else 'not yet'})"
        )
        lines.append(
            f"gateway/nginx CPU us/req: {_f(r_cpu, '{:.2f}x')}  "
            f"(goal: gateway CPU per request <= {GOAL_CPU}x nginx's: "
            f"{'met' if r_cpu is not None and r_cpu <= GOAL_CPU else 'not yet'})"
        )
    else:
        lines.append("gateway/nginx: nginx is not installed, so the reference is missing (apt-get install nginx-light)")
    for key, v in ratios.items():
        if key.startswith("workers_") and key.endswith("_cpu"):
            n, one = key.split("_")[1], key.split("_")[3]
            lines.append(
                f"gateway {n} workers / {one}: CPU us/req {v:.2f}x (goal <= 1.10x: "
                f"{'met' if v <= 1.10 else 'NOT met'}), req/s {ratios[key[:-3] + 'rps']:.2f}x "
                f"(every worker shares the proxy core with the others here: req/s is bounded by "
                f"that one core, and by the load core's client and upstream, not by the workers)"
            )
    lines += _stream_lines(res)
    prof = res.get("profile")
    if prof:
        lines.append("")
        if "error" in prof:
            lines.append("profile: " + prof["error"])
        else:
            kept = f"; collapsed stacks in {prof['raw']}" if prof["raw"] else ""
            lines.append(f"Gateway profile under load ({prof['samples']} py-spy samples{kept}):")
            # A share of the samples times the gateway's CPU us/request: what each costs a request.
            cpu = (res["targets"].get("gateway") or {}).get("cpu_us_per_req") or 0.0
            lines.append("  self %   ~us/req  function")
            lines += [f"  {pct:6.1f}   {pct * cpu / 100:7.1f}  {f}" for f, pct in prof["self"]]
            lines.append("  total %  ~us/req  function (a coroutine's stack may be cut where it was resumed)")
            lines += [f"  {pct:6.1f}   {pct * cpu / 100:7.1f}  {f}" for f, pct in prof["inclusive"]]
    return "\n".join(lines)


def _base_result(args) -> dict:
    """The run's config, host and warnings (the cores checked, the load client chosen)."""
    allowed = os.sched_getaffinity(0)
    warnings: list[str] = []
    if args.proxy_cpu not in allowed or args.load_cpu not in allowed or args.proxy_cpu == args.load_cpu:
        warnings.append(
            f"cores {args.proxy_cpu}/{args.load_cpu} are not two distinct usable CPUs "
            f"(have {sorted(allowed)}): running unpinned, the figures mix proxy and load"
        )
        args.proxy_cpu = args.load_cpu = None
    if args.client == "auto":
        args.client = "wrk" if shutil.which("wrk") else "python"
    elif args.client == "wrk" and not shutil.which("wrk"):
        raise SystemExit("wrk is not installed (apt-get install wrk), use --client python")
    return {
        "config": {k: v for k, v in vars(args).items() if not k.startswith("_")},
        "host": {
            "cpus": os.cpu_count(),
            "cpu_model": cpu_model(),
            "python": platform.python_version(),
            "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg()),
            "proxy_cpu": args.proxy_cpu,
            "load_cpu": args.load_cpu,
            "nginx": None if args.no_nginx else nginx_version(),
        },
        "targets": {},
        "ratios": {},
        "warnings": warnings,
    }


def run(args) -> dict:
    """Start everything, measure every target, stop everything; the figures as a dict."""
    if args.body_kb:
        return run_sizes(args)
    res = _base_result(args)
    warnings = res["warnings"]
    procs = Procs()
    with tempfile.TemporaryDirectory(prefix="velocity-overhead-") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o755)
        try:
            up_p, up_port = start_upstream(procs, args.load_cpu)
            targets = [Target("direct", up_port, None)]
            # One gateway per --workers count: "gateway" the first, "gateway-Nw" the others
            # (their CPU is the supervisor's and every worker's: the process tree).
            for n in args.workers:
                t = start_gateway(
                    procs,
                    args.proxy_cpu,
                    up_port,
                    args.policy,
                    work,
                    [*args.gateway_arg, *(["--workers", str(n)] if n > 1 else [])],
                )
                if n != args.workers[0]:
                    t.name = f"gateway-{n}w"
                targets.append(t)
            if not args.no_nginx:
                ng = start_nginx(procs, args.proxy_cpu, up_port, work)
                if ng is not None:
                    targets.append(ng)
            rounds: dict[str, list[dict]] = {t.name: [] for t in targets}
            for t in targets:  # warm-up: connections, the gateway's adaptive limit, caches
                run_load(args.client, work, t.port, args.connections, args.warmup, args.load_cpu)
            for i in range(args.rounds):
                order = targets if i % 2 == 0 else targets[::-1]
                for t in order:
                    rounds[t.name].append(throughput(t, args, work, [up_p.pid]))
            for t in targets:
                rows = rounds[t.name]
                entry = {"rounds": rows}
                for key in (
                    "rps",
                    "cpu_us_per_req",
                    "user_us_per_req",
                    "sys_us_per_req",
                    "p50_us",
                    "p99_us",
                    "proxy_core_busy",
                    "load_core_busy",
                    "proxy_core_foreign",
                    "load_core_foreign",
                    "load_cpu_share",
                    "proxy_runq_wait",
                    "upstream_runq_wait",
                ):
                    entry[key] = _median(rows, key)
                entry["latency"] = latency(t, args, work)
                res["targets"][t.name] = entry
                bad = sum(r["non2xx"] + r["errors"] for r in rows)
                if bad:
                    warnings.append(f"{t.name}: {bad} non-2xx answers or transport errors under load")
                if t.name != "direct" and (entry["load_cpu_share"] or 0) >= LOAD_BOUND_BUSY:
                    warnings.append(
                        f"{t.name}: the upstream and the client used {entry['load_cpu_share']:.0%} "
                        f"of the load core, so its req/s may be bounded by the load side"
                    )
                waited, foreign = entry["proxy_runq_wait"] or 0, entry["load_core_foreign"] or 0
                if waited > 0.05 or foreign > 0.1:
                    warnings.append(
                        f"{t.name}: other work on the machine took the cores (proxy waited {waited:.0%} "
                        f"for its core, {foreign:.0%} of the load core went to others), so req/s is "
                        f"below capacity; CPU us/req and req/s per core hold. For req/s rerun on a "
                        f"quiet machine or with --nice -10"
                    )
            if args.profile > 0:
                gw = next(t for t in targets if t.name == "gateway")
                res["profile"] = profile_gateway(gw, args, work)
            if args.stream_events > 0:
                stream_phase(procs, args, work, res)
        finally:
            procs.stop_all()
    T = res["targets"]
    for n in args.workers[1:]:
        w = T.get(f"gateway-{n}w")
        if w and T.get("gateway") and T["gateway"]["cpu_us_per_req"] and w["cpu_us_per_req"]:
            res["ratios"][f"workers_{n}_vs_{args.workers[0]}_cpu"] = (
                w["cpu_us_per_req"] / T["gateway"]["cpu_us_per_req"]
            )
            res["ratios"][f"workers_{n}_vs_{args.workers[0]}_rps"] = w["rps"] / T["gateway"]["rps"]
    if "gateway" in T and "direct" in T and T["direct"]["rps"]:
        res["ratios"]["gateway_vs_direct_rps"] = T["gateway"]["rps"] / T["direct"]["rps"]
    if "gateway" in T and "nginx" in T:
        res["ratios"]["gateway_vs_nginx_rps"] = T["gateway"]["rps"] / T["nginx"]["rps"]
        if T["gateway"]["cpu_us_per_req"] and T["nginx"]["cpu_us_per_req"]:
            res["ratios"]["gateway_vs_nginx_cpu"] = T["gateway"]["cpu_us_per_req"] / T["nginx"]["cpu_us_per_req"]
    return res


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=5.0, help="seconds per throughput phase (default 5)")
    p.add_argument("--rounds", type=int, default=2, help="throughput rounds per target, median reported (default 2)")
    p.add_argument("--latency-duration", type=float, default=3.0, help="seconds of the 1-connection phase")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds of warm-up load per target")
    p.add_argument("--connections", type=int, default=64)
    p.add_argument(
        "--client",
        choices=("auto", "wrk", "python"),
        default="auto",
        help="load client: wrk when installed, else the Python one of bench.lib.load (auto)",
    )
    p.add_argument("--proxy-cpu", type=int, default=0, help="core of the gateway and nginx (default 0)")
    p.add_argument("--load-cpu", type=int, default=1, help="core of the upstream and the client (default 1)")
    p.add_argument(
        "--policy",
        default=None,
        choices=("dynamic", "static", "smart"),
        help="the gateway's policy (default dynamic; smart with --body-kb: prefix affinity on)",
    )
    p.add_argument(
        "--body-kb",
        default=None,
        metavar="LIST",
        help="instead of the phases above, the prompt-size sweep: chat bodies of these sizes in KiB "
        "(e.g. 0,1,16,64,256; 0 is the one-line request), gateway and nginx req/s and CPU per "
        "request, and a PNG plot",
    )
    p.add_argument(
        "--markdown",
        action="store_true",
        help="with --body-kb: then bench/README.md's table of the gateway against nginx",
    )
    p.add_argument(
        "--plot",
        default=None,
        metavar="PATH",
        help="--body-kb's plot of CPU per request against prompt size (default bench/results/overhead_body_kb.png)",
    )
    p.add_argument(
        "--gateway-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an extra flag for `velocityllm serve` (repeatable), e.g. --gateway-arg=--max-concurrency=64",
    )
    p.add_argument(
        "--nginx-heap",
        action="store_true",
        help="with --body-kb: also nginx given the gateway's glibc malloc thresholds "
        "(velocity_fast/server/heap.py), as a third target",
    )
    p.add_argument("--no-nginx", action="store_true", help="skip the nginx reference")
    p.add_argument(
        "--profile",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="then sample the gateway with py-spy under load for this long",
    )
    p.add_argument(
        "--profile-native",
        action="store_true",
        help="py-spy --native: include C frames (stops the gateway at each sample)",
    )
    p.add_argument("--profile-out", default=None, help="keep py-spy's collapsed stacks at this path")
    p.add_argument("--profile-top", type=int, default=20)
    p.add_argument(
        "--nice",
        type=int,
        default=0,
        help="niceness of every measured process; negative (root only) makes other work on a "
        "shared machine yield during the run",
    )
    p.add_argument(
        "--stream-events",
        type=int,
        default=32,
        metavar="N",
        help="then the SSE relay phase: streams of N token events (0: skip)",
    )
    p.add_argument(
        "--stream-interval-ms",
        type=float,
        default=1.0,
        help="the upstream's pause between events of a stream (default 1)",
    )
    p.add_argument(
        "--stream-body-kb",
        type=int,
        default=0,
        metavar="K",
        help="the SSE phase's prompt: a K KiB chat body (default 0: a one-line prompt); with "
        "--body-kb, a stream phase runs after the sweep only when this is given",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    p.add_argument(
        "--workers",
        default="1",
        metavar="LIST",
        help="gateway worker processes, a comma-separated list (e.g. 1,2): one gateway target "
        "per count, all pinned to the proxy core; CPU us/req and req/s of each (default 1)",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="every phase, shortest (" + ", ".join(f"{k}={v}" for k, v in SMOKE.items()) + "): checks that it runs",
    )
    if "--smoke" in argv:
        p.set_defaults(**SMOKE)
    args = p.parse_args(argv)
    if args.duration <= 0 or args.rounds < 1 or args.latency_duration <= 0 or args.connections < 1:
        p.error("--duration, --rounds, --latency-duration and --connections must be positive")
    if args.body_kb is not None:
        try:
            args.body_kb = [int(x) for x in args.body_kb.split(",") if x.strip()]
        except ValueError:
            p.error(f"--body-kb: a comma-separated list of sizes in KiB, not {args.body_kb!r}")
        if not args.body_kb or min(args.body_kb) < 0 or max(args.body_kb) > 8192:
            p.error("--body-kb: sizes from 0 (the one-line request) to 8192 KiB")
        args.plot = args.plot or str(REPO / "bench" / "results" / "overhead_body_kb.png")
    args.policy = args.policy or ("smart" if args.body_kb else "dynamic")
    try:
        args.workers = [int(x) for x in str(args.workers).split(",") if x.strip()]
    except ValueError:
        p.error(f"--workers: a comma-separated list of counts, not {args.workers!r}")
    if not args.workers or min(args.workers) < 1 or len(set(args.workers)) != len(args.workers):
        p.error("--workers: distinct counts of at least 1")

    processes.set_nice(args.nice)
    if args.nice < 0 and os.geteuid() != 0:
        p.error("a negative --nice needs root")

    def on_term(signum, frame):
        raise KeyboardInterrupt

    # SIGINT too: a shell that starts this in the background has it ignore SIGINT otherwise.
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    try:
        res = run(args)
    except KeyboardInterrupt:
        print("interrupted; every process stopped", file=sys.stderr)
        return 130
    except RuntimeError as e:
        print(f"overhead: {e}", file=sys.stderr)
        return 1
    print(summarize_sizes(res) if "body_kb" in res else summarize(res))
    if args.markdown and "body_kb" in res:
        print()
        print(markdown_sizes(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
