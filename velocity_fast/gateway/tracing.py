"""OpenTelemetry traces of the proxied requests (docs/tracing.md).

Imported only when ``tracing.sample_ratio`` is above 0: the gateway then keeps a
``Tracing`` in its Ingress, and the front door asks it for a ``Trace`` for each request that
goes through admission (``begin``: chat, completions, /generate, the Responses and
Messages APIs). A request that is not sampled gets None and goes on as
with tracing off. A sampled one:

- joins the caller's ``traceparent``/``tracestate`` (W3C) or starts a trace, in a SERVER
  span started at the time the request was read;
- sends the engine ``traceparent`` naming the CLIENT span of its attempt, so that the
  engine's own span (vLLM's) is a child of it;
- answers with ``traceparent`` naming the server span.

The ``admission.wait`` and ``route`` spans are made when their work is done, from the
times the exchange kept (monotonic, turned into wall-clock nanoseconds). Finished spans
go to the SDK's BatchSpanProcessor: its own thread exports them in batches, its queue is
bounded (``tracing.max_queue_size``; past it spans are dropped), so nothing on the event
loop waits on the collector.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import threading
import time
from typing import Any

import orjson
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
from opentelemetry.trace import SpanKind, Status, StatusCode, get_current_span, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from velocity_fast.config import TracingSettings, traces_url

__all__ = ["Tracing", "Trace"]

# One export waits at most this long for the collector (in the exporter's thread).
EXPORT_TIMEOUT_S = 5.0

# What a stream's chunks say of the answer, read only for sampled requests.
# (OpenAI's finish_reason and token names; the Messages API's stop_reason, and its and the
# Responses API's input_tokens and output_tokens.)
_FINISH = re.compile(rb'"finish_reason":\s*"([^"]+)"')
_STOP = re.compile(rb'"stop_reason":\s*"([^"]+)"')  # (vLLM's chat chunks name a stop string so)
_MODEL = re.compile(rb'"model":\s*"([^"\\]*)"')
_PROMPT = re.compile(rb'"(?:prompt|input)_tokens":\s*(\d+)')
_COMPLETION = re.compile(rb'"(?:completion|output)_tokens":\s*(\d+)')


class Tracing:
    """The gateway's tracer: sampler, exporter and batch processor, made once at start."""

    def __init__(self, settings: TracingSettings) -> None:
        # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES name the service when given.
        own = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": "velocityllm"}
        # The ratio is applied in begin(), before any span is made: a request not sampled
        # costs a header look-up and a random number, not the SDK's start_span.
        self.ratio = settings.sample_ratio
        self._random = random.random
        self.provider = TracerProvider(resource=Resource.create(own), sampler=ParentBased(ALWAYS_ON))
        self.exporter = OTLPSpanExporter(endpoint=traces_url(settings.otlp_endpoint or ""), timeout=EXPORT_TIMEOUT_S)
        self.processor = BatchSpanProcessor(
            self.exporter,
            max_queue_size=settings.max_queue_size,
            max_export_batch_size=min(512, settings.max_queue_size),
        )
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer("velocity_fast.gateway")
        self.propagator = TraceContextTextMapPropagator()

    def begin(self, x: Any, chat: bool, asked: Any) -> "Trace | None":
        """The trace of the exchange ``x`` (a chat request when ``chat``, ``asked``: the
        max tokens it named), or None when it is not sampled."""
        req = x.req
        headers = req.headers
        ctx = None
        if "traceparent" in headers:  # the caller decided, unless its context is invalid
            ctx = self.propagator.extract(headers)
            sc = get_current_span(ctx).get_span_context()
            if not sc.is_valid:
                ctx = None
            elif not sc.trace_flags.sampled:
                return None
        if ctx is None and self._random() >= self.ratio:
            return None
        ticket = x.ticket
        op = "chat" if chat else "text_completion"
        offset = time.time_ns() - time.monotonic_ns()
        t0 = req.received_at or time.monotonic()
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": op,
            "gen_ai.request.model": str(ticket.model),
            "velocity.band": ticket.band,
            "http.request.method": "POST",
            "url.path": x.route,
        }
        if asked is not None:
            attrs["gen_ai.request.max_tokens"] = int(asked)
        if ticket.tenant is not None:
            attrs["velocity.tenant"] = str(ticket.tenant)
        span = self.tracer.start_span(
            f"{op} {ticket.model}",
            context=ctx,
            kind=SpanKind.SERVER,
            start_time=offset + int(t0 * 1e9),
            attributes=attrs,
        )
        adm = x.ingress.admission
        predicted = ahead = None
        try:  # what the SLA check predicts for it now, at arrival (None: nothing known yet)
            got = adm.prediction(ticket.model, ticket.band, ticket.max_tokens, ticket.prompt_bytes)
            predicted = got[0] if got is not None else None
            # Its place in the queue: the requests of its pool already waiting in its band
            # and the bands above (the bands are highest first).
            ps = adm.known_pools().get(ticket.model)
            if ps is not None:
                ahead = sum(ps.queues.band(i).count for i in range(adm.band_names.index(ticket.band) + 1))
        except Exception:  # an admission without these figures (a policy of its own): none
            pass
        return Trace(self, span, offset, t0, op, predicted, ahead, x.route)

    async def close(self, timeout: float = EXPORT_TIMEOUT_S + 1.0) -> None:
        """Export what is queued and stop the processor's thread, waiting at most ``timeout``
        (a collector that is down must not hold the gateway's stop)."""
        done = threading.Thread(target=self.provider.shutdown, name="velocity-otel-shutdown", daemon=True)
        done.start()
        deadline = time.monotonic() + timeout
        while done.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)


