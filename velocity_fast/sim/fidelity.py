"""Sim fidelity: the same calls to a sim engine and to a vLLM engine, and what differs in
what a gateway or a client reads from them.

    python -m velocity_fast.sim.fidelity --vllm http://127.0.0.1:8000 --vllm-kv ipc:///tmp/e1.kv \\
        --sim http://127.0.0.1:8100 --sim-kv tcp://127.0.0.1:8101 [--topic kv] [--json]

Both engines serve the same model name (the sim with ``--tokenizer`` set to the model's
tokenizer.json and ``--block-size`` to the engine's). Each call's answer is reduced to its
shape: the status, the header names, the JSON keys with their types (values only where
they are the contract: ``object``, the error ``type`` and ``code``), the SSE frames, the
metric families a gateway scrapes with their types and label names, and the fields of a
KV event batch. The two reductions are then compared key by key.

A difference is either fixed in the sim or listed in ``DELIBERATE`` with its reason (and in
docs/design.md, "Sim fidelity"). Exit status 0 when every difference is deliberate, 1 when
one is not, 2 when an engine cannot be reached.
"""

from __future__ import annotations

import argparse
import fnmatch
import http.client
import json
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

__all__ = ["DELIBERATE", "Report", "observe", "compare", "main"]

#: Differences kept on purpose: a key pattern (fnmatch) and why.
DELIBERATE: dict[str, str] = {
    "metrics:family:*": "the sim exports the families a gateway or a dashboard reads, not all of vLLM's",
    "metrics:vllm:cache_config_info:other-labels": "the sim labels cache_config_info with what a gateway "
    "reads of it (block_size, num_gpu_blocks, prefix caching)",
    "embeddings:*": "vLLM serves /v1/embeddings only for a pooling model (--runner pooling); the sim serves it "
    "for its one model, so that a gateway's relay of it can be tested without a second engine",
    "*:header-names": "server and vary are uvicorn's and its CORS middleware's; connection and cache-control "
    "are the sim's HTTP/1.1 server's. A gateway reads the content type, compared apart",
}

#: cache_config_info's labels that a gateway reads; vLLM writes about forty.
_CACHE_LABELS = {"block_size", "num_gpu_blocks", "enable_prefix_caching", "engine"}

#: Metric families whose names, types and labels are compared (what fleet/scrape.py and the
#: shipped dashboards read).
METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:inter_token_latency_seconds",
    "vllm:time_to_first_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:num_preemptions",
)

#: Values that are the contract, not content: kept in the shape.
_VALUE_KEYS = {"object", "type", "code", "role", "finish_reason_kind"}

_PROMPT = (
    "The gateway keeps each request until an engine has room for it, and it routes a "
    "request to the engine that already holds its prefix in the cache. "
) * 6


@dataclass
class Report:
    """Per key, the sim's and vLLM's shape, and which differences are deliberate."""

    sim: dict[str, Any] = field(default_factory=dict)
    vllm: dict[str, Any] = field(default_factory=dict)
    differences: list[tuple[str, Any, Any, str | None]] = field(default_factory=list)

    @property
    def undeclared(self) -> list[tuple[str, Any, Any]]:
        return [(k, s, v) for k, s, v, why in self.differences if why is None]

    def text(self) -> str:
        lines = [
            f"{len(self.sim)} sim keys, {len(self.vllm)} vLLM keys, {len(self.differences)} differences "
            f"({len(self.undeclared)} not deliberate)"
        ]
        for k, s, v, why in self.differences:
            mark = "deliberate" if why else "DIFFERS"
            lines.append(
                f"  {mark:10} {k}\n      sim:  {s!r}\n      vllm: {v!r}" + (f"\n      why:  {why}" if why else "")
            )
        return "\n".join(lines)


