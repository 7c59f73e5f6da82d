"""Optional OpenTelemetry tracing: a span per RPC, exported over OTLP (off by default).

The spans come from OpenTelemetry's own grpc.aio server interceptor
(``opentelemetry-instrumentation-grpc``), which also continues a trace the caller propagated
in its metadata; ``SpanAttributesInterceptor`` adds what a trainer needs to see where a
group waited: the group id and the session name, read from the request and the reply
(``sessionrouter.group_id``, ``sessionrouter.session``). The packages are the ``otel``
extra; nothing here is imported unless tracing is on.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import Message
from opentelemetry import trace
from opentelemetry.instrumentation.grpc import aio_server_interceptor
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Status, StatusCode

GROUP_ATTRIBUTE = "sessionrouter.group_id"
SESSION_ATTRIBUTE = "sessionrouter.session"
STATUS_CODE_ATTRIBUTE = "rpc.grpc.status_code"
SERVER_FAULTS = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)
"""The codes OpenTelemetry's gRPC instrumentation marks as a server span's error."""

if TYPE_CHECKING:  # grpc's classes are generic only in its type stubs
    _Handler = grpc.RpcMethodHandler[Any, Any]
    _Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[_Handler | None]]


def otlp_exporter(endpoint: str | None) -> SpanExporter:
    """The OTLP/gRPC span exporter; ``endpoint`` None takes OpenTelemetry's own default
    (``$OTEL_EXPORTER_OTLP_ENDPOINT``, else ``localhost:4317``)."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()


def tracer_provider(exporter: SpanExporter) -> TracerProvider:
    """A provider of its own (the process-wide one stays untouched) that batches spans to
    ``exporter`` off the event loop; ``shutdown()`` flushes it."""
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: "sessionrouter"}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def tracing_interceptors(provider: TracerProvider) -> list[grpc.aio.ServerInterceptor]:
    """The interceptors to add after the others: OpenTelemetry's span per RPC, then ours,
    which runs inside that span and names the group and session."""
    spans: grpc.aio.ServerInterceptor = aio_server_interceptor(  # type: ignore[no-untyped-call]
        tracer_provider=provider
    )
    return [spans, SpanAttributesInterceptor()]


def _field(message: Message, name: str) -> Any:
    """The field's value, or None when the message has no such field."""
    return getattr(message, name) if name in message.DESCRIPTOR.fields_by_name else None


def _ids_of(message: Any, span: trace.Span) -> None:
    """Sets the group id and session name a request or reply carries: ``group_id`` and
    ``session`` (a name) in requests, ``session`` (a Session) and ``group`` in replies."""
    if not isinstance(message, Message):
        return
    group_id = _field(message, "group_id")
    session = _field(message, "session")
    group = _field(message, "group")
    if isinstance(session, Message):
        group_id = _field(session, "group_id") or group_id
        session = _field(session, "name")
    if isinstance(group, Message):
        group_id = _field(group, "group_id") or group_id
    if isinstance(group_id, str) and group_id:
        span.set_attribute(GROUP_ATTRIBUTE, group_id)
    if isinstance(session, str) and session:
        span.set_attribute(SESSION_ATTRIBUTE, session)


def _status_of(context: grpc.aio.ServicerContext[Any, Any], span: trace.Span) -> None:
    """Records the code of a call aborted with ``abort_with_status`` (how every refusal is
    sent, with its details), which OpenTelemetry's context wrapper does not see: the
    ``rpc.grpc.status_code`` attribute, and an error status for the codes its own rule
    counts as server faults (client faults such as INVALID_ARGUMENT leave it unset)."""
    code: grpc.StatusCode | None = context.code()  # None until a code is set (stubs say not)
    if code is None:
        return
    span.set_attribute(STATUS_CODE_ATTRIBUTE, code.value[0])
    if code in SERVER_FAULTS:
        span.set_status(Status(StatusCode.ERROR, f"{code}:{context.details() or ''}"))


class SpanAttributesInterceptor(grpc.aio.ServerInterceptor):
    """Puts the group id and session name of unary calls on the current span."""

    async def intercept_service(
        self, continuation: _Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> _Handler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        behavior = handler.unary_unary

        async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            span = trace.get_current_span()
            _ids_of(request, span)
            try:
                reply = await behavior(request, context)  # type: ignore[arg-type]
            except grpc.aio.AbortError:
                _status_of(context, span)
                raise
            _ids_of(reply, span)
            return reply

        return grpc.unary_unary_rpc_method_handler(
            unary, handler.request_deserializer, handler.response_serializer
        )
