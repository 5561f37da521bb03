"""Entry point of one sim engine process: ``main(args) -> int``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from .settings import SimConfig

log = logging.getLogger("velocity.sim")

#: Seconds in-flight requests get to finish after SIGTERM before connections close.
SHUTDOWN_GRACE = 2.0


async def _nothing_to_clean() -> None:
    return None


def main(args: argparse.Namespace) -> int:
    """Run a sim engine until SIGTERM/SIGINT; 2 on bad flags, else 0."""
    if getattr(args, "write_tokenizer", None):
        from .tokens import write_tokenizer

        try:
            print(write_tokenizer(args.write_tokenizer))
        except (ValueError, OSError) as e:
            print(f"sim-engine: --write-tokenizer: {e}", file=sys.stderr)
            return 2
        return 0
    cfg = SimConfig.from_args(args)
    try:
        cfg.validate()
    except ValueError as e:
        print(f"sim-engine: {e}", file=sys.stderr)
        return 2
    tokenizer = None
    if cfg.tokenizer:
        from .tokens import TextTokenizer

        try:
            tokenizer = TextTokenizer(cfg.tokenizer)
        except ValueError as e:
            print(f"sim-engine: {e}", file=sys.stderr)
            return 2
    from velocity_fast.server.http_server import HTTPServer
    from velocity_fast.server.run import run_until_signalled
    from velocity_fast.sim.api import SimAPI

    from .engine import Engine
    from .kvevents import open_publisher

    # The events' sockets open first: a port that is taken ends the process (status 2)
    # before it listens, and they close however the process ends.
    try:
        publisher = open_publisher(cfg.kv_events_config)
    except ValueError as e:
        print(f"sim-engine: {e}", file=sys.stderr)
        return 2

    async def start(stop: asyncio.Event):
        # Like a loading model: the port refuses connections until this is over (a
        # signal meanwhile ends the process without ever listening).
        if cfg.startup_delay > 0:
            try:
                await asyncio.wait_for(stop.wait(), cfg.startup_delay / cfg.time_scale)
            except asyncio.TimeoutError:
                pass
            else:
                return _nothing_to_clean
        engine = Engine(cfg, publisher=publisher)
        engine.start()
        api = SimAPI(cfg, engine, tokenizer)
        server = HTTPServer(api.handle, name="sim")
        try:
            await server.start(cfg.host, cfg.port)
        except BaseException:
            await engine.stop()
            raise
        api.kvx.bind(server.host, server.port)  # where decode engines pull held blocks
        # The one line on stdout: test helpers that pass --port 0 read the port from it.
        print(f"sim engine {cfg.model!r} listening on http://{server.host}:{server.port}", flush=True)

        async def cleanup() -> None:
            await server.shutdown(grace=SHUTDOWN_GRACE)
            await engine.stop()

        return cleanup

    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return run_until_signalled(start)
    finally:
        if publisher is not None:
            publisher.shutdown()
