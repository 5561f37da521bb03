"""User-space machine instructions per proxied request: the gateway and nginx, in one run.

Method
------
The socket benchmark (bench/overhead.py) measures CPU time, which drifts with whatever
else the machine runs. This one counts instructions instead, which do not drift: each
proxy runs under valgrind's callgrind with counting off, serves wrk's load (64
connections, the same POST as overhead.py) against the fixed upstream for a warm-up, then
counting is switched on (callgrind_control) for --duration seconds of the same load and
off again. Instructions counted over requests wrk completed in that window is the figure.

* The gateway: `velocityllm serve`, one endpoint, default settings (dynamic admission,
  routing, metrics), as in overhead.py. nginx: `proxy_pass`, upstream keep-alive, one
  process (no master). Both pinned to the proxy core; upstream and wrk to the load core.
* Only the proxy's user-space instructions: the kernel's share of a request (about half
  of the gateway's CPU time and most of nginx's, see overhead.py's usr/sys) is not seen.
* Under valgrind a proxy runs some 50 times slower, so it serves far fewer requests per
  loop pass than at full speed; a pass's fixed cost is spread over fewer requests, and
  the figures are a little above what a full-speed run executes. Both proxies alike.
* Requests still in flight when counting starts or stops are a few dozen of thousands:
  the figure repeats to about +-3 %.

Needs valgrind, wrk and nginx (apt-get install valgrind wrk nginx-light).

    python -m bench.instructions [--duration 10] [--json out.json]
    python -m bench.instructions --smoke [--json out.json]   # 1 s windows: it works, figures rough
    python -m bench.instructions --tenants 1000   # the gateway with tenants budgeted in tokens
    python -m bench.instructions --workers 2      # the supervisor and its workers, counted together
    python -m bench.instructions --keep /tmp/cg   # then: callgrind_annotate /tmp/cg/callgrind.gateway*

--state-store (with --tenants): the same tenants' buckets shared through a redis-server
the benchmark starts on a free loopback port (state_store; needs redis-server and the
`redis` extra): the per-request cost of drawing from the local lease of a shared bucket,
for tenants under their limit, against the same run without it.

--tenants N: the gateway is given N tenants (weights 1 to 4, a tokens_per_minute quota
too large to bind) and token fairness settled from the engine's usage, and wrk names a
different tenant on each request (x-velocity-tenant, in turn): the per-request cost of
the quota, the usage read and the settlement, and of that many tenants in the books.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.lib.bodies import BODY, PATH, chat_body
from bench.lib.load import wrk_cmd
from bench.lib.processes import Procs
from bench.lib.targets import start_gateway, start_nginx, start_upstream
from velocity_fast.harness.redis import RedisServer, redis_binary

# --smoke: one-second windows (CI: tests/bench/); flags given still win.
SMOKE = {"duration": 3.0, "warmup": 2.0}  # under valgrind a loaded machine may finish nothing in 1 s


def _callgrind(out: Path, children: bool = False) -> list[str]:
    """valgrind's command line; ``children``: follow the processes it spawns (the gateway's
    workers), one file each (``%p``: the pid)."""
    if children:
        return [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            "--trace-children=yes",
            f"--callgrind-out-file={out}.%p",
        ]
    return ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]


def _family(pid: int) -> list[str]:
    """The pid and its children's (a supervisor and its workers): counting is switched for
    them together."""
    kids = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [str(pid), *kids]


TENANT_LUA = """\
wrk.method = "POST"
local f = assert(io.open("{path}", "rb"))
wrk.body = f:read("*a")
f:close()
local n = 0
request = function()
  n = n + 1
  return wrk.format(nil, nil, {{["Content-Type"] = "application/json",
                                ["x-velocity-tenant"] = "t" .. (n % {tenants})}})
