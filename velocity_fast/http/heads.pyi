"""Stubs for velocity_fast.http.heads (the HTTP/1.1 heads the gateway writes)."""

CONTINUE: bytes

def status_line(status: int) -> bytes:
    """The status line: b"HTTP/1.1 <status> <reason>\\r\\n"."""
