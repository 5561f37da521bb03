"""The limits a server enforces on every connection, each with its status code."""

from __future__ import annotations

__all__ = ["ServerLimits"]


class ServerLimits:
    """Limits a server enforces on every connection (each has its status code)."""

    __slots__ = (
        "max_body_bytes",
        "max_header_bytes",
        "header_timeout",
        "body_timeout",
        "keepalive_timeout",
        "max_pipelined",
        "write_buffer_high",
        "linger_timeout",
        "first_byte_timeout",
    )

    def __init__(
        self,
        *,
        max_body_bytes: int = 16 * 1024 * 1024,
        max_header_bytes: int = 64 * 1024,
        header_timeout: float = 10.0,
        body_timeout: float = 60.0,
        keepalive_timeout: float = 75.0,
        max_pipelined: int = 32,
        write_buffer_high: int = 512 * 1024,
        linger_timeout: float = 2.0,
        first_byte_timeout: float | None = None,
    ) -> None:
        self.max_body_bytes = max_body_bytes  # 413 past it
        self.max_header_bytes = max_header_bytes  # 431 past it (request line + headers)
        self.header_timeout = header_timeout  # 408 when a started head does not complete in time
        self.body_timeout = body_timeout  # 408 when a body does not complete in time
        self.keepalive_timeout = keepalive_timeout  # an idle connection is closed after it
        self.max_pipelined = max_pipelined  # reading pauses while this many wait their turn
        self.write_buffer_high = write_buffer_high  # write flow control: pause the producer above it
        self.linger_timeout = linger_timeout  # after an error answer, how long to wait for the client's EOF
        # A new connection that sends no byte of a request is closed (quietly, as nginx's
        # client_header_timeout does) after this; None: header_timeout. Between requests of a
        # kept-alive connection the wait is keepalive_timeout.
        self.first_byte_timeout = header_timeout if first_byte_timeout is None else first_byte_timeout
