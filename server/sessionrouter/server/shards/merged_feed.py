"""SubscribeGroups of a sharded router: the merged feed of every shard, from JetStream.

Every shard serves the same stream ``SESSIONROUTER_GROUPS`` (each shard's finalized groups,
published after its journal commit), so a trainer follows one feed whichever shard it
reaches, with the same API: the cursor is the stream's sequence, one sequence across shards,
and ``after_cursor`` resumes after it. The filters of SubscribeGroups apply as on a single
router (``min_version`` and ``skip_degenerate`` count and skip, ``last_cursor`` covers
skipped groups), in either form: GroupResult messages, or with ``columnar`` one
GroupResultBatch per message, built from the same groups with the same cursors and counts.

Each subscription is an ephemeral pull consumer (no acks) starting after the requested
sequence; it fetches only when the gRPC stream has sent what it fetched before, so a slow
trainer holds back its own consumer and nothing else. Cursors outside the stream are
OUT_OF_RANGE as on a single router (``CURSOR_EXPIRED`` below the stream's first sequence,
``CURSOR_AHEAD_OF_FEED`` beyond its last).

While NATS is unreachable the feed cannot be served (the shard alone knows only its own
groups, under other cursors): a subscription then ends, or is refused, with UNAVAILABLE
``NATS_UNAVAILABLE`` and metadata ``cursor``, the last cursor sent, and clients resume after
it once NATS is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator
from typing import Any

import grpc

from sessionrouter.server.core.errors import RouterError, Unavailable
from sessionrouter.server.core.feed import check_cursor
from sessionrouter.server.core.router import SessionRouter
from sessionrouter.server.core.streams import Commit, no_journal
from sessionrouter.server.servicer import (
    AFTER_CURSOR_HEADER,
    FEED_READ_BATCH,
    MESSAGE_BYTE_BUDGET,
    SessionServicer,
    pack_feed_messages,
)
from sessionrouter.server.shards.link import FEED_STREAM, FEED_SUBJECT_PREFIX, NatsLink
from sessionrouter.server.status import Refusals
from sessionrouter.v1 import resources_pb2 as pb
from sessionrouter.v1 import session_service_pb2 as spb

FETCH_WAIT_S = 1.0
"""How long one fetch waits for a new group before it checks the link and the drain."""
CONSUMER_INACTIVE_S = 60.0
"""The server forgets a subscription's consumer this long after its stream went away."""


def merged_messages(
    batch: list[tuple[int, pb.GroupResult]], skip_degenerate: bool, min_version: int = 0
) -> list[spb.SubscribeGroupsResponse]:
    """One fetched batch (stream order) as feed messages, split and filtered as on a single
    router (``pack_feed_messages``): the cursor is the stream sequence."""
    return pack_feed_messages(
        batch,
        skip_degenerate,
        min_version,
        facts=lambda item: (item[0], item[1].min_version, item[1].degenerate),
        to_proto=lambda item: item[1],
    )


def merged_batches(
    batch: list[tuple[int, pb.GroupResult]], skip_degenerate: bool, min_version: int = 0
) -> list[spb.SubscribeGroupsResponse]:
    """``merged_messages`` in columnar form: the same filters, counts and ``last_cursor``s,
    each message's groups in one GroupResultBatch (with the ``shards`` column). A message is
    closed before its estimate passes the byte budget; the estimate is the group's message
    size, an upper bound of its columns (names become indices, one estimator per batch),
    plus a filter metric per member (NaN-filled when another group has metrics)."""
    messages: list[spb.SubscribeGroupsResponse] = []
    groups: list[pb.GroupResult] = []
    stale = skipped = size = covered = 0

    def close() -> None:
        message = spb.SubscribeGroupsResponse(
            skipped_degenerate=skipped, skipped_groups=stale, last_cursor=covered
        )
        if groups:
            message.batch.CopyFrom(results_to_batch(groups))
        messages.append(message)

    for cursor, result in batch:
        if min_version and result.min_version < min_version:
            stale += 1
        elif skip_degenerate and result.degenerate:
            skipped += 1
        else:
            grows = result.ByteSize() + 8 * (len(result.sessions) + 1)
            if groups and size + grows > MESSAGE_BYTE_BUDGET:
                close()
                groups, stale, skipped, size = [], 0, 0, 0
            groups.append(result)
            size += grows
        covered = cursor
    close()
    return messages


