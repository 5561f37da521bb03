"""Precise prefix routing, the request side: prompts as token blocks, matched against the
engines' own KV events (docs/kv-events.md, "Precise routing in the gateway").

    precise = PrecisePrefix(settings, block_index, registry=reg, block_size=fn)
    router = Router(settings, registry=reg, precise=precise)  # calls attach() and choose()
    ...
    precise.close()

- ``attach(info, body, data)`` (on the event loop, for a chat-profile request of a
  precise pool) looks the prompt up in the token cache and, when it is not all there,
  hands it to the tokenizer thread. It never tokenizes and never waits.
- The **token cache** is keyed by the prompt's message chain: the key of messages
  ``0..j`` is a chained hash of their canonical bytes (the same bytes approximate
  hashing reads, split at message starts). An entry holds the token-block chain of
  those messages under the chat template, the tokens left over after the last full
  block, and the chain of the whole prompt (with the assistant's opening) for a request
  that ends there. A conversation's next turn finds its earlier turn's messages at once
  (precise routing on that prefix with no tokenizing), and the thread tokenizes only
  the new messages.
- ``choose(...)`` (the chat profile of a precise pool): an endpoint whose index is
  ``exact`` scores ``BlockIndex.match`` over the prompt's token chain; any other, and
  every endpoint while the request's tokens are not ready, scores the approximate
  index, with the same load balance and hot-spot guard as approximate routing.

ChatML is applied per message as the sim engine's template does
(``<|im_start|>role\\ncontent<|im_end|>\\n``, then ``<|im_start|>assistant\\n``); the
per-message tokens are the whole prompt's when the markers are special tokens, which a
probe checks once per tokenizer (otherwise each prompt is tokenized whole and cached
whole).
"""
from __future__ import annotations

import logging
import os
import queue
import threading
from collections import OrderedDict
from typing import Any, Callable

import msgspec

from velocity_fast.kvevents.index import BlockIndex, extend_chain
from velocity_fast.metrics.registry import Registry
from velocity_fast.routing.prefix import choose_by_affinity
from velocity_fast.routing.settings import RoutingSettings

__all__ = ["PrecisePrefix", "PreciseRequest", "chat_template", "message_texts", "load_tokenizer"]

log = logging.getLogger("velocity.precise")

_MSG = b"\x1e"          # the message separator of routing/prefix_render.py
_TIE = 1e-9
_STOP = object()
#: Token jobs waiting at most; past it a request stays approximate (counted as dropped).
MAX_PENDING = 4096
DEFAULT_BLOCK_SIZE = 16


def chat_template(messages: list[tuple[str, str]]) -> str:
    """ChatML, as the sim engine's template: each message, then the assistant's opening."""
    return "".join(_chatml_one(r, t) for r, t in messages) + _GEN_PROMPT


def _chatml_one(role: str, text: str) -> str:
    return f"<|im_start|>{role}\n{text}<|im_end|>\n"


_GEN_PROMPT = "<|im_start|>assistant\n"


def _get(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def message_texts(messages: list) -> list[tuple[str, str]]:
    """(role, text) of each message; of a content list only the text parts count (as the
    sim engine reads them)."""
    out = []
    for m in messages:
        if isinstance(m, msgspec.Raw):
            m = msgspec.json.decode(m)
        c = _get(m, "content")
        if c is None:
            text = ""
        elif isinstance(c, str):
            text = c
        elif isinstance(c, list):
            text = "".join((_get(p, "text") or "") for p in c if _get(p, "type") == "text")
        else:
            text = str(c)
        out.append((str(_get(m, "role") or ""), text))
    return out


def load_tokenizer(path: str):
    """A ``tokenizers.Tokenizer`` from a tokenizer.json or a model folder holding one;
    ValueError with the reason otherwise."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError("precise prefix routing needs the `tokenizers` package "
                         "(pip install velocityllm[tokenizers])") from None
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    try:
        return Tokenizer.from_file(file)
    except Exception as e:
        raise ValueError(f"tokenizer {path}: cannot load a tokenizer.json: {e}") from None


class PreciseRequest:
    """One request's token side. ``chain`` is None until its tokens are ready (then the
    token-block chain, possibly of a leading part of the prompt only)."""

    __slots__ = ("owner", "pool", "chain", "block_size")

    def __init__(self, owner: "PrecisePrefix", pool: "_PoolTokens") -> None:
        self.owner = owner
        self.pool = pool
        self.chain: list[int] | None = None
        self.block_size = pool.block_size


class _Entry:
    __slots__ = ("chain", "rest", "full")

    def __init__(self, chain: list[int] | None, rest: tuple, full: list[int]) -> None:
        self.chain = chain   # blocks of the messages up to here (None: not split by message)
        self.rest = rest     # their tokens after the last full block
        self.full = full     # blocks of the prompt that ends here (with the assistant's opening)


class _PoolTokens:
    """One precise pool's tokenizer, block size and token cache."""

    def __init__(self, model: str, tokenizer: Any, split_ok: bool, gen_ids: tuple, capacity: int,
                 block_size: int) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.split_ok = split_ok
        self.gen_ids = gen_ids
        self.capacity = capacity
        self.block_size = block_size
        self.seed = hash(("velocity-precise", model))
        self.cache: OrderedDict[int, _Entry] = OrderedDict()

    def put(self, key: int, entry: _Entry) -> None:
        c = self.cache
        c[key] = entry
        c.move_to_end(key)
        while len(c) > self.capacity:
            c.popitem(last=False)


