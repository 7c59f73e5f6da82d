"""Bearer-token authentication and role checks for every RPC but health and reflection.

Each call's ``authorization: Bearer <token>`` names a credential (``credentials``); the
credential's role must be among the roles ``roles.ACCESS`` allows for the method. The refusals
carry ``google.rpc.ErrorInfo`` like every other error of the router:

- no token, a malformed header or an unknown token: UNAUTHENTICATED, reason
  ``MISSING_TOKEN`` or ``UNKNOWN_TOKEN``;
- a known token whose role may not call the method: PERMISSION_DENIED, reason
  ``ROLE_NOT_ALLOWED``, metadata ``role`` (held), ``allowed_roles`` (comma-separated),
  ``method``;
- a worker token naming a worker id its binding does not match: PERMISSION_DENIED, reason
  ``WORKER_NOT_BOUND``, metadata ``role``, ``worker_id`` (cut to 128 characters), ``method``.

Health and reflection stay open, so that load balancers and mesh probes, which carry no token,
can still see whether the router serves.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar, cast

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from sessionrouter.server.core.errors import DOMAIN
from sessionrouter.server.credentials import Credential, Role, TokenTable
from sessionrouter.server.roles import ACCESS, access_of, is_open

log = logging.getLogger("sessionrouter.auth")

ECHO_MAX_LEN = 128
"""Characters of a caller's value (a worker id) echoed in a refusal, at most."""

_BEARER = b"bearer "

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")


class RoleAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without a known token (UNAUTHENTICATED) or outside the token's role
    (PERMISSION_DENIED), per ``roles.ACCESS``."""

    def __init__(self, tokens: TokenTable) -> None:
        self._tokens = tokens
        self._warned: set[str] = set()

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[_Req, _Resp] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[_Req, _Resp] | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or is_open(method):
            return handler
        token = _bearer(handler_call_details.invocation_metadata or ())
        if token is None:
            return _refusing(
                handler, _unauthenticated("MISSING_TOKEN", "missing 'authorization: Bearer'")
            )
        credential = self._tokens.identify(token)
        if credential is None:
            return _refusing(handler, _unauthenticated("UNKNOWN_TOKEN", "unknown bearer token"))
        if method not in ACCESS and method not in self._warned:
            self._warned.add(method)
            log.warning("rpc without roles", extra={"event": "rpc_without_roles", "method": method})
        access = access_of(method)
        if credential.role not in access.roles:
            allowed = ",".join(sorted(r.value for r in access.roles))
            return _refusing(
                handler,
                _denied(
                    "ROLE_NOT_ALLOWED",
                    f"a {credential.role.value} token may not call {method} (allowed: {allowed})",
                    {"role": credential.role.value, "allowed_roles": allowed, "method": method},
                ),
            )
        if access.worker_scoped and credential.role is Role.WORKER:
            return _worker_scoped(handler, credential, method)
        return handler


def _bearer(metadata: Any) -> bytes | None:
    """The token of the first ``authorization`` header, if it is ``Bearer <token>``."""
    for key, value in metadata:
        if key == "authorization":
            given = value if isinstance(value, bytes) else str(value).encode()
            if given[: len(_BEARER)].lower() != _BEARER or len(given) == len(_BEARER):
                return None
            return bytes(given[len(_BEARER) :])
    return None


def _status(code: int, reason: str, message: str, metadata: Mapping[str, str]) -> grpc.Status:
    info = any_pb2.Any()
    info.Pack(error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN, metadata=metadata))
    status: grpc.Status = rpc_status.to_status(
        status_pb2.Status(code=code, message=message, details=[info])
    )
    return status


def _unauthenticated(reason: str, message: str) -> grpc.Status:
    return _status(code_pb2.UNAUTHENTICATED, reason, message, {})


def _denied(reason: str, message: str, metadata: Mapping[str, str]) -> grpc.Status:
    return _status(code_pb2.PERMISSION_DENIED, reason, message, metadata)


def _refusing(
    handler: grpc.RpcMethodHandler[Any, Any], status: grpc.Status
) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler of the same streaming shape as ``handler`` that refuses the call.

    grpc.aio accepts a plain coroutine for streaming handlers too (it writes nothing and
    aborts), so one function serves every shape."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort_with_status(status)

    des, ser = handler.request_deserializer, handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, des, ser)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, des, ser)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, des, ser)
    return grpc.unary_unary_rpc_method_handler(refuse, des, ser)


def _worker_scoped(
    handler: grpc.RpcMethodHandler[Any, Any], credential: Credential, method: str
) -> grpc.RpcMethodHandler[Any, Any]:
    """``handler`` behind a check that the request's ``worker_id`` is bound to the token."""
    if handler.unary_unary is None or handler.request_streaming or handler.response_streaming:
        raise TypeError(f"{method}: a worker-scoped RPC must be unary")
    # grpc.aio servicers are coroutines; the stubs type the handler's behavior as sync.
    behavior = cast(Callable[[Any, Any], Awaitable[Any]], handler.unary_unary)

    async def scoped(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        worker_id = str(request.worker_id)
        if not credential.binds(worker_id):
            shown = worker_id[:ECHO_MAX_LEN]
            await context.abort_with_status(
                _denied(
                    "WORKER_NOT_BOUND",
                    f"this worker token may not act on worker {shown!r}",
                    {"role": credential.role.value, "worker_id": shown, "method": method},
                )
            )
        return await behavior(request, context)

    return grpc.unary_unary_rpc_method_handler(
        scoped, handler.request_deserializer, handler.response_serializer
    )
