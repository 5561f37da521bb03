"""The chat template and the tokenizer of precise prefix routing. The sim engine renders
ChatML (``chat_template``); a model folder with its own template (``chat_template.jinja``,
else ``tokenizer_config.json``'s ``chat_template``) is rendered as vLLM renders it, through
jinja2 (``load_renderer``), so that the gateway's token blocks are the engine's.

    text = chat_template([("system", "be brief"), ("user", "hi")])
    tok = load_tokenizer("/models/my-model")   # a tokenizers.Tokenizer; ValueError says why not
    r = load_renderer("/models/my-model")     # a ChatRenderer: the model's template, else ChatML
    r.render(texts), r.pieces(texts), r.gen
"""

from __future__ import annotations

import json
import os
from typing import Any

import msgspec

__all__ = [
    "chat_template",
    "chatml_one",
    "GEN_PROMPT",
    "get",
    "message_texts",
    "load_tokenizer",
    "ChatRenderer",
    "load_renderer",
    "find_template",
]

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
        raise ValueError(f"{who} needs the `tokenizers` package (pip install velocityllm[tokenizers])") from None
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    try:
        return Tokenizer.from_file(file)
    except Exception as e:
        raise ValueError(f"{who}: tokenizer {path}: cannot load a tokenizer.json: {e}") from None


class ChatRenderer:
    """How a model's conversations are rendered: ``render(texts)`` the whole prompt (with
    the assistant's opening), ``pieces(texts)`` each message's part of it (joined, the
    prompt without the opening), ``gen`` the opening. ChatML without a template.

    ``stable``: each conversation's rendering begins with the rendering of its leading
    messages (so a message's piece does not depend on what follows it, and the pieces
    can be tokenized and cached one by one); checked on a probe conversation."""

    def __init__(self, template: str | None = None, tokens: dict | None = None, source: str = "ChatML") -> None:
        self.source = source
        self._tmpl = None
        self._tokens = tokens or {}
        if template is not None:
            self._tmpl = _jinja_env().from_string(template)
        probe = [("system", "you are brief."), ("user", "hello there, who are you?"), ("assistant", "me.")]
        try:
            prefixes = [self._render(probe[:k], False) for k in range(len(probe) + 1)]
            whole = self._render(probe, True)
        except Exception as e:
            raise ValueError(f"chat template of {source}: cannot render a conversation: {e}") from None
        self.stable = all(b.startswith(a) for a, b in zip(prefixes, prefixes[1:])) and whole.startswith(prefixes[-1])
        self.gen = whole[len(prefixes[-1]) :] if self.stable else ""
        self.chatml = whole == chat_template(probe)

    def _render(self, texts: list[tuple[str, str]], gen: bool) -> str:
        if self._tmpl is None:
            return "".join(chatml_one(r, t) for r, t in texts) + (GEN_PROMPT if gen else "")
        return self._tmpl.render(
            messages=[{"role": r, "content": t} for r, t in texts],
            add_generation_prompt=gen,
            tools=None,
            **self._tokens,
        )

    def render(self, texts: list[tuple[str, str]]) -> str:
        """The prompt vLLM renders for these messages (``add_generation_prompt``)."""
        return self._render(texts, True)

    def pieces(self, texts: list[tuple[str, str]]) -> list[str]:
        """Each message's part of the rendering (the first with what precedes the
        messages, such as a BOS token); only for a ``stable`` template."""
        if self._tmpl is None:
            return [chatml_one(r, t) for r, t in texts]
        out, at = [], 0
        for k in range(1, len(texts) + 1):
            text = self._render(texts[:k], False)
            out.append(text[at:])
            at = len(text)
        return out


def find_template(path: str) -> tuple[str | None, dict, str]:
    """The chat template of the model folder ``path`` (or of the folder of a tokenizer.json
    file) as vLLM takes it: ``chat_template.jinja``, else ``tokenizer_config.json``'s
    ``chat_template`` (a string, or the one named ``default`` of a list); with the special
    tokens the template may use. (None, ..) when there is none."""
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    cfg: dict = {}
    try:
        with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        pass
    tokens = {}
    for k in ("bos_token", "eos_token", "pad_token", "unk_token"):
        v = cfg.get(k)
        if isinstance(v, dict):
            v = v.get("content")
        tokens[k] = v if isinstance(v, str) else ""
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read(), tokens, jinja
    t = cfg.get("chat_template")
    if isinstance(t, list):
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    return (t, tokens, os.path.join(folder, "tokenizer_config.json")) if isinstance(t, str) else (None, tokens, "")


def load_renderer(path: str, who: str = "precise prefix routing") -> ChatRenderer:
    """The model's own template (``find_template``), else ChatML; ValueError, naming
    ``who``, when it has one that cannot be used (jinja2 missing, or it does not render)."""
    template, tokens, source = find_template(path)
    if template is None:
        return ChatRenderer()
    try:
        import jinja2  # noqa: F401
    except ImportError:
        raise ValueError(
            f"{who}: {source} is a jinja2 template, and rendering it needs the `jinja2` "
            "package (pip install velocityllm[tokenizers])"
        ) from None
    return ChatRenderer(template, tokens, source)


def _jinja_env():
    # As transformers (whose apply_chat_template vLLM calls) sets it up.
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env
