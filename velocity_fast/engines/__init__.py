"""Real engines: GPU detection, model resolution, the vLLM launcher and its supervisor.

The package import stays light (nothing is imported here) so that the command line can
load only the module a command needs: ``detect``, ``models``, ``plan``, ``supervisor``
or ``app``.
"""
