"""`velocityllm serve` and `velocityllm chargeVelocity`: settings, engines, gateway, shutdown."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
import shutil
import sys
import tempfile

from ..config import ConfigError, Settings, load_settings
from .errors import ListenError
from .flags import flag_overrides
from .reload import Reloader

__all__ = ["serve_main", "charge_main"]

log = logging.getLogger("velocity.launch")


def _settings(args: argparse.Namespace) -> Settings | None:
    try:
        settings = load_settings(args.config, flag_overrides(args))
        _check_tokenizers(settings, args)
        return settings
    except ConfigError as e:
        print(f"velocityllm: config error: {e}", file=sys.stderr)
        return None


def _check_tokenizers(settings: Settings, args: argparse.Namespace, source: str | None = None) -> None:
    """Precise pools' tokenizers load (a file that is no tokenizer.json, or no `tokenizers`
    package, is a config error at start, not a traceback)."""
    from velocity_fast.routing.precise.template import load_tokenizer

    from .assemble import routing_settings

    rs = routing_settings(settings)
    if not rs.precise_models():
        return
    for key, path in [("routing.tokenizer", rs.tokenizer)] + [
        (f"models.{m}.tokenizer", p) for m, p in rs.tokenizers.items()
    ]:
        if path is not None:
            try:
                load_tokenizer(path)
            except ValueError as e:
                where = source or (
                    "--tokenizer"
                    if key == "routing.tokenizer" and getattr(args, "tokenizer", None)
                    else args.config or os.environ.get("VELOCITY_CONFIG") or "defaults"
                )
                raise ConfigError(f"{where}: {key}: {e}") from None


def _check_ports(settings: Settings) -> None:
    """The gateway's two ports can be bound, before engines that take minutes to load are
    started in vain (bound as the server binds them, with SO_REUSEADDR; released at once)."""
    import socket

    for key in ("port", "admin_port"):
        port = getattr(settings, key)
        if port == 0:
            continue
        try:
            infos = socket.getaddrinfo(settings.host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except OSError:
            return  # the server's own bind says what is wrong with the host
        for family, type_, proto, _, address in infos:
            with socket.socket(family, type_, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind(address)
                except OSError as e:
                    raise ListenError(key, settings.host, port, e) from None


def sim_flags(settings: Settings, extra: str | None) -> list[str]:
    """The `sim:` config section (and --sim-args) as sim-engine flags."""
    out: list[str] = []
    for key, value in settings.sim.items():
        flag = "--" + str(key).replace("_", "-")
        if value is None:  # null in YAML: the sim engine's own default
            continue
        if value is True:
            out.append(flag)
        elif value is False:
            out.append("--no-" + flag[2:])
        else:
            out += [flag, str(value)]
    if extra:
        out += shlex.split(extra)
    return out


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise ValueError(message)


def _check_sim_engines(plan, args: argparse.Namespace) -> None:
    """The sim engines' flags (the `sim:` section, --sim-args, max_model_len), read as each
    engine will read them: a value it would refuse is a config error now, in the one form,
    not an engine that exits before answering."""
    from velocity_fast.sim.flags import add_arguments
    from velocity_fast.sim.settings import SimConfig

    parser = _RaisingParser(prog="sim-engine", add_help=False)
    add_arguments(parser)
    argv = list(plan.specs[0].argv)
    flags = argv[argv.index("velocity_fast.sim") + 1 :]
    try:
        SimConfig.from_args(parser.parse_args(flags)).validate()
    except ValueError as e:
        source = (
            "--sim-args"
            if getattr(args, "sim_args", None)
            else args.config or os.environ.get("VELOCITY_CONFIG") or "defaults"
        )
        raise ConfigError(f"{source}: sim: {e} (the sim engines' flags: `sim:`, --sim-args, max_model_len)") from None


def _sim_defaults() -> dict:
    """The sim engine's own flag defaults, by the `sim:` key that names each."""
    from velocity_fast.sim.flags import add_arguments

    parser = _RaisingParser(prog="sim-engine", add_help=False)
    add_arguments(parser)
    return {a.dest: a.default for a in parser._actions if a.dest and a.option_strings}


def engines_only_keys(settings: Settings) -> list[str]:
    """The keys set (away from their defaults) that only chargeVelocity's engines read:
    `serve` starts no engine, so each would do nothing there. A `sim:` value equal to the
    sim engine's default (as the example config lists them) changes nothing and passes."""
    out = []
    if settings.model_path:
        out.append("model_path")
    if settings.engine != "auto":
        out.append("engine")
    if settings.vllm_python:
        out.append("vllm_python")
    if settings.sim:
        defaults = _sim_defaults()
        for key, value in settings.sim.items():
            if value is not None and defaults.get(str(key).replace("-", "_"), object()) != value:
                out.append(f"sim.{key}")
    return out


