"""How one call reaches its router: the route, the caller's metadata, one deadline shared
by the retries, and a ``WRONG_SHARD`` refusal followed once to the owner it names.

``UnaryCalls`` is the base of the client's method groups (``_worker_calls``,
``_session_calls``, ``_feed_calls``, ``_reward_calls``): it holds what every call needs (the
shard routing, the metadata, the default deadline and the retrier) and the one way of
calling (``_unary``): every call reaches one shard, since what sharded routers share (the
worker pool with its weight updates, the trainer state) any shard writes for all.
"""

# `timeout=` on these coroutines is the gRPC deadline, sent to the router and shared by the
# retries of one call; `asyncio.timeout` around the call could not do either (ASYNC109).

from __future__ import annotations

import logging
import time
from collections.abc import (
    Callable,
)
from typing import TypeVar

import grpc

from sessionrouter.client._errors import (
    FailedPreconditionError,
)
from sessionrouter.client._retry import Retrier
from sessionrouter.client._shards import Route, ShardRouting, ShardStubs

__all__ = ["UnaryCalls"]

_log = logging.getLogger("sessionrouter.client")

Req = TypeVar("Req")
Resp = TypeVar("Resp")


class UnaryCalls:
    """See the module docstring."""

    _routing: ShardRouting
    _metadata: tuple[tuple[str, str], ...]
    _default_timeout: float | None
    _retrier: Retrier

    async def _unary(
        self,
        method: Callable[[ShardStubs], grpc.aio.UnaryUnaryMultiCallable[Req, Resp]],
        request: Req,
        timeout: float | None,
        route: Route | None = None,
    ) -> Resp:
        """One unary call on ``route`` (the next shard when None), retried while transient;
        a ``WRONG_SHARD`` refusal is followed once to the owner it names."""
        route = route or self._routing.any()
        budget = self._default_timeout if timeout is None else timeout
        started = time.monotonic()
        try:
            return await self._unary_on(route, method, request, budget)
        except FailedPreconditionError as error:
            owner = self._routing.owner_of(error, route)
            if owner is None:
                raise
            _log.warning("%s; following it to %s", error, owner.stubs.address or owner.shard)
            left = None if budget is None else max(0.0, budget - (time.monotonic() - started))
            return await self._unary_on(owner, method, request, left)

    async def _unary_on(
        self,
        route: Route,
        method: Callable[[ShardStubs], grpc.aio.UnaryUnaryMultiCallable[Req, Resp]],
        request: Req,
        budget: float | None,
    ) -> Resp:
        call = method(route.stubs)
        metadata = (*self._metadata, *route.headers)

        async def attempt(remaining: float | None) -> Resp:
            return await call(request, timeout=remaining, metadata=metadata)

        return await self._retrier.call(attempt, timeout=budget)
