"""Optional bearer-token authentication for every RPC but health checks.

Health stays open so that load balancers and mesh probes, which carry no token, can still see
whether the router serves. The comparison is constant-time.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

_OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without ``authorization: Bearer <token>`` with UNAUTHENTICATED."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("an empty token would let everyone in")
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[_Req, _Resp] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[_Req, _Resp] | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(_OPEN_PREFIXES):
            return handler
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                given = value if isinstance(value, bytes) else value.encode()
                if hmac.compare_digest(given, self._expected):
                    return handler
        return _denying_like(handler)


def _denying_like(handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler of the same streaming shape as ``handler`` that refuses the call.

    grpc.aio accepts a plain coroutine for streaming handlers too (it writes nothing and
    aborts), so one function serves every shape."""

    async def deny(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    des, ser = handler.request_deserializer, handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny, des, ser)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, des, ser)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny, des, ser)
    return grpc.unary_unary_rpc_method_handler(deny, des, ser)
