"""A seeded workload: every request's arrival time, headers and body, built up front.

Requests are rendered to the exact bytes the client writes, so that the run itself
does no JSON encoding and two runs with the same seed send identical bytes (apart
from nothing: even ``x-request-id`` is derived from the seed and the index).

Three independent random streams are used — one for arrival times, one for the
request contents, one for how each client writes its body (``Mix.clients``: no
``max_tokens``, vLLM's ``priority: 0``, ``temperature`` and ``stop``) — so changing the
pattern leaves the bodies unchanged, and the client shares leave the prompts unchanged.
"""

from __future__ import annotations

import bisect
import itertools
import random
from dataclasses import dataclass

import orjson

from velocity_fast.sim.tokens import PROMPT_WORDS

from .arrivals import arrival_times
from .mix import Mix

ROUTES = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "generate": "/generate",
}

# The sim engines and the gateway approximate a token as about 4 bytes of text.
BYTES_PER_TOKEN = 4

WORDS = list(PROMPT_WORDS)  # the sim's tokenizer knows each (sim/tokens.py)

# What clients send with ``Mix.clients.sampling``: OpenAI's and vLLM's usual values, and
# stop strings as chat clients set them (a turn marker, a blank line).
TEMPERATURES = (0.0, 0.2, 0.7, 1.0)
STOPS = (["\n\nUser:"], ["</s>", "<|im_end|>"], ["###"])


@dataclass(slots=True)
class RequestSpec:
    """One request of a workload and the bytes that carry it."""

    index: int
    at: float
    band: str
    tenant: str
    stream: bool
    prompt_tokens: int
    max_tokens: int  # 0: none sent (the engine ends the reply)
    prefix_group: int
    sla_ms: float
    session: str
    path: str
    headers: dict[str, str]
    body: bytes
    wire: bytes


@dataclass(slots=True)
class WorkloadConfig:
    """What the workload builder needs apart from the mix."""

    num_requests: int
    pattern: str
    duration: float
    seed: int
    route: str = "chat"
    model: str | None = None
    host: str = "127.0.0.1"
    api_key: str | None = None
    sla_ms: float = 3000.0
    send_sla: bool = False
    # False: no request carries an SLA of its own (not sla_ms, nor a band's): the server's
    # SLA applies to all; sla_ms and the bands' still judge goodput.
    request_sla: bool = True
    base_path: str = ""


class _Text:
    """Deterministic filler text; slices of one seeded corpus keep generation cheap."""

    def __init__(self, rng: random.Random, size: int = 1 << 16) -> None:
        words = []
        n = 0
        while n < size:
            w = rng.choice(WORDS)
            words.append(w)
            n += len(w) + 1
        self.corpus = " ".join(words)
        self.doubled = self.corpus + " " + self.corpus

    def take(self, rng: random.Random, nbytes: int) -> str:
        out = []
        while nbytes > 0:
            k = min(nbytes, len(self.corpus))
            start = rng.randrange(len(self.corpus))
            out.append(self.doubled[start : start + k])
            nbytes -= k
        return "".join(out)


def _picker(rng: random.Random, items: list, weights: list[float]):
    cum = list(itertools.accumulate(weights))
    total = cum[-1]

    def pick():
        return items[min(bisect.bisect_right(cum, rng.random() * total), len(items) - 1)]

    return pick


