"""Flags of ``velocityllm loadgen`` (imports nothing heavy; the CLI adds them)."""

from __future__ import annotations

import argparse


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that define a workload; shared by ``loadgen`` and ``bench``."""
    g = parser.add_argument_group("workload")
    g.add_argument("--num-requests", "-n", type=int, default=200, help="requests to send (default 200)")
    g.add_argument(
        "--pattern",
        choices=("flood", "constant", "poisson", "burst"),
        default="constant",
        help="arrival pattern (default constant)",
    )
    g.add_argument("--duration", type=float, default=10.0, help="seconds over which arrivals are spread (default 10)")
    g.add_argument(
        "--rate", type=float, default=None, help="mean arrival rate in requests/s; sets the duration to N / rate"
    )
    g.add_argument("--seed", type=int, default=0, help="same seed, same workload (default 0)")
    g.add_argument(
        "--route",
        choices=("chat", "completions", "generate"),
        default="chat",
        help="API to call: /v1/chat/completions, /v1/completions or /generate (default chat)",
    )
    g.add_argument("--model", default=None, help="model name to put in the body (default: none)")
    g.add_argument("--stream", action="store_true", help="stream every request (SSE)")
    g.add_argument(
        "--sla-ms",
        type=float,
        default=None,
        help="SLA in ms that judges goodput (default 3000); sent as x-velocity-sla-ms only when given",
    )
    m = parser.add_argument_group("request mix (flags override --mix)")
    m.add_argument("--mix", metavar="FILE", default=None, help="YAML file describing the mix")
    m.add_argument(
        "--bands",
        default=None,
        metavar="SPEC",
        help="bands and weights sent as x-velocity-priority, e.g. high:1:2000,normal:3,low:6 (name:weight[:sla_ms])",
    )
    m.add_argument(
        "--tenants",
        default=None,
        metavar="SPEC",
        help="tenants and weights sent as x-velocity-tenant, e.g. alpha:1,beta:2",
    )
    m.add_argument(
        "--prompt-tokens",
        default=None,
        metavar="DIST",
        help="prompt length: N, constant:N, uniform:A:B, normal:MU:SD, lognormal:MEDIAN:SIGMA, "
        "exponential:MEAN (default 128)",
    )
    m.add_argument(
        "--output-tokens", default=None, metavar="DIST", help="max_tokens distribution, same forms (default 64)"
    )
    m.add_argument("--prefix-groups", type=int, default=None, help="number of shared prompt prefixes")
    m.add_argument("--prefix-tokens", type=int, default=None, help="length of each shared prefix")
    m.add_argument(
        "--prefix-share", type=float, default=None, help="share of requests that start with a shared prefix (0..1)"
    )
    m.add_argument("--stream-share", type=float, default=None, help="share of streamed requests (0..1)")
    m.add_argument(
        "--no-max-tokens-share",
        type=float,
        default=None,
        metavar="SHARE",
        help="share of requests sent without max_tokens (and without ignore_eos): the engine "
        "ends the reply, as for most OpenAI clients (default 0.3)",
    )
    m.add_argument(
        "--priority-zero-share",
        type=float,
        default=None,
        metavar="SHARE",
        help="share of requests whose body carries vLLM's default \"priority\": 0 (default 0.3)",
    )
    m.add_argument(
        "--sampling-share",
        type=float,
        default=None,
        metavar="SHARE",
        help="share of requests with a temperature and a stop list (default 0.5)",
    )
    m.add_argument(
        "--sessions", type=int, default=None, help="spread requests over this many x-session-id values (0: none)"
    )


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    """Client flags shared by ``loadgen`` and ``bench``."""
    g = parser.add_argument_group("client")
    g.add_argument(
        "--concurrency",
        "-c",
        type=int,
        default=256,
        help="most requests in flight (and connections) at once (default 256)",
    )
    g.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    g.add_argument("--timeout", type=float, default=300.0, help="per-request timeout in seconds (default 300)")
    g.add_argument("--no-progress", action="store_true", help="no progress display even on a terminal")


def add_loadgen_arguments(parser: argparse.ArgumentParser) -> None:
    """All flags of ``velocityllm loadgen``."""
    parser.add_argument(
        "--url", default="http://127.0.0.1:8000", help="server base URL (default http://127.0.0.1:8000)"
    )
    add_workload_arguments(parser)
    add_client_arguments(parser)
    parser.add_argument(
        "--output",
        metavar="PREFIX",
        default=None,
        help="write PREFIX.json (summary) and PREFIX.csv (one row a request)",
    )