def _shape(x: Any, path: str, out: dict[str, str]) -> None:
    """Flattens JSON into ``path: type`` (lists merged over their items)."""
    if isinstance(x, dict) and path.endswith("top_logprobs[]") and all(isinstance(v, float) for v in x.values()):
        out[path] = "map<str,number>"  # completions: token -> logprob
        return
    if isinstance(x, dict):
        for k, v in x.items():
            p = f"{path}.{k}" if path else k
            if k in _VALUE_KEYS and isinstance(v, str):
                out[p] = f"str={v}"
                continue
            _shape(v, p, out)
        if not x:
            out[path] = "{}"
        return
    if isinstance(x, list):
        if not x:
            out.setdefault(path + "[]", "empty")
        for v in x:
            _shape(v, path + "[]", out)
        return
    t = (
        "null"
        if x is None
        else "bool"
        if isinstance(x, bool)
        else "int"
        if isinstance(x, int)
        else "number"
        if isinstance(x, float)
        else "str"
        if isinstance(x, str)
        else type(x).__name__
    )
    prev = out.get(path)
    # An int where a float is expected (0 vs 0.5) is one JSON number to a client.
    if prev is not None and prev != t and {prev, t} <= {"int", "number"}:
        t = "number"
    out[path] = t


_SKIP_HEADERS = {"date", "content-length", "x-request-id"}


def _call(
    base: str, method: str, path: str, body: Any = None, raw: bytes | None = None, timeout: float = 60.0
) -> tuple[int, dict[str, str], bytes]:
    u = urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        headers = {"content-type": "application/json"} if data is not None else {}
        conn.request(method, path, body=data, headers=headers)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def _headers(name: str, h: dict[str, str], obs: dict[str, Any]) -> None:
    obs[f"{name}:content-type"] = h.get("content-type", "").split(";")[0].strip()
    obs[f"{name}:header-names"] = ",".join(sorted(k for k in h if k not in _SKIP_HEADERS))


def _sse(body: bytes) -> list[str]:
    """The frames of a stream, each as its shape; consecutive equal shapes once."""
    frames: list[str] = []
    for block in body.decode(errors="replace").split("\n\n"):
        block = block.strip()
        if not block or block.startswith(":"):
            continue
        event = ""
        if block.startswith("event: ") and "\n" in block:  # the Responses and Messages APIs name events
            head, block = block.split("\n", 1)
            event = head[7:].strip() + " "
        if not block.startswith("data: "):
            frames.append("not-data: " + block[:40])
            continue
        payload = block[6:]
        if payload == "[DONE]":
            shape = "[DONE]"
        else:
            out: dict[str, str] = {}
            try:
                _shape(json.loads(payload), "", out)
            except ValueError:
                out = {"?": "not json"}
            shape = event + json.dumps(dict(sorted(out.items())))
        if not frames or frames[-1] != shape:
            frames.append(shape)
    return frames


