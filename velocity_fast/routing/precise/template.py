"""The chat template and the tokenizer of precise prefix routing, shared with the sim
engine: both render a conversation the one way (ChatML) and load a ``tokenizer.json`` the
one way, so that the gateway's token blocks are the engine's.

    text = chat_template([("system", "be brief"), ("user", "hi")])
    tok = load_tokenizer("/models/my-model")   # a tokenizers.Tokenizer; ValueError says why not
"""
from __future__ import annotations

import os
from typing import Any

import msgspec

__all__ = ["chat_template", "chatml_one", "GEN_PROMPT", "get", "message_texts", "load_tokenizer"]

#: The assistant's opening, after the messages (``add_generation_prompt``).
GEN_PROMPT = "<|im_start|>assistant\n"


def chat_template(messages: list[tuple[str, str]]) -> str:
    """ChatML: ``<|im_start|>role\\ncontent<|im_end|>\\n`` per message, then the
    assistant's opening (``add_generation_prompt``)."""
    return "".join(chatml_one(r, t) for r, t in messages) + GEN_PROMPT


def chatml_one(role: str, text: str) -> str:
    """One message in ChatML."""
    return f"<|im_start|>{role}\n{text}<|im_end|>\n"


def get(obj: Any, name: str) -> Any:
    """A field of a decoded message: a dict's key or an object's attribute."""
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def message_texts(messages: list) -> list[tuple[str, str]]:
    """(role, text) of each message; of a content list only the text parts count (as the
    sim engine reads them)."""
    out = []
    for m in messages:
        if isinstance(m, msgspec.Raw):
            m = msgspec.json.decode(m)
        c = get(m, "content")
        if c is None:
            text = ""
        elif isinstance(c, str):
            text = c
        elif isinstance(c, list):
            text = "".join((get(p, "text") or "") for p in c if get(p, "type") == "text")
        else:
            text = str(c)
        out.append((str(get(m, "role") or ""), text))
    return out


def load_tokenizer(path: str, who: str = "precise prefix routing"):
    """A ``tokenizers.Tokenizer`` from a tokenizer.json or a model folder holding one (as
    vLLM's --tokenizer, a model folder will do: its tokenizer.json is used); ValueError
    with the reason otherwise, naming ``who`` needs it."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError(f"{who} needs the `tokenizers` package "
                         "(pip install velocityllm[tokenizers])") from None
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    try:
        return Tokenizer.from_file(file)
    except Exception as e:
        raise ValueError(f"{who}: tokenizer {path}: cannot load a tokenizer.json: {e}") from None
