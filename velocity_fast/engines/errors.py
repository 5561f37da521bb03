"""The engines package's exceptions: a model path that is not a model, a plan that cannot be
made, an engine that would not start."""

from __future__ import annotations

__all__ = ["EngineStartError", "ModelPathError", "ModelPromptAborted", "PlanError", "VllmNotFound"]


class EngineStartError(RuntimeError):
    """An engine exited or did not answer /health in time while starting."""

    def __init__(self, name: str, reason: str, log_path: str, tail: str) -> None:
        self.name = name
        self.reason = reason
        self.log_path = log_path
        self.tail = tail
        super().__init__(f"engine {name} failed to start: {reason}\n--- last lines of {log_path} ---\n{tail}\n---")


class PlanError(ValueError):
    """The engines cannot be planned as asked (GPU count vs TP size, vllm missing, ...)."""


class VllmNotFound(PlanError):
    """GPUs and a model are there, but no ``vllm`` executable is on PATH."""


class ModelPathError(ValueError):
    """A model path was given (flag, environment or prompt) but is not a model folder."""


class ModelPromptAborted(Exception):
    """The user left the model prompt with Ctrl-C or end of input."""