def _engines_only_error(settings: Settings, source: str) -> ConfigError | None:
    keys = engines_only_keys(settings)
    if not keys:
        return None
    return ConfigError(
        f"{source}: {', '.join(keys)}: only `velocityllm chargeVelocity` starts engines and reads "
        f"{'it' if len(keys) == 1 else 'them'}; `serve` proxies to the endpoints it is given and would "
        "ignore it. Remove it from the config (or its VELOCITY_* variable), or run chargeVelocity"
    )


def serve_main(args: argparse.Namespace) -> int:
    """The gateway alone, in front of engines that already run (--endpoint / config)."""
    from velocity_fast.server.run import run_until_signalled

    from .app import Gateway
    from .observability import setup_logging
    from .workers import supervise, worker_count, worker_side

    settings = _settings(args)
    if settings is None:
        return 2
    if not settings.endpoints:
        print(
            "velocityllm: config error: no endpoints: give --endpoint NAME=URL=MODEL or `endpoints:` "
            "in the config file",
            file=sys.stderr,
        )
        return 2
    source = args.config or os.environ.get("VELOCITY_CONFIG") or "the environment"
    wrong = _engines_only_error(settings, source)
    if wrong is not None:
        print(f"velocityllm: config error: {wrong}", file=sys.stderr)
        return 2
    side = worker_side()  # a worker of a supervisor (gateway/workers.py), or the gateway itself
    setup_logging(settings.structured_logs, settings.log_level, None if side is None else side.index)
    workers = worker_count(settings)

    def reread() -> Settings:
        s = load_settings(args.config, flag_overrides(args))
        if not s.endpoints:
            raise ConfigError(
                f"{args.config or os.environ.get('VELOCITY_CONFIG') or 'defaults'}: endpoints: "
                "none left; a gateway alone needs at least one"
            )
        wrong = _engines_only_error(s, args.config or os.environ.get("VELOCITY_CONFIG") or "the environment")
        if wrong is not None:  # a reload that adds one is refused as at start
            raise wrong
        return s

    if side is None and workers > 1:
        try:
            return supervise(args, settings, reread)
        except ListenError as e:
            print(f"velocityllm: {e}", file=sys.stderr)
            return 1

    async def main(stop: asyncio.Event):
        if side is not None:
            side.attach()
        gw = Gateway(settings, backend="endpoints")
        if side is None:
            await gw.start()
        else:  # the supervisor's port, shared; a private admin port it merges from
            await gw.start(port=side.port, admin_port=0, admin_host="127.0.0.1", reuse_port=True)
        reloader = Reloader(gw, reread)
        reloader.install()
        if side is None:
            print(
                f"velocityllm: gateway http://{settings.host}:{gw.port} admin http://{settings.host}:"
                f"{gw.admin_port} policy {settings.policy}, {len(settings.endpoints)} endpoint(s), 1 worker",
                flush=True,
            )
        else:
            side.report(gw.admin_port)

        async def cleanup() -> None:
            reloader.close()
            await gw.stop()

        return cleanup

    try:
        return run_until_signalled(main)
    except ListenError as e:
        print(f"velocityllm: {e}", file=sys.stderr)
        return 1


