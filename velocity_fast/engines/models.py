"""Model resolution: which model folder ``chargeVelocity`` serves, and where it was found.

Order: ``--model-path``; ``VELOCITY_MODEL_PATH``; the first folder holding ``config.json``
under ``./models`` then ``~/velocity-models``; an interactive prompt when stdin is a
terminal; otherwise none (sim engines).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from velocity_fast.engines.errors import ModelPathError, ModelPromptAborted

ENV_MODEL_PATH = "VELOCITY_MODEL_PATH"
# How deep to look under ./models and ~/velocity-models: "models/NAME/config.json" and
# Hugging Face's "models/ORG/NAME/config.json".
SEARCH_DEPTH = 2

SOURCE_FLAG = "--model-path"
SOURCE_ENV = ENV_MODEL_PATH
SOURCE_LOCAL = "./models"
SOURCE_HOME = "~/velocity-models"
SOURCE_PROMPT = "prompt"


@dataclass(frozen=True)
class ModelChoice:
    """The model folder, the name engines serve it under, and where it was found."""

    path: Path
    name: str
    source: str


def check_model_folder(path: str | os.PathLike[str], home: str | None = None) -> Path:
    """Return the absolute folder if it holds ``config.json``; else raise ModelPathError."""
    raw = os.fspath(path).strip()
    if not raw:
        raise ModelPathError("empty model path")
    if raw == "~" or raw.startswith("~/"):
        raw = (home or os.path.expanduser("~")) + raw[1:]
    folder = Path(raw).absolute()
    if not folder.exists():
        raise ModelPathError(f"model path {folder} does not exist")
    if not folder.is_dir():
        raise ModelPathError(f"model path {folder} is not a folder")
    if not (folder / "config.json").is_file():
        raise ModelPathError(
            f"model folder {folder} has no config.json "
            "(expected a Hugging Face model folder: config.json, tokenizer and weights)"
        )
    return folder


def find_model_under(root: Path, depth: int = SEARCH_DEPTH) -> Path | None:
    """The first folder holding ``config.json`` at or under ``root``, breadth first by name."""
    level = [root]
    for _ in range(depth + 1):
        nxt: list[Path] = []
        for folder in level:
            if (folder / "config.json").is_file():
                return folder.absolute()
            try:
                children = sorted(p for p in folder.iterdir() if p.is_dir())
            except OSError:  # unreadable or vanished folders are skipped, not fatal
                continue
            nxt.extend(c for c in children if not c.name.startswith("."))
        level = nxt
    return None


def resolve_model(
    model_path: str | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    interactive: bool | None = None,
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
) -> ModelChoice | None:
    """Resolve the model in the documented order; None means no model (sim engines).

    ``interactive`` None asks only when ``stdin`` is a terminal. A path that was given
    but holds no ``config.json`` raises ModelPathError; leaving the prompt with Ctrl-C or
    end of input raises ModelPromptAborted. Blocking (file system, terminal).
    """
    env = os.environ if environ is None else environ
    home = env.get("HOME") or os.path.expanduser("~")
    if model_path:
        return _choice(check_model_folder(model_path, home), SOURCE_FLAG)
    if env.get(ENV_MODEL_PATH):
        try:
            folder = check_model_folder(env[ENV_MODEL_PATH], home)
        except ModelPathError as exc:
            raise ModelPathError(f"{ENV_MODEL_PATH}: {exc}") from None
        return _choice(folder, SOURCE_ENV)
    base = Path(cwd) if cwd is not None else Path.cwd()
    for root, source in ((base / "models", SOURCE_LOCAL), (Path(home) / "velocity-models", SOURCE_HOME)):
        if root.is_dir():
            found = find_model_under(root)
            if found is not None:
                return _choice(found, source)
    inp = sys.stdin if stdin is None else stdin
    if interactive is None:
        interactive = _isatty(inp)
    if not interactive:
        return None
    return prompt_for_model(inp, sys.stderr if stdout is None else stdout, home)


def prompt_for_model(stdin: TextIO, stdout: TextIO, home: str | None = None) -> ModelChoice | None:
    """Ask for a model folder until a valid one (or an empty answer: none) is given."""
    stdout.write("No model found (--model-path, VELOCITY_MODEL_PATH, ./models, ~/velocity-models).\n")
    # Ctrl-C can land anywhere in the loop (while the prompt is written, too).
    try:
        while True:
            stdout.write("Model folder (holding config.json), or Enter for sim engines: ")
            stdout.flush()
            line = stdin.readline()
            if not line:
                stdout.write("\n")
                raise ModelPromptAborted("model prompt closed (end of input)")
            answer = line.strip()
            if not answer:
                return None
            try:
                return _choice(check_model_folder(answer, home), SOURCE_PROMPT)
            except ModelPathError as exc:
                stdout.write(f"{exc}; try again.\n")
    except KeyboardInterrupt:
        stdout.write("\n")
        raise ModelPromptAborted("model prompt interrupted (Ctrl-C)") from None


def _choice(folder: Path, source: str) -> ModelChoice:
    return ModelChoice(folder, folder.name, source)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed or replaced streams are not terminals
        return False
