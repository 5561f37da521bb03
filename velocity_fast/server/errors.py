"""The server's exceptions."""

__all__ = ["ClientDisconnected"]


class ClientDisconnected(ConnectionError):
    """The client went away before the response was finished."""
