"""The completed-group feed methods of ``SessionRouterClient``: ``subscribe_groups`` and
its columnar form ``subscribe_result_batches`` (one ``_follow_feed``: the same reconnects,
cursors and shard failover), and ``wait_group_result``."""

# `timeout=` on these coroutines is the gRPC deadline, sent to the router and shared by the
# retries of one call; `asyncio.timeout` around the call could not do either (ASYNC109).

from __future__ import annotations

import asyncio
import itertools
from collections.abc import (
    AsyncGenerator,
)
from typing import Literal, TypedDict, Unpack, overload

import grpc

from sessionrouter.client._errors import (
    InternalError,
    OutOfRangeError,
)
from sessionrouter.client._feed import (
    FeedRetryHook,
    FeedSkipHook,
    batches_of,
    follow_feed,
    groups_of,
)
from sessionrouter.client._retry import Retrier, RetryPolicy
from sessionrouter.client._session_calls import SessionCalls
from sessionrouter.client.types import (
    GroupResult,
    ResultBatch,
)
from sessionrouter.v1 import session_service_pb2 as spb

__all__ = ["FeedCalls"]


class _FeedOptions(TypedDict):
    """What a caller chooses about a feed subscription (see ``subscribe_groups``)."""

    after_cursor: int
    from_latest: bool
    max_failed_connections: int | None
    on_retry: FeedRetryHook | None
    skip_degenerate: bool
    on_skipped: FeedSkipHook | None
    min_version: int


