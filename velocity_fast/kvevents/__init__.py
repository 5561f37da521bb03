"""Precise prefix index from the engines' own KV cache events (vLLM ``--kv-events-config``).

Off the request path: one ``Subscriber`` thread per engine (``subscriber``) decodes its
event batches (``wire``) into a shared ``BlockIndex`` (``index``); the router asks
``BlockIndex.match`` how many leading blocks of a prompt an engine holds.
docs/kv-events.md describes both sides.
"""
