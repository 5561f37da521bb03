"""Token model of the sim engine: by default no tokenizer, about four bytes a token;
with ``--tokenizer`` a real one (``TextTokenizer``).

Prompts are counted and hashed from their bytes (or the tokenizer's ids); generated
text is drawn from a fixed vocabulary of pseudo-words, so the same seed and request
give the same text.
"""

from __future__ import annotations

import hashlib
import random

from velocity_fast.routing.precise.template import chat_template, load_tokenizer

#: Bytes per token when counting a prompt (docs/design.md, "Where each contract lives").
BYTES_PER_TOKEN = 4

#: 2**VOCAB_BITS pseudo-words; a power of two so a token id is one getrandbits call.
VOCAB_BITS = 10

_ONSETS = ("", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "st", "tr", "pl", "gr")
_VOWELS = ("a", "e", "i", "o", "u", "ae", "io", "ou")
_CODAS = ("", "", "n", "r", "s", "m", "l", "t")


def _build_vocab() -> tuple[tuple[str, ...], tuple[bytes, ...]]:
    # A fixed generator (not the engine seed): the vocabulary is part of the "model".
    rng = random.Random(0x5EED)
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < (1 << VOCAB_BITS) - 2:
        w = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(rng.randint(1, 3)))
        if w in seen:
            continue
        seen.add(w)
        words.append(" " + w)
    # Punctuation makes the text look like sentences; plain ASCII so no JSON escaping.
    words += [".", ","]
    return tuple(words), tuple(w.encode() for w in words)


#: Token id -> text, and the same as bytes (ASCII letters, safe inside a JSON string).
VOCAB, VOCAB_BYTES = _build_vocab()

#: The words loadgen writes prompts from (loadgen/workload.py), kept here so that the
#: sim's tokenizer (``write_tokenizer``) knows every one of them.
PROMPT_WORDS = tuple(
    (
        "the of and to in is was that for on are with as be at by this had not but from "
        "or have an they which one you were all we her she there been if more when will "
        "would who so no model token cache engine queue batch prefill decode latency "
        "tenant band request stream router gateway scheduler throughput"
    ).split()
)


def write_tokenizer(folder: str) -> str:
    """Write the sim's own tokenizer.json into ``folder`` (made if missing) and return its
    path: one token a word, over loadgen's prompt words and the sim's generated words,
    with ChatML's markers, so that precise prefix routing runs with sim engines and no
    download. Needs the `tokenizers` package (ValueError saying so otherwise)."""
    import os

    try:
        from tokenizers import Tokenizer, models, pre_tokenizers
    except ImportError:
        raise ValueError(
            "the sim's tokenizer needs the `tokenizers` package (pip install velocityllm[tokenizers])"
        ) from None
    vocab = {"[UNK]": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for w in ("system", "user", "assistant") + PROMPT_WORDS + tuple(v.strip() for v in VOCAB):
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "tokenizer.json")
    tok.save(path)
    return path


def count_tokens(data: bytes) -> int:
    """Prompt tokens for ``data``: ceil(len / BYTES_PER_TOKEN), at least one."""
    return max(1, -(-len(data) // BYTES_PER_TOKEN))


def block_hashes(data: bytes, block_size: int, seed: bytes = b"") -> list[int]:
    """Chained hashes of the prompt's full blocks (block_size tokens each).

    Each hash covers its parent's hash and the block's bytes, so it names the whole
    prefix up to that block, like vLLM's block hashes. ``seed`` (the model name) keeps
    models apart. Python's ``hash`` is enough: the cache lives in one process.
    """
    step = block_size * BYTES_PER_TOKEN
    out: list[int] = []
    parent = hash(seed)
    for i in range(0, len(data) - step + 1, step):
        parent = hash((parent, data[i : i + step]))
        out.append(parent)
    return out


def request_rng(seed: int, content: bytes) -> random.Random:
    """The generator of one request, from the engine seed and the request content.

    Arrival order does not enter, so the same request gets the same text however many
    others run beside it.
    """
    digest = hashlib.blake2b(content, digest_size=16, key=seed.to_bytes(8, "little", signed=True)).digest()
    return random.Random(int.from_bytes(digest, "little"))


def stop_point(rng, target: int, stops: list[str]) -> tuple[int, int, str] | None:
    """Where a reply of ``target`` tokens drawn from ``rng`` (left as it was) meets one of
    ``stops``, as vLLM ends it: (tokens generated, up to the one that completes the stop
    string; characters of text kept, before the stop string; the string), or None."""
    r = random.Random()
    r.setstate(rng.getstate())
    text = ""
    longest = max(len(s) for s in stops)
    for i in range(target):
        before = len(text)
        text += VOCAB[r.getrandbits(VOCAB_BITS)]
        found = None
        for s in stops:
            at = text.find(s, max(0, before - longest + 1))
            if at >= 0 and (found is None or at < found[0]):
                found = (at, s)
        if found is not None:
            return i + 1, found[0], found[1]
    return None


#: vLLM's default --max-logprobs: the most top logprobs a request may ask for.
MAX_LOGPROBS = 20


def token_logprobs(tok: int, k: int) -> list[tuple[str, float]]:
    """The sampled token and its alternatives, best first: ``max(k, 1)`` (text, logprob)
    pairs. The values are made up but consistent: the sampled token ranks first, each
    alternative is a distinct vocabulary word, and the same token gives the same list."""
    lp = round(-0.05 - (tok * 37 % 100) / 40, 3)
    v = VOCAB
    mask = (1 << VOCAB_BITS) - 1
    # 131 is odd, so the k-1 alternatives differ from each other and from the token.
    return [(v[tok], lp)] + [(v[(tok + 131 * j) & mask], round(lp - 0.75 * j, 3)) for j in range(1, k)]


def render_text(token_ids: list[int]) -> str:
    """The text of a list of token ids."""
    v = VOCAB
    return "".join([v[t] for t in token_ids])


def pseudo_token_ids(data: bytes) -> list[int]:
    """Token ids for ``data`` without a tokenizer: one per four bytes, from the bytes
    they stand for (stable for the same text; as many as ``count_tokens`` says)."""
    n = count_tokens(data)
    return [
        int.from_bytes(data[i : i + BYTES_PER_TOKEN], "little") % 151_936
        for i in range(0, BYTES_PER_TOKEN * n, BYTES_PER_TOKEN)
    ]


def token_block_hashes(token_ids: list[int], block_size: int, seed: bytes = b"") -> list[int]:
    """Chained hashes of the full blocks of a list of token ids (tokenizer mode)."""
    out: list[int] = []
    parent = hash(seed)
    for i in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[i : i + block_size])))
        out.append(parent)
    return out


class TextTokenizer:
    """A real tokenizer (``--tokenizer PATH`` to a ``tokenizer.json`` or a folder with
    one), with the chat template precise prefix routing applies too
    (routing/precise/template.py: ChatML, the form most chat models use).

    Needs the ``tokenizers`` package (the ``tokenizers`` extra).
    """

    def __init__(self, path: str) -> None:
        self._tok = load_tokenizer(path, who="--tokenizer")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        """The text of token ids, special tokens kept (vLLM's /detokenize)."""
        return self._tok.decode(ids, skip_special_tokens=False)

    def encode_chat(self, messages: list[tuple[str, str]]) -> list[int]:
        """Token ids of a conversation after the chat template, ready for the
        assistant's turn (as vLLM: the template adds the special tokens itself)."""
        return self.encode(chat_template(messages), add_special_tokens=False)