class FeedCalls(SessionCalls):
    """See the module docstring."""

    def subscribe_groups(
        self,
        *,
        after_cursor: int = 0,
        from_latest: bool = False,
        min_version: int = 0,
        retry_policy: RetryPolicy | None = None,
        max_failed_connections: int | None = None,
        on_retry: FeedRetryHook | None = None,
        skip_degenerate: bool = False,
        on_skipped: FeedSkipHook | None = None,
    ) -> AsyncGenerator[GroupResult, None]:
        """Every finalized or dropped group after ``after_cursor``, then new ones as they come.

        ``after_cursor=0`` starts at the oldest group the router retains; pass the cursor of
        the last group you processed to resume after a restart of the trainer, or
        ``from_latest=True`` to skip the backlog. The iterator reconnects by itself whenever
        the stream is lost (router restart or drain, a proxy's reset), with the backoff of
        ``retry_policy`` (the client's by default), resuming after the last group it yielded:
        nothing is missed, nothing delivered twice (see ``_feed``). It never gives up unless
        ``max_failed_connections`` consecutive connections fail; every retry is logged and
        passed to ``on_retry(failures, error, delay, cursor)``. It never ends by itself; break
        out of the loop (or ``aclose()`` it, or cancel the task) to stop.

        ``skip_degenerate=True`` asks the router to leave out degenerate groups (all rewards,
        or all filter metrics, equal: nothing to learn from); ``min_version`` leaves out
        groups whose ``min_version`` is older. ``on_skipped(count, last_cursor)`` hears how
        many either left out, up to which cursor; a reconnect resumes after the last cursor
        the router covered.
        """
        return self._follow_feed(
            after_cursor=after_cursor,
            from_latest=from_latest,
            retry_policy=retry_policy,
            max_failed_connections=max_failed_connections,
            on_retry=on_retry,
            skip_degenerate=skip_degenerate,
            on_skipped=on_skipped,
            min_version=min_version,
            columnar=False,
        )

    def subscribe_result_batches(
        self,
        *,
        after_cursor: int = 0,
        from_latest: bool = False,
        retry_policy: RetryPolicy | None = None,
        max_failed_connections: int | None = None,
        on_retry: FeedRetryHook | None = None,
        skip_degenerate: bool = False,
        on_skipped: FeedSkipHook | None = None,
        min_version: int = 0,
    ) -> AsyncGenerator[ResultBatch, None]:
        """``subscribe_groups`` in columnar form: the router sends each message's groups as
        flat arrays, and this yields them as a ``ResultBatch`` (NumPy arrays, no Python
        object per group; ``batch.groups`` builds the typed view when asked). Resume after
        ``batch.last_cursor``. Same reconnection, cursor, skipping and shard failover rules:
        a sharded router's merged feed is served in this form too, with the same cursors."""
        return self._follow_feed(
            after_cursor=after_cursor,
            from_latest=from_latest,
            retry_policy=retry_policy,
            max_failed_connections=max_failed_connections,
            on_retry=on_retry,
            skip_degenerate=skip_degenerate,
            on_skipped=on_skipped,
            min_version=min_version,
            columnar=True,
        )

    @overload
    def _follow_feed(
        self,
        *,
        columnar: Literal[False],
        retry_policy: RetryPolicy | None,
        **options: Unpack[_FeedOptions],
    ) -> AsyncGenerator[GroupResult, None]: ...

    @overload
    def _follow_feed(
        self,
        *,
        columnar: Literal[True],
        retry_policy: RetryPolicy | None,
        **options: Unpack[_FeedOptions],
    ) -> AsyncGenerator[ResultBatch, None]: ...

    def _follow_feed(
        self, *, columnar: bool, retry_policy: RetryPolicy | None, **options: Unpack[_FeedOptions]
    ) -> AsyncGenerator[GroupResult, None] | AsyncGenerator[ResultBatch, None]:
        """The feed in either form over ``follow_feed``: one reconnect loop, with failover.

        Every shard serves the one merged feed (in both forms): a lost stream reconnects to
        the next shard, with the same cursor, so a shard that is down costs one reconnect.
        An unsharded client has one shard, so it reconnects to its router.
        """
        retrier = self._retrier if retry_policy is None else Retrier(retry_policy)
        first = self._routing.any().shard
        connections = itertools.count(max(first, 0))

        def open_call(
            request: spb.SubscribeGroupsRequest,
        ) -> grpc.aio.UnaryStreamCall[spb.SubscribeGroupsRequest, spb.SubscribeGroupsResponse]:
            route = self._routing.shard(next(connections) % self._routing.count)
            metadata = (*self._metadata, *route.headers)
            return route.stubs.sessions.SubscribeGroups(request, metadata=metadata)

        if columnar:
            return follow_feed(open_call, batches_of, retrier=retrier, columnar=True, **options)
        return follow_feed(open_call, groups_of, retrier=retrier, **options)

    async def wait_group_result(
        self,
        group_id: str,
        *,
        poll_interval: float = 0.01,
        max_poll_interval: float = 1.0,
    ) -> GroupResult:
        """Waits until ``group_id`` is finalized or dropped, and returns its result.

        Polls ``get_group`` (every ``poll_interval`` seconds, doubling up to
        ``max_poll_interval``) until the group has a feed cursor, then reads that one result
        from the feed. An incomplete group ends at its deadline, so this may take that long.

        Sharded: ``Group.cursor`` is the owning shard's own cursor k, and the merged feed
        holds each shard's results in its cursor order, so the group sits at a merged cursor
        of at least k: the feed is read from there until the group comes (also waiting while
        the shard's backlog is still on its way to the merged feed).
        """
        interval = poll_interval
        while True:
            group = await self.get_group(group_id)
            if group.cursor > 0:
                break
            await asyncio.sleep(interval)
            interval = min(interval * 2, max_poll_interval)
        if self._routing.sharded:
            return await self._find_on_merged_feed(group_id, group.cursor, max_poll_interval)
        feed = self.subscribe_groups(after_cursor=group.cursor - 1)
        try:
            result = await anext(feed)
        finally:
            await feed.aclose()
        if result.group_id != group_id:
            raise InternalError(
                f"feed cursor {group.cursor} holds group {result.group_id!r}, not {group_id!r}"
            )
        return result

    async def _find_on_merged_feed(
        self, group_id: str, shard_cursor: int, retry_interval: float
    ) -> GroupResult:
        after = shard_cursor - 1
        while True:
            feed = self.subscribe_groups(after_cursor=after)
            try:
                async for result in feed:
                    if result.group_id == group_id:
                        return result
            except OutOfRangeError as error:
                if error.reason == "CURSOR_EXPIRED":
                    after = 0  # the merged feed no longer starts that early: from its oldest
                    continue
                # Ahead of the merged feed: the shard's results are still on their way.
                await asyncio.sleep(retry_interval)
            finally:
                await feed.aclose()
