"""Soak: the gateway's open file descriptors over a long run at about 70 % of capacity.

A `velocityllm serve` process in front of three sim engines of mixed speed (time scales
20, 10 and 5: the same work at different speeds), with a tenant whose request bucket is
kept in a real `redis-server` (`state_store`) when one is installed. After a calibration
(closed loop at twice the engines' slots, ``--calibrate`` seconds) the load is Poisson at
``--load`` (0.7) of the capacity measured: a quarter of the requests on a fresh client
connection each, the rest on keep-alive ones (one idle past 15 s, or closed by the gateway,
is closed, not reused, as HTTP clients do), one in twenty streamed and dropped by its
client after its first event (a cancelled upstream request).

Every ``--interval`` (5) seconds the gateway's fds are read from /proc/PID/fd and each is
named by kind, sockets mapped through /proc/PID/net/tcp{,6} inodes to their ports:

- ``client``: a connection on the client or admin port (listening sockets are ``other``);
- ``pool``: a connection to an engine's port (the engine connection pool);
- ``store``: a connection to the state store's port;
- ``events``: a connection to an engine's KV event ports, or a unix socket (ZeroMQ ipc);
- ``other``: anything else (listening sockets, pipes, the event loop's epoll, files,
  shared memory).

Verdict: no kind but ``pool`` grows after the first minute (the mean of the last fifth of
the run is at most the mean of the minute after the first plus 2 fds and 10 %, and
``store``, ``events`` and ``other`` never pass their first minute's largest count; ``client``
is judged on what the gateway holds beyond the connections the load itself holds open at
the sample, in flight or kept alive: those follow the load, as a slower moment of the
machine puts more in flight and the kept ones fill up to 64, and a gateway that keeps
connections its clients closed shows as that excess growing), and
the pool stays within its documented bound (per engine, ``max_concurrency`` + 2: the
endpoint's concurrency limit, a health check and a scrape). A failure names each fd of
the kinds that failed. Exits 1 when the verdict fails.

    python -m bench.soak [--minutes 10] [--output out.json]
    python -m bench.soak --smoke        # 75 s: every phase runs, figures rough
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from velocity_fast.harness.gateway import GatewayProcess
from velocity_fast.harness.ports import free_port
from velocity_fast.harness.probe import http_status, wait_until
from velocity_fast.harness.procs import stop_all
from velocity_fast.harness.redis import RedisServer, redis_binary
from velocity_fast.harness.sim import SimEngine

MODEL = "sim-model"
SCALES = (20.0, 10.0, 5.0)  # the engines' speeds: the same work at these time scales
SEQS = 8  # each engine's batch
MAX_CONCURRENCY = 32  # the gateway's default: what bounds each engine's pool
POOL_SPARE = 2  # gateway/app.py's POOL_SPARE: a health check and a scrape
KINDS = ("client", "pool", "store", "events", "other")
FLAT = ("store", "events", "other")  # these never pass their first minute's largest
SMOKE = {"minutes": 1.25, "calibrate": 5.0}
CLIENT_KEEPALIVE_S = 15.0  # a kept connection idle longer is closed, not reused (aiohttp's default)
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def _tcp_table(pid: int) -> dict[int, tuple[int, str, int, str]]:
    """Socket inode -> (local port, remote host, remote port, state) for the process's
    network namespace."""
    out = {}
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for ln in lines:
            f = ln.split()
            local, remote, state, inode = f[1], f[2], f[3], int(f[9])
            rhost, rport = remote.rsplit(":", 1)
            out[inode] = (
                int(local.rsplit(":", 1)[1], 16),
                rhost,
                int(rport, 16),
                {
                    "01": "ESTABLISHED",
                    "0A": "LISTEN",
                    "06": "TIME_WAIT",
                    "08": "CLOSE_WAIT",
                    "02": "SYN_SENT",
                    "04": "FIN_WAIT1",
                    "05": "FIN_WAIT2",
                }.get(state, state),
            )
    return out


def _unix_inodes(pid: int) -> dict[int, str]:
    out = {}
    try:
        for ln in Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]:
            f = ln.split()
            out[int(f[6])] = f[7] if len(f) > 7 else ""
    except OSError:
        pass
    return out


def classify(pid: int, ports: dict) -> dict[str, list[str]]:
    """The process's fds by kind, each as a line naming it. ``ports``: ``client`` (the
    client and admin ports), ``pool`` (engine ports -> names), ``store`` (port or None),
    ``events`` (ports)."""
    out: dict[str, list[str]] = {k: [] for k in KINDS}
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    targets = []
    for fd in fds:
        try:
            targets.append((fd, os.readlink(f"/proc/{pid}/fd/{fd}")))
        except OSError:
            continue  # closed meanwhile
    # Read after the fds: every socket listed is in the tables unless it closed since.
    tcp, unix = _tcp_table(pid), _unix_inodes(pid)
    for fd, target in targets:
        kind, what = "other", target
        if target.startswith("socket:["):
            inode = int(target[8:-1])
            if inode in tcp:
                lport, rhost, rport, state = tcp[inode]
                what = f"tcp :{lport} -> :{rport} {state}"
                if state == "LISTEN":
                    what = f"tcp listening on :{lport}"
                elif lport in ports["client"]:
                    kind, what = "client", f"client connection :{lport} <- :{rport} {state}"
                elif rport in ports["pool"]:
                    kind, what = "pool", f"engine {ports['pool'][rport]} connection :{lport} -> :{rport} {state}"
                elif ports["store"] is not None and rport == ports["store"]:
                    kind, what = "store", f"state store connection :{lport} -> :{rport} {state}"
                elif rport in ports["events"]:
                    kind, what = "events", f"KV events connection :{lport} -> :{rport} {state}"
            elif inode in unix:
                # A named one is ZeroMQ's ipc:// (KV events); unnamed ones are the event
                # loop's own socketpairs.
                kind = "events" if unix[inode] else "other"
                what = f"unix socket {unix[inode] or '(unnamed)'}"
            else:
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}") != target:
                        continue
                except OSError:
                    continue  # closed between the listing and the tables: not counted
                what = f"socket inode {inode} (udp or netlink)"
        elif target.startswith("/dev/shm/"):
            what = f"shared memory {target}"
        out[kind].append(f"fd {fd}: {what}")
    return out


def verdict(samples: list[dict], t_first: float, pool_bound: int) -> tuple[bool, list[str]]:
    """Whether the run met the soak's goal, and why not (one line per failure, naming the
    fds of the last sample of each failing kind). ``samples``: {"t", "counts", "fds"}, and
    "held": the connections the load held open then (client fds beyond them are judged)."""
    first = [s for s in samples if s["t"] <= t_first]
    after = [s for s in samples if s["t"] > t_first]
    problems: list[str] = []
    if not first or len(after) < 2:
        return False, ["too few samples after the first minute to judge"]
    n = max(2, len(after) // 5)
    base, tail = after[:n], after[-n:]
    last = samples[-1]
    for kind in KINDS:
        if kind == "pool":
            continue
        own = (lambda s: s.get("held", 0)) if kind == "client" else (lambda s: 0)
        b = statistics.fmean(s["counts"][kind] - own(s) for s in base)
        e = statistics.fmean(s["counts"][kind] - own(s) for s in tail)
        limit = b + 2 + 0.1 * statistics.fmean(s["counts"][kind] for s in base)
        grew = e > limit
        over = kind in FLAT and max(s["counts"][kind] for s in after) > max(s["counts"][kind] for s in first)
        if grew or over:
            why = (
                f"grew from {b:.1f} to {e:.1f} (limit {limit:.1f})"
                + (" beyond the connections the load held open" if kind == "client" else "")
                if grew
                else f"passed its first minute's largest ({max(s['counts'][kind] for s in first)}) "
                f"with {max(s['counts'][kind] for s in after)}"
            )
            problems.append(f"{kind}: {why}; its fds at the end:\n    " + "\n    ".join(sorted(last["fds"][kind])))
    top = max(s["counts"]["pool"] for s in samples)
    if top > pool_bound:
        worst = max(samples, key=lambda s: s["counts"]["pool"])
        problems.append(
            f"pool: {top} connections at {worst['t']:.0f} s, past its bound {pool_bound}:\n    "
            + "\n    ".join(sorted(worst["fds"]["pool"]))
        )
    return not problems, problems


def _body(rng: random.Random, stream: bool) -> bytes:
    d = {
        "model": MODEL,
        "prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 200))),
        "max_tokens": rng.randint(8, 64),
    }
    if stream:
        d["stream"] = True
    return json.dumps(d).encode()


class Load:
    """Requests to the gateway: each on a fresh connection or a kept one, some streamed
    and dropped after their first event. Counts outcomes."""

    def __init__(self, port: int, seed: int) -> None:
        self.port = port
        self.rng = random.Random(seed)
        self.kept: list[tuple] = []
        self.held = 0  # connections open on this side: in flight or kept
        self.done = self.failed = self.dropped = 0
        self.why: dict[str, int] = {}  # each failure by kind: a status, or what broke and on which connection

    def _fail(self, why: str) -> None:
        self.failed += 1
        self.why[why] = self.why.get(why, 0) + 1

    async def one(self) -> None:
        stream = self.rng.random() < 0.05
        fresh = stream or self.rng.random() < 0.25 or not self.kept
        body = _body(self.rng, stream)
        conn = None if fresh else self._reuse()
        if conn is None:
            fresh = True
            conn = await asyncio.open_connection("127.0.0.1", self.port)
            self.held += 1
        reader, writer = conn
        ok = False
        try:
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"x-velocity-tenant: soak\r\ncontent-length: %d\r\n\r\n" % len(body) + body
            )
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
            status = int(head.split(b" ", 2)[1])
            if stream:
                await asyncio.wait_for(reader.read(64), 60)  # the first event, then gone
                self.dropped += 1
                return
            length = 0
            for ln in head.split(b"\r\n"):
                if ln.lower().startswith(b"content-length:"):
                    length = int(ln.split(b":", 1)[1])
            await asyncio.wait_for(reader.readexactly(length), 60)
            if status == 200:
                self.done += 1
            else:
                self._fail(f"status {status}")
            ok = True
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError, IndexError) as e:
            self._fail(f"{type(e).__name__} on a {'fresh' if fresh else 'kept'} connection")
        finally:
            if ok and len(self.kept) < 64:
                self.kept.append((reader, writer, time.monotonic()))
            else:
                self._close(writer)

    def _close(self, writer) -> None:
        writer.close()
        self.held -= 1

    def _reuse(self) -> tuple | None:
        """The most recently used kept connection that is still good, as HTTP clients pick
        one: one idle past the client's own keep-alive (aiohttp's 15 s), or that the gateway
        closed (its keepalive_timeout_s), is closed, never sent a request."""
        while self.kept:
            reader, writer, used = self.kept.pop()
            if reader.at_eof() or writer.is_closing() or time.monotonic() - used > CLIENT_KEEPALIVE_S:
                self._close(writer)
                continue
            return reader, writer
        return None

    def close(self) -> None:
        for _, w, _ in self.kept:
            self._close(w)
        self.kept.clear()


async def _closed_loop(load: Load, clients: int, seconds: float) -> float:
    """Requests a second answered with ``clients`` in a closed loop (the capacity)."""
    until = time.monotonic() + seconds
    before = load.done

    async def client():
        while time.monotonic() < until:
            await load.one()

    await asyncio.gather(*(client() for _ in range(clients)))
    return (load.done - before) / seconds


async def _soak(load: Load, rate: float, seconds: float, interval: float, sample) -> list[dict]:
    samples: list[dict] = []
    tasks: set[asyncio.Task] = set()
    start = time.monotonic()
    next_sample = start
    next_arrival = start
    while time.monotonic() < start + seconds:
        now = time.monotonic()
        if now >= next_sample:
            samples.append(sample(now - start, load.held))
            next_sample += interval
        while next_arrival <= now:
            if len(tasks) < 512:  # bounded: a stalled gateway is not flooded without end
                t = asyncio.create_task(load.one())
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            next_arrival += load.rng.expovariate(rate)
        await asyncio.sleep(max(0.0, min(next_sample, next_arrival) - time.monotonic()))
    if tasks:
        await asyncio.wait(tasks, timeout=60)
    samples.append(sample(time.monotonic() - start, load.held))
    return samples


def run(args) -> dict:
    redis = redis_binary() if not args.no_store else None
    sims: list[SimEngine] = []
    store = gateway = None
    with tempfile.TemporaryDirectory(prefix="velocity-soak-") as tmp:
        work = Path(tmp)
        try:
            engines = {}
            for i, scale in enumerate(SCALES):
                eng = SimEngine(
                    "--max-num-seqs",
                    str(SEQS),
                    "--seed",
                    str(i),
                    model=MODEL,
                    port=free_port(),
                    time_scale=scale,
                    log=work / f"engine-{i}.log",
                    death_signal=signal.SIGTERM,
                )
                sims.append(eng)
                eng.start(20)
                engines[eng.port] = f"e{i}"
            store_port = None
            cfg = ["endpoints:"] + [
                f"  - {{name: {n}, url: 'http://127.0.0.1:{p}', model: {MODEL}}}" for p, n in engines.items()
            ]
            cfg += [
                f"max_concurrency: {MAX_CONCURRENCY}",
                "sla_ms: 600000",
                "tenants:",
                "  - {name: soak, requests_per_second: 10000}",
            ]
            if redis is not None:
                store = RedisServer(redis).start()
                store_port = store.port
                cfg.append(f"state_store: {store.url}")
            (work / "gw.yaml").write_text("\n".join(cfg) + "\n")
            log = work / "gateway.log"
            gateway = GatewayProcess(
                "serve",
                "--config",
                str(work / "gw.yaml"),
                "--log-level",
                "warning",
                log=log,
                death_signal=signal.SIGTERM,
            ).spawn()
            gw, port, admin = gateway.proc, gateway.port, gateway.admin_port
            wait_until(lambda: gw.poll() is None and http_status(admin, "/ready") == 200, 30, "the gateway", log)
            ports = {"client": {port, admin}, "pool": engines, "store": store_port, "events": set()}
            pool_bound = len(engines) * (MAX_CONCURRENCY + POOL_SPARE)

            def sample(t: float, held: int) -> dict:
                fds = classify(gw.pid, ports)
                return {"t": round(t, 1), "counts": {k: len(v) for k, v in fds.items()}, "fds": fds, "held": held}

            async def drive():
                load = Load(port, args.seed)
                try:
                    capacity = await _closed_loop(load, 2 * SEQS * len(engines), args.calibrate)
                    rate = args.load * capacity
                    print(
                        f"capacity {capacity:.1f} requests/s (closed loop, {2 * SEQS * len(engines)} clients); "
                        f"soak at {rate:.1f}/s for {args.minutes:g} min",
                        flush=True,
                    )
                    before = (load.done, load.failed, load.dropped)
                    load.why.clear()
                    samples = await _soak(load, rate, args.minutes * 60, args.interval, sample)
                    done = [a - b for a, b in zip((load.done, load.failed, load.dropped), before)]
                    return capacity, rate, samples, done, dict(load.why)
                finally:
                    load.close()

            capacity, rate, samples, done, why = asyncio.run(drive())
            if gw.poll() is not None:
                raise RuntimeError("the gateway exited: " + (work / "gateway.log").read_text()[-800:])
            with_conns = _get_json(admin, "/stats")
            return {
                "capacity_rps": capacity,
                "rate_rps": rate,
                "load": args.load,
                "minutes": args.minutes,
                "completed": done[0],
                "failed": done[1],
                "failed_why": why,
                "dropped": done[2],
                "pool_bound": pool_bound,
                "store": store_port is not None,
                "samples": samples,
                "connections": {e["name"]: e.get("connections") for e in with_conns.get("endpoints", [])},
            }
        finally:
            stop_all(
                [gateway and gateway.proc, store and store.proc, *(e.proc for e in reversed(sims))], 5.0, whole=True
            )
            if store is not None:
                store.close()


def _get_json(port: int, path: str) -> dict:
    import http.client

    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5.0)
    try:
        c.request("GET", path)
        return json.loads(c.getresponse().read())
    except (OSError, ValueError):
        return {}
    finally:
        c.close()


def report(res: dict, first_s: float) -> tuple[bool, list[str]]:
    samples = res["samples"]
    ok, problems = verdict(samples, first_s, res["pool_bound"])
    first = [s for s in samples if s["t"] <= first_s]
    after = [s for s in samples if s["t"] > first_s]
    print(f"{'kind':7} {'first min: max':>15} {'after: min':>11} {'mean':>7} {'max':>5} {'last':>5}")
    for k in KINDS:
        a = [s["counts"][k] for s in after] or [0]
        print(
            f"{k:7} {max(s['counts'][k] for s in first):>15} {min(a):>11} {statistics.fmean(a):>7.1f} "
            f"{max(a):>5} {samples[-1]['counts'][k]:>5}"
        )
    beyond = [s["counts"]["client"] - s.get("held", 0) for s in after] or [0]
    print(
        f"client fds beyond the connections the load held open: after the first stretch at most {max(beyond)}, "
        f"at the end {beyond[-1]}"
    )
    total = [sum(s["counts"].values()) for s in samples]
    print(
        f"total fds: {total[0]} at the start, {max(total)} at most, {total[-1]} at the end; "
        f"{res['completed']} answered, {res['failed']} failed, {res['dropped']} dropped by their clients "
        f"at {res['rate_rps']:.1f}/s ({res['load']:.0%} of {res['capacity_rps']:.1f}/s)"
        + "".join(f"; {n} {why}" for why, n in sorted(res.get("failed_why", {}).items()))
    )
    print(
        f"pool: at most {max(s['counts']['pool'] for s in samples)} connections, bound {res['pool_bound']} "
        f"({len(SCALES)} engines x (max_concurrency {MAX_CONCURRENCY} + {POOL_SPARE})); /stats at the end: "
        + ", ".join(f"{n} {c['open']} open/{c['idle']} idle" for n, c in res["connections"].items() if c)
    )
    print(
        f"goal (no kind but the pool grows after the first minute; the pool within its bound): "
        f"{'met' if ok else 'NOT met'}"
    )
    for p in problems:
        print(p)
    return ok, problems


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="the soak's length (after the calibration)")
    p.add_argument("--load", type=float, default=0.7, help="the share of the measured capacity offered")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between fd samples")
    p.add_argument("--calibrate", type=float, default=10.0, help="seconds of closed loop measuring the capacity")
    p.add_argument("--first", type=float, default=60.0, help="the first stretch (s) that growth is judged after")
    p.add_argument("--no-store", action="store_true", help="no state store even where redis-server is installed")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output")
    p.add_argument("--smoke", action="store_true", help="75 s, the first stretch 20 s: every phase runs")
    if "--smoke" in (sys.argv[1:] if argv is None else argv):
        p.set_defaults(**SMOKE, first=20.0)
    args = p.parse_args(argv)
    res = run(args)
    ok, problems = report(res, args.first)
    if args.output:
        Path(args.output).write_text(json.dumps({"args": vars(args), "ok": ok, "problems": problems, **res}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
