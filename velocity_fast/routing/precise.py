"""Precise prefix routing, the request side: prompts as token blocks, matched against the
engines' own KV events (docs/kv-events.md, "Precise routing in the gateway").

    precise = PrecisePrefix(settings, block_index, registry=reg, block_size=fn)
    router = Router(settings, registry=reg, precise=precise)  # calls attach() and choose()
    ...
    precise.close()

- ``attach(info, body, data)`` (on the event loop, for a chat-profile request of a
  precise pool) looks the prompt up in the token cache and, when it is not all there,
  hands it to the tokenizer thread. It never tokenizes and never waits.
- The **token cache** is keyed by the request's own approximate block hashes (the
  chained hashes of its rendered bytes): every prompt tokenized enters its byte blocks,
  each with how many of its token blocks are decided within the bytes up to it. A
  request binary-searches its chain for the longest entered block, so a next turn, a
  shared system prompt or a shared context inside one message is matched at once; a
  whole prompt seen before is a whole hit. The thread also keeps each run of leading
  messages (keyed by their byte pieces' chain), so that it tokenizes only new messages.
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
import time
from collections import OrderedDict, deque
from typing import Any, Callable

import msgspec

from velocity_fast.kvevents.index import BlockIndex, extend_chain, leading_in
from velocity_fast.metrics.registry import Registry
from velocity_fast.routing.affinity import score
from velocity_fast.routing.prefix import choose_by_affinity
from velocity_fast.routing.settings import RoutingSettings

__all__ = ["PrecisePrefix", "PreciseRequest", "chat_template", "message_texts", "load_tokenizer"]

log = logging.getLogger("velocity.precise")

_MSG = b"\x1e"          # the message separator of routing/prefix_render.py
_STOP = object()
#: Bytes before a byte block's end within which a token is not taken as decided (a word
#: cut by the block's end could tokenize otherwise once the rest of it comes).
_MARGIN = 16
#: Token jobs waiting at most; past it a request stays approximate (counted as dropped).
MAX_PENDING = 4096
DEFAULT_BLOCK_SIZE = 16
#: A prompt routed to an engine counts as on its way there (``_Placed``) until the
#: engine's events report its blocks, or this many seconds at most (a request that was
#: declined, failed or is still queued behind a long prefill), or until this many newer
#: ones on the same engine push it out.
PLACED_TTL_S = 10.0
PLACED_MAX = 64


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
    """One precise pool's tokenizer, block size and caches (see the module doc)."""

    def __init__(self, model: str, tokenizer: Any, split_ok: bool, gen_ids: tuple, capacity: int,
                 block_size: int) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.split_ok = split_ok
        self.gen_ids = gen_ids
        self.capacity = capacity
        self.block_size = block_size
        self.seed = hash(("velocity-precise", model))
        self.chatml = True   # the tokenizer knows ChatML's markers (else chat requests stay approximate)
        # Leading messages (their byte pieces' chain) -> their tokens' blocks: the thread's.
        self.cache: OrderedDict[int, _Entry] = OrderedDict()
        # A whole prompt (its last byte block's hash and its tail) -> its token blocks.
        self.whole: OrderedDict[int, list[int]] = OrderedDict()
        # A prompt byte block's chained hash (the approximate BlockHashes) -> (token blocks
        # of a prompt through it, how many of them lie within the bytes up to that block).
        self.blocks: OrderedDict[int, tuple[list[int], int]] = OrderedDict()

    def put(self, key: int, entry: _Entry) -> None:
        _bounded_put(self.cache, key, entry, max(1, self.capacity // 16))

    def clear(self) -> None:
        self.cache.clear()
        self.whole.clear()
        self.blocks.clear()


def _bounded_put(d: OrderedDict, key: Any, value: Any, capacity: int) -> None:
    d[key] = value
    d.move_to_end(key)
    while len(d) > capacity:
        d.popitem(last=False)


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


class _Placed:
    """Prompts routed to one engine whose blocks its events have not reported yet: the
    events come after the prefill, and until then the index alone would see an empty
    cache where the router has just sent work. ``items``: (time, chain, blocks it adds,
    blocks the engine's events showed of it then), oldest first; ``blocks``: the sum of
    the third."""

    __slots__ = ("blocks", "items")

    def __init__(self) -> None:
        self.items: deque = deque()
        self.blocks = 0


def _common(a: list[int], b: list[int]) -> int:
    """Leading blocks two chains share: chained hashes agree exactly up to where the two
    prompts part, so a binary search finds it."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi) >> 1
        if a[mid] == b[mid]:
            lo = mid + 1
        else:
            hi = mid
    return lo


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
        self._placed: dict[str, _Placed] = {}
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
            pool.chatml = all(tok.token_to_id(t) is not None for t in ("<|im_start|>", "<|im_end|>"))
            if not pool.chatml:
                log.warning("precise prefix routing, model %s: its tokenizer (%s) has no ChatML markers, so "
                            "chat prompts cannot be rendered as the engine renders them: chat requests are "
                            "routed approximately, completions precisely", model, path)
        self._pools[model] = pool
        return pool

    def attach(self, info: Any, body: Any, data: bytes) -> None:
        """Give ``info`` its token side: the whole prompt's token blocks when the cache has
        them, else those of its longest cached run of leading byte blocks (a binary search
        over the request's approximate block hashes); the thread tokenizes the rest."""
        model = info.model
        pool = self._pools.get(model)
        if pool is None:
            if model in self._pools:
                return
            pool = self._pool(model)
            if pool is None:
                return
        is_chat = body is not None and not isinstance(body, (bytes, bytearray)) and bool(_get(body, "messages"))
        if is_chat and not pool.chatml:
            return  # the engine's chat template is not the one applied here: no token match
        req = PreciseRequest(self, pool)
        info.precise = req
        if type(data) is not bytes:
            data = bytes(data)
        hashes = info.hashes
        n = len(hashes)  # a precise pool's chain is not thinned: n byte blocks
        wkey = hash((hashes[n - 1] if n else pool.seed, data[n * hashes.block_bytes:]))
        full = pool.whole.get(wkey)
        if full is not None:
            req.chain = full
            self._hit.inc()
            return
        blocks = pool.blocks
        lo = leading_in(blocks, hashes)  # (it caches runs of leading byte blocks: whole from the root)
        got = blocks.get(hashes[lo - 1]) if lo else None
        if got is not None and got[1]:
            req.chain = got[0][:got[1]]  # the leading part now; the thread adds the rest
            self._prefix_hit.inc()
        else:
            self._miss.inc()
        what = _get(body, "messages") if is_chat else (_get(body, "prompt") if body is not None else None)
        self._submit((req, is_chat, what, data, hashes, wkey, lo))

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

    def _tokenize(self, req: PreciseRequest, is_chat: bool, what: Any, data: bytes, hashes: Any,
                  wkey: int, known: int) -> None:
        pool = req.pool
        bs = self._block_size(pool.model) or DEFAULT_BLOCK_SIZE
        if bs != pool.block_size:  # the engines' block size became known: earlier chains are void
            pool.clear()
            pool.block_size = bs
        req.block_size = bs
        if is_chat:
            got = self._chat(pool, bs, what, data)
        else:
            got = self._prompt(pool, bs, what, data)
        if got is None:
            return  # not a prompt the template takes: the request stays approximate
        full, ends, since = got
        _bounded_put(pool.whole, wkey, full, max(1, self.settings.token_cache_entries // 16))
        self._register(pool, hashes, full, ends, since, known)
        req.chain = full

    def _register(self, pool: _PoolTokens, hashes: Any, full: list[int], ends: list[float], since: int,
                  known: int) -> None:
        """Enter the prompt's byte blocks ending after byte ``since`` and from block
        ``known`` on (earlier ones were entered by the requests that tokenized those bytes
        first): each with how many token blocks end, with a margin, within the bytes up to
        it. ``ends[k]``: the byte at which token block k is decided."""
        bb = hashes.block_bytes
        cap = self.settings.token_cache_entries
        blocks = pool.blocks
        k = 0
        nk = len(ends)
        for i in range(len(hashes)):
            b = (i + 1) * bb
            if b <= since or i < known:
                continue
            while k < nk and ends[k] <= b - _MARGIN:
                k += 1
            _bounded_put(blocks, hashes[i], (full, k), cap)

    def _chat(self, pool: _PoolTokens, bs: int, what: Any, data: bytes):
        if isinstance(what, msgspec.Raw):  # as the gateway's request decoder leaves them
            what = msgspec.json.decode(what)
        if not isinstance(what, list):
            return None
        texts = message_texts(what)
        tok = pool.tokenizer
        # The message pieces of the rendered bytes (routing/prefix_render.py): where each
        # message's content starts, to say at which byte each token is decided.
        pieces = data.split(_MSG)[1:]
        if len(pieces) != len(texts) or not pool.split_ok:
            ids = tok.encode_batch([chat_template(texts)], add_special_tokens=False)[0].ids
            self._tokens.inc(len(ids))
            return extend_chain((), ids, bs), [], len(data)  # no byte blocks entered
        starts, at = [], 0
        keys, k = [], pool.seed
        for piece in pieces:
            starts.append(at)  # the offset of the message's separator
            at += 1 + len(piece)
            k = hash((k, piece))
            keys.append(k)
        j = len(keys) - 1
        entry = None
        while j >= 0:
            entry = pool.cache.get(keys[j])
            if entry is not None and entry.chain is not None:
                break
            j -= 1
        if j >= 0:
            chain, rest, first = entry.chain, entry.rest, j + 1
        else:
            chain, rest, first = [], (), 0
        since = starts[first] if first < len(starts) else len(data)
        ends: list[float] = [since] * len(chain)   # blocks of earlier messages: decided before `since`
        rest_ends: list[float] = [since] * len(rest)
        # encode_batch runs with the interpreter lock released: the event loop goes on.
        encs = tok.encode_batch([_chatml_one(r, t) for r, t in texts[first:]], add_special_tokens=False)
        full = chain
        for m, enc in zip(range(first, len(texts)), encs):
            role, text = texts[m]
            piece = pieces[m]
            cbytes = text.encode("utf-8", "surrogatepass")
            # The content's bytes end the piece (no name or tool fields after it), else the
            # message's tokens are decided only where the next message starts.
            plain = isinstance(_get(what[m], "content"), str) and piece.endswith(cbytes) \
                and not _get(what[m], "tool_calls") and not _get(what[m], "tool_call_id")
            msg_end = starts[m] + 1 + len(piece)
            c_at = msg_end - len(cbytes)
            c0 = len("<|im_start|>") + len(role) + 1
            conv = _char_to_byte(text) if plain and not text.isascii() else None
            new_ends = []
            for _, e in enc.offsets:
                if not plain:
                    new_ends.append(msg_end + 1)
                elif e <= c0:
                    new_ends.append(c_at)
                elif e <= c0 + len(text):
                    new_ends.append(c_at + (e - c0 if conv is None else conv[e - c0]))
                else:  # the end marker: decided once the next message begins
                    new_ends.append(msg_end + 1)
            ids = rest + tuple(enc.ids)
            idx_ends = rest_ends + new_ends
            self._tokens.inc(len(enc.ids))
            new = extend_chain(chain, ids, bs)
            nb = len(new) - len(chain)
            ends += [idx_ends[(b + 1) * bs - 1] for b in range(nb)]
            rest = ids[nb * bs:]
            rest_ends = idx_ends[nb * bs:]
            chain = new
            full = extend_chain(chain, rest + pool.gen_ids, bs)
            pool.put(keys[m], _Entry(chain, rest, full))
        if first == len(texts):
            full = extend_chain(chain, rest + pool.gen_ids, bs)
        inf = float("inf")
        return full, ends + [inf] * (len(full) - len(ends)), since

    def _prompt(self, pool: _PoolTokens, bs: int, prompt: Any, data: bytes):
        """A completions prompt: text (special tokens as vLLM adds them) or token ids."""
        if isinstance(prompt, msgspec.Raw):  # as the gateway's request decoder leaves it
            prompt = msgspec.json.decode(prompt) if prompt else None
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            full = extend_chain((), prompt, bs)
            return full, [(k + 1) * bs * 4 for k in range(len(full))], 0  # 4 bytes a token id
        if not isinstance(prompt, str):
            return None
        enc = pool.tokenizer.encode_batch([prompt], add_special_tokens=True)[0]
        self._tokens.inc(len(enc.ids))
        conv = _char_to_byte(prompt) if not prompt.isascii() else None
        tok_ends = [e if conv is None else conv[e] for _, e in enc.offsets]
        full = extend_chain((), enc.ids, bs)
        return full, [tok_ends[(k + 1) * bs - 1] for k in range(len(full))], 0

    # -- scoring (the chat profile of a precise pool) --------------------------------------------
    def choose(self, req: PreciseRequest, cands: list, loads: list, info: Any, state: Any,
               rand: int, waits: list | None = None, hotspot_waiting: float | None = None) -> tuple[int, str]:
        """(position in cands, basis), as ``choose_by_affinity``; endpoints whose KV index
        is exact score the engine's own blocks, the others the approximate index. ``waits``
        and ``hotspot_waiting`` are the hot-spot guard's (the settings' by default)."""
        hw = self.settings.hotspot_waiting if hotspot_waiting is None else hotspot_waiting
        chain = req.chain
        if chain is None:
            self._count(info.model, "not_ready")
            s = self.settings
            return choose_by_affinity(state.index, info.hashes, cands, loads, s.hotspot_gap, s.load_weight, rand,
                                      waits, hw)
        index = self.index
        bs = req.block_size
        n = len(chain)
        now = time.monotonic()
        aff: list[float] = []
        free: list[float] = []   # the share of each engine's cache its events leave free; 0 unknown
        need: list[float] = []   # blocks the prompt would evict there, cold; inf where not exact
        evict: list[float] = []  # the share of the prompt whose prefill there evicts others' blocks
        approx = None
        used = False
        for ep in cands:
            held = index.match_exact(ep.name, chain, bs)
            if held >= 0:
                used = True
                coming = 0
                placed = self._placed.get(ep.name)
                if placed is not None:
                    held = max(held, self._on_way(placed, ep.name, chain, bs, now))
                    coming = placed.blocks
                aff.append(held / n if n else 0.0)
                size = index.size(ep.name) + coming
                cap = ep.num_gpu_blocks
                free.append(max(0.0, 1.0 - size / cap) if cap else 0.0)
                need.append(max(0, size + n - cap) if cap else size)
                evict.append(min(n - held, max(0, size + n - held - cap)) / n if cap and n else 0.0)
                continue
            free.append(0.0)
            need.append(INF)
            evict.append(0.0)
            if approx is None:
                approx = state.index.match(info.hashes) if info.nblocks else []
            slot = state.index.slot_of(ep.name)
            aff.append(approx[slot] / info.nblocks if 0 <= slot < len(approx) else 0.0)
        s = self.settings
        if not used:
            self._count(info.model, "not_exact")
            return choose_by_affinity(state.index, info.hashes, cands, loads, s.hotspot_gap, s.load_weight, rand,
                                      waits, hw)
        self._count(info.model, "precise")
        if max(aff) == 0.0:
            return _place_cold(need, loads, rand, max(2, n // 4)), "kv"
        fw = s.free_cache_weight
        if fw > 0.0:
            # The cache's side: room it has counts for it; the blocks this prompt would
            # push out of a full one count against it. A full engine that kept only part
            # of a prompt (the rest evicted: it holds more than it has room for) then
            # loses it to one with room, instead of evicting again on every request.
            aff = [a + fw * (f - x) for a, f, x in zip(aff, free, evict)]
        return score(aff, loads, s.hotspot_gap, s.load_weight, rand, waits, hw)

    def dispatched(self, name: str, req: PreciseRequest) -> None:
        """The request was sent to the engine ``name`` (the router's on_dispatch). Its
        events report the prompt's blocks only after the prefill; until then they count
        as on their way there: held, for the prompts that share them (a group's next
        requests follow its first instead of each placing it again), and in the cache's
        size, for where cold prompts go."""
        chain = req.chain
        if not chain:
            return
        bs = req.block_size
        held = reported = self.index.match_exact(name, chain, bs)
        if held < 0:
            return  # not exact: the approximate index, which on_dispatch touches, stands in
        now = time.monotonic()
        placed = self._placed.get(name)
        if placed is None:
            placed = self._placed[name] = _Placed()
        else:
            held = max(held, self._on_way(placed, name, chain, bs, now))
        if held < len(chain):
            placed.items.append((now, chain, len(chain) - held, reported))
            placed.blocks += len(chain) - held
            if len(placed.items) > PLACED_MAX:
                placed.blocks -= placed.items.popleft()[2]

    def forget(self, name: str) -> None:
        """The endpoint left (or its engine restarted): nothing is on its way there. An
        engine name that is gone keeps no chains (endpoints come and go with discovery)."""
        self._placed.pop(name, None)

    def _on_way(self, placed: _Placed, name: str, chain: list[int], bs: int, now: float) -> int:
        """The leading blocks of ``chain`` that prompts sent to the engine carry there (0:
        none). A prompt leaves once the engine's events report blocks of it past what it
        held when sent (its prefill is done, or under way in chunks), or after
        PLACED_TTL_S."""
        cutoff = now - PLACED_TTL_S
        match = self.index.match_exact
        live = [item for item in placed.items if item[0] >= cutoff and match(name, item[1], bs) <= item[3]]
        if len(live) != len(placed.items):
            placed.items = deque(live)
            placed.blocks = sum(item[2] for item in live)
        return max((_common(chain, item[1]) for item in live), default=0)

    def _count(self, model: str, how: str) -> None:
        child = self._pick_children.get((model, how))
        if child is None:
            child = self._pick_children[(model, how)] = self._picks.labels(model, how)
        child.inc()

    def precise_share(self) -> float:
        """Precise picks over all picks of precise pools (0 before any)."""
        total = precise = 0.0
        for key, child in self._picks.children():
            total += child.value
            if key[1] == "precise":
                precise += child.value
        return precise / total if total else 0.0

    def stats(self) -> dict:
        return {"share": round(self.precise_share(), 4), "pools": {m: {"cached": len(p.cache), "block_size": p.block_size, "split_by_message": p.split_ok}
                for m, p in self._pools.items() if p is not None},
                "on_way": {name: p.blocks for name, p in self._placed.items() if p.blocks}}


INF = float("inf")


def _place_cold(need: list[float], loads: list, rand: int, slack: float) -> int:
    """A prefix no engine holds goes to the least loaded engine, and among those to one
    where its prefill evicts least (``need``: the blocks it would push out, by the
    engines' events and their ``num_gpu_blocks``; without that, the blocks the engine
    holds; inf where not exact: counted as full). After a restart that is the restarted
    engine, which takes back the prefixes it lost instead of pushing them onto full
    caches. Engines within ``slack`` blocks of the least are equal, and equals are drawn
    at random: full caches differ by a few blocks from one event to the next, and a
    strict order would send every cold prefix to the same one."""
    low = min(loads)
    least = INF
    for i, x in enumerate(need):
        if loads[i] <= low + 1e-9 and x < least:
            least = x
    best = [i for i, x in enumerate(need) if loads[i] <= low + 1e-9 and x <= least + slack]
    return best[rand % len(best)]


def _char_to_byte(text: str) -> list[int]:
    """Byte offset in UTF-8 of each character offset of ``text`` (one past the end too)."""
    out = [0]
    n = 0
    for ch in text:
        n += len(ch.encode("utf-8", "surrogatepass"))
        out.append(n)
    return out


def _adopt(reg: Any, kind: str, name: str, help: str, labels: tuple = ()) -> Any:
    got = reg.get(name)
    return got if got is not None else getattr(reg, kind)(name, help, labels)