def _split_ok(tok: Any) -> bool:
    """Whether tokens per message are the whole prompt's tokens (the markers are special
    tokens that cut the text), on a probe conversation."""
    msgs = [("system", "you are brief."), ("user", "hello there, who are you?"), ("assistant", "me.")]
    whole = tok.encode(chat_template(msgs), add_special_tokens=False).ids
    parts: list[int] = []
    for r, t in msgs:
        parts += tok.encode(_chatml_one(r, t), add_special_tokens=False).ids
    parts += tok.encode(_GEN_PROMPT, add_special_tokens=False).ids
    return whole == parts


class PrecisePrefix:
    """The token side of precise pools and their scoring; see the module doc."""

    def __init__(self, settings: RoutingSettings, index: BlockIndex, *, registry: Registry | None = None,
                 block_size: Callable[[str], int] | None = None) -> None:
        self.settings = settings
        self.index = index
        self._block_size = block_size or (lambda model: DEFAULT_BLOCK_SIZE)
        self._tokenizers: dict[str, Any] = {}   # path -> (Tokenizer, split_ok, gen ids)
        self._pools: dict[str, _PoolTokens | None] = {}
        for path in {settings.tokenizer, *settings.tokenizers.values()} - {None}:
            self._load(path)
        reg = registry if registry is not None else Registry()
        self._picks = _adopt(reg, "counter", "velocity_prefix_precise_picks_total",
                             "Chat-profile picks in precise pools, by how they were scored: precise (the "
                             "engines' KV events), not_ready (tokens not ready: approximate), not_exact (no "
                             "candidate's index exact: approximate).", ("model", "how"))
        self._lookups = _adopt(reg, "counter", "velocity_prefix_token_cache_total",
                               "Token-cache look-ups of precise pools: hit (the whole prompt), prefix (its "
                               "leading messages), miss.", ("result",))
        self._jobs = _adopt(reg, "counter", "velocity_prefix_tokenize_total",
                            "Prompts handed to the tokenizer thread: done, dropped (queue full), failed.",
                            ("result",))
        self._tokens = _adopt(reg, "counter", "velocity_prefix_tokenized_tokens_total",
                              "Tokens the tokenizer thread produced (a next turn counts only its new messages).")
        share = self.precise_share
        if reg.get("velocity_prefix_precise_share") is None:
            reg.gauge_fn("velocity_prefix_precise_share", "Share of chat-profile picks in precise pools that "
                         "were scored by the engines' KV events.", share)
        else:
            reg.get("velocity_prefix_precise_share").fn = share
        self._pick_children: dict[tuple[str, str], Any] = {}
        self._hit = self._lookups.labels("hit")
        self._prefix_hit = self._lookups.labels("prefix")
        self._miss = self._lookups.labels("miss")
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="precise-tokenizer", daemon=True)
        self._thread.start()

    def _load(self, path: str) -> tuple:
        got = self._tokenizers.get(path)
        if got is None:
            tok = load_tokenizer(path)
            got = self._tokenizers[path] = (tok, _split_ok(tok),
                                            tuple(tok.encode(_GEN_PROMPT, add_special_tokens=False).ids))
        return got

    def close(self) -> None:
        """End the tokenizer thread (jobs still queued are left: their requests route
        approximately)."""
        self._queue.put(_STOP)
        self._thread.join(2.0)

    # -- the event loop's side ------------------------------------------------------------
    def _pool(self, model: str) -> _PoolTokens | None:
        path = self.settings.tokenizer_for(model)
        if path is None:
            pool = None
        else:
            tok, split_ok, gen = self._load(path)
            pool = _PoolTokens(model, tok, split_ok, gen, self.settings.token_cache_entries,
                               self._block_size(model) or DEFAULT_BLOCK_SIZE)
        self._pools[model] = pool
        return pool

    def attach(self, info: Any, body: Any, data: bytes) -> None:
        """Give ``info`` its token side: the cached chain when the cache has the prompt (or
        its leading messages); the rest is tokenized on the thread."""
        model = info.model
        pool = self._pools.get(model)
        if pool is None:
            if model in self._pools:
                return
            pool = self._pool(model)
            if pool is None:
                return
        req = PreciseRequest(self, pool)
        info.precise = req
        messages = _get(body, "messages") if body is not None and not isinstance(body, (bytes, bytearray)) else None
        cache = pool.cache
        if messages:
            keys = []
            k = pool.seed
            for piece in (data if type(data) is bytes else bytes(data)).split(_MSG)[1:]:
                k = hash((k, piece))
                keys.append(k)
            j = len(keys) - 1
            entry = None
            while j >= 0:
                entry = cache.get(keys[j])
                if entry is not None and (entry.chain is not None or j == len(keys) - 1):
                    break
                j -= 1
            if j == len(keys) - 1 and entry is not None:
                req.chain = entry.full
                self._hit.inc()
                return
            if j >= 0:
                req.chain = entry.chain  # the leading messages now; the thread adds the rest
                self._prefix_hit.inc()
            else:
                self._miss.inc()
            self._submit((req, messages, keys, j))
        else:
            key = hash((pool.seed, b"\x00prompt", data if type(data) is bytes else bytes(data)))
            entry = cache.get(key)
            if entry is not None:
                req.chain = entry.full
                self._hit.inc()
                return
            self._miss.inc()
            self._submit((req, _get(body, "prompt") if body is not None else None, key, None))

    def _submit(self, job: tuple) -> None:
        if self._queue.qsize() >= MAX_PENDING:
            self._jobs.labels("dropped").inc()
            return
        self._queue.put(job)

    # -- the tokenizer thread -----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is _STOP:
                return
            try:
                self._tokenize(*job)
            except Exception:  # one odd prompt must not end the thread
                log.exception("precise prefix: tokenizing a prompt failed")
                self._jobs.labels("failed").inc()
            else:
                self._jobs.labels("done").inc()

    def _tokenize(self, req: PreciseRequest, what: Any, keys: Any, j: int | None) -> None:
        pool = req.pool
        bs = self._block_size(pool.model) or DEFAULT_BLOCK_SIZE
        if bs != pool.block_size:  # the engines' block size became known: earlier chains are void
            pool.cache.clear()
            pool.block_size = bs
            j = -1 if j is not None else None
        req.block_size = bs
        tok = pool.tokenizer
        if j is None:  # a completions prompt: text (special tokens as vLLM adds them) or token ids
            prompt = what[0] if isinstance(what, list) and what and isinstance(what[0], (str, list)) else what
            if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                ids = prompt
            else:
                ids = tok.encode_batch([prompt if isinstance(prompt, str) else str(prompt)],
                                       add_special_tokens=True)[0].ids
            self._tokens.inc(len(ids))
            full = extend_chain((), ids, bs)
            pool.put(keys, _Entry(None, (), full))
            req.chain = full
            return
        if isinstance(what, msgspec.Raw):  # as the gateway's request decoder leaves them
            what = msgspec.json.decode(what)
        if not isinstance(what, list):
            return  # not a list of messages: the request stays approximate
        texts = message_texts(what)
        cacheable = len(texts) == len(keys)  # else a message's text held the separator byte
        if pool.split_ok and cacheable:
            start = j + 1
            entry = pool.cache.get(keys[j]) if j >= 0 else None
            if entry is None or entry.chain is None:
                start, chain, rest = 0, [], ()
            else:
                chain, rest = entry.chain, entry.rest
            # encode_batch runs with the interpreter lock released: the event loop goes on.
            encs = tok.encode_batch([_chatml_one(r, t) for r, t in texts[start:]], add_special_tokens=False)
            full = chain
            for i, enc in enumerate(encs):
                ids = rest + tuple(enc.ids)
                self._tokens.inc(len(enc.ids))
                new = extend_chain(chain, ids, bs)
                rest = ids[(len(new) - len(chain)) * bs:]
                chain = new
                full = extend_chain(chain, rest + pool.gen_ids, bs)
                pool.put(keys[start + i], _Entry(chain, rest, full))
            if start == len(texts):  # every message was cached but not as a whole prompt
                full = extend_chain(chain, rest + pool.gen_ids, bs)
            req.chain = full
            return
        ids = tok.encode_batch([chat_template(texts)], add_special_tokens=False)[0].ids
        self._tokens.inc(len(ids))
        full = extend_chain((), ids, bs)
        if cacheable and keys:
            pool.put(keys[-1], _Entry(None, (), full))
        req.chain = full

    # -- scoring (the chat profile of a precise pool) --------------------------------------------
    def choose(self, req: PreciseRequest, cands: list, loads: list, info: Any, state: Any,
               rand: int) -> tuple[int, str]:
        """(position in cands, basis), as ``choose_by_affinity``; endpoints whose KV index
        is exact score the engine's own blocks, the others the approximate index."""
        chain = req.chain
        if chain is None:
            self._count(info.model, "not_ready")
            s = self.settings
            return choose_by_affinity(state.index, info.hashes, cands, loads, s.hotspot_gap, s.load_weight, rand)
        match = self.index.match_exact
        bs = req.block_size
        n = len(chain)
        aff: list[float] = []
        approx = None
        used = False
        for ep in cands:
            held = match(ep.name, chain, bs)
            if held >= 0:
                used = True
                aff.append(held / n if n else 0.0)
                continue
            if approx is None:
                approx = state.index.match(info.hashes) if info.nblocks else []
            slot = state.index.slot_of(ep.name)
            aff.append(approx[slot] / info.nblocks if 0 <= slot < len(approx) else 0.0)
        s = self.settings
        if not used:
            self._count(info.model, "not_exact")
            return choose_by_affinity(state.index, info.hashes, cands, loads, s.hotspot_gap, s.load_weight, rand)
        self._count(info.model, "precise")
        return score(aff, loads, s.hotspot_gap, s.load_weight, rand)

    def _count(self, model: str, how: str) -> None:
        child = self._pick_children.get((model, how))
        if child is None:
            child = self._pick_children[(model, how)] = self._picks.labels(model, how)
        child.inc()

    def precise_share(self) -> float:
        """Precise picks over all picks of precise pools (0 before any)."""
        total = precise = 0.0
        for key, child in list(self._picks._children.items()):
            total += child.value
            if key[1] == "precise":
                precise += child.value
        return precise / total if total else 0.0

    def stats(self) -> dict:
        return {"share": round(self.precise_share(), 4), "pools": {m: {"cached": len(p.cache), "block_size": p.block_size, "split_by_message": p.split_ok}
                for m, p in self._pools.items() if p is not None}}


