"""Stubs for velocity_fast.routing.blockscan (prefix block hashes straight from a request's JSON bytes)."""

from typing import Any

from velocity_fast.routing.prefix import BlockHashes, PrefixHasher

def hash_body(body: Any, hasher: PrefixHasher, model: str) -> BlockHashes | None:
    """The blocks of a whole request body (bytes), as ``hasher.hash(render_prompt(decoded), model)``; None: not taken."""

def hash_messages(messages: Any, hasher: PrefixHasher, model: str) -> BlockHashes | None:
    """The blocks of a chat body's raw ``messages`` (msgspec.Raw or bytes); None: not taken."""

def hash_json(value: Any, hasher: PrefixHasher, model: str, compact: bool = False) -> BlockHashes:
    """The blocks of one valid JSON value as the client wrote it (whitespace between tokens and the last byte left out)."""

def render_body(body: Any) -> bytes | None:
    """The bytes ``render_prompt`` gives for a whole body; None: not taken."""

def render_messages(messages: Any) -> bytes | None:
    """The bytes ``render_prompt`` gives for raw messages; None: not taken."""
