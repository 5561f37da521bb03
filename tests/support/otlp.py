"""A real OTLP/HTTP trace receiver for the tests: an HTTP server on 127.0.0.1 that decodes
the ``ExportTraceServiceRequest`` protobuf an OpenTelemetry exporter posts to /v1/traces
(the gateway's, or vLLM's with ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``).

    need_otel()                      # at a test module's top: the otel packages, or skip (fail under CI)
    with Receiver() as rx:           # rx.url: http://127.0.0.1:PORT; rx.spans: every span, decoded
        ...
"""

from __future__ import annotations

import gzip
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

SERVER, CLIENT = 2, 3  # Span.SpanKind in the OTLP protobuf


def need_otel() -> None:
    """The test extra brings opentelemetry; without it a test module skips, saying how to
    install it, and under CI=true it fails (CI installs the extra)."""
    try:
        import opentelemetry.proto  # noqa: F401
        import opentelemetry.sdk  # noqa: F401
    except ImportError:
        msg = "needs the otel packages: pip install -e '.[test]' (or 'velocityllm[otel]')"
        if os.environ.get("CI") == "true":
            pytest.fail("under CI=true: " + msg, pytrace=False)
        pytest.skip(msg, allow_module_level=True)


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


class Receiver:
    """An OTLP/HTTP trace receiver on 127.0.0.1: every span it was sent, decoded."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.posts = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                assert self.path == "/v1/traces"
                assert self.headers["content-type"] == "application/x-protobuf"
                from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

                req = ExportTraceServiceRequest.FromString(body)
                for rs in req.resource_spans:
                    res = {a.key: _value(a.value) for a in rs.resource.attributes}
                    for ss in rs.scope_spans:
                        for s in ss.spans:
                            outer.spans.append(
                                {
                                    "name": s.name,
                                    "kind": s.kind,
                                    "trace_id": s.trace_id.hex(),
                                    "span_id": s.span_id.hex(),
                                    "parent": s.parent_span_id.hex(),
                                    "start": s.start_time_unix_nano,
                                    "end": s.end_time_unix_nano,
                                    "attrs": {a.key: _value(a.value) for a in s.attributes},
                                    "error": s.status.code == 2,
                                    "resource": res,
                                }
                            )
                outer.posts += 1
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}"

    def __enter__(self) -> "Receiver":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)
