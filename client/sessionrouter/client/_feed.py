"""The completed-group feed as an async iterator that survives router restarts.

A trainer consumes finalized groups for hours; connections drop (router restart, proxy idle
timeout, max connection age). On UNAVAILABLE, or when the router ends the stream (which the
contract says it does not do while serving), the iterator reconnects with the cursor of the
last group it yielded, so the trainer misses nothing and sees nothing twice.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable

import grpc

from sessionrouter.client import _convert
from sessionrouter.client._errors import UnavailableError, map_rpc_errors
from sessionrouter.client._retry import Retrier
from sessionrouter.client.types import GroupResult
from sessionrouter.v1 import session_service_pb2 as pb

__all__ = ["follow_feed"]

FeedCall = grpc.aio.UnaryStreamCall[pb.SubscribeGroupsRequest, pb.SubscribeGroupsResponse]


async def follow_feed(
    open_call: Callable[[pb.SubscribeGroupsRequest], FeedCall],
    *,
    after_cursor: int,
    from_latest: bool,
    retrier: Retrier,
    clock: Callable[[], float] = time.monotonic,
) -> AsyncGenerator[GroupResult, None]:
    """Yields every group result after ``after_cursor``, reconnecting on UNAVAILABLE.

    Consecutive failed connections are bounded by ``retrier.policy.max_attempts``; a connection
    that delivered a group, or stayed up for ``max_backoff`` seconds, resets the count, so a
    feed that is quiet for hours and reconnects now and then never gives up. Any other error
    (OUT_OF_RANGE for a cursor older than the retained feed, say) is raised at once.
    ``from_latest`` applies until the first group arrives; after that the cursor rules.
    """
    cursor = after_cursor
    failures = 0
    while True:
        request = pb.SubscribeGroupsRequest(after_cursor=cursor, from_latest=from_latest)
        call = open_call(request)
        opened = clock()
        try:
            with map_rpc_errors():
                while True:
                    message = await call.read()
                    if not isinstance(message, pb.SubscribeGroupsResponse):
                        raise UnavailableError("the router ended the group feed")
                    for group in message.groups:  # several per message under load
                        if group.cursor <= cursor and not from_latest:
                            continue  # already delivered before a reconnect
                        cursor, from_latest, failures = group.cursor, False, 0
                        yield _convert.group_result_from_proto(group)
        except UnavailableError as error:
            if clock() - opened >= retrier.policy.max_backoff:
                failures = 0
            failures += 1
            if failures >= retrier.policy.max_attempts:
                error.add_note(f"sessionrouter: feed gave up after {failures} reconnect(s)")
                raise
            await retrier.wait(failures, error)
        finally:
            call.cancel()
