"""Entry points: ``velocityllm detect`` and the engine preparation ``chargeVelocity`` uses.

``prepare_engines(args)`` detects the GPUs, resolves the model and plans the engines
(blocking: call ``prepare_engines_async`` from a running loop, or call it before the loop
starts, which the interactive prompt needs anyway). The caller then runs the plan's specs
with ``EngineSupervisor``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Mapping, Sequence
from typing import TextIO

from velocity_fast.engines.errors import ModelPathError, ModelPromptAborted, PlanError, VllmNotFound
from velocity_fast.engines.models import ModelChoice, resolve_model
from velocity_fast.engines.plan import EnginePlan, plan_engines

from .detect import Detection, detect_gpus

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def plan_from_args(
    args: argparse.Namespace,
    detection: Detection,
    model: ModelChoice | None,
    *,
    api_key: str | None = None,
    sim_args: Sequence[str] = (),
) -> EnginePlan:
    """Plan the engines from the flags of ``add_engine_arguments``."""
    return plan_engines(
        detection.gpus,
        model,
        mock=args.mock,
        engine=getattr(args, "engine", None) or "auto",
        vllm_python=getattr(args, "vllm_python", None),
        engines=args.engines,
        tensor_parallel_size=args.tensor_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        base_port=args.engine_base_port,
        log_dir=args.engine_log_dir,
        api_key=api_key,
        sim_args=sim_args,
    )


def prepare_engines(
    args: argparse.Namespace,
    *,
    interactive: bool | None = None,
    environ: Mapping[str, str] | None = None,
    api_key: str | None = None,
    sim_args: Sequence[str] = (),
) -> tuple[Detection, EnginePlan]:
    """Detect, resolve the model (prompting on a terminal) and plan. Blocking.

    With --mock the model prompt is skipped: sim engines need no model folder. Raises
    ModelPathError, ModelPromptAborted or PlanError; see ``exit_code_for``.
    """
    detection = detect_gpus(environ)
    engine = getattr(args, "engine", None)
    ask = interactive if not args.mock and engine != "sim" and (detection.gpus or engine == "vllm") else False
    model = resolve_model(args.model_path, environ=environ, interactive=ask)
    return detection, plan_from_args(args, detection, model, api_key=api_key, sim_args=sim_args)


async def prepare_engines_async(args: argparse.Namespace, **kwargs: object) -> tuple[Detection, EnginePlan]:
    """``prepare_engines`` in a worker thread, for callers already on the event loop."""
    return await asyncio.to_thread(prepare_engines, args, **kwargs)  # type: ignore[arg-type]


def exit_code_for(exc: BaseException) -> int:
    """The exit status a command returns for an error of ``prepare_engines``."""
    if isinstance(exc, ModelPromptAborted):
        return EXIT_INTERRUPTED
    return EXIT_USAGE


def detect_main(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """``velocityllm detect``: print the GPUs, the model and the engines chargeVelocity
    would start. Exit 0 whatever is found; 2 when a given model path is not a model folder
    or the flags cannot be satisfied."""
    out = sys.stdout if out is None else out
    detection = detect_gpus()
    if detection.gpus:
        out.write(f"GPUs: {detection.count} (via {detection.source})\n")
        for g in detection.gpus:
            out.write(f"  [{g.index}] {g.name}, {g.memory_mib} MiB\n")
    else:
        out.write("GPUs: none\n")
    for note in detection.notes:
        out.write(f"  note: {note}\n")

    try:
        # detect only reports: it never asks for a model.
        model = resolve_model(args.model_path, interactive=False)
    except ModelPathError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if model is None:
        out.write(
            "Model: none found (--model-path, VELOCITY_MODEL_PATH, ./models, ~/velocity-models); "
            "chargeVelocity would ask on a terminal, else run sim engines\n"
        )
    else:
        out.write(f"Model: {model.name} at {model.path} (from {model.source})\n")

    try:
        plan = plan_from_args(args, detection, model)
    except VllmNotFound as exc:
        out.write(f"Engines: none startable: {exc}\n")
        return 0
    except PlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    out.write(f"Engines: {len(plan.specs)} x {plan.kind} ({plan.reason})\n")
    for spec in plan.specs:
        devices = f" CUDA_VISIBLE_DEVICES={spec.env['CUDA_VISIBLE_DEVICES']}" if spec.gpus else ""
        out.write(f"  {spec.name}: {spec.url} model {spec.model_name}{devices}\n")
        out.write(f"    {' '.join(spec.argv)}\n")
        out.write(f"    log: {spec.log_path}\n")
    return 0


def _parser() -> argparse.ArgumentParser:
    from .flags import add_engine_arguments

    parser = argparse.ArgumentParser(prog="velocityllm detect", description=detect_main.__doc__)
    add_engine_arguments(parser)
    return parser


if __name__ == "__main__":
    # `python -m velocity_fast.engines.app [flags]`: detect without the full CLI.
    sys.exit(detect_main(_parser().parse_args()))
