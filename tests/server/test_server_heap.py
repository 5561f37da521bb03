"""Large request bodies do not cost page faults: freed bodies stay in the heap
(velocity_fast/server/heap.py), under `velocityllm serve` at its defaults."""

from __future__ import annotations

import http.client
import json
import threading
from pathlib import Path

import pytest

from tests.support.bench import fixed_upstream
from tests.support.gateway import gateway_process
from velocity_fast.server.heap import keep_freed_memory

pytestmark = pytest.mark.timeout(120)

BODY = json.dumps(
    {
        "model": "fixed",
        "messages": [
            {"role": "system", "content": "You answer briefly.\n" * 10},
            {"role": "user", "content": "a 256 KiB prompt " * (256 * 1024 // 17)},
        ],
    }
).encode()
CLIENTS, PER_CLIENT = 8, 24


def _minor_faults(pid: int) -> int:
    # /proc/PID/stat: field 10 is minflt; the command name (field 2) may hold spaces.
    rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(rest[7])


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _load(port: int, n: int, failures: list) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        for _ in range(n):
            conn.request("POST", "/v1/chat/completions", body=BODY, headers={"content-type": "application/json"})
            r = conn.getresponse()
            r.read()
            if r.status != 200:
                failures.append(r.status)
    except OSError as e:
        failures.append(repr(e))
    finally:
        conn.close()


def _round(port: int, failures: list) -> None:
    threads = [threading.Thread(target=_load, args=(port, PER_CLIENT, failures)) for _ in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)


def _faults_per_request(upstream_port: int, env: dict[str, str]) -> tuple[float, float]:
    """Minor faults a request over a round of CLIENTS concurrent clients, and the RSS growth
    (MiB) over a second round: what the heap keeps must not grow."""
    with gateway_process("serve", "--endpoint", f"e1=http://127.0.0.1:{upstream_port}=fixed", env=env) as gp:
        failures: list = []
        _load(gp.port, 16, failures)  # warm: connections, the heap's first growth
        before = _minor_faults(gp.proc.pid)
        _round(gp.port, failures)
        after = _minor_faults(gp.proc.pid)
        rss = _rss_mib(gp.proc.pid)
        _round(gp.port, failures)
        grown = _rss_mib(gp.proc.pid) - rss
        assert not failures, failures[:5]
        return (after - before) / (CLIENTS * PER_CLIENT), grown


@pytest.fixture
def upstream_port():
    with fixed_upstream() as port:
        yield port


def test_large_bodies_do_not_fault_pages_in_at_defaults(upstream_port):
    kept, grown = _faults_per_request(upstream_port, {})
    # The same load with glibc's own thresholds (fixed at its 128 KiB default, as an
    # operator's MALLOC_* variables are left alone): every 256 KiB body is mapped afresh.
    mapped, _ = _faults_per_request(
        upstream_port, {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
    )
    assert mapped >= 32, f"{mapped:.1f} faults a request: the load no longer shows glibc's cost"
    assert kept <= 8, f"{kept:.1f} minor page faults a 256 KiB request (glibc's own thresholds: {mapped:.1f})"
    # The heap keeps what the busiest moment needed (8 bodies in flight), no more.
    assert grown <= 8, f"RSS grew {grown:.1f} MiB over a second round of the same load"


def test_operator_malloc_settings_are_left_alone():
    assert keep_freed_memory({"MALLOC_TRIM_THRESHOLD_": "1048576"}) is False
    assert keep_freed_memory({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}) is False
