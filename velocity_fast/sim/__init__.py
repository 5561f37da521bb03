"""The built-in sim engine: looks like vLLM from outside (docs/design.md, "Where each contract lives").

Continuous batching over a KV-block pool with automatic prefix caching, vLLM's OpenAI
routes and /metrics, on the package's HTTP server. Nothing of the gateway is used.
"""
