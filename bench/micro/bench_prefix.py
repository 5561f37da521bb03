"""Micro benchmark: compiled prefix hashing and prefix-affinity scoring.

Run: .venv/bin/python -m pytest bench/micro/bench_prefix.py --benchmark-only -q -p no:cacheprovider

What is measured (medians; the summary is printed at the end):
- hashing: PrefixHasher.hash over a 16 KB prompt and over 4 MB, in GB/s, next to two
  baselines measured in the same run: a plain copy of the same bytes (memory speed)
  and a naive chained hash in Python (hashlib.blake2b per 64-byte block).
  Target: >= 2 GB/s.
- scoring: the chat profile's compiled scoring of 64 endpoints for a 16 KB prompt
  (one pass over the prompt's 256 block hashes against an index where every endpoint
  holds a prefix of it, then affinity vs load and the hot-spot guard).
  Target: <= 10 microseconds.
- for context, the whole Router.pick over a pool of 64 endpoints (compiled filters plus
  that scoring), Router.route_info (rendering a chat body, then hashing), and the
  index work of on_dispatch (touching a 16 KB prompt: new and evicting, or known).
"""

import hashlib
import os
import random

import pytest

from velocity_fast.fleet.endpoint import Endpoint, Pool
from velocity_fast.routing.prefix import PrefixHasher, PrefixIndex, choose_by_affinity
from velocity_fast.routing.router import Router
from velocity_fast.routing.settings import RoutingSettings

KB16 = os.urandom(16 * 1024)
MB4 = os.urandom(4 * 1024 * 1024)
ENDPOINTS = 64
RESULTS: dict[str, str] = {}
_rng = random.Random(1)


def _median(benchmark) -> float:
    return benchmark.stats.stats.median


def _naive_chain(data: bytes) -> list[bytes]:
    out, parent = [], b"m"
    for i in range(0, len(data) - len(data) % 64, 64):
        parent = hashlib.blake2b(parent + data[i : i + 64], digest_size=8).digest()
        out.append(parent)
    return out


@pytest.mark.parametrize("size", ["16KB", "4MB"])
def test_hash_throughput(benchmark, size):
    data = KB16 if size == "16KB" else MB4
    hasher = PrefixHasher(64)
    hasher.seed_for("m")
    benchmark.pedantic(
        hasher.hash,
        args=(data, "m"),
        rounds=200 if size == "16KB" else 30,
        iterations=20 if size == "16KB" else 1,
        warmup_rounds=2,
    )
    RESULTS[f"hash {size}"] = f"{len(data) / _median(benchmark) / 1e9:.2f} GB/s"


def test_copy_baseline(benchmark):
    benchmark.pedantic(bytearray, args=(MB4,), rounds=30, iterations=1, warmup_rounds=2)
    RESULTS["copy 4MB (memory speed)"] = f"{len(MB4) / _median(benchmark) / 1e9:.2f} GB/s"


def test_naive_python_baseline(benchmark):
    benchmark.pedantic(_naive_chain, args=(KB16,), rounds=20, iterations=1, warmup_rounds=1)
    RESULTS["naive blake2b chain 16KB"] = f"{len(KB16) / _median(benchmark) / 1e9:.3f} GB/s"


class _Ep:
    __slots__ = ("name",)

    def __init__(self, name):
        self.name = name


def _index_with_prefixes(hashes):
    """64 endpoints, each holding a different-length prefix of the prompt."""
    index = PrefixIndex(100_000)
    full = hashes.tolist()
    from velocity_fast.routing.prefix import BlockHashes

    for e in range(ENDPOINTS):
        index.touch(f"e{e}", BlockHashes.of(full[: (e * 4) % len(full)]))
    return index


