"""The built-in sim engine: looks like vLLM from outside (DESIGN.md section 8).

Continuous batching over a KV-block pool with automatic prefix caching, vLLM's OpenAI
routes and /metrics, on the package's HTTP server. Nothing of the gateway is used.
"""