def score(aff: list[float], loads: list, hotspot_gap: float, load_weight: float, rand: int) -> tuple[int, str]:
    """The chat profile's rule over given affinities (``choose_by_affinity``'s, in Python):
    affinity less load_weight per hotspot_gap of load above the least; past the gap, the
    least loaded (the most affine among them); no affinity anywhere: the least loaded."""
    min_load = min(loads)
    nc = len(aff)
    if max(aff) <= 0.0:
        return _nth_tie(aff, [i for i in range(nc) if loads[i] <= min_load + _TIE], rand), "load"
    cost = load_weight / hotspot_gap if hotspot_gap > 0 else load_weight
    sc = [aff[i] - cost * (loads[i] - min_load) for i in range(nc)]
    best = _nth_tie(sc, range(nc), rand)
    if loads[best] - min_load > hotspot_gap:
        return _nth_tie(aff, [i for i in range(nc) if loads[i] <= min_load + _TIE], rand), "hotspot"
    return best, "prefix"


def _nth_tie(values: list[float], among: Any, rand: int) -> int:
    """Position of the highest of ``values`` among positions ``among``, ties by ``rand``."""
    top = max(values[i] for i in among)
    ties = [i for i in among if values[i] >= top - _TIE]
    return ties[0] if len(ties) == 1 else ties[rand % len(ties)]


def _adopt(reg: Any, kind: str, name: str, help: str, labels: tuple = ()) -> Any:
    got = reg.get(name)
    return got if got is not None else getattr(reg, kind)(name, help, labels)