def build_workload(cfg: WorkloadConfig, mix: Mix) -> list[RequestSpec]:
    """Build the whole workload; the same config, mix and seed give the same list."""
    if cfg.route not in ROUTES:
        raise ValueError(f"unknown route {cfg.route!r}; choose one of {', '.join(ROUTES)}")
    times = arrival_times(cfg.pattern, cfg.num_requests, cfg.duration, cfg.seed)
    rng = random.Random(f"mix:{cfg.seed}")
    crng = random.Random(f"clients:{cfg.seed}")
    clients = mix.clients
    shaped = cfg.route != "generate" and (
        clients.no_max_tokens > 0 or clients.priority_zero > 0 or clients.sampling > 0
    )
    text = _Text(rng)
    prefixes = [
        f"[shared context {g}] " + text.take(rng, mix.prefix.tokens * BYTES_PER_TOKEN)
        for g in range(mix.prefix.groups if mix.prefix.share > 0 else 0)
    ]
    band_of = _picker(rng, mix.bands, [b.weight for b in mix.bands]) if mix.bands else None
    tenant_of = _picker(rng, mix.tenants, [t.weight for t in mix.tenants]) if mix.tenants else None
    path = cfg.base_path + ROUTES[cfg.route]
    out = []
    for i, at in enumerate(times):
        band = band_of() if band_of else None
        tenant = tenant_of() if tenant_of else None
        stream = rng.random() < mix.stream_share
        ptoks = mix.prompt_tokens.sample(rng)
        otoks = mix.output_tokens.sample(rng)
        group = rng.randrange(len(prefixes)) if prefixes and rng.random() < mix.prefix.share else -1
        if group >= 0 and mix.prefix.hot > 0:  # (no draw without it: seeded workloads stay as they were)
            group = 0 if rng.random() < mix.prefix.hot else 1 + rng.randrange(len(prefixes) - 1)
        session = f"sess-{rng.randrange(mix.sessions)}" if mix.sessions > 0 else ""
        # The unique tag follows the shared prefix so that only the prefix is shared.
        tag = f"Request {cfg.seed}-{i}: "
        body_len = max(0, ptoks * BYTES_PER_TOKEN - len(tag))
        prompt = (prefixes[group] if group >= 0 else "") + tag + text.take(rng, body_len)
        sla = band.sla_ms if band is not None and band.sla_ms is not None else cfg.sla_ms
        headers = {"x-request-id": f"lg-{cfg.seed}-{i}"}
        if band is not None:
            headers["x-velocity-priority"] = band.name
        if tenant is not None:
            headers["x-velocity-tenant"] = tenant.name
        if cfg.request_sla and (cfg.send_sla or (band is not None and band.sla_ms is not None)):
            headers["x-velocity-sla-ms"] = str(int(sla))
        if session:
            headers["x-session-id"] = session
        key = tenant.api_key if tenant is not None and tenant.api_key else cfg.api_key
        if key:
            headers["authorization"] = f"Bearer {key}"
        shape = None
        if shaped:  # three draws a request, whatever the shares: seeds stay comparable
            shape = (
                crng.random() < clients.no_max_tokens,
                crng.random() < clients.priority_zero,
                crng.random() < clients.sampling,
                crng.randrange(len(TEMPERATURES)),
                crng.randrange(len(STOPS)),
            )
        body = _body(cfg, prompt, otoks, stream, shape)
        if shape is not None and shape[0]:
            otoks = 0
        out.append(
            RequestSpec(
                index=i,
                at=at,
                band=band.name if band else "",
                tenant=tenant.name if tenant else "",
                stream=stream,
                prompt_tokens=ptoks + (mix.prefix.tokens if group >= 0 else 0),
                max_tokens=otoks,
                prefix_group=group,
                sla_ms=sla,
                session=session,
                path=path,
                headers=headers,
                body=body,
                wire=render_request("POST", path, cfg.host, headers, body),
            )
        )
    return out


def _body(cfg: WorkloadConfig, prompt: str, max_tokens: int, stream: bool, shape: tuple | None = None) -> bytes:
    """The request body; ``shape`` (no max_tokens, priority 0, sampling, temperature and
    stop picks) writes it as that kind of client does."""
    if cfg.route == "generate":
        obj: dict = {"prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    else:
        obj = {}
        if cfg.model:
            obj["model"] = cfg.model
        if cfg.route == "chat":
            obj["messages"] = [{"role": "user", "content": prompt}]
        else:
            obj["prompt"] = prompt
        if shape is not None and shape[0]:
            # No limit, as most OpenAI clients send: the reply ends where the model ends it.
            obj["stream"] = stream
        else:
            # ignore_eos (a vLLM extension) makes real engines generate exactly max_tokens,
            # so that output lengths are part of the seeded workload there too.
            obj.update(max_tokens=max_tokens, stream=stream, ignore_eos=True)
        if shape is not None:
            if shape[1]:
                obj["priority"] = 0
            if shape[2]:
                obj["temperature"] = TEMPERATURES[shape[3]]
                obj["stop"] = STOPS[shape[4]]
        if stream:
            obj["stream_options"] = {"include_usage": True}
    return orjson.dumps(obj)


def render_request(method: str, path: str, host: str, headers: dict[str, str], body: bytes) -> bytes:
    """The HTTP/1.1 request bytes (keep-alive, Content-Length framing)."""
    lines = [
        f"{method} {path} HTTP/1.1",
        f"host: {host}",
        "content-type: application/json",
        f"content-length: {len(body)}",
    ]
    lines.extend(f"{k}: {v}" for k, v in headers.items())
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
