"""The engine connection's error (shared by the compiled connection and the pool)."""

__all__ = ["UpstreamError"]


class UpstreamError(ConnectionError):
    """The engine connection failed. `received` says the engine had begun its answer (not
    safe to retry elsewhere); `connect` says we never connected."""

    def __init__(self, message: str, *, connect: bool = False, received: bool = False) -> None:
        super().__init__(message)
        self.connect = connect
        self.received = received
