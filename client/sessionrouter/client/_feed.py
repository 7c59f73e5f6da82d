"""The completed-group feed as an async iterator that outlives router restarts and proxies.

A trainer consumes finalized groups for days; connections drop (router restart or drain,
proxy idle timeout, max connection age). The iterator reconnects by itself, with backoff, for
as long as the caller lets it (forever by default), each time asking for the groups after the
last cursor it yielded, so the trainer misses nothing and sees nothing twice.

What counts as "reconnect": UNAVAILABLE (router down, or draining: the router ends a feed
stream it drains with UNAVAILABLE and ErrorInfo reason ``SHUTTING_DOWN``), an INTERNAL without
status details (a proxy's RST_STREAM, see ``_errors.is_transient``), and a stream that ends
with OK (which a router does only while stopping). Resuming by cursor is always safe. Any
other status is the router's answer and is raised at once (OUT_OF_RANGE for a cursor older
than the retained feed, UNAUTHENTICATED, ...).

``from_latest`` applies to the first connection only. The router names, in the
``sessionrouter-after-cursor`` response header, the cursor a subscription starts after; from
then on the iterator resumes from that cursor (or from the last group it yielded), never "from
latest" again, so the groups finalized while it was away are delivered too.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Callable, Iterable
from typing import Protocol, TypeVar

import grpc

from sessionrouter.client import _convert
from sessionrouter.client._errors import SessionRouterError, is_transient, map_rpc_errors
from sessionrouter.client._retry import Retrier
from sessionrouter.client.types import GroupResult, ResultBatch
from sessionrouter.v1 import session_service_pb2 as pb

__all__ = [
    "AFTER_CURSOR_HEADER",
    "FeedRetryHook",
    "FeedSkipHook",
    "batches_of",
    "follow_feed",
    "groups_of",
]

_log = logging.getLogger("sessionrouter.client.feed")

AFTER_CURSOR_HEADER = "sessionrouter-after-cursor"
"""Response header of SubscribeGroups: the cursor the stream delivers after (decimal)."""

FeedCall = grpc.aio.UnaryStreamCall[pb.SubscribeGroupsRequest, pb.SubscribeGroupsResponse]


class FeedRetryHook(Protocol):
    """Called before each reconnect wait of the feed.

    Args:
        failures: consecutive connections that failed, this one included (1, 2, ...).
        error: why the last connection ended.
        delay: seconds the feed waits before it reconnects.
        cursor: the cursor it will resume after (0 with ``from_latest`` not yet resolved).
    """

    def __call__(
        self, failures: int, error: SessionRouterError, delay: float, cursor: int
    ) -> None: ...


FeedSkipHook = Callable[[int, int], None]
"""``on_skipped(count, last_cursor)``: ``count`` groups with cursors up to ``last_cursor`` are
left out (degenerate ones with ``skip_degenerate``, older ones with ``min_version``). Called
when a message arrives, before the groups it does deliver are yielded."""


class _StreamEndedError(SessionRouterError):
    """The router ended the feed with OK: it is stopping (a serving router never does)."""


T = TypeVar("T")

Items = Callable[[pb.SubscribeGroupsResponse, int, bool], Iterable[tuple[int, T]]]
"""What one feed message delivers, given the cursor delivered so far and whether
``from_latest`` is still unresolved: (cursor of its last group, item) pairs."""


def groups_of(
    message: pb.SubscribeGroupsResponse, cursor: int, from_latest: bool
) -> Iterable[tuple[int, GroupResult]]:
    """The groups of a message as GroupResult values, those already delivered left out."""
    for group in message.groups:  # several per message under load
        if group.cursor <= cursor and not from_latest:
            continue  # already delivered before a reconnect
        yield group.cursor, _convert.group_result_from_proto(group)


def batches_of(
    message: pb.SubscribeGroupsResponse, cursor: int, from_latest: bool
) -> Iterable[tuple[int, ResultBatch]]:
    """The groups of a columnar message as one ResultBatch, those already delivered left out."""
    if message.HasField("batch"):
        batch = _convert.result_batch_from_proto(message.batch)
        if not from_latest:
            batch = batch.after(cursor)
        if len(batch):
            yield batch.last_cursor, batch


async def follow_feed(
    open_call: Callable[[pb.SubscribeGroupsRequest], FeedCall],
    items: Items[T],
    *,
    after_cursor: int,
    from_latest: bool,
    retrier: Retrier,
    max_failed_connections: int | None = None,
    on_retry: FeedRetryHook | None = None,
    skip_degenerate: bool = False,
    on_skipped: FeedSkipHook | None = None,
    min_version: int = 0,
    columnar: bool = False,
) -> AsyncGenerator[T, None]:
    """Yields every group result after ``after_cursor`` (or after the newest, with
    ``from_latest``), reconnecting whenever the stream is lost: as ``items`` makes them
    from each message (``groups_of``, or ``batches_of`` with ``columnar``).

    Waits follow ``retrier.policy``'s backoff (RetryInfo first), growing with consecutive
    failed connections; a connection on which the router answered (its headers, or a group,
    arrived) resets the count, so a feed that reconnects now and then for days never backs
    off for long. ``max_failed_connections`` bounds the consecutive failures: once reached,
    the last error is raised; ``None`` (the default) never gives up. Each retry is logged at
    WARNING and passed to ``on_retry``.

    With ``skip_degenerate`` the router leaves degenerate groups out, with ``min_version``
    the groups whose min_version is older; each message that covered some tells
    ``on_skipped`` how many, and the resume cursor moves past them, so a reconnect neither
    asks for them again nor counts them twice.
    """
    cursor = after_cursor
    failures = 0
    while True:
        request = pb.SubscribeGroupsRequest(
            after_cursor=cursor,
            from_latest=from_latest,
            skip_degenerate=skip_degenerate,
            min_version=min_version,
            columnar=columnar,
        )
        call = open_call(request)
        try:
            with map_rpc_errors():
                start = _after_cursor_of(await call.initial_metadata())
                if start is not None:
                    # The router answered: this connection worked, and it says where the
                    # stream starts, which settles from_latest for every reconnect.
                    failures = 0
                    if from_latest:
                        cursor, from_latest = start, False
                while True:
                    message = await call.read()
                    if not isinstance(message, pb.SubscribeGroupsResponse):
                        raise _StreamEndedError("the router ended the group feed")
                    # Counted when the message arrives, before its groups are yielded: a
                    # consumer that stops at one of them has still heard of the skips.
                    covers_new = message.last_cursor > cursor or (
                        from_latest and message.last_cursor > 0
                    )
                    skipped = message.skipped_degenerate + message.skipped_groups
                    if covers_new and skipped and on_skipped is not None:
                        on_skipped(skipped, message.last_cursor)
                    for last, item in items(message, cursor, from_latest):
                        cursor, from_latest, failures = last, False, 0
                        yield item
                    if covers_new:
                        # Skipped groups after the last one delivered: resume past them.
                        cursor = max(cursor, message.last_cursor)
                        from_latest, failures = False, 0
        except SessionRouterError as error:
            if not (isinstance(error, _StreamEndedError) or is_transient(error)):
                raise
            failures += 1
            if max_failed_connections is not None and failures >= max_failed_connections:
                error.add_note(f"sessionrouter: feed gave up after {failures} failed connection(s)")
                raise
            delay = retrier.delay(failures, error)
            _log.warning(
                "group feed lost (%s); reconnecting after cursor %d in %.2fs (failure %d)",
                error,
                cursor,
                delay,
                failures,
            )
            if on_retry is not None:
                on_retry(failures, error, delay, cursor)
            await retrier.sleep(delay)
        finally:
            call.cancel()


def _after_cursor_of(metadata: grpc.aio.Metadata | None) -> int | None:
    """The ``sessionrouter-after-cursor`` header's value; None when absent (older routers,
    or a call that failed before its headers) or malformed."""
    if metadata is None:
        return None
    for key, value in metadata:
        if key == AFTER_CURSOR_HEADER:
            text = value.decode() if isinstance(value, bytes) else str(value)
            return int(text) if text.isdigit() else None
    return None
