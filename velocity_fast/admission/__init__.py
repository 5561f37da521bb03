"""Admission: whether and when each request runs (docs/design.md, "Admission").

``controller``: the Admission controller, its tickets, leases and dispatch cycle;
``bands``: per-band, per-tenant queues; ``saturation``: one number per engine;
``aimd``: each engine's adaptive limit; ``estimators`` and ``telemetry``: what it
learns and what it reports; ``policies`` and ``settings``: how it is configured;
``errors``: how it says no.
"""