end
"""


def _tenant_config(work: Path, tenants: int, state_store: str | None = None) -> Path:
    """A config of ``tenants`` tenants in tokens (see the module doc)."""
    out = work / "tenants.yaml"
    rows = [f"  - {{name: t{i}, weight: {1 + i % 4}, tokens_per_minute: 1.0e12}}" for i in range(tenants)]
    store = f"state_store: {state_store}\n" if state_store else ""
    out.write_text(store + "admission:\n  fairness: tokens\ntenants:\n" + "\n".join(rows) + "\n")
    return out


def _wrk_argv(work: Path, tenants: int, body: bytes) -> list[str]:
    if not tenants:
        return wrk_cmd(work, body)
    script = work / "tenants.lua"
    if not script.exists():
        (work / "tenants.body").write_bytes(body)
        script.write_text(TENANT_LUA.format(path=work / "tenants.body", tenants=tenants))
    return [*wrk_cmd(work, body)[:5], str(script)]


def _wrk(work: Path, port: int, seconds: float, cpu: int | None, tenants: int = 0, body: bytes = BODY) -> dict:
    """Requests wrk completed in ``seconds`` at 64 connections, and those that failed:
    answers other than 2xx/3xx, and socket errors (connect, read, write, timeout)."""
    argv = [*_wrk_argv(work, tenants, body), "-c64", f"-d{seconds:g}s", f"http://127.0.0.1:{port}{PATH}"]
    if cpu is not None:
        argv = ["taskset", "-c", str(cpu), *argv]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60).stdout
    m = re.search(r"(\d+) requests in", out)
    if m is None:
        raise RuntimeError("wrk gave no count: " + out[-400:])
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    return {
        "requests": int(m.group(1)),
        "non2xx": int(bad.group(1)) if bad else 0,
        "errors": sum(map(int, sock.groups())) if sock else 0,
    }


def _total(path: Path) -> int:
    """The instructions a callgrind output file counted."""
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("totals:"):  # (a dump's "summary:" line can say 0)
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {path}")


def measure(name: str, start, args, work: Path) -> dict:
    out = work / f"callgrind.{name}"
    procs = Procs()
    try:
        target = start(procs, out)
        tenants = args.tenants if name == "gateway" else 0
        body = chat_body(args.body_kb) if args.body_kb else BODY
        _wrk(work, target.port, args.warmup, args.load_cpu, tenants, body)
        pids = _family(target.pid) if name == "gateway" and args.workers > 1 else [str(target.pid)]
        subprocess.run(["callgrind_control", "-i", "on", *pids], capture_output=True, check=True)
        w = _wrk(work, target.port, args.duration, args.load_cpu, tenants, body)
        subprocess.run(["callgrind_control", "-i", "off", *pids], capture_output=True, check=True)
        subprocess.run(["callgrind_control", "-d", *pids], capture_output=True, check=True)
        time.sleep(1)
    finally:
        procs.stop_all()
    # The dump holds the counted window; the file written at exit, the rest (none).
    total = sum(_total(p) for p in work.glob(f"callgrind.{name}*") if p.stat().st_size)
    if args.keep:  # for callgrind_annotate: where the instructions went
        Path(args.keep).mkdir(parents=True, exist_ok=True)
        for p in work.glob(f"callgrind.{name}*"):
            if p.stat().st_size:
                shutil.copy(p, Path(args.keep) / p.name)
    n = w["requests"]
    return {
        "requests": n,
        "non2xx": w["non2xx"],
        "errors": w["errors"],
        "instructions": total,
        "per_request": total / n if n else None,
    }


def run(args) -> dict:
    for tool in ("valgrind", "callgrind_control", "wrk", "nginx"):
        if shutil.which(tool) is None and not (tool == "nginx" and Path("/usr/sbin/nginx").exists()):
            raise SystemExit(f"{tool} is not installed")
    res = {"duration_s": args.duration, "connections": 64, "targets": {}}
    with tempfile.TemporaryDirectory(prefix="velocity-instr-") as tmp:
        work = Path(tmp)
        up_procs = Procs()
        redis = None
        try:
            _, up_port = start_upstream(up_procs, args.load_cpu)
            gw_dir = work / "gw"
            gw_dir.mkdir()
            store = None
            if args.state_store:
                redis = RedisServer(redis_binary() or "/usr/bin/redis-server").start()
                store = redis.url
            extra = ["--config", str(_tenant_config(work, args.tenants, store))] if args.tenants else []
            if args.workers > 1:
                extra += ["--workers", str(args.workers)]
            res["workers"] = args.workers
            res["body_kb"] = args.body_kb
            res["tenants"] = args.tenants
            res["state_store"] = bool(store)
            res["targets"]["gateway"] = measure(
                "gateway",
                lambda procs, out: start_gateway(
                    procs,
                    args.proxy_cpu,
                    up_port,
                    args.policy or ("smart" if args.body_kb else "dynamic"),
                    gw_dir,
                    extra,
                    wrap=_callgrind(out, children=args.workers > 1),
                    ready_s=300,
                ),
                args,
                work,
            )
            res["targets"]["nginx"] = measure(
                "nginx",
                lambda procs, out: start_nginx(procs, args.proxy_cpu, up_port, work, wrap=_callgrind(out), ready_s=120),
                args,
                work,
            )
        finally:
            up_procs.stop_all()
            if redis is not None:
                redis.close()
    g, n = res["targets"]["gateway"]["per_request"], res["targets"]["nginx"]["per_request"]
    res["gateway_vs_nginx"] = g / n if g and n else None
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=10.0, help="counted seconds per proxy")
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument(
        "--keep",
        default=None,
        metavar="DIR",
        help="keep the callgrind files of the counted windows here (callgrind_annotate reads them)",
    )
    p.add_argument("--proxy-cpu", type=int, default=0)
    p.add_argument("--load-cpu", type=int, default=1)
    p.add_argument("--json", type=Path)
    p.add_argument(
        "--tenants",
        type=int,
        default=0,
        help="give the gateway this many tenants budgeted in tokens, one a request in turn",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="the gateway's --workers; the supervisor and every worker are counted (on one core all)",
    )
    p.add_argument(
        "--body-kb",
        type=int,
        default=0,
        metavar="K",
        help="a K KiB chat prompt (bench/lib/bodies.py) instead of the small request; the gateway's policy "
        "is then smart (prefix affinity on), as overhead.py --body-kb runs it",
    )
    p.add_argument("--policy", choices=("dynamic", "static", "smart"), default=None, help="the gateway's policy")
    p.add_argument(
        "--state-store",
        action="store_true",
        help="with --tenants: their buckets shared through a redis-server started for the run",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="short windows (" + ", ".join(f"{k}={v}" for k, v in SMOKE.items()) + "): checks that it runs",
    )
    if "--smoke" in (sys.argv[1:] if argv is None else argv):
        p.set_defaults(**SMOKE)
    args = p.parse_args(argv)
    if args.state_store and not args.tenants:
        p.error("--state-store needs --tenants (the buckets it shares are the tenants')")
    res = run(args)
    for name, t in res["targets"].items():
        failed = t["non2xx"] + t["errors"]
        if not t["requests"]:
            print(f"{name:8} finished no request in the counted {args.duration:g} s (machine too busy?)")
            return 1
        print(
            f"{name:8} {t['requests']:7d} requests  {t['per_request']:9,.0f} user-space instructions/request"
            + (f"  ({failed} failed: non-2xx answers or socket errors)" if failed else "")
        )
    print(f"gateway/nginx instructions per request: {res['gateway_vs_nginx']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
