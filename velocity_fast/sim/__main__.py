"""``python -m velocity_fast.sim --port P --model M [flags]``: one sim engine."""

import argparse
import sys

from .flags import add_arguments


def _main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m velocity_fast.sim", description="A simulated vLLM engine (OpenAI API, vLLM metrics)."
    )
    add_arguments(parser)
    args = parser.parse_args()
    from .app import main

    return main(args)


if __name__ == "__main__":
    sys.exit(_main())
