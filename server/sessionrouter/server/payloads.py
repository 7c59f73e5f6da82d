"""Requests that do not decode get INVALID_ARGUMENT, never UNKNOWN.

grpc.aio runs a method's request deserializer itself, and any exception it raises (a
``DecodeError`` for bytes that are not the message, or for a string field holding invalid
UTF-8) ends the call with UNKNOWN and a server-side traceback. This guard swaps every
handler's deserializer for one that never raises: a payload that cannot be decoded becomes an
``Undecodable`` marker, and a thin wrapper around the method aborts the call with
INVALID_ARGUMENT when it meets one. A request stream ends, for the method, at the message
that did not decode: the method answers the messages before it as after a half-close (a
SubmitRewards stream acks them and delivers the groups they completed), then the call ends
with INVALID_ARGUMENT. Every service the server hosts is covered,
health and reflection included. The refusal is a core ``InvalidArgument`` (reason
``UNDECODABLE_PAYLOAD``, the payload's size and the decoder's error in the details) and goes
through ``status.Refusals`` like every other, so it is counted and logged with them.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from sessionrouter.server.core.errors import InvalidArgument
from sessionrouter.server.status import Refusals

ReplyTo = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Any]


@dataclass(frozen=True, slots=True)
class Undecodable:
    """What a request deserializer returns for bytes that are not its message."""

    size: int
    """Bytes of the payload that did not decode."""
    problem: str


def safe_deserializer(decode: Callable[[bytes], Any] | None) -> Callable[[bytes], Any]:
    """``decode`` that returns ``Undecodable`` instead of raising."""

    def deserialize(data: bytes) -> Any:
        if decode is None:
            return data
        try:
            return decode(data)
        except Exception as exc:  # DecodeError, and whatever a future protobuf raises
            return Undecodable(len(data), type(exc).__name__)

    return deserialize


def undecodable_error(bad: Undecodable) -> InvalidArgument:
    """The core error a payload that did not decode becomes."""
    return InvalidArgument(
        "UNDECODABLE_PAYLOAD",
        f"the request payload ({bad.size} bytes) is not a valid message of this method"
        f" ({bad.problem}: not protobuf, or a string field that is not UTF-8)",
        metadata={"payload_bytes": bad.size, "problem": bad.problem},
    )


class _Checked:
    """A request stream that ends at the first message that did not decode, and keeps it:
    the method sees a half-close and answers what came before; the wrapper then refuses."""

    def __init__(self, requests: AsyncIterable[Any]) -> None:
        self._requests = requests
        self.bad: Undecodable | None = None

    async def __aiter__(self) -> AsyncIterator[Any]:
        async for request in self._requests:
            if isinstance(request, Undecodable):
                self.bad = request
                return
            yield request


def _guard(
    handler: grpc.RpcMethodHandler[Any, Any], refusals: Refusals
) -> grpc.RpcMethodHandler[Any, Any]:
    """The same handler with a deserializer that cannot raise, and a check of its result."""

    async def _refuse(context: grpc.aio.ServicerContext[Any, Any], bad: Undecodable) -> None:
        await context.abort_with_status(refusals.status_of(undecodable_error(bad)))

    des = safe_deserializer(handler.request_deserializer)
    ser = handler.response_serializer
    if handler.response_streaming:
        inner: ReplyTo = (
            handler.stream_stream  # type: ignore[assignment]
            if handler.request_streaming
            else handler.unary_stream
        )
        if not inspect.isasyncgenfunction(inner):
            # The read/write API (``context.write``; health's Watch): nothing to wrap for
            # replies, only the request to check.
            return _guard_writer(handler, inner, des, ser, _refuse)
    if handler.request_streaming and handler.response_streaming:
        inner_ss: ReplyTo = handler.stream_stream  # type: ignore[assignment]

        async def stream_stream(
            requests: Any, context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[Any]:
            checked = _Checked(requests)
            async for reply in inner_ss(checked, context):
                yield reply
            if checked.bad is not None:
                await _refuse(context, checked.bad)

        return grpc.stream_stream_rpc_method_handler(stream_stream, des, ser)
    if handler.request_streaming:
        inner_su: ReplyTo = handler.stream_unary  # type: ignore[assignment]

        async def stream_unary(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            checked = _Checked(requests)
            reply = await inner_su(checked, context)
            if checked.bad is not None:
                await _refuse(context, checked.bad)
            return reply

        return grpc.stream_unary_rpc_method_handler(stream_unary, des, ser)
    if handler.response_streaming:
        inner_us: ReplyTo = handler.unary_stream  # type: ignore[assignment]

        async def unary_stream(
            request: Any, context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[Any]:
            if isinstance(request, Undecodable):
                await _refuse(context, request)
            async for reply in inner_us(request, context):
                yield reply

        return grpc.unary_stream_rpc_method_handler(unary_stream, des, ser)
    inner_uu: ReplyTo = handler.unary_unary  # type: ignore[assignment]

    async def unary_unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        if isinstance(request, Undecodable):
            await _refuse(context, request)
        return await inner_uu(request, context)

    return grpc.unary_unary_rpc_method_handler(unary_unary, des, ser)


def _guard_writer(
    handler: grpc.RpcMethodHandler[Any, Any],
    inner: ReplyTo,
    des: Callable[[bytes], Any],
    ser: Callable[[Any], bytes] | None,
    refuse: Callable[[grpc.aio.ServicerContext[Any, Any], Undecodable], Awaitable[None]],
) -> grpc.RpcMethodHandler[Any, Any]:
    """A guarded response-streaming handler written as a coroutine."""
    if handler.request_streaming:

        async def stream_writer(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            checked = _Checked(requests)
            await inner(checked, context)
            if checked.bad is not None:
                await refuse(context, checked.bad)

        return grpc.stream_stream_rpc_method_handler(stream_writer, des, ser)

    async def unary_writer(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        if isinstance(request, Undecodable):
            await refuse(context, request)
        await inner(request, context)

    return grpc.unary_stream_rpc_method_handler(unary_writer, des, ser)


class DecodingGuard:
    """The guard of every method's decoding (see the module docstring), as a layer of
    ``guard_chain``: it must wrap the service's own handler (other layers read the decoded
    request), and it wraps each method once, when the server is built."""

    def __init__(self, refusals: Refusals | None = None) -> None:
        self._refusals = refusals or Refusals()

    def __call__(
        self, method: str, handler: grpc.RpcMethodHandler[Any, Any]
    ) -> grpc.RpcMethodHandler[Any, Any]:
        return _guard(handler, self._refusals)
