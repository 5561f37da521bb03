"""What the benchmarks share, one concern a module:

- ``processes``: start children pinned to a core and niced, stop their process trees;
- ``procfs``: figures from /proc (CPU ticks, run-queue wait, per-core times, fds, RSS);
- ``bodies``: the requests the proxy benchmarks send;
- ``targets``: the fixed upstream, the gateway (`velocityllm serve`) and nginx as targets;
- ``load``: the load client (wrk, or the project's HTTP client closed- or open-loop);
- ``pyspy``: py-spy's samples of a process under load;
- ``engines``: sim engine processes for the routing benchmarks, and their cache hits;
- ``stack``: a gateway in front of sim engines, from a config file (reliability);
- ``hostile``: a raw client and seeded hostile cases (mutated heads, odd bodies).
"""
