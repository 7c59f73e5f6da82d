"""Per-RPC Prometheus metrics for the grpc.aio server: latency, status codes, streams.

Why hand-written: OpenTelemetry's gRPC instrumentation for Python
(``opentelemetry-instrumentation-grpc`` 0.66b2, its ``aio_server_interceptor``) records spans
only, no metrics (metrics support is an open request upstream), and the Prometheus
interceptor packages for grpc.aio on PyPI (py-async-grpc-prometheus,
grpc-prometheus-metrics) are small forks with a release a year or more old. So this module
is the thinnest wrapper over prometheus-client: it times each call and counts, nothing
else, and uses the registry the rest of the router's metrics are served from. It is the
outermost layer of ``guard_chain`` (each method's handler is wrapped once, when the server is
built), so it also counts the calls the role check refuses.

Families (``method`` is ``package.Service/Method``; ``code`` a gRPC status name such as
``OK`` or ``FAILED_PRECONDITION``):

- ``sessionrouter_rpc_duration_seconds{method}``: histogram, call start to status sent;
- ``sessionrouter_rpc_requests_total{method,code}``: finished calls by status;
- ``sessionrouter_rpc_streams_in_flight{method}``: streaming calls open now;
- ``sessionrouter_rpc_stream_messages{method,direction}``: histogram, messages received or
  sent per streaming call, observed when the call ends.

Per call it costs one clock read at each end, one histogram observation and one counter
increment (label children are looked up once per method and code, then cached); streams
add a gauge step at each end and a counter per message. ``scripts/bench_rpc_metrics.py``
measures it on StartSession.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterable, AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.registry import CollectorRegistry

DURATION_BUCKETS_S = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    60.0,
    600.0,
)
"""Seconds: unary calls answer in a few hundred microseconds on loopback; streams (feeds,
reward streams) stay open for minutes or hours."""
MESSAGE_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)
"""Messages per streaming call."""

if TYPE_CHECKING:  # grpc's classes are generic only in its type stubs
    _Handler = grpc.RpcMethodHandler[Any, Any]


class _MethodMetrics:
    """The label children of one method, so that a call does no label lookup."""

    __slots__ = ("_codes", "_method", "_requests", "duration", "in_flight", "received", "sent")

    def __init__(self, metrics: RpcMetrics, method: str) -> None:
        self.duration = metrics.duration.labels(method)
        self.in_flight = metrics.in_flight.labels(method)
        self.received = metrics.messages.labels(method, "received")
        self.sent = metrics.messages.labels(method, "sent")
        self._requests = metrics.requests
        self._codes: dict[str, Counter] = {}
        self._method = method

    def finished(self, code: str, seconds: float) -> None:
        self.duration.observe(seconds)
        counter = self._codes.get(code)
        if counter is None:
            counter = self._codes[code] = self._requests.labels(self._method, code)
        counter.inc()


class RpcMetrics:
    """Times and counts every call: the outermost layer of ``guard_chain``, so it sees what
    the layers inside it refuse."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.duration = Histogram(
            "sessionrouter_rpc_duration_seconds",
            "Time from the start of a call to its status, by method",
            ["method"],
            buckets=DURATION_BUCKETS_S,
            registry=registry,
        )
        self.requests = Counter(
            "sessionrouter_rpc_requests",
            "Finished calls by method and gRPC status code",
            ["method", "code"],
            registry=registry,
        )
        self.in_flight = Gauge(
            "sessionrouter_rpc_streams_in_flight",
            "Streaming calls open now, by method",
            ["method"],
            registry=registry,
        )
        self.messages = Histogram(
            "sessionrouter_rpc_stream_messages",
            "Messages per streaming call, by method and direction (received, sent)",
            ["method", "direction"],
            buckets=MESSAGE_BUCKETS,
            registry=registry,
        )

    def __call__(self, method: str, handler: _Handler) -> _Handler:
        """``handler`` timed and counted under ``method`` (``/package.Service/Method``)."""
        return _wrapped(handler, _MethodMetrics(self, method.lstrip("/")))


def _code_after(context: grpc.aio.ServicerContext[Any, Any], error: BaseException | None) -> str:
    """The status the call ends with: what the handler set or aborted with, CANCELLED for a
    call the client cancelled, UNKNOWN for an exception that was not an abort (grpc sends
    UNKNOWN for those)."""
    if isinstance(error, asyncio.CancelledError):
        return "CANCELLED"
    code = context.code()
    if code is not None and code is not grpc.StatusCode.OK:
        return code.name
    if error is not None and not isinstance(error, grpc.aio.AbortError):
        return "UNKNOWN"
    return "OK"


def _wrapped(handler: _Handler, m: _MethodMetrics) -> _Handler:
    des, ser = handler.request_deserializer, handler.response_serializer
    if handler.unary_unary is not None:
        unary_behavior = handler.unary_unary

        async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            started = time.perf_counter()
            error: BaseException | None = None
            try:
                return await unary_behavior(request, context)  # type: ignore[arg-type]
            except BaseException as exc:
                error = exc
                raise
            finally:
                m.finished(_code_after(context, error), time.perf_counter() - started)

        return grpc.unary_unary_rpc_method_handler(unary, des, ser)

    behavior: Any = handler.unary_stream or handler.stream_unary or handler.stream_stream
    request_streaming = handler.request_streaming
    response_streaming = handler.response_streaming

    async def streamed(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        started = time.perf_counter()
        received = [0 if request_streaming else 1]
        sent = 0
        error: BaseException | None = None
        m.in_flight.inc()
        try:
            result = behavior(
                _counted(request, received) if request_streaming else request, context
            )
            if inspect.isasyncgen(result):
                async for message in result:
                    sent += 1
                    yield message
            else:  # a coroutine: a unary reply, or a streaming handler that only aborts
                reply = await result
                if not response_streaming:
                    sent = 1
                    yield reply
        except BaseException as exc:
            error = exc
            raise
        finally:
            m.in_flight.dec()
            m.received.observe(received[0])
            m.sent.observe(sent)
            m.finished(_code_after(context, error), time.perf_counter() - started)

    if not response_streaming:
        # grpc wants a coroutine for a unary reply: drain the one-message generator.
        async def stream_unary(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            reply = None
            async for reply in streamed(requests, context):  # noqa: B007
                pass
            return reply

        return grpc.stream_unary_rpc_method_handler(stream_unary, des, ser)
    if request_streaming:
        return grpc.stream_stream_rpc_method_handler(streamed, des, ser)
    return grpc.unary_stream_rpc_method_handler(streamed, des, ser)


async def _counted(requests: AsyncIterable[Any], received: list[int]) -> AsyncIterator[Any]:
    async for request in requests:
        received[0] += 1
        yield request
