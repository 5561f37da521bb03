"""Precise prefix index from the engines' own KV cache events (vLLM ``--kv-events-config``).

Off the request path: one ``Subscriber`` thread per engine decodes its event batches
into a shared ``BlockIndex``; the router asks ``BlockIndex.match`` how many leading
blocks of a prompt an engine holds. docs/kv-events.md describes both sides.
"""
from .index import ROOT, BlockIndex, EndpointStats, chain_hashes
from .subscriber import Subscriber
from .wire import decode_batch

__all__ = ["BlockIndex", "EndpointStats", "Subscriber", "ROOT", "chain_hashes", "decode_batch"]