def results_to_batch(results: list[pb.GroupResult]) -> pb.GroupResultBatch:
    """GroupResult messages (read from the stream, cursors set) as one GroupResultBatch: the
    columns the single router builds from its own results (``convert.results_to_batch``),
    plus each group's shard."""
    batch = pb.GroupResultBatch()
    estimators: dict[bytes, int] = {}
    members = excluded = 0
    batch.member_offsets.append(0)
    batch.excluded_offsets.append(0)
    with_metrics = any(r.filter_metrics for r in results)
    for r in results:
        batch.cursors.append(r.cursor)
        batch.group_ids.append(r.group_id)
        batch.task_ids.append(r.task_id)
        batch.outcomes.append(r.outcome)
        batch.group_sizes.append(r.group_size)
        batch.means.append(r.mean)
        batch.stds.append(r.std)
        batch.degenerate.append(r.degenerate)
        batch.finalize_unix_nanos.append(r.finalize_time.ToNanoseconds())
        key = r.estimator.SerializeToString(deterministic=True)
        position = estimators.get(key)
        if position is None:
            position = estimators[key] = len(batch.estimators)
            batch.estimators.append(r.estimator)
        batch.estimator_of.append(position)
        prefix = len(r.group_id) + 17  # len("groups/" + group_id + "/sessions/")
        n = len(r.sessions)
        batch.member_indices.extend([int(name[prefix:]) for name in r.sessions])
        batch.rewards.extend(r.rewards)
        batch.advantages.extend(r.advantages if len(r.advantages) == n else [0.0] * n)
        if with_metrics:
            batch.filter_metrics.extend(
                r.filter_metrics if len(r.filter_metrics) == n else [math.nan] * n
            )
        members += n
        batch.member_offsets.append(members)
        replaced = set(r.replaced_sessions)
        batch.excluded_indices.extend([int(name[prefix:]) for name in r.excluded_sessions])
        batch.excluded_replaced.extend([name in replaced for name in r.excluded_sessions])
        excluded += len(r.excluded_sessions)
        batch.excluded_offsets.append(excluded)
        batch.min_versions.append(r.min_version)
        batch.max_versions.append(r.max_version)
        batch.trainer_versions.append(r.trainer_version)
        batch.admitted_trainer_versions.append(r.admitted_trainer_version)
        batch.shards.append(r.shard)
    return batch


class ShardedSessionServicer(SessionServicer):
    """SessionService whose feed is the merged stream of all shards."""

    def __init__(
        self,
        router: SessionRouter,
        link: NatsLink,
        commit: Commit = no_journal,
        refusals: Refusals | None = None,
    ) -> None:
        super().__init__(router, commit, refusals)
        self._link = link

    def _nats_down(self, cursor: int) -> Unavailable:
        return Unavailable(
            "NATS_UNAVAILABLE",
            f"NATS is unreachable, so the merged feed cannot be served; resume after cursor"
            f" {cursor} once it is back",
            retry_after_s=1.0,
            metadata={"cursor": cursor},
        )

    async def _start_after(self, request: spb.SubscribeGroupsRequest) -> int:
        """The stream sequence the subscription starts after; RouterError when it cannot."""
        try:
            info = await self._link.js.stream_info(FEED_STREAM)
        except Exception:
            raise self._nats_down(request.after_cursor) from None
        first, last = int(info.state.first_seq), int(info.state.last_seq)
        first = max(first, 1)
        if request.from_latest:
            return last
        after = request.after_cursor
        if after == 0:
            return min(first, last + 1) - 1
        check_cursor(after, first, last)
        return after

    async def SubscribeGroups(
        self,
        request: spb.SubscribeGroupsRequest,
        context: grpc.aio.ServicerContext[object, object],
    ) -> AsyncIterator[spb.SubscribeGroupsResponse]:
        from nats.js import api

        pack = merged_batches if request.columnar else merged_messages
        if not self._link.connected:
            await self._abort(context, self._nats_down(request.after_cursor))
        try:
            cursor = await self._start_after(request)
        except RouterError as error:
            await self._abort(context, error)
        await context.send_initial_metadata(((AFTER_CURSOR_HEADER, str(cursor)),))
        feed = self._router.feed
        subscription = feed.subscribe(context.peer(), cursor)
        config = api.ConsumerConfig(
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=cursor + 1,
            ack_policy=api.AckPolicy.NONE,
            inactive_threshold=CONSUMER_INACTIVE_S,
            mem_storage=True,
        )
        consumer: Any = None
        try:
            try:
                consumer = await self._link.js.pull_subscribe(
                    f"{FEED_SUBJECT_PREFIX}.*", stream=FEED_STREAM, config=config
                )
            except Exception:
                await self._abort(context, self._nats_down(cursor))
            while True:
                if feed.closed:
                    await self._abort(context, self._draining_error("group feed", cursor))
                if self._link.down():
                    await self._abort(context, self._nats_down(cursor))
                try:
                    msgs = await consumer.fetch(FEED_READ_BATCH, timeout=FETCH_WAIT_S)
                except TimeoutError:
                    # Nothing new within the wait. nats-py raises its own TimeoutError (a
                    # subclass) or asyncio's, depending on where the wait ran out: both are
                    # an idle feed, not a lost NATS.
                    continue
                except (asyncio.CancelledError, GeneratorExit):
                    raise
                except Exception:
                    await self._abort(context, self._nats_down(cursor))
                batch = []
                for msg in msgs:
                    sequence = int(msg.metadata.sequence.stream)
                    if sequence <= cursor:
                        continue  # a redelivery after a consumer reset
                    result = pb.GroupResult.FromString(msg.data)
                    result.cursor = sequence
                    batch.append((sequence, result))
                if not batch:
                    continue
                for message in pack(batch, request.skip_degenerate, request.min_version):
                    yield message
                cursor = subscription.cursor = batch[-1][0]
        finally:
            feed.unsubscribe(subscription)
            if consumer is not None:
                with contextlib.suppress(Exception):  # else the server drops it when inactive
                    info = await asyncio.wait_for(consumer.consumer_info(), 1.0)
                    await asyncio.wait_for(
                        self._link.js.delete_consumer(FEED_STREAM, info.name), 1.0
                    )
                with contextlib.suppress(Exception):
                    await consumer.unsubscribe()
