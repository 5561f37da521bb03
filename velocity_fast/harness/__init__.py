"""Starting and stopping the gateway's processes from outside: what the tests, the
benchmarks and ``velocityllm bench`` run.

- ``procs``: a child in its own process group (``start``), stopped with SIGTERM then
  SIGKILL (``stop``, ``stop_all``: the one way every child here ends);
- ``ports``: free listening ports below the ephemeral range;
- ``probe``: waiting until a child is ready (a GET, a poll, the port it prints);
- ``gateway``, ``sim``, ``redis``: a gateway, a sim engine and a redis-server as children;
- ``stack``: sim engines with gateways in front of them.

It imports nothing else of the package (it runs the gateway as a command), so that any
layer may use it: the engine supervisor stops vLLM with its ``stop_all``.
"""