def charge_main(args: argparse.Namespace) -> int:
    """Batteries included: engines per GPU (or sim engines) and the gateway in front."""
    from velocity_fast.engines.errors import EngineStartError, ModelPathError, ModelPromptAborted, PlanError
    from velocity_fast.engines.supervisor import EngineSupervisor
    from velocity_fast.server.run import run_until_signalled

    from ..engines.app import exit_code_for, prepare_engines
    from .app import Gateway
    from .assemble import routing_settings
    from .kv import kv_events_for_engines
    from .observability import setup_logging
    from .workers import worker_count

    settings = _settings(args)
    if settings is None:
        return 2
    if worker_count(settings) > 1:
        source = (
            "--workers"
            if getattr(args, "workers", None) is not None
            else "VELOCITY_WORKERS"
            if os.environ.get("VELOCITY_WORKERS")
            else args.config or os.environ.get("VELOCITY_CONFIG") or "defaults"
        )
        print(
            f"velocityllm: config error: {source}: workers: chargeVelocity runs one gateway process beside "
            f"the engines it supervises; for more, start the engines on their own and run `velocityllm serve "
            f"--workers {settings.workers}` in front of them",
            file=sys.stderr,
        )
        return 2
    try:
        _check_ports(settings)
    except ListenError as e:
        print(f"velocityllm: {e}", file=sys.stderr)
        return 1
    setup_logging(settings.structured_logs, settings.log_level)
    if settings.model_path and not args.model_path:
        args.model_path = settings.model_path
    args.engine = settings.engine  # the flag, else the config's engine:
    if settings.vllm_python and not args.vllm_python:
        args.vllm_python = settings.vllm_python
    if args.max_model_len is None:
        args.max_model_len = settings.max_model_len
    try:
        detection, plan = prepare_engines(
            args, api_key=None, sim_args=sim_flags(settings, getattr(args, "sim_args", None))
        )
    except (ModelPathError, PlanError) as e:
        print(f"velocityllm: {e}", file=sys.stderr)
        return exit_code_for(e)
    except ModelPromptAborted as e:
        print(f"velocityllm: {e}", file=sys.stderr)
        return exit_code_for(e)
    if plan.kind == "sim":
        try:
            _check_sim_engines(plan, args)
        except ConfigError as e:
            print(f"velocityllm: config error: {e}", file=sys.stderr)
            return 2
    if plan.kind == "sim" and not args.mock and args.engine != "sim":
        print(f"velocityllm: {plan.reason}; starting {len(plan.specs)} built-in sim engine(s) instead.", flush=True)

    # Precise pools: the engines publish their KV events on free ports (the model
    # folder's tokenizer unless one is configured; sim engines' own, written here).
    own_tokenizer = None
    sock_dir = tempfile.mkdtemp(prefix="velocity-kv-")  # the engines' KV event sockets, if any
    rs = routing_settings(settings)
    untokenized = sorted(
        {
            spec.model_name
            for spec in plan.specs
            if rs.prefix_for(spec.model_name) == "precise" and rs.tokenizer_for(spec.model_name) is None
        }
    )
    if untokenized and plan.model is not None and (plan.model.path / "tokenizer.json").exists():
        own_tokenizer = str(plan.model.path)
        settings.routing["tokenizer"] = own_tokenizer
    elif untokenized and plan.kind == "sim":
        from velocity_fast.sim.tokens import write_tokenizer

        try:
            own_tokenizer = write_tokenizer(sock_dir)
        except ValueError as e:
            shutil.rmtree(sock_dir, ignore_errors=True)
            print(f"velocityllm: config error: precise prefix routing with sim engines: {e}", file=sys.stderr)
            return 2
        settings.routing["tokenizer"] = own_tokenizer
        log.info("precise prefix routing with the sim engines' own tokenizer (%s)", own_tokenizer)
    elif untokenized:
        shutil.rmtree(sock_dir, ignore_errors=True)
        where = (
            "--prefix"
            if getattr(args, "prefix", None)
            else args.config or os.environ.get("VELOCITY_CONFIG") or "routing.prefix"
        )
        print(
            f"velocityllm: config error: {where}: model {untokenized[0]!r} is precise but has no tokenizer: "
            f"give --tokenizer PATH (a tokenizer.json, or a model folder holding one; or `tokenizer` under "
            f"`routing:` in the config file), or a --model-path whose folder holds a tokenizer.json",
            file=sys.stderr,
        )
        return 2
    plan, engine_endpoints = kv_events_for_engines(plan, routing_settings(settings), sock_dir)
    settings.endpoints.extend(engine_endpoints)
    try:
        try:
            settings.validate()
        except ConfigError as e:  # what the engines started here added: their own flags
            raise ConfigError(f"{'--model-path' if own_tokenizer else '--engines'}: {e}") from None
        if own_tokenizer is not None and plan.kind != "sim":
            _check_tokenizers(settings, args, source="--model-path")
    except ConfigError as e:
        shutil.rmtree(sock_dir, ignore_errors=True)
        print(f"velocityllm: config error: {e}", file=sys.stderr)
        return 2

    def reread() -> Settings:  # the engines started here stay; the file may add more
        s = load_settings(args.config, flag_overrides(args))
        if own_tokenizer is not None and s.routing.get("tokenizer") is None:
            s.routing["tokenizer"] = own_tokenizer
        s.endpoints.extend(engine_endpoints)
        return s.validate()

    gw_box: list[Gateway] = []

    def on_state(name: str, state: str) -> None:  # the supervisor logs each change itself
        if gw_box:
            gw_box[0].set_endpoint_available(name, state == "ready")

    sup = EngineSupervisor(plan.specs, on_state_change=on_state)

    async def main(stop: asyncio.Event):
        try:
            await sup.start()
            gw = Gateway(
                settings,
                backend=plan.kind,
                model_label=plan.model.path.name if plan.model else (plan.specs[0].model_name if plan.specs else None),
            )
            gw_box.append(gw)
            await gw.start()
        except BaseException:
            await sup.stop()
            raise
        gpus = ", ".join(f"{g.name} ({g.memory_mib} MiB)" for g in detection.gpus) or "none"
        lines = [
            "velocityllm chargeVelocity",
            f"  GPUs:     {gpus}",
            f"  model:    {plan.model.path if plan.model else 'none (sim engines)'}",
            f"  engines:  {plan.kind}: " + ", ".join(f"{s.name} {s.url}" for s in plan.specs),
            f"  gateway:  http://{settings.host}:{gw.port}",
            f"  admin:    http://{settings.host}:{gw.admin_port}  (/metrics /ready /stats)",
            f"  policy:   {settings.policy}",
        ]
        print("\n".join(lines), flush=True)
        reloader = Reloader(gw, reread)
        reloader.install()

        async def cleanup() -> None:
            reloader.close()
            try:
                await gw.stop()
            finally:
                gw_box.clear()  # engines stopped on purpose are no "restarting" to report
                await sup.stop()

        return cleanup

    try:
        return run_until_signalled(main)
    except (EngineStartError, ListenError) as e:
        print(f"velocityllm: {e}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
