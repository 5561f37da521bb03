"""Precise prefix routing: prompts as the engines' own token blocks, matched against the
blocks the engines' KV events report (docs/kv-events.md).

- template.py: the chat template and the tokenizer's loading, shared with the sim engine;
- tokens.py: the token side, its token cache and tokenizer thread;
- scoring.py: ``PrecisePrefix``, where the chat profile of a precise pool sends a request;
- affinity.pyx: the compiled rule that picks from the scores.

The events themselves and their block index are kvevents/; the gateway's wiring of
subscribers, index and token side is gateway/kv.py. Each module is imported by its own
name: the sim engine takes the template without the rest.
"""
