"""Stubs for velocity_fast.http.message (the parsed HTTP request)."""

from typing import Any

class Request:
    """One parsed HTTP request. Header names are lower case."""

    method: str
    path: str
    query: str
    headers: dict[str, str]
    http_version: str
    keep_alive: bool
    client: Any
    received_at: float
    body: bytes
    expect_continue: bool
    gateway_headers: bool
    def __init__(
        self,
        method: str,
        path: str,
        query: str,
        headers: dict[str, str],
        http_version: str,
        keep_alive: bool,
        client: Any,
        received_at: float,
        body: bytes = b"",
        expect_continue: bool = False,
    ) -> None: ...
    def header(self, name: str, default: str | None = None) -> str | None: ...
