"""Server reflection that also answers method names, as grpcurl and ghz ask for them.

grpcio-reflection answers ``file_containing_symbol`` with the descriptor pool's
``FindFileContainingSymbol``, and the pool of protobuf's default (upb) backend does not know a
method as a symbol: ``sessionrouter.v1.SessionService.StartSession`` is "not found", although
the reflection protocol says any fully-qualified symbol, methods included, names its file.
``grpcurl describe SERVICE.METHOD`` and ``ghz --call SERVICE/METHOD`` (without ``--proto``)
ask exactly that, and failed. The servicer below keeps the library's for everything and only
answers a name the pool does not know, but that is ``SERVICE.METHOD`` of a known service,
with the file of that service (what the reference servers in Go and C++ answer).

Only ``grpc.reflection.v1alpha`` is served: grpcio-reflection has no ``v1`` servicer, and
grpcurl and ghz fall back to ``v1alpha`` when ``v1`` is unimplemented.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc
from google.protobuf import descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

__all__ = ["SERVICE_NAME", "MethodAwareReflectionServicer", "enable_server_reflection"]

SERVICE_NAME: str = reflection.SERVICE_NAME


class MethodAwareReflectionServicer(reflection.aio.ReflectionServicer):  # type: ignore[misc]
    """grpcio-reflection's asyncio servicer, with ``SERVICE.METHOD`` names resolved."""

    def __init__(
        self, service_names: Iterable[str], pool: descriptor_pool.DescriptorPool | None = None
    ) -> None:
        self._descriptors = pool if pool is not None else descriptor_pool.Default()
        super().__init__(service_names, pool=self._descriptors)

    def _file_containing_symbol(self, request: Any, fully_qualified_name: str) -> Any:
        return super()._file_containing_symbol(request, self.symbol_with_file(fully_qualified_name))

    def symbol_with_file(self, name: str) -> str:
        """``name`` itself when the pool finds its file, else the service of a method name
        (whose file is the method's), else ``name`` (the library then answers NOT_FOUND)."""
        try:
            self._descriptors.FindFileContainingSymbol(name)
        except KeyError:
            service, _, method = name.rpartition(".")
            try:
                found = self._descriptors.FindServiceByName(service)
            except KeyError:
                return name
            if method in found.methods_by_name:
                return service
        return name


def enable_server_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Adds the reflection service for ``service_names`` to an asyncio server."""
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
        MethodAwareReflectionServicer(service_names), server
    )
