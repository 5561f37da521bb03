"""Request bodies the sim engine reads: msgspec Structs with only the fields it uses.

Unknown fields are ignored, as vLLM tolerates them; wrong types are a 400 naming the
field. ``priority`` orders the queue under ``--scheduling-policy priority``; vLLM 0.32
takes any integer under either policy (``fcfs`` ignores it).
"""

from __future__ import annotations

from typing import Annotated

import msgspec


class StreamOptions(msgspec.Struct):
    """``stream_options`` of a streamed request."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class ContentPart(msgspec.Struct):
    """One part of a message's content; only text parts count."""

    type: str = "text"
    text: str | None = None


class Message(msgspec.Struct):
    """One chat message."""

    role: str
    content: str | list[ContentPart] | None = None


class _Common(msgspec.Struct):
    model: str | None = None
    max_tokens: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False
    priority: int = 0
    # Sampling: the temperature changes nothing here but is checked as vLLM checks it;
    # stop strings end the reply as vLLM's do (tokens.stop_point).
    temperature: float | None = None
    stop: str | list[str] | None = None
    # Checked as vLLM checks them (SimAPI._validate); n and logprobs are served.
    top_p: float | None = None
    n: int | None = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)] | None = None
    # Features the sim does not implement: a request that needs them is refused.
    response_format: dict | None = None
    # Disaggregation (sim/pd.py): an object, as vLLM's request model types it.
    kv_transfer_params: dict | None = None


class ChatRequest(_Common):
    """Body of POST /v1/chat/completions."""

    messages: list[Message] = msgspec.field(default_factory=list)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    # UNSET: absent (vLLM then defaults to "auto" when tools are given).
    tool_choice: str | dict | None | msgspec.UnsetType = msgspec.UNSET


class CompletionRequest(_Common):
    """Body of POST /v1/completions."""

    # str, a list of strings, or a list of token ids (vLLM accepts all three).
    prompt: str | list | None = None
    logprobs: int | None = None


class TokenizeRequest(msgspec.Struct):
    """Body of POST /tokenize (a prompt or chat messages)."""

    model: str | None = None
    prompt: str | list | None = None
    messages: list[Message] | None = None


chat_decoder = msgspec.json.Decoder(ChatRequest)
completion_decoder = msgspec.json.Decoder(CompletionRequest)
tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)


def message_texts(messages: list[Message]) -> list[tuple[str, str]]:
    """(role, text) of each message; only text parts of a content list count."""
    out: list[tuple[str, str]] = []
    for m in messages:
        c = m.content
        if c is None:
            text = ""
        elif isinstance(c, str):
            text = c
        else:
            text = "".join(p.text or "" for p in c if p.type == "text")
        out.append((m.role, text))
    return out


def render_chat(messages: list[Message]) -> bytes:
    """The prompt a chat template would produce, as bytes (counted and hashed).

    A fixed, simple template: the same messages give the same bytes, and a shared
    leading conversation gives a shared byte prefix, which is what prefix caching needs.
    """
    parts: list[str] = []
    for m in messages:
        c = m.content
        if c is None:
            text = ""
        elif isinstance(c, str):
            text = c
        else:
            text = "".join(p.text or "" for p in c if p.type == "text")
        parts.append(f"<|{m.role}|>\n{text}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts).encode()


def render_prompt(prompt: str | list | None) -> bytes:
    """A completions prompt as bytes; raises ValueError for shapes vLLM refuses."""
    if prompt is None:
        raise ValueError("Either prompt or prompt_embeds must be provided.")
    if isinstance(prompt, str):
        return prompt.encode()
    if not prompt:
        raise ValueError("Prompt cannot be empty.")
    if all(isinstance(t, str) for t in prompt):
        if len(prompt) != 1:
            # Batched prompts give several choices in vLLM; one is enough for a sim.
            raise ValueError("The sim engine accepts one prompt per request.")
        return prompt[0].encode()
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        # Token ids: four bytes each, so the count comes out as the number of ids.
        return b"".join((t & 0xFFFFFFFF).to_bytes(4, "little") for t in prompt)
    raise ValueError("prompt must be a string, a list of strings or a list of token ids.")
