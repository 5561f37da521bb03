"""HTTP/1.1 on uvloop + httptools, shared by the sim engine and the gateway.

It knows nothing of engines, bands or routing: a handler gets a Request and a
Responder and answers. See docs/internals.md for the interface.
"""

from .messages import ClientDisconnected, Request, ServerLimits, error_body
from .protocol import HTTPServer, Responder
from .run import run_until_signalled

__all__ = ["HTTPServer", "Request", "Responder", "ServerLimits", "ClientDisconnected",
           "error_body", "run_until_signalled"]
