"""Stubs for velocity_fast.http.http1 (HTTP/1.1 request and response scanners)."""

def response_headers(data: bytes, pos: int, end: int) -> dict[str, str]:
    """The header lines of a response the scanner took, as a dict of lower-case names."""

def scan_request(
    data: bytes, pos: int, max_head: int, max_body: int
) -> tuple[str, str, str, dict[str, str], bool, bytes, int] | None: ...
def scan_response(data: bytes, pos: int) -> tuple[int, dict[str, str], bool, bytes, int] | None: ...
def scan_chunked_head(data: bytes, pos: int) -> tuple[int, dict[str, str], bool, int] | None: ...