def _traceparent_line(span: Any) -> bytes:
    """The ``traceparent`` header line that makes an engine's span a child of ``span``."""
    sc = span.get_span_context()
    return f"traceparent: 00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}\r\n".encode("ascii")


class Trace:
    """One sampled request's spans: the server span, live; its children made as their
    work ends."""

    __slots__ = (
        "tracing",
        "span",
        "ctx",
        "offset",
        "t0",
        "op",
        "predicted",
        "ahead",
        "traceparent",
        "header_line",
        "route_t0",
        "router",
        "profile",
        "attempt_span",
        "attempt_t",
        "attempts",
        "first_at",
        "finish",
        "finish_re",
        "model",
        "prompt_tokens",
        "completion_tokens",
        "ended",
    )

    def __init__(
        self,
        tracing: Tracing,
        span: Any,
        offset: int,
        t0: float,
        op: str,
        predicted: float | None,
        ahead: int | None,
        route: str = "",
    ) -> None:
        self.tracing = tracing
        self.span = span
        self.ctx = set_span_in_context(span)
        self.offset = offset
        self.t0 = t0
        self.op = op
        self.predicted = predicted
        self.ahead = ahead
        sc = span.get_span_context()
        self.traceparent = f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"
        self.header_line = b"traceparent: " + self.traceparent.encode("ascii") + b"\r\n"
        self.route_t0 = 0.0
        self.router = None
        self.profile = None
        self.attempt_span = None
        self.attempt_t = 0.0
        self.attempts = 0
        self.first_at = 0.0
        self.finish: list[str] = []
        self.finish_re = _STOP if route == "/v1/messages" else _FINISH
        self.model = None
        self.prompt_tokens = None
        self.completion_tokens = None
        self.ended = False

    def _ns(self, mono: float) -> int:
        return self.offset + int(mono * 1e9)

    # -- the exchange's steps ------------------------------------------------------------------
    def routing(self, router: Any, info: Any) -> None:
        """A pick begins: its start, and the profile's basis cleared so that a pick without
        a choice (one candidate, which sets none) shows as such."""
        self.route_t0 = time.monotonic()
        self.router = router
        profile = router.profile(info.profile)
        if profile is not None:
            profile.basis = None
        self.profile = profile

    def attempt(self, ep: Any, info: Any) -> bytes:
        """The pick chose ``ep``: the route span, and the client span of this attempt (the
        one before it, if any, failed); returns the engine's traceparent line."""
        self.route(ep, info)
        return self.client(ep)

    def route(self, ep: Any, info: Any) -> None:
        """The pick chose ``ep``: the route span, from ``routing`` to now."""
        now = time.monotonic()
        basis = getattr(self.profile, "basis", None) if self.profile is not None else None
        attrs: dict[str, Any] = {
            "velocity.route.profile": str(info.profile),
            "velocity.route.basis": basis or "only",
            "velocity.endpoint": ep.name,
            "velocity.route.prompt_blocks": int(info.nblocks),
        }
        if self.router is not None and info.nblocks:
            attrs["velocity.route.prefix_blocks_matched"] = int(self.router.matched_blocks(ep, info))
        held = self.router.kv_blocks_held(ep, info) if self.router is not None else None
        if held is not None:
            # Precise routing: the engine's own blocks of the prompt, as its KV events say
            # (-1: its index is not exact, the pick went by the approximate one).
            attrs["velocity.route.kv_blocks"], attrs["velocity.route.kv_blocks_held"] = int(held[0]), int(held[1])
        span = self.tracing.tracer.start_span(
            "route", context=self.ctx, start_time=self._ns(self.route_t0 or now), attributes=attrs
        )
        span.end(self._ns(now))

    def _client_span(self, ep: Any, now: float, attrs: dict[str, Any]) -> Any:
        host, _, port = ep.url.split("://", 1)[-1].split("/", 1)[0].rpartition(":")
        attrs["gen_ai.operation.name"] = self.op
        attrs["velocity.endpoint"] = ep.name
        attrs["server.address"] = host or port
        if host and port.isdigit():
            attrs["server.port"] = int(port)
        return self.tracing.tracer.start_span(
            self.span.name, context=self.ctx, kind=SpanKind.CLIENT, start_time=self._ns(now), attributes=attrs
        )

    def client(self, ep: Any, leg: str | None = None) -> bytes:
        """The request (or, with P/D, its decode ``leg``: "decode" after a prefill leg,
        "colocated" without one) is sent to ``ep``: its client span (the one before it, if
        any, failed); returns the engine's traceparent line."""
        now = time.monotonic()
        if self.attempt_span is not None:
            self.attempt_span.set_status(Status(StatusCode.ERROR, "the engine failed before answering"))
            self.attempt_span.end(self._ns(now))
        attrs: dict[str, Any] = {"velocity.retry": self.attempts}
        if leg is not None:
            attrs["velocity.pd.leg"] = leg
        span = self._client_span(ep, now, attrs)
        self.attempt_span = span
        self.attempt_t = now
        self.attempts += 1
        self.first_at = 0.0
        return _traceparent_line(span)

    def prefill(self, ep: Any, tokens: float) -> tuple[Any, bytes]:
        """A P/D prefill leg is sent to ``ep`` (``tokens``: the prompt's tokens it is
        expected to compute): its client span, ended by ``prefill_end``, and the engine's
        traceparent line (the prefill engine's span becomes its child)."""
        span = self._client_span(
            ep, time.monotonic(), {"velocity.pd.leg": "prefill", "velocity.pd.uncached_tokens": int(tokens)}
        )
        return span, _traceparent_line(span)

    def prefill_end(self, span: Any, status: int, error: Any) -> None:
        """The prefill leg's end: the engine's status, or why it has none (``error``)."""
        if status:
            span.set_attribute("http.response.status_code", status)
        if error is not None or not 200 <= status < 300:
            span.set_status(Status(StatusCode.ERROR, str(error) if error is not None else f"status {status}"))
        span.end(self._ns(time.monotonic()))

    def piece(self, data: bytes, first: bool) -> None:
        """A piece of a stream relayed: its first is the first token's time; its chunks
        say the model, the finish reasons and the usage."""
        if first:
            self.first_at = time.monotonic()
        if self.model is None and (m := _MODEL.search(data)) is not None:
            self.model = m.group(1).decode("utf-8", "replace")
        for m in self.finish_re.finditer(data):
            self.finish.append(m.group(1).decode("utf-8", "replace"))
        if (m := _PROMPT.search(data)) is not None:
            self.prompt_tokens = int(m.group(1))
        if (m := _COMPLETION.search(data)) is not None:
            self.completion_tokens = int(m.group(1))

    def _whole(self, body: bytes) -> None:
        """A whole answer's model, finish reasons and usage."""
        try:
            obj = orjson.loads(body)
            self.model = obj.get("model")
            self.finish = [c.get("finish_reason") for c in obj.get("choices") or () if c.get("finish_reason")]
            if obj.get("stop_reason"):  # the Messages API's
                self.finish = [obj["stop_reason"]]
            usage = obj.get("usage") or {}
            self.prompt_tokens = usage.get("prompt_tokens", usage.get("input_tokens"))
            self.completion_tokens = usage.get("completion_tokens", usage.get("output_tokens"))
        except (orjson.JSONDecodeError, AttributeError, TypeError):
            pass  # not an answer's shape: nothing to say of it

    def end(self, x: Any, status: int, reason: str | None, retry_after: Any, body: bytes | None) -> None:
        """The request's end (its status, the reason of a decline and the Retry-After
        promised with it, a whole answer's ``body``): every span ended."""
        if self.ended:
            return
        self.ended = True
        now = time.monotonic()
        tracer = self.tracing.tracer
        if body is not None and 200 <= status < 300:
            self._whole(body)
        # admission.wait: from arrival to the grant, or to the decline
        granted = x.lease is not None
        waited = x.queue_s if granted else now - self.t0
        attrs: dict[str, Any] = {"velocity.band": x.ticket.band, "velocity.wait_ms": waited * 1000.0}
        if self.predicted is not None:
            attrs["velocity.predicted_wait_ms"] = self.predicted * 1000.0
        if self.ahead is not None:
            attrs["velocity.queued_ahead"] = self.ahead
        if reason is not None and not granted:
            attrs["velocity.decline_reason"] = reason
        if retry_after is not None:
            attrs["velocity.retry_after_s"] = float(retry_after)
        wait = tracer.start_span("admission.wait", context=self.ctx, start_time=self._ns(self.t0), attributes=attrs)
        if not granted and status >= 400:
            wait.set_status(Status(StatusCode.ERROR, reason or f"status {status}"))
        wait.end(self._ns(self.t0 + waited))
        attempt = self.attempt_span
        if attempt is not None:
            if self.first_at:
                attempt.set_attribute("velocity.ttft_ms", (self.first_at - self.attempt_t) * 1000.0)
            if x.ep is not None and reason not in ("upstream",):
                attempt.set_attribute("http.response.status_code", status)
            if status >= 500 or reason == "upstream":
                attempt.set_status(Status(StatusCode.ERROR, reason or f"status {status}"))
            attempt.end(self._ns(now))
        span = self.span
        span.set_attribute("http.response.status_code", status)
        if reason is not None:
            span.set_attribute("velocity.decline_reason", reason)
        if self.model:
            span.set_attribute("gen_ai.response.model", self.model)
        if self.finish:
            span.set_attribute("gen_ai.response.finish_reasons", self.finish)
        if self.prompt_tokens is not None:
            span.set_attribute("gen_ai.usage.input_tokens", int(self.prompt_tokens))
        if self.completion_tokens is not None:
            span.set_attribute("gen_ai.usage.output_tokens", int(self.completion_tokens))
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR, reason or f"status {status}"))
        span.end(self._ns(now))
