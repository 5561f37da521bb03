"""`velocityllm`: the commands. Parses flags and calls into the rooms; no logic here.

Each command's module is imported only when that command runs, so `version` and
`--help` answer without loading uvloop, msgspec or vLLM.
"""

from __future__ import annotations

import argparse
import sys

from . import __version__

COMMANDS = ("chargeVelocity", "serve", "sim-engine", "detect", "loadgen", "bench", "version")


def build_parser() -> argparse.ArgumentParser:
    from .engines.flags import add_engine_arguments
    from .gateway.flags import add_gateway_arguments
    from .loadgen.bench_cmd import add_bench_arguments
    from .loadgen.flags import add_loadgen_arguments
    from .sim.flags import add_arguments as add_sim_arguments

    parser = argparse.ArgumentParser(
        prog="velocityllm", description="VelocityLLM: an LLM gateway and scheduler in front of vLLM engines."
    )
    parser.add_argument("--version", action="version", version=f"velocityllm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "chargeVelocity", help="detect GPUs and the model; start engines (vLLM or sim) and the gateway in front"
    )
    add_gateway_arguments(p)  # --endpoint: engines beside the ones it starts, as VELOCITY_ENDPOINTS
    add_engine_arguments(p)
    p.set_defaults(max_model_len=None)  # let the config file and VELOCITY_MAX_MODEL_LEN speak first
    p.add_argument(
        "--sim-args",
        default=None,
        metavar="'FLAGS'",
        help="extra flags for each sim engine, e.g. \"--time-scale 10 --max-num-seqs 64\"",
    )

    p = sub.add_parser("serve", help="the gateway alone, in front of engines that already run")
    add_gateway_arguments(p)
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + completion the gateway accepts; /v1/models reports the smaller of "
        "this and what the engines report (default 131072)",
    )

    p = sub.add_parser("sim-engine", help="one simulated vLLM engine")
    add_sim_arguments(p)

    p = sub.add_parser("detect", help="print the GPUs, the model and the engines chargeVelocity would start")
    add_engine_arguments(p)

    p = sub.add_parser("loadgen", help="send test traffic to a running server")
    add_loadgen_arguments(p)

    p = sub.add_parser("bench", help="compare the policies on identical seeded traffic")
    add_bench_arguments(p)

    sub.add_parser("version", help="print the version")
    for command in sub.choices.values():
        _name_values(command)
    return parser


# What a flag takes, named by kind, so that usage reads `--repeats N` rather than repeating
# the flag's own name (`--repeats REPEATS`) for each of them.
_VALUE_NAMES = {
    "config": "FILE",
    "host": "ADDR",
    "api_key": "KEY",
    "model": "NAME",
    "served_model_name": "NAME",
    "model_path": "PATH",
    "tokenizer": "PATH",
    "url": "http://HOST:PORT",
    "engine_log_dir": "DIR",
    "kv_events_config": "JSON",
    "policies": "LIST",
}


def _name_values(parser: argparse.ArgumentParser) -> None:
    for action in parser._actions:
        if (
            not action.option_strings
            or action.metavar is not None
            or action.nargs == 0
            or action.choices is not None
            or action.help == argparse.SUPPRESS
        ):
            continue
        kind = getattr(action.type, "__name__", "")
        if action.dest in _VALUE_NAMES:
            action.metavar = _VALUE_NAMES[action.dest]
        elif kind in ("float", "_fraction"):
            action.metavar = "NUM"
        elif kind in ("int", "_positive_int", "_port"):
            action.metavar = "N"
        else:
            action.metavar = "VALUE"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["version"]:
        print(f"velocityllm {__version__}")
        return 0
    args = build_parser().parse_args(argv)
    args.argv = list(argv)  # as given: `serve --workers N` starts its workers with the same flags
    cmd = args.command
    if cmd is None:
        build_parser().print_help()
        return 2
    if cmd == "chargeVelocity":
        from .gateway.launch import charge_main

        return charge_main(args)
    if cmd == "serve":
        from .gateway.launch import serve_main

        return serve_main(args)
    if cmd == "sim-engine":
        from .sim.app import main as sim_main

        return sim_main(args)
    if cmd == "detect":
        from .engines.app import detect_main

        return detect_main(args)
    if cmd == "loadgen":
        from .loadgen.app import loadgen_main

        return loadgen_main(args)
    if cmd == "bench":
        from .loadgen.bench_cmd import bench_main

        return bench_main(args)
    if cmd == "version":
        print(f"velocityllm {__version__}")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
