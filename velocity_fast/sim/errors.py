"""The sim engine's exceptions."""

__all__ = ["BadRequest"]


class BadRequest(Exception):
    """A request vLLM would refuse with 400; ``param`` names the field (the error's
    ``param``). With a ``value``, the message ends as vLLM's validation errors do:
    ``(parameter=NAME, value=VALUE)``."""

    def __init__(self, message: str, param: str | None = None, value: object = None) -> None:
        if value is not None:
            message = f"{message} (parameter={param}, value={value})"
        super().__init__(message)
        self.param = param
