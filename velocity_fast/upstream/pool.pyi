"""Stubs for velocity_fast.upstream.pool (a keep-alive connection pool per engine endpoint)."""

from velocity_fast.upstream.connection import ResponseHandler, UpstreamConnection

def request_head(method: str, path: str, host: bytes, headers: list[tuple[str, str]], body_len: int) -> bytes:
    """The request line and headers for one request with a Content-Length body."""

class UpstreamPool:
    """Idle keep-alive connections to one engine, reused most-recent first."""

    url: str
    host: str
    port: int
    connect_timeout: float
    connects: int
    max_idle: int
    base_path: str
    host_header: bytes
    _all: set[UpstreamConnection]
    _connecting: set
    _idle: list[UpstreamConnection | None]
    _n_idle: int
    _json_posts: dict[str, bytes]
    def __init__(self, url: str, *, max_idle: int = 256, connect_timeout: float = 3.0) -> None: ...
    async def connect(self) -> UpstreamConnection: ...
    async def open_request(self, data: bytes) -> UpstreamConnection:
        """Send a request; returns the connection once the response head arrived."""
    async def fetch(
        self,
        method: str,
        path: str,
        *,
        body: bytes = b"",
        headers: list[tuple[str, str]] | None = None,
        timeout: float = 2.0,
    ) -> tuple[int, bytes]:
        """A whole small request (health checks, scrapes, model lists): (status, body)."""
    def stats(self) -> dict[str, int]: ...
    def close(self) -> None: ...
    def json_post_head(self, path: str) -> bytes:
        """The start of a JSON POST to ``path``, up to the per-request headers, built once per path."""
    def idle_connection(self) -> UpstreamConnection | None: ...
    def release(self, conn: UpstreamConnection) -> None:
        """Return a connection whose response completed; anything else is closed."""
    def request(self, data: bytes | tuple[bytes, bytes], handler: ResponseHandler) -> None:
        """Send a request (bytes, or its head and body) whose answer goes to ``handler`` (see upstream.connection.ResponseHandler)."""
    def connect_for(self, data: bytes | tuple[bytes, bytes], handler: ResponseHandler) -> None:
        """Connect a fresh connection and send ``data`` there, its answer to ``handler``."""
    def adopt(self, conn: UpstreamConnection) -> None:
        """An open connection made elsewhere joins the pool as an idle one."""
    def forget(self, conn: UpstreamConnection) -> None:
        """The connection closed: no longer the pool's."""