def _calls(model: str, max_len: int) -> list[tuple[str, str, str, Any, bytes | None, bool]]:
    """(name, method, path, json body, raw body, streamed)."""
    chat = {
        "model": model,
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 4,
        "ignore_eos": True,
    }
    comp = {"model": model, "prompt": "Once upon a time", "max_tokens": 4, "ignore_eos": True}
    return [
        ("models", "GET", "/v1/models", None, None, False),
        ("model", "GET", f"/v1/models/{model}", None, None, False),
        ("health", "GET", "/health", None, None, False),
        ("version", "GET", "/version", None, None, False),
        ("chat", "POST", "/v1/chat/completions", chat, None, False),
        (
            "chat-stream",
            "POST",
            "/v1/chat/completions",
            {**chat, "stream": True, "stream_options": {"include_usage": True}},
            None,
            True,
        ),
        ("chat-stream-plain", "POST", "/v1/chat/completions", {**chat, "stream": True}, None, True),
        (
            "chat-n2-logprobs",
            "POST",
            "/v1/chat/completions",
            {**chat, "n": 2, "logprobs": True, "top_logprobs": 2},
            None,
            False,
        ),
        ("completion", "POST", "/v1/completions", comp, None, False),
        (
            "completion-stream",
            "POST",
            "/v1/completions",
            {**comp, "stream": True, "stream_options": {"include_usage": True}},
            None,
            True,
        ),
        ("completion-logprobs", "POST", "/v1/completions", {**comp, "logprobs": 2}, None, False),
        # Stop strings both engines meet within a few tokens, so that the shape compared
        # is always that of a reply a stop string ended (stop_reason the string): every
        # sim word starts with a space, and a BPE reply of 8 tokens without a space, an
        # "e" or an "a" is rare. (With "the" it was content: vLLM's sampled reply met it
        # in one run, the sim's did not.)
        (
            "completion-stop",
            "POST",
            "/v1/completions",
            {**comp, "max_tokens": 8, "stop": [" ", "e", "a"]},
            None,
            False,
        ),
        (
            "responses",
            "POST",
            "/v1/responses",
            {"model": model, "input": "Say something.", "max_output_tokens": 4},
            None,
            False,
        ),
        (
            "responses-stream",
            "POST",
            "/v1/responses",
            {"model": model, "input": "Say something.", "max_output_tokens": 4, "stream": True},
            None,
            True,
        ),
        (
            "messages",
            "POST",
            "/v1/messages",
            {"model": model, "max_tokens": 4, "messages": chat["messages"]},
            None,
            False,
        ),
        (
            "messages-stream",
            "POST",
            "/v1/messages",
            {"model": model, "max_tokens": 4, "messages": chat["messages"], "stream": True},
            None,
            True,
        ),
        ("embeddings", "POST", "/v1/embeddings", {"model": model, "input": "Say something."}, None, False),
        ("tokenize", "POST", "/tokenize", {"model": model, "prompt": "Once upon a time"}, None, False),
        ("detokenize", "POST", "/detokenize", {"model": model, "tokens": [1, 2, 3]}, None, False),
        # vLLM 0.32 takes any integer priority under its default fcfs policy (and ignores it).
        ("chat-priority", "POST", "/v1/chat/completions", {**chat, "priority": 3}, None, False),
        ("err-unknown-model", "POST", "/v1/chat/completions", {**chat, "model": "no-such-model"}, None, False),
        ("err-past-context", "POST", "/v1/chat/completions", {**chat, "max_tokens": max_len + 1}, None, False),
        ("err-bad-json", "POST", "/v1/chat/completions", None, b"{not json", False),
        ("err-no-messages", "POST", "/v1/chat/completions", {"model": model, "max_tokens": 4}, None, False),
        ("err-bad-temperature", "POST", "/v1/chat/completions", {**chat, "temperature": -1}, None, False),
        ("err-bad-max-tokens", "POST", "/v1/completions", {**comp, "max_tokens": "four"}, None, False),
        ("err-n-zero", "POST", "/v1/completions", {**comp, "n": 0}, None, False),
        ("err-bad-priority", "POST", "/v1/chat/completions", {**chat, "priority": "first"}, None, False),
        ("err-unknown-route", "GET", "/v1/no-such-route", None, None, False),
    ]


