"""The sim engine's exceptions."""

__all__ = ["BadRequest"]


class BadRequest(Exception):
    """A request vLLM would refuse with 400."""
