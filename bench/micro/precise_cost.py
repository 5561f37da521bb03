"""Micro benchmark: what precise prefix routing adds to a request on the event loop.

    python -m bench.micro.precise_cost            # instructions per request (callgrind)

One request = Router.route_info + Router.pick over 4 endpoints, for a chat body of a
system prompt (~2 KB) and a question, in three setups on the same bodies:

- approximate: the default (the prefix index of where the gateway sent prompts);
- precise, prefix hit: the pool is precise, the system prompt's tokens are cached (the
  usual case for a shared system prompt or a conversation's next turn), every endpoint's
  KV index is exact: the look-up, BlockIndex.match per endpoint, the scoring, and the
  hand-off of the new question to the tokenizer thread (stopped here: its tokenizing
  runs off the loop, with the interpreter lock released, and is not counted);
- precise, not ready: nothing cached: the hand-off and the approximate fallback.

Instructions are callgrind totals of two runs (N and 10 N requests), differenced, so
start-up is cancelled out (needs valgrind). Without valgrind, --time prints microseconds.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

WORDS = (
    "the of and to in is was that for on are with as be at by this had not but from or have an they "
    "which one you were all we her she there been if more when will would who so no model token cache "
    "engine queue batch prefill decode latency tenant band request stream router gateway"
).split()
BS = 16


def _tokenizer(folder: str) -> str:
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        [" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=["[UNK]", "<|im_start|>", "<|im_end|>"])
    )
    path = os.path.join(folder, "tokenizer.json")
    tok.save(path)
    return path


def _setup(mode: str, folder: str):
    from velocity_fast.fleet.endpoint import Endpoint, Pool
    from velocity_fast.metrics.registry import Registry
    from velocity_fast.routing.router import Router
    from velocity_fast.routing.settings import RoutingSettings

    rng = random.Random(1)
    system = " ".join(rng.choice(WORDS) for _ in range(400))
    bodies = [
        {
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(20))},
            ]
        }
        for _ in range(64)
    ]
    eps = []
    for i in range(4):
        ep = Endpoint(f"e{i}", f"http://127.0.0.1:{9300 + i}", "m")
        ep.healthy = True
        eps.append(ep)
    pool = Pool("m", eps)
    reg = Registry()
    if mode == "approximate":
        r = Router(RoutingSettings(seed=1, default_profile="chat"), registry=reg)
        for i, b in enumerate(bodies[:8]):
            r.on_dispatch(eps[i % 4], r.route_info("m", b, {}))
        return r, pool, bodies, None
    from velocity_fast.kvevents.index import EXACT, BlockIndex
    from velocity_fast.kvevents.wire import Stored
    from velocity_fast.routing.precise.scoring import PrecisePrefix
    from velocity_fast.routing.precise.template import chat_template

    tok = _tokenizer(folder)
    s = RoutingSettings(seed=1, default_profile="chat", prefix="precise", tokenizer=tok)
    index = BlockIndex()
    precise = PrecisePrefix(s, index, registry=reg, block_size=lambda m: BS)
    r = Router(s, registry=reg, precise=precise)
    ids = Tokenizer.from_file(tok).encode(chat_template([("system", system)]), add_special_tokens=False).ids
    for i, ep in enumerate(eps):
        index.set_state(ep.name, EXACT)
        n = (len(ids) // BS) * (i + 1) // 4
        index.apply(ep.name, [Stored([f"{i}-{k}" for k in range(n)], None, ids[: n * BS], BS, None, "GPU", None, None)])
    if mode == "precise-hit":  # the system prompt's tokens cached (one request tokenized)
        info = r.route_info("m", {"messages": bodies[0]["messages"][:1] + [{"role": "user", "content": "x"}]}, {})
        deadline = time.monotonic() + 5
        while info.precise.chain is None and time.monotonic() < deadline:
            time.sleep(0.01)
    # The thread stops here: what is measured is the event loop's side alone (the
    # hand-offs queue up, as they would while the thread works).
    precise.close()
    return r, pool, bodies, precise


def _loop(mode: str, n: int) -> None:
    with tempfile.TemporaryDirectory() as folder:
        r, pool, bodies, precise = _setup(mode, folder)
        nb = len(bodies)
        for i in range(n):
            info = r.route_info("m", bodies[i % nb], {})
            r.pick(pool, info)


def _instructions(mode: str, n: int) -> int:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "cg.out")
        subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={out}",
                sys.executable,
                __file__,
                "--_worker",
                mode,
                str(n),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        with open(out) as f:
            for line in f:
                if line.startswith("summary:") or line.startswith("totals:"):
                    return int(line.split()[1])
    raise RuntimeError("no callgrind total")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--time", action="store_true", help="microseconds per request instead of instructions")
    p.add_argument("--modes", default="approximate,precise-hit,precise-not-ready")
    p.add_argument("--_worker", dest="worker", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        _loop(a.worker[0], int(a.worker[1]))
        return
    for mode in a.modes.split(","):
        if a.time:
            with tempfile.TemporaryDirectory() as folder:
                r, pool, bodies, precise = _setup(mode, folder)
                t0 = time.perf_counter()
                for i in range(20000):
                    r.pick(pool, r.route_info("m", bodies[i % len(bodies)], {}))
                per = (time.perf_counter() - t0) / 20000 * 1e6
            print(f"{mode:18s} {per:8.2f} us per route_info + pick")
        else:
            small, large = 200, 2000
            per = (_instructions(mode, large) - _instructions(mode, small)) / (large - small)
            print(f"{mode:18s} {per:10,.0f} instructions per route_info + pick")


if __name__ == "__main__":
    main()