def _metrics(text: str) -> dict[str, str]:
    types: dict[str, str] = {}
    labels: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(None, 3)
            types[name] = kind
        elif line and not line.startswith("#"):
            m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? ", line)
            if m:
                ls = set(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', m.group(2) or ""))
                labels.setdefault(m.group(1), set()).update(ls)
    out: dict[str, str] = {}
    for fam in METRICS:
        kind = types.get(fam) or types.get(fam + "_total")
        if kind is None:
            continue
        out[f"metrics:{fam}:type"] = kind
        suffixes = ("", "_total", "_bucket", "_sum", "_count")  # not prometheus_client's _created
        for n in (fam + x for x in suffixes):
            ls = labels.get(n)
            if ls is None:
                continue
            if fam == "vllm:cache_config_info":
                out[f"metrics:{fam}:other-labels"] = ",".join(sorted(ls - _CACHE_LABELS))
                ls = ls & _CACHE_LABELS
            # engine/model labels carry values of their own; their names are the contract.
            out[f"metrics:{n}:labels"] = ",".join(sorted(ls - {"le"}))
    for fam, kind in types.items():
        if fam.startswith("vllm:"):
            out[f"metrics:family:{fam.removesuffix('_total')}"] = kind
    return out


def _kv_events(endpoint: str, topic: str, send) -> dict[str, str]:
    """Subscribes, runs ``send()``, and reduces the batches that arrive within 3 s."""
    import msgspec
    import zmq

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
    sock.connect(endpoint)
    out: dict[str, str] = {}
    try:
        time.sleep(0.5)  # the subscription reaches the publisher before the events do
        t = threading.Thread(target=send, daemon=True)
        t.start()
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            if not sock.poll(200):
                continue
            frames = sock.recv_multipart()
            out["kv:frames"] = f"{len(frames)}"
            out["kv:topic"] = frames[0].decode(errors="replace")
            out["kv:seq"] = f"{len(frames[1])}-byte big-endian" if len(frames) == 3 else "?"
            batch = msgspec.msgpack.decode(frames[-1])
            out["kv:batch"] = (
                type(batch).__name__ + f"[{len(batch)}]" if isinstance(batch, list) else type(batch).__name__
            )
            for ev in batch[1] if isinstance(batch, list) and len(batch) > 1 else []:
                tag = ev.get("type") if isinstance(ev, dict) else ev[0] if ev else "?"
                fields: dict[str, str] = {}
                if isinstance(ev, dict):
                    _shape({k: v for k, v in ev.items() if k != "type"}, "", fields)
                else:
                    fields["array"] = f"len={len(ev)}"
                for k, v in fields.items():
                    out[f"kv:{tag}.{k}"] = v
        t.join(5)
    finally:
        sock.close()
    return out


def observe(base: str, model: str, kv: str | None = None, topic: str = "kv", max_len: int = 4096) -> dict[str, Any]:
    """One engine's answers to every call, reduced to shapes."""
    obs: dict[str, Any] = {}
    for name, method, path, body, raw, streamed in _calls(model, max_len):
        status, headers, data = _call(base, method, path, body, raw)
        obs[f"{name}:status"] = status
        _headers(name, headers, obs)
        if streamed and status == 200:
            obs[f"{name}:sse"] = _sse(data)
            continue
        try:
            doc = json.loads(data) if data else None
        except ValueError:
            obs[f"{name}:body"] = "not json: " + data[:60].decode(errors="replace")
            continue
        shape: dict[str, str] = {}
        _shape(doc, "", shape)
        for k, v in shape.items():
            obs[f"{name}:body:{k}"] = v
    status, _, text = _call(base, "GET", "/metrics")
    obs["metrics:status"] = status
    obs.update(_metrics(text.decode(errors="replace")))
    if kv:
        # New blocks each run (a nonce first): an engine publishes only what it did not hold.
        long_chat = {
            "model": model,
            "messages": [{"role": "user", "content": f"{time.time()} {_PROMPT}"}],
            "max_tokens": 2,
        }
        obs.update(_kv_events(kv, topic, lambda: _call(base, "POST", "/v1/chat/completions", long_chat)))
    return obs


def compare(sim: dict[str, Any], vllm: dict[str, Any]) -> Report:
    rep = Report(sim=sim, vllm=vllm)
    for k in sorted(set(sim) | set(vllm)):
        s, v = sim.get(k), vllm.get(k)
        if s == v:
            continue
        why = next((r for pat, r in DELIBERATE.items() if fnmatch.fnmatchcase(k, pat)), None)
        rep.differences.append((k, s, v, why))
    return rep


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m velocity_fast.sim.fidelity", description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm", required=True, help="a vLLM engine's base URL")
    p.add_argument("--sim", required=True, help="a sim engine's base URL (same model name, tokenizer and block size)")
    p.add_argument("--vllm-kv", default=None, help="the vLLM engine's KV events PUB address")
    p.add_argument("--sim-kv", default=None, help="the sim engine's KV events PUB address")
    p.add_argument("--topic", default="kv", help="the KV events topic of both (default %(default)s)")
    p.add_argument("--model", default=None, help="the served model name (default: the first of vLLM's /v1/models)")
    p.add_argument("--max-model-len", type=int, default=None, help="default: vLLM's /v1/models max_model_len")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    a = p.parse_args(argv)
    try:
        _, _, data = _call(a.vllm, "GET", "/v1/models", timeout=10)
        card = json.loads(data)["data"][0]
    except (OSError, ValueError, KeyError, IndexError) as e:
        print(f"fidelity: cannot read {a.vllm}/v1/models: {e}", file=sys.stderr)
        return 2
    model = a.model or card["id"]
    max_len = a.max_model_len or int(card.get("max_model_len") or 4096)
    try:
        rep = compare(
            observe(a.sim, model, a.sim_kv, a.topic, max_len), observe(a.vllm, model, a.vllm_kv, a.topic, max_len)
        )
    except OSError as e:
        print(f"fidelity: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(
            json.dumps(
                {
                    "differences": [
                        {"key": k, "sim": s, "vllm": v, "deliberate": why} for k, s, v, why in rep.differences
                    ]
                },
                indent=1,
            )
        )
    else:
        print(rep.text())
    return 1 if rep.undeclared else 0


if __name__ == "__main__":
    sys.exit(main())
