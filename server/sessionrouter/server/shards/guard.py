"""The gRPC side of ownership: every unary call naming a group is checked before it runs.

A layer of ``guard_chain`` (each checked method's handler is wrapped once, when the server
is built) rather than code in each handler, so the servicer stays as it is for the single
process: for StartSession and StartGroup (when they name a group), GetGroup,
GetSession and AbortSession it reads the group from the request (a session name carries it),
checks the ``x-group-id`` header against it (INVALID_ARGUMENT ``GROUP_HEADER_MISMATCH``),
then ownership (FAILED_PRECONDITION ``WRONG_SHARD`` with the owner) and the registry's shard
count (``SHARD_COUNT_MISMATCH``). Reward entries are checked one by one inside the core
(``SessionRouter.foreign_reward``), since one stream may carry entries of many groups; the
header is not checked on streams for the same reason.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from sessionrouter.server.core.errors import RouterError
from sessionrouter.server.core.validation import check_id, try_parse_session_name
from sessionrouter.server.shards.identity import GROUP_HEADER, Ownership
from sessionrouter.server.status import Refusals

_SERVICE = "/sessionrouter.v1.SessionService/"


def _valid(group_id: str) -> str | None:
    """The id when it is well formed; None leaves a malformed one to the core's own
    INVALID_ARGUMENT, as on a single router."""
    try:
        return check_id("group_id", group_id)
    except RouterError:
        return None


def _group_field(request: Any) -> str | None:
    return _valid(request.group_id) if request.HasField("group_id") else None


def _plain_group(request: Any) -> str | None:
    return _valid(request.group_id)


def _session_group(request: Any) -> str | None:
    parsed = try_parse_session_name(request.session)
    return parsed[0] if parsed is not None else None


GROUP_OF: dict[str, Callable[[Any], str | None]] = {
    _SERVICE + "StartSession": _group_field,
    _SERVICE + "StartGroup": _group_field,
    _SERVICE + "GetGroup": _plain_group,
    _SERVICE + "GetSession": _session_group,
    _SERVICE + "AbortSession": _session_group,
}
"""The methods checked, and how each request names its group (None: names none)."""


def _header(context: grpc.aio.ServicerContext[Any, Any]) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == GROUP_HEADER:
            return value if isinstance(value, str) else value.decode("utf-8", "replace")
    return None


class ShardGuard:
    """Refuses calls about groups this shard must not serve (see the module docstring).
    The innermost layer, inside the decoding guard, so requests arrive decoded."""

    def __init__(
        self,
        ownership: Ownership,
        check_counts: Callable[[], None],
        refusals: Refusals,
    ) -> None:
        self._ownership = ownership
        self._check_counts = check_counts
        self._refusals = refusals

    def check(self, group_id: str, header: str | None) -> None:
        """The three checks, in the order a caller can fix them; RouterError on the first
        that fails."""
        self._ownership.check_header(header, group_id)
        self._check_counts()
        self._ownership.check_group(group_id)

    def _wrap(
        self, handler: grpc.RpcMethodHandler[Any, Any], group_of: Callable[[Any], str | None]
    ) -> grpc.RpcMethodHandler[Any, Any]:
        inner: Callable[[Any, Any], Awaitable[Any]] = handler.unary_unary  # type: ignore[assignment]

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            group_id = group_of(request)
            if group_id is not None:
                try:
                    self.check(group_id, _header(context))
                except RouterError as error:
                    await context.abort_with_status(self._refusals.status_of(error))
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary_unary, handler.request_deserializer, handler.response_serializer
        )

    def __call__(
        self, method: str, handler: grpc.RpcMethodHandler[Any, Any]
    ) -> grpc.RpcMethodHandler[Any, Any]:
        group_of = GROUP_OF.get(method)
        if group_of is None or handler.unary_unary is None:
            return handler
        return self._wrap(handler, group_of)
