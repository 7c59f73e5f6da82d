"""The guard chain wraps each method's handler once, when the server is built: real calls
on loopback go through every layer, in order, and no layer is applied again per call."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from sessionrouter.server.guard_chain import GuardedServer, Handler

_IDENTITY = (lambda data: data, lambda data: data)


class Recorder:
    """A layer that counts how often it wraps and writes its name into each reply."""

    def __init__(self, name: str, trace: list[str]) -> None:
        self.name = name
        self.trace = trace
        self.wrapped: list[str] = []

    def __call__(self, method: str, handler: Handler) -> Handler:
        self.wrapped.append(method)
        inner: Any = handler.unary_unary
        name, trace = self.name, self.trace

        async def unary(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
            trace.append(name)
            reply: bytes = await inner(request, context)
            return name.encode() + b">" + reply

        return grpc.unary_unary_rpc_method_handler(
            unary, handler.request_deserializer, handler.response_serializer
        )


async def _echo(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
    return request


class _Generic(grpc.GenericRpcHandler):
    """A hand-written generic handler with no method table, answering with the same handler
    on every call (as grpc's own do): wrapped on first use, then reused."""

    def __init__(self) -> None:
        self._echo = grpc.unary_unary_rpc_method_handler(_echo, *_IDENTITY)

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Handler | None:
        return self._echo if handler_call_details.method == "/test.Plain/Echo" else None


async def test_layers_wrap_once_outermost_first_for_registered_and_generic_methods() -> None:
    trace: list[str] = []
    outer, inner = Recorder("outer", trace), Recorder("inner", trace)
    server = grpc.aio.server()
    guarded = GuardedServer(server, [outer, inner]).stand_in()
    table = {"Echo": grpc.unary_unary_rpc_method_handler(_echo, *_IDENTITY)}
    guarded.add_registered_method_handlers("test.Table", table)
    guarded.add_generic_rpc_handlers((_Generic(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            for method in ("/test.Table/Echo", "/test.Plain/Echo"):
                call = channel.unary_unary(method, *_IDENTITY)
                for _ in range(3):
                    assert await call(b"x") == b"outer>inner>x"
            missing = channel.unary_unary("/test.Plain/Missing", *_IDENTITY)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await missing(b"x")
            assert refused.value.code() is grpc.StatusCode.UNIMPLEMENTED
    finally:
        await server.stop(None)
    # Registered: wrapped at registration; generic: at its first call; never again.
    assert outer.wrapped == inner.wrapped == ["/test.Table/Echo", "/test.Plain/Echo"]
    assert trace == ["outer", "inner"] * 6
