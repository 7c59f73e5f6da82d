"""The guards every call passes (metrics, roles, payload decoding, shard ownership), applied
once per method when the server is built, not looked up per call.

A grpc.aio interceptor runs on every call before the handler is even found: grpc creates a
continuation and a coroutine per interceptor and the interceptor then looks its wrapped
handler up again. These guards do not depend on anything a call brings that its method does
not fix (the token, the request and the ``x-group-id`` header are read inside the wrapped
handler), so each method's handler is wrapped here, layer by layer, when its service is
registered: a call goes straight from grpc's method table into the outermost layer.

``GuardedServer`` stands in for the server while the generated ``add_*_to_server`` functions
register their services (they call ``add_generic_rpc_handlers`` and then
``add_registered_method_handlers`` with the method table); the wrapped table is what the real
server gets. A generic handler that comes with no method table (hand-written, or from code
generated before grpcio had registered methods) is wrapped lazily, one method at a time, the
first time a call names it.

A layer is ``(method, handler) -> handler``, ``method`` the full name
(``/package.Service/Method``); layers are given outermost first: the first sees every call,
including those a later one refuses, and the last wraps the service's own handler.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import grpc

if TYPE_CHECKING:  # grpc's classes are generic only in its type stubs
    Handler = grpc.RpcMethodHandler[Any, Any]
else:
    Handler = grpc.RpcMethodHandler

Layer = Callable[[str, "Handler"], "Handler"]
"""Wraps one method's handler: (full method name, handler) -> the handler calls get."""


def wrap(method: str, handler: Handler, layers: Sequence[Layer]) -> Handler:
    """``handler`` inside ``layers`` (outermost first)."""
    for layer in reversed(layers):
        handler = layer(method, handler)
    return handler


class _LazyGuarded(grpc.GenericRpcHandler):
    """A generic handler without a method table, its methods wrapped on first use."""

    def __init__(self, inner: grpc.GenericRpcHandler, layers: Sequence[Layer]) -> None:
        self._inner = inner
        self._layers = layers
        self._wrapped: dict[str, tuple[Handler, Handler]] = {}
        """Method -> (the inner handler, its wrapped form); bounded by the inner's methods."""

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Handler | None:
        handler = self._inner.service(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        known = self._wrapped.get(method)
        if known is None or known[0] is not handler:
            known = self._wrapped[method] = (handler, wrap(method, handler, self._layers))
        return known[1]


class GuardedServer:
    """Registers services on ``server`` with every handler wrapped in ``layers`` (see the
    module docstring). Pass it where generated code expects the server."""

    def __init__(self, server: grpc.aio.Server, layers: Sequence[Layer]) -> None:
        self._server = server
        self._layers = tuple(layers)

    def stand_in(self) -> grpc.aio.Server:
        """Itself, typed as the server the generated ``add_*_to_server`` functions take
        (they call only the two methods below)."""
        return cast("grpc.aio.Server", self)

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        """Registered as a fallback: grpc looks registered methods up first, so a service
        whose method table follows (``add_registered_method_handlers``) never reaches it."""
        self._server.add_generic_rpc_handlers(
            tuple(_LazyGuarded(handler, self._layers) for handler in handlers)
        )

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Handler]) -> None:
        wrapped = {
            name: wrap(f"/{service}/{name}", handler, self._layers)
            for name, handler in handlers.items()
        }
        self._server.add_registered_method_handlers(service, wrapped)
