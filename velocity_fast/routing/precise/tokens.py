"""Precise prefix routing's token side: prompts as token blocks, with a token cache and a
tokenizer thread, so that the event loop never tokenizes and never waits.

    tokens = TokenSide(settings, registry=reg, block_size=fn)
    tokens.attach(owner, info, body, data)   # info.precise: a PreciseRequest, its chain later
    tokens.close()

- ``attach`` (on the event loop, for a chat-profile request of a precise pool) looks the
  prompt up in the token cache and, when it is not all there, hands it to the tokenizer
  thread.
- The **token cache** is keyed by the request's own approximate block hashes (the
  chained hashes of its rendered bytes): every prompt tokenized enters its byte blocks,
  each with how many of its token blocks are decided within the bytes up to it. A
  request binary-searches its chain for the longest entered block, so a next turn, a
  shared system prompt or a shared context inside one message is matched at once; a
  whole prompt seen before is a whole hit. The thread also keeps each run of leading
  messages (keyed by their byte pieces' chain), so that it tokenizes only new messages.

The model's own chat template renders the messages, as vLLM renders them (template.py:
the folder's ``chat_template.jinja`` or ``tokenizer_config.json``'s, else ChatML, as the sim
engine renders); each message's piece is tokenized on its own when the template renders
a conversation as its leading messages' rendering and more, and the per-message tokens
are the whole prompt's (the markers are special tokens), which a probe checks once per
tokenizer (otherwise each prompt is tokenized whole and cached whole).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import OrderedDict
from typing import Any, Callable

import msgspec

from velocity_fast.kvevents.index import extend_chain, leading_in
from velocity_fast.metrics.registry import SUM, Registry
from velocity_fast.routing.precise.template import ChatRenderer, get, load_renderer, load_tokenizer, message_texts
from velocity_fast.routing.settings import RoutingSettings

__all__ = ["TokenSide", "PreciseRequest", "DEFAULT_BLOCK_SIZE", "MAX_PENDING", "adopt", "pool_stats"]

log = logging.getLogger("velocity.precise")

_MSG = b"\x1e"  # the message separator of routing/prefix_render.py
_STOP = object()
#: Bytes before a byte block's end within which a token is not taken as decided (a word
#: cut by the block's end could tokenize otherwise once the rest of it comes).
_MARGIN = 16
#: Token jobs waiting at most; past it a request stays approximate (counted as dropped).
MAX_PENDING = 4096
#: A pick waits for its tokens only while at most this many jobs wait in the thread's queue.
WAIT_QUEUE_MAX = 8
DEFAULT_BLOCK_SIZE = 16


class PreciseRequest:
    """One request's token side. ``chain`` is None until its tokens are ready (then the
    token-block chain, possibly of a leading part of the prompt only)."""

    __slots__ = ("owner", "pool", "chain", "block_size", "side", "pending", "waiter", "timer")

    def __init__(self, owner: Any, pool: "_PoolTokens", side: "TokenSide | None" = None) -> None:
        self.owner = owner
        self.pool = pool
        self.chain: list[int] | None = None
        self.block_size = pool.block_size
        self.side = side
        self.pending = False  # a job of it is with the tokenizer thread
        self.waiter: tuple | None = None  # (loop, callback): the pick that waits for its tokens
        self.timer = None

    def wait(self, callback: Callable[[], Any]) -> bool:
        """Whether the pick waits for the tokens (True: ``callback`` is called once, on this
        event loop, when the thread is done with them or after ``precise_token_wait_ms``).

        A prompt new to the token cache is otherwise picked approximately (``not_ready``),
        which places a prompt another replica's traffic already cached by load alone, on
        an engine that prefills it cold. Tokenizing it takes a millisecond or two; the pick
        waits for that, not for a queue of other prompts (none when more than
        WAIT_QUEUE_MAX are waiting in the thread's queue)."""
        side = self.side
        if not self.pending or side is None:
            return False
        wait_s = side.settings.precise_token_wait_ms / 1000.0
        if wait_s <= 0.0 or side._queue.qsize() > WAIT_QUEUE_MAX:
            return False
        loop = asyncio.get_running_loop()
        self.waiter = (loop, callback)
        if not self.pending:  # the thread was done before the waiter was in place
            self.waiter = None
            return False
        self.timer = loop.call_later(wait_s, self._wake)
        return True

    def _wake(self) -> None:
        """On the loop: the tokens are ready, or the wait is over; the pick goes on once."""
        w = self.waiter
        if w is None:
            return
        self.waiter = None
        side = self.side
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        side._waits.labels("ready" if self.chain is not None else "timeout").inc()
        w[1]()


class _Entry:
    __slots__ = ("chain", "rest", "full")

    def __init__(self, chain: list[int] | None, rest: tuple, full: list[int]) -> None:
        self.chain = chain  # blocks of the messages up to here (None: not split by message)
        self.rest = rest  # their tokens after the last full block
        self.full = full  # blocks of the prompt that ends here (with the assistant's opening)


class _PoolTokens:
    """One precise pool's tokenizer, block size and caches (see the module doc)."""

    def __init__(
        self,
        model: str,
        tokenizer: Any,
        split_ok: bool,
        gen_ids: tuple,
        capacity: int,
        block_size: int,
        renderer: ChatRenderer | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.renderer = renderer if renderer is not None else ChatRenderer()
        self.split_ok = split_ok
        self.gen_ids = gen_ids
        self.capacity = capacity
        self.block_size = block_size
        self.seed = hash(("velocity-precise", model))
        # The template renders as vLLM does: the model's own, or ChatML whose markers the
        # tokenizer knows (else chat requests stay approximate).
        self.chat_ok = True
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


def _split_ok(tok: Any, renderer: ChatRenderer) -> bool:
    """Whether tokens per message are the whole prompt's tokens (the template renders a
    conversation as its leading messages' rendering and more, and its markers are special
    tokens that cut the text), on a probe conversation."""
    if not renderer.stable:
        return False
    msgs = [("system", "you are brief."), ("user", "hello there, who are you?"), ("assistant", "me.")]
    whole = tok.encode(renderer.render(msgs), add_special_tokens=False).ids
    parts: list[int] = []
    for piece in renderer.pieces(msgs):
        parts += tok.encode(piece, add_special_tokens=False).ids
    parts += tok.encode(renderer.gen, add_special_tokens=False).ids
    return whole == parts


class TokenSide:
    """The token side of precise pools (see the module doc): their tokenizers, caches and
    the thread that tokenizes."""

    def __init__(
        self,
        settings: RoutingSettings,
        *,
        registry: Registry | None = None,
        block_size: Callable[[str], int] | None = None,
    ) -> None:
        self.settings = settings
        self._block_size = block_size or (lambda model: DEFAULT_BLOCK_SIZE)
        self._tokenizers: dict[str, Any] = {}  # path -> (Tokenizer, split_ok, gen ids, renderer)
        self.pools: dict[str, _PoolTokens | None] = {}
        for path in {settings.tokenizer, *settings.tokenizers.values()} - {None}:
            self._load(path)
        reg = registry if registry is not None else Registry()
        self._lookups = adopt(
            reg,
            "counter",
            "velocity_prefix_token_cache_total",
            "Token-cache look-ups of precise pools: hit (the whole prompt), prefix (its leading messages), miss.",
            ("result",),
            merge=SUM,
        )
        self._jobs = adopt(
            reg,
            "counter",
            "velocity_prefix_tokenize_total",
            "Prompts handed to the tokenizer thread: done, dropped (queue full), failed.",
            ("result",),
            merge=SUM,
        )
        self._tokens = adopt(
            reg,
            "counter",
            "velocity_prefix_tokenized_tokens_total",
            "Tokens the tokenizer thread produced (a next turn counts only its new messages).",
            merge=SUM,
        )
        self._waits = adopt(
            reg,
            "counter",
            "velocity_prefix_token_waits_total",
            "Picks of prompts new to the token cache that waited for their tokens: ready (picked "
            "precisely) or timeout (precise_token_wait_ms passed: picked approximately).",
            ("result",),
            merge=SUM,
        )
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
            renderer = load_renderer(path)
            got = self._tokenizers[path] = (
                tok,
                _split_ok(tok, renderer),
                tuple(tok.encode(renderer.gen, add_special_tokens=False).ids),
                renderer,
            )
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
            tok, split_ok, gen, renderer = self._load(path)
            pool = _PoolTokens(
                model,
                tok,
                split_ok,
                gen,
                self.settings.token_cache_entries,
                self._block_size(model) or DEFAULT_BLOCK_SIZE,
                renderer,
            )
            pool.chat_ok = renderer.source != "ChatML" or all(
                tok.token_to_id(t) is not None for t in ("<|im_start|>", "<|im_end|>")
            )
            if not pool.chat_ok:
                log.warning(
                    "precise prefix routing, model %s: no chat template beside its tokenizer (%s) and no "
                    "ChatML markers in it, so chat prompts cannot be rendered as the engine renders them: "
                    "chat requests are routed approximately, completions precisely",
                    model,
                    path,
                )
        self.pools[model] = pool
        return pool

    def attach(self, owner: Any, info: Any, body: Any, data: bytes) -> None:
        """Give ``info`` its token side (a PreciseRequest whose ``owner`` scores it): the
        whole prompt's token blocks when the cache has them, else those of its longest
        cached run of leading byte blocks (a binary search over the request's approximate
        block hashes); the thread tokenizes the rest."""
        model = info.model
        pool = self.pools.get(model)
        if pool is None:
            if model in self.pools:
                return
            pool = self._pool(model)
            if pool is None:
                return
        is_chat = body is not None and not isinstance(body, (bytes, bytearray)) and bool(get(body, "messages"))
        if is_chat and not pool.chat_ok:
            return  # the engine's chat template is not the one applied here: no token match
        req = PreciseRequest(owner, pool, self)
        info.precise = req
        if type(data) is not bytes:
            data = bytes(data)
        hashes = info.hashes
        n = len(hashes)  # a precise pool's chain is not thinned: n byte blocks
        wkey = hash((hashes[n - 1] if n else pool.seed, data[n * hashes.block_bytes :]))
        full = pool.whole.get(wkey)
        if full is not None:
            req.chain = full
            self._hit.inc()
            return
        blocks = pool.blocks
        lo = leading_in(blocks, hashes)  # (it caches runs of leading byte blocks: whole from the root)
        got = blocks.get(hashes[lo - 1]) if lo else None
        if got is not None and got[1]:
            req.chain = got[0][: got[1]]  # the leading part now; the thread adds the rest
            self._prefix_hit.inc()
        else:
            self._miss.inc()
        what = get(body, "messages") if is_chat else (get(body, "prompt") if body is not None else None)
        self._submit((req, is_chat, what, data, hashes, wkey, lo))

    def _submit(self, job: tuple) -> None:
        if self._queue.qsize() >= MAX_PENDING:
            self._jobs.labels("dropped").inc()
            return
        job[0].pending = True
        self._queue.put(job)

    # -- the tokenizer thread -----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is _STOP:
                return
            req = job[0]
            try:
                self._tokenize(*job)
            except Exception:  # one odd prompt must not end the thread
                log.exception("precise prefix: tokenizing a prompt failed")
                self._jobs.labels("failed").inc()
            else:
                self._jobs.labels("done").inc()
            # pending first, then the waiter: a pick that registers between the two sees
            # pending False and does not wait; one registered before is woken here.
            req.pending = False
            w = req.waiter
            if w is not None:
                try:
                    w[0].call_soon_threadsafe(req._wake)
                except RuntimeError:  # its loop is closed: nothing waits any more
                    pass

    def _tokenize(
        self, req: PreciseRequest, is_chat: bool, what: Any, data: bytes, hashes: Any, wkey: int, known: int
    ) -> None:
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

    def _register(
        self, pool: _PoolTokens, hashes: Any, full: list[int], ends: list[float], since: int, known: int
    ) -> None:
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
            ids = tok.encode_batch([pool.renderer.render(texts)], add_special_tokens=False)[0].ids
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
        # Tokens of earlier messages are decided before `since` (a message boundary): the
        # margin for a word a block's end cuts is not theirs. Marked decided at `since`, a
        # byte block just past it would be entered with none of them, over the entry of the
        # request that tokenized those messages first, and its group's next requests would
        # find no tokens there.
        ends: list[float] = [since - _MARGIN] * len(chain)
        rest_ends: list[float] = [since - _MARGIN] * len(rest)
        # encode_batch runs with the interpreter lock released: the event loop goes on.
        rendered = pool.renderer.pieces(texts)
        encs = tok.encode_batch(rendered[first:], add_special_tokens=False)
        full = chain
        for m, enc in zip(range(first, len(texts)), encs):
            role, text = texts[m]
            piece = pieces[m]
            cbytes = text.encode("utf-8", "surrogatepass")
            # The content's bytes end the piece (no name or tool fields after it), else the
            # message's tokens are decided only where the next message starts.
            c0 = rendered[m].rfind(text) if text else -1  # where the content is in the message's rendering
            plain = (
                isinstance(get(what[m], "content"), str)
                and piece.endswith(cbytes)
                and c0 >= 0
                and not get(what[m], "tool_calls")
                and not get(what[m], "tool_call_id")
            )
            msg_end = starts[m] + 1 + len(piece)
            c_at = msg_end - len(cbytes)
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
            rest = ids[nb * bs :]
            rest_ends = idx_ends[nb * bs :]
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


def pool_stats(pools: dict) -> dict:
    """What /stats shows of each precise pool's token side."""
    return {
        m: {"cached": len(p.cache), "block_size": p.block_size, "split_by_message": p.split_ok}
        for m, p in pools.items()
        if p is not None
    }


def _char_to_byte(text: str) -> list[int]:
    """Byte offset in UTF-8 of each character offset of ``text`` (one past the end too)."""
    out = [0]
    n = 0
    for ch in text:
        n += len(ch.encode("utf-8", "surrogatepass"))
        out.append(n)
    return out


def adopt(reg: Any, kind: str, name: str, help: str, labels: tuple = (), *, merge: str | None = None) -> Any:
    """The registry's metric ``name``, made as ``kind`` when it has none yet (a reload's
    new side keeps counting on the old one's)."""
    got = reg.get(name)
    return got if got is not None else getattr(reg, kind)(name, help, labels, merge=merge)