def test_score_64_endpoints_16kb(benchmark):
    hashes = PrefixHasher(64).hash(KB16, "m")
    index = _index_with_prefixes(hashes)
    cands = [_Ep(f"e{e}") for e in range(ENDPOINTS)]
    loads = [float(_rng.randrange(4)) for _ in range(ENDPOINTS)]
    i, basis = choose_by_affinity(index, hashes, cands, loads, 8.0, 0.25, 12345)
    assert basis == "prefix"
    benchmark.pedantic(
        choose_by_affinity,
        args=(index, hashes, cands, loads, 8.0, 0.25, 12345),
        rounds=300,
        iterations=20,
        warmup_rounds=2,
    )
    RESULTS["score 64 endpoints, 16KB prompt"] = f"{_median(benchmark) * 1e6:.2f} us"


def test_match_only_64_endpoints_16kb(benchmark):
    hashes = PrefixHasher(64).hash(KB16, "m")
    index = _index_with_prefixes(hashes)
    benchmark.pedantic(index.match, args=(hashes,), rounds=300, iterations=20, warmup_rounds=2)
    RESULTS["index match (one pass) 64 endpoints, 16KB"] = f"{_median(benchmark) * 1e6:.2f} us"


def test_touch_new_16kb_prompt_at_capacity(benchmark):
    """on_dispatch's index work for a prompt never seen: 256 inserts, each evicting."""
    hasher = PrefixHasher(64)
    chains = [hasher.hash(os.urandom(16 * 1024), "m") for _ in range(64)]
    index = PrefixIndex(4096)  # 16 prompts' worth: every touch below evicts
    for c in chains[:16]:
        index.touch("e", c)
    state = {"i": 0}

    def touch_next():
        state["i"] += 1
        index.touch("e", chains[state["i"] % 64])

    benchmark.pedantic(touch_next, rounds=300, iterations=1, warmup_rounds=20)
    RESULTS["index touch, new 16KB prompt at capacity"] = f"{_median(benchmark) * 1e6:.1f} us"


def test_touch_known_16kb_prompt(benchmark):
    index = PrefixIndex(4096)
    chain = PrefixHasher(64).hash(KB16, "m")
    index.touch("e", chain)
    benchmark.pedantic(index.touch, args=("e", chain), rounds=300, iterations=10, warmup_rounds=2)
    RESULTS["index touch, known 16KB prompt"] = f"{_median(benchmark) * 1e6:.1f} us"


def _router_and_pool():
    router = Router(RoutingSettings(seed=1))
    eps = []
    for e in range(ENDPOINTS):
        ep = Endpoint(f"e{e}", f"http://127.0.0.1:{10000 + e}", "m")
        ep.healthy = True
        ep.inflight = _rng.randrange(4)
        eps.append(ep)
    pool = Pool("m", eps)
    system = KB16[: 12 * 1024].hex()[: 12 * 1024]
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "q" * 4000}]}
    info = router.route_info("m", body, {})
    for e, ep in enumerate(eps):
        part = {"messages": [{"role": "system", "content": system[: (e * 190) % len(system)]}]}
        router.on_dispatch(ep, router.route_info("m", part, {}))
    router.pick(pool, info)
    return router, pool, info, body


def test_router_pick_64_endpoints_16kb(benchmark):
    router, pool, info, _ = _router_and_pool()
    benchmark.pedantic(router.pick, args=(pool, info), rounds=300, iterations=10, warmup_rounds=2)
    RESULTS["Router.pick 64 endpoints, 16KB (filters + scoring)"] = f"{_median(benchmark) * 1e6:.2f} us"


def test_router_route_info_16kb_chat(benchmark):
    router, _, _, body = _router_and_pool()
    benchmark.pedantic(router.route_info, args=("m", body, {}), rounds=300, iterations=10, warmup_rounds=2)
    RESULTS["Router.route_info 16KB chat body (render + hash)"] = f"{_median(benchmark) * 1e6:.2f} us"


def teardown_module(_):
    if RESULTS:
        print(
            "\nprefix micro (median): "
            + "; ".join(f"{k}: {v}" for k, v in RESULTS.items())
            + " (targets: hashing >= 2 GB/s, scoring 64 endpoints <= 10 us)"
        )
