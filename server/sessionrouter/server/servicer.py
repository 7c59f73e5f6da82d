"""gRPC servicers: proto in, one core call, proto out; core errors become statuses.

No routing logic lives here. Each handler converts its request, calls the SessionRouter
synchronously (so the call is atomic on the event loop), converts the records it got back into
messages *before* awaiting anything, then awaits the durability barrier so that nothing is
acknowledged before it is journaled.

A SubmitRewards stream is a ``core.streams.RewardFlow``: the flow keeps the stream's promise
(ack order, results after acks, back-pressure, limits); the handler only converts requests in
and events out, and ends the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterable, AsyncIterator, Callable, Sequence
from functools import partial
from typing import NoReturn, TypeVar

import grpc
import numpy as np
from numpy.typing import NDArray

from sessionrouter.server import convert, paging
from sessionrouter.server.core.errors import RouterError, Unavailable
from sessionrouter.server.core.feed import GroupResult
from sessionrouter.server.core.results import (
    RestoredResults,
    ResultColumns,
    ResultRows,
    columns_of_results,
    concat_columns,
    rows_between,
)
from sessionrouter.server.core.rewards import RewardBatch
from sessionrouter.server.core.router import SessionRouter
from sessionrouter.server.core.sizes import MESSAGE_BUDGET_BYTES
from sessionrouter.server.core.staleness import (
    LeasePendingError,
    TrainerStateChange,
    refused_while_pending,
)
from sessionrouter.server.core.streams import (
    Commit,
    MemberReplaced,
    RewardAck,
    RewardFlow,
    StreamEvent,
    no_journal,
)
from sessionrouter.server.status import Refusals
from sessionrouter.server.worker_directory import LocalWorkers, WorkerDirectory
from sessionrouter.v1 import resources_pb2 as pb
from sessionrouter.v1 import session_service_pb2 as spb
from sessionrouter.v1 import session_service_pb2_grpc as spb_grpc
from sessionrouter.v1 import worker_service_pb2 as wpb
from sessionrouter.v1 import worker_service_pb2_grpc as wpb_grpc

log = logging.getLogger("sessionrouter.servicer")

FEED_READ_BATCH = 256
"""Groups per SubscribeGroups read (and so message), at most, in the message form."""
COLUMNAR_FEED_READ_BATCH = 4096
"""Groups per SubscribeGroups read in the columnar form, at most (messages are split by
bytes): a default micro-batch of the finalizer is one read."""
FEED_CACHE_ENTRIES = 64
FEED_CACHE_BYTES = 64 * 1024 * 1024
"""Packed feed reads kept for other subscribers, at most (entries, estimated wire bytes)."""
RESULTS_PER_MESSAGE = 256
"""Group results per SubmitRewards message, at most."""
MESSAGE_BYTE_BUDGET = MESSAGE_BUDGET_BYTES
"""Bytes a feed or reward-stream message may hold, well below the 4 MiB a default gRPC
client receives: more groups go into further messages. One group never exceeds it, because
StartGroup refuses a group whose result could not fit (``core.sizes``)."""

AFTER_CURSOR_HEADER = "sessionrouter-after-cursor"
"""SubscribeGroups response header: the cursor the stream delivers after (decimal)."""
DEFAULT_ADMISSION_WAIT_S = 60.0
"""How long a start that asks to wait for admission waits when the call has no deadline."""

_T = TypeVar("_T")
_Item = TypeVar("_Item")


async def _start(
    router: SessionRouter,
    start: Callable[[], _T],
    wait: bool,
    context: grpc.aio.ServicerContext[object, object],
) -> _T:
    """Runs a start now, or, when the caller asks to wait for admission, until admission
    opens within the call's deadline."""
    if not wait:
        try:
            return start()
        except LeasePendingError as pending:  # a shard's lease ran out: one NATS round trip
            return await pending.retry(start)
    remaining = context.time_remaining()
    timeout = DEFAULT_ADMISSION_WAIT_S if remaining is None else min(remaining, 86_400.0)
    return await router.start_when_admitted(partial(refused_while_pending, start), timeout)


class _Refusing:
    """What both servicers share: core errors become counted, logged statuses."""

    _commit: Commit
    _refusals: Refusals

    async def _abort(
        self, context: grpc.aio.ServicerContext[object, object], error: RouterError
    ) -> NoReturn:
        await context.abort_with_status(self._refusals.status_of(error))
        raise AssertionError("abort_with_status returned")  # pragma: no cover

    async def _durable(self, context: grpc.aio.ServicerContext[object, object]) -> None:
        """Waits until the call's changes are durable; a failed journal fails the call."""
        try:
            await self._commit()
        except RouterError as error:
            await self._abort(context, error)


class _StreamForm:
    """How one SubmitRewards stream wants its group results: set by its requests, read when
    its responses are packed."""

    __slots__ = ("columnar_results",)

    def __init__(self) -> None:
        self.columnar_results = False


async def _reward_requests(
    requests: AsyncIterable[spb.SubmitRewardsRequest], form: _StreamForm
) -> AsyncIterator[tuple[int, RewardBatch]]:
    """The requests of a SubmitRewards stream as the core's (sequence, batch) pairs; a
    malformed request raises here, inside the flow, after the acks of the ones before it."""
    async for request in requests:
        if request.columnar_results:
            form.columnar_results = True
        yield request.sequence, convert.reward_batch_from_proto(request)


def _pack_stream_events(
    events: list[StreamEvent], columnar_results: bool = False, shard: int = 0
) -> list[spb.SubmitRewardsResponse]:
    """Packs queued stream events into as few messages as the contract allows: each ack
    opens a message, and the group results after it ride along (at most
    RESULTS_PER_MESSAGE per message as GroupResult messages; as one GroupResultBatch per
    message in columnar form, bounded by the byte budget only, packed from the columns of
    the finalizer's batch without an object per group)."""
    messages: list[spb.SubmitRewardsResponse] = []
    current: spb.SubmitRewardsResponse | None = None
    size = 0
    pending: list[ResultColumns] = []

    def flush() -> None:
        if pending:
            assert current is not None
            columns = concat_columns(pending)
            convert.fill_result_batch(current.result_batch, columns)
            if shard:
                current.result_batch.shards.extend([shard] * len(columns))  # as on the feed
            pending.clear()

    def open_message() -> spb.SubmitRewardsResponse:
        nonlocal current, size
        flush()
        current = spb.SubmitRewardsResponse()
        messages.append(current)
        size = 0
        return current

    def add_columns(columns: ResultColumns) -> None:
        """Columnar results, split where the byte budget says (upper estimates)."""
        nonlocal size
        total = np.cumsum(columns.group_bytes)
        k, before = 0, 0
        while k < len(columns):
            if current is None:
                open_message()
            fit = int(np.searchsorted(total[k:], before + MESSAGE_BYTE_BUDGET - size, "right"))
            if fit == 0:
                if size > 0:
                    open_message()
                    continue
                fit = 1  # one group over the budget: StartGroup refuses such groups
            pending.append(columns.take(np.arange(k, k + fit, dtype=np.intp)))
            size += int(total[k + fit - 1]) - before
            before = int(total[k + fit - 1])
            k += fit

    def add_result(event: GroupResult) -> None:
        nonlocal current, size
        result = convert.result_to_proto(event)
        if shard:
            result.shard = shard  # as on the merged feed
        grows = result.ByteSize() + 8  # the field's tag and length
        if (
            current is None
            or len(current.group_results) >= RESULTS_PER_MESSAGE
            or (size + grows > MESSAGE_BYTE_BUDGET and size > 0)
        ):
            current = spb.SubmitRewardsResponse()
            messages.append(current)
            size = 0
        current.group_results.append(result)
        size += grows

    for event in events:
        if isinstance(event, RewardAck):
            flush()
            current = spb.SubmitRewardsResponse()
            convert.fill_ack(current.ack, event)
            messages.append(current)
            size = current.ByteSize()
        elif isinstance(event, MemberReplaced):
            replacement = convert.replacement_to_proto(event)
            grows = replacement.ByteSize() + 8  # the field's tag and length
            if current is None or (size + grows > MESSAGE_BYTE_BUDGET and size > 0):
                open_message()
            assert current is not None
            current.replacements.append(replacement)
            size += grows
        elif isinstance(event, ResultRows):
            if columnar_results:
                add_columns(event.columns())
            else:
                for result in event.results():
                    add_result(result)
        elif columnar_results:
            add_columns(columns_of_results([event]))
        else:
            add_result(event)
    flush()
    return messages


def _feed_messages(
    batch: list[GroupResult],
    skip_degenerate: bool,
    min_version: int = 0,
    columnar: bool = False,
) -> list[spb.SubscribeGroupsResponse]:
    """``feed_messages`` for results that exist as objects."""
    rows = [rows_between(RestoredResults(batch), 0, len(batch))] if batch else []
    return feed_messages(rows, skip_degenerate, min_version, columnar)


def feed_messages(
    rows: Sequence[ResultRows],
    skip_degenerate: bool,
    min_version: int = 0,
    columnar: bool = False,
) -> list[spb.SubscribeGroupsResponse]:
    """One feed read (rows in cursor order, consecutive cursors) as feed messages of at
    most MESSAGE_BYTE_BUDGET bytes each. A group older than ``min_version`` (its
    min_version below it) is skipped and counted in ``skipped_groups``; otherwise, with
    ``skip_degenerate``, a degenerate group is skipped and counted in ``skipped_degenerate``
    (so a group is counted once). Each message names the last cursor it covers, skipped
    ones included; a read gives at least one message, so a trainer that skips every group
    still sees its cursor move. ``columnar`` puts each message's groups in one
    GroupResultBatch, packed from the sources' columns (no object per group)."""
    if not columnar:
        return pack_feed_messages(
            [result for part in rows for result in part.results()],
            skip_degenerate,
            min_version,
            facts=lambda group: (group.cursor, group.min_version, group.degenerate),
            to_proto=convert.result_to_proto,
        )
    if not rows:
        return [spb.SubscribeGroupsResponse()]
    columns = [part.columns() for part in rows]
    cursors = np.concatenate([c.cursors for c in columns])
    stale = np.zeros(cursors.shape[0], dtype=np.bool_)
    if min_version:
        stale = np.concatenate([c.versions[:, 0] for c in columns]) < min_version
    skipped = np.zeros(cursors.shape[0], dtype=np.bool_)
    if skip_degenerate:
        skipped = np.concatenate([c.degenerate for c in columns]) & ~stale
    kept = np.flatnonzero(~(stale | skipped))
    part_of = np.repeat(np.arange(len(columns)), [len(c) for c in columns])[kept]
    position = (
        np.arange(cursors.shape[0])
        - np.repeat(np.cumsum([0] + [len(c) for c in columns[:-1]]), [len(c) for c in columns])
    )[kept]
    sizes = np.concatenate([c.group_bytes for c in columns])[kept]
    messages = []
    for first, last, stale_count, skip_count, covered in _feed_layout(
        cursors, stale, skipped, kept, sizes
    ):
        message = spb.SubscribeGroupsResponse(
            skipped_degenerate=skip_count, skipped_groups=stale_count, last_cursor=covered
        )
        if last > first:
            parts = part_of[first:last]
            at = position[first:last].astype(np.intp)
            cuts = np.flatnonzero(np.diff(parts)) + 1
            pieces = [
                columns[int(parts[a])].take(at[a:b])
                for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), len(parts)], strict=True)
            ]
            convert.fill_result_batch(message.batch, concat_columns(pieces))
        messages.append(message)
    return messages


def _feed_layout(
    cursors: NDArray[np.int64],
    stale: NDArray[np.bool_],
    skipped: NDArray[np.bool_],
    kept: NDArray[np.intp],
    sizes: NDArray[np.int64],
) -> list[tuple[int, int, int, int, int]]:
    """How one read (consecutive ``cursors``, flags per group) is cut into feed messages:
    per message, the range of ``kept`` (positions of the groups sent, with their ``sizes``
    in bytes) it holds, the stale and the degenerate groups it skips, and the last cursor it
    covers. A message holds kept groups while their sizes fit MESSAGE_BYTE_BUDGET (at least
    one), and covers everything up to the next message's first group, so a group skipped
    between two messages belongs to the first and resuming after any message's last cursor
    loses nothing."""
    total = np.cumsum(sizes)
    bounds: list[tuple[int, int]] = []
    first, before = 0, 0
    while first < kept.shape[0]:
        last = int(np.searchsorted(total, before + MESSAGE_BYTE_BUDGET, "right"))
        last = max(last, first + 1)
        bounds.append((first, last))
        before = int(total[last - 1])
        first = last
    if not bounds:
        bounds.append((0, 0))
    stale_before = np.concatenate([[0], np.cumsum(stale)]).tolist()
    skipped_before = np.concatenate([[0], np.cumsum(skipped)]).tolist()
    count = cursors.shape[0]
    layout = []
    covered_from = 0
    for first, last in bounds:
        end = int(kept[last]) if last < kept.shape[0] else count
        layout.append(
            (
                first,
                last,
                stale_before[end] - stale_before[covered_from],
                skipped_before[end] - skipped_before[covered_from],
                int(cursors[end - 1]),
            )
        )
        covered_from = end
    return layout


def pack_feed_messages(
    batch: Sequence[_Item],
    skip_degenerate: bool,
    min_version: int,
    *,
    facts: Callable[[_Item], tuple[int, int, bool]],
    to_proto: Callable[[_Item], pb.GroupResult],
) -> list[spb.SubscribeGroupsResponse]:
    """The message form of ``feed_messages`` for any kind of item: ``facts`` gives an
    item's (cursor, min_version, degenerate), and ``to_proto`` its message, asked only for
    the groups sent. The single router's feed (core results) and a shard's merged feed
    (messages read from the stream, keyed by stream sequence) both split with it."""
    if not batch:
        return [spb.SubscribeGroupsResponse()]
    table = [facts(item) for item in batch]
    cursors = np.array([cursor for cursor, _, _ in table], dtype=np.int64)
    stale = np.array(
        [bool(min_version) and version < min_version for _, version, _ in table], dtype=np.bool_
    )
    skipped = np.array([skip_degenerate and degenerate for _, _, degenerate in table]) & ~stale
    kept = np.flatnonzero(~(stale | skipped))
    groups = [to_proto(batch[i]) for i in kept.tolist()]
    sizes = np.array([g.ByteSize() + 8 for g in groups], dtype=np.int64)  # tag and length
    messages = []
    for first, last, stale_count, skip_count, covered in _feed_layout(
        cursors, stale, skipped, kept, sizes
    ):
        message = spb.SubscribeGroupsResponse(
            skipped_degenerate=skip_count, skipped_groups=stale_count, last_cursor=covered
        )
        message.groups.extend(groups[first:last])
        messages.append(message)
    return messages


class PackedFeedCache:
    """The messages of recent feed reads, by what was read (the cursors after and through)
    and how (filters, form): subscribers that follow the feed read the same new groups the
    same way, so a batch is packed once and every one of them sends the same messages.
    Bounded by ``FEED_CACHE_ENTRIES`` and ``FEED_CACHE_BYTES`` (wire-size estimates),
    least recently used first out; the messages are never changed once packed."""

    Key = tuple[int, int, bool, int, bool]

    def __init__(
        self, max_entries: int = FEED_CACHE_ENTRIES, max_bytes: int = FEED_CACHE_BYTES
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[
            PackedFeedCache.Key, tuple[list[spb.SubscribeGroupsResponse], int]
        ] = OrderedDict()

    def messages(
        self,
        rows: Sequence[ResultRows],
        after: int,
        skip_degenerate: bool,
        min_version: int,
        columnar: bool,
    ) -> list[spb.SubscribeGroupsResponse]:
        """The feed messages of the read ``rows`` (the groups after cursor ``after``)."""
        through = int(rows[-1].cursors[-1]) if rows else after
        key = (after, through, skip_degenerate, bool(min_version) and min_version, columnar)
        found = self._entries.get(key)
        if found is not None:
            self.hits += 1
            self._entries.move_to_end(key)
            return found[0]
        self.misses += 1
        messages = feed_messages(rows, skip_degenerate, min_version, columnar)
        size = sum(part.wire_bytes() for part in rows)
        if size <= self.max_bytes:
            self._entries[key] = (messages, size)
            self.bytes += size
            while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
                _, (_, gone) = self._entries.popitem(last=False)
                self.bytes -= gone
        return messages


class WorkerServicer(_Refusing, wpb_grpc.WorkerServiceServicer):
    """WorkerService over a worker directory: the router's own registry by default, the
    shared pool on a shard (``worker_directory``)."""

    def __init__(
        self,
        router: SessionRouter,
        commit: Commit = no_journal,
        refusals: Refusals | None = None,
        workers: WorkerDirectory | None = None,
    ) -> None:
        self._router = router
        self._commit = commit
        self._refusals = refusals or Refusals()
        self._workers: WorkerDirectory = workers or LocalWorkers(router)

    async def RegisterWorker(
        self, request: wpb.RegisterWorkerRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> wpb.RegisterWorkerResponse:
        try:
            worker = await self._workers.register(
                request.worker_id,
                request.address,
                request.capacity,
                dict(request.labels),
                request.policy_version,
            )
        except RouterError as error:
            await self._abort(context, error)
        reply = wpb.RegisterWorkerResponse(
            worker=worker,
            heartbeat_timeout=convert.duration(self._router.settings.heartbeat_timeout_s),
        )
        await self._durable(context)
        return reply

    async def Heartbeat(
        self, request: wpb.HeartbeatRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> wpb.HeartbeatResponse:
        try:
            worker = await self._workers.heartbeat(request.worker_id, request.policy_version)
        except RouterError as error:
            await self._abort(context, error)
        reply = wpb.HeartbeatResponse(worker=worker)
        if request.policy_version:
            await self._durable(context)  # a new version is journaled
        return reply

    async def DrainWorker(
        self, request: wpb.DrainWorkerRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> wpb.DrainWorkerResponse:
        try:
            worker = await self._workers.drain(request.worker_id, request.resume)
        except RouterError as error:
            await self._abort(context, error)
        reply = wpb.DrainWorkerResponse(worker=worker)
        await self._durable(context)
        return reply

    async def DeregisterWorker(
        self,
        request: wpb.DeregisterWorkerRequest,
        context: grpc.aio.ServicerContext[object, object],
    ) -> wpb.DeregisterWorkerResponse:
        try:
            worker, lost = await self._workers.deregister(request.worker_id)
        except RouterError as error:
            await self._abort(context, error)
        reply = wpb.DeregisterWorkerResponse(worker=worker, lost_sessions=lost)
        await self._durable(context)
        return reply

    async def GetWorker(
        self, request: wpb.GetWorkerRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> wpb.GetWorkerResponse:
        try:
            worker = self._workers.get(request.worker_id)
        except RouterError as error:
            await self._abort(context, error)
        return wpb.GetWorkerResponse(worker=worker)

    async def ListWorkers(
        self, request: wpb.ListWorkersRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> wpb.ListWorkersResponse:
        try:
            after = paging.decode_id("workers", request.page_token)
        except RouterError as error:
            await self._abort(context, error)
        workers, last = self._workers.page(paging.page_size(request.page_size), after)
        return wpb.ListWorkersResponse(
            workers=workers, next_page_token=paging.encode("workers", last)
        )

    async def BeginWeightUpdate(
        self,
        request: wpb.BeginWeightUpdateRequest,
        context: grpc.aio.ServicerContext[object, object],
    ) -> wpb.BeginWeightUpdateResponse:
        try:
            workers, interrupted = await self._workers.begin_update(
                request.version, list(request.worker_ids), request.interrupt_sessions
            )
        except RouterError as error:
            await self._abort(context, error)
        reply = wpb.BeginWeightUpdateResponse(workers=workers, interrupted_sessions=interrupted)
        await self._durable(context)
        return reply

    async def CompleteWeightUpdate(
        self,
        request: wpb.CompleteWeightUpdateRequest,
        context: grpc.aio.ServicerContext[object, object],
    ) -> wpb.CompleteWeightUpdateResponse:
        try:
            worker, finished = await self._workers.complete_update(
                request.worker_id, request.version
            )
        except RouterError as error:
            await self._abort(context, error)
        reply = wpb.CompleteWeightUpdateResponse(worker=worker, update_finished=finished)
        await self._durable(context)
        return reply


class SessionServicer(_Refusing, spb_grpc.SessionServiceServicer):
    """SessionService over the router core."""

    def __init__(
        self,
        router: SessionRouter,
        commit: Commit = no_journal,
        refusals: Refusals | None = None,
    ) -> None:
        self._router = router
        self._commit = commit
        self._draining = False
        self.result_shard = 0
        """The shard index its group results carry (``GroupResult.shard``; 0 unsharded)."""
        # The router's own set: it sends replacement notices to the same open streams.
        self._reward_flows: set[RewardFlow] = router.reward_flows
        self._refusals = refusals or Refusals()
        self.feed_cache = PackedFeedCache()
        """Feed reads packed for one subscriber, sent as they are to the others."""

    async def StartSession(
        self, request: spb.StartSessionRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> spb.StartSessionResponse:
        # The usual start (no admission wait, nothing pending) is one synchronous core call:
        # no closure and no coroutine of ``_start`` or ``_durable`` per call.
        router = self._router
        try:
            command = convert.start_session_from_proto(request)
            if request.wait_for_admission:
                started = await _start(router, lambda: router.start_session(command), True, context)
            else:
                try:
                    started = router.start_session(command)
                except LeasePendingError as pending:  # a shard's lease ran out
                    started = await pending.retry(lambda: router.start_session(command))
        except RouterError as error:
            await self._abort(context, error)
        reply = convert.start_session_reply(started)
        commit = self._commit
        if commit is not no_journal:
            try:
                await commit()
            except RouterError as error:
                await self._abort(context, error)
        return reply

    async def StartGroup(
        self, request: spb.StartGroupRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> spb.StartGroupResponse:
        try:
            group_command = convert.start_group_from_proto(request)
            started = await _start(
                self._router,
                lambda: self._router.start_group(group_command),
                request.wait_for_admission,
                context,
            )
        except RouterError as error:
            await self._abort(context, error)
        reply = spb.StartGroupResponse(
            group=convert.group_to_proto(started.group),
            shared_worker=started.shared_worker,
            replayed=started.replayed,
            placement_mode=convert.placement_to_proto(started.group),
        )
        await self._durable(context)
        return reply

    async def AbortSession(
        self, request: spb.AbortSessionRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> spb.AbortSessionResponse:
        try:
            session = self._router.abort_session(request.session, request.reason, request.retryable)
        except RouterError as error:
            await self._abort(context, error)
        reply = spb.AbortSessionResponse(
            session=convert.session_to_proto(session, self._router.find_group(session.group_id))
        )
        await self._durable(context)
        return reply

    async def GetSession(
        self, request: spb.GetSessionRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> spb.GetSessionResponse:
        try:
            session = self._router.get_session(request.session)
        except RouterError as error:
            await self._abort(context, error)
        return spb.GetSessionResponse(
            session=convert.session_to_proto(session, self._router.find_group(session.group_id))
        )

    async def GetGroup(
        self, request: spb.GetGroupRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> spb.GetGroupResponse:
        try:
            group = self._router.get_group(request.group_id)
        except RouterError as error:
            await self._abort(context, error)
        return spb.GetGroupResponse(
            group=convert.group_to_proto(group), placement_mode=convert.placement_to_proto(group)
        )

    async def ListGroups(
        self, request: spb.ListGroupsRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> spb.ListGroupsResponse:
        try:
            after = paging.decode_int("groups", request.page_token)
            state = convert.group_state_from_proto(request.state)
        except RouterError as error:
            await self._abort(context, error)
        found, next_seq = self._router.list_groups(
            paging.page_size(request.page_size), after, state
        )
        return spb.ListGroupsResponse(
            groups=[convert.group_to_proto(g, with_members=False) for g in found],
            next_page_token=paging.encode("groups", str(next_seq) if next_seq else ""),
        )

    async def SubmitRewards(
        self,
        request_iterator: AsyncIterable[spb.SubmitRewardsRequest],
        context: grpc.aio.ServicerContext[object, object],
    ) -> AsyncIterator[spb.SubmitRewardsResponse]:
        if self._draining:
            await self._abort(context, self._draining_error("reward stream"))
        stream = RewardFlow(self._router.submit_batch, self._commit)
        self._reward_flows.add(stream)
        form = _StreamForm()
        reader = asyncio.create_task(stream.read(_reward_requests(request_iterator, form)))
        try:
            async for batch in stream.batches():
                for response in _pack_stream_events(
                    batch, form.columnar_results, self.result_shard
                ):
                    yield response
            if reader.cancelled():
                # Only drain() cancels a running intake (and so its reader).
                await self._abort(context, self._draining_error("reward stream"))
            error = reader.exception() if reader.done() else None
            if isinstance(error, RouterError):
                await self._abort(context, error)
        finally:
            self._reward_flows.discard(stream)
            if not reader.done():
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reader

    async def SubscribeGroups(
        self,
        request: spb.SubscribeGroupsRequest,
        context: grpc.aio.ServicerContext[object, object],
    ) -> AsyncIterator[spb.SubscribeGroupsResponse]:
        feed = self._router.feed
        after = request.after_cursor
        cursor = feed.last_cursor if request.from_latest else feed.start_after(after)
        # Headers go out at once, so a client knows the subscription is live before the
        # first group arrives, and where it starts: a client that asked "from latest" resumes
        # from that cursor after a disconnect instead of skipping what it missed.
        await context.send_initial_metadata(((AFTER_CURSOR_HEADER, str(cursor)),))
        subscription = feed.subscribe(context.peer(), cursor)
        limit = COLUMNAR_FEED_READ_BATCH if request.columnar else FEED_READ_BATCH
        try:
            while True:
                try:
                    rows = feed.read_rows_after(cursor, limit)
                except RouterError as error:
                    await self._abort(context, error)
                if not rows:
                    if not await feed.wait_beyond(cursor):
                        await self._abort(context, self._draining_error("group feed", cursor))
                    continue
                for message in self.feed_cache.messages(
                    rows, cursor, request.skip_degenerate, request.min_version, request.columnar
                ):
                    # Sent once yielded: gRPC resumes this generator only after the write,
                    # when the client may already hold the message, so the lag gauges count
                    # it from here, not from the resume.
                    subscription.cursor = max(subscription.cursor, message.last_cursor)
                    yield message
                cursor = subscription.cursor = int(rows[-1].cursors[-1])
        finally:
            feed.unsubscribe(subscription)

    def drain(self) -> None:
        """Ends the intake of every SubmitRewards stream, for a graceful shutdown.

        Each stream stops reading requests, still acks the ones it applied and sends the
        group results owed to it, then ends with UNAVAILABLE (``SHUTTING_DOWN``) so that its
        client reconnects and resends what was not acknowledged. Streams opened after this
        end at once the same way."""
        self._draining = True
        for flow in self._reward_flows:
            flow.stop_intake()

    def _draining_error(self, what: str, cursor: int | None = None) -> Unavailable:
        metadata = {} if cursor is None else {"cursor": cursor}
        tail = "" if cursor is None else f" (resume after cursor {cursor})"
        return Unavailable(
            "SHUTTING_DOWN",
            f"the router is shutting down and ended this {what}; reconnect{tail}",
            retry_after_s=self._router.settings.retry_after_s,
            metadata=metadata,
        )

    async def SetTrainerState(
        self,
        request: spb.SetTrainerStateRequest,
        context: grpc.aio.ServicerContext[object, object],
    ) -> spb.SetTrainerStateResponse:
        try:
            await self._set_trainer_state(
                TrainerStateChange(
                    request.version,
                    convert.policy_from_proto(request),
                    clear_policy=request.clear_policy,
                    reset_counters=request.reset_counters,
                    refuse_mixed_versions=request.refuse_mixed_versions
                    if request.HasField("refuse_mixed_versions")
                    else None,
                )
            )
        except RouterError as error:
            await self._abort(context, error)
        reply = spb.SetTrainerStateResponse(state=self._trainer_state())
        await self._durable(context)
        return reply

    def _trainer_state(self) -> pb.TrainerState:
        """The state Get/SetTrainerState answer: this router's (a shard overrides it with
        the fleet's counters and weight update)."""
        return convert.trainer_state_to_proto(self._router)

    async def _set_trainer_state(self, change: TrainerStateChange) -> None:
        """Where a SetTrainerState goes: this router's state (a shard overrides it to write
        the fleet's)."""
        self._router.set_trainer_state(
            change.version,
            change.policy,
            clear_policy=change.clear_policy,
            reset_counters=change.reset_counters,
            refuse_mixed_versions=change.refuse_mixed_versions,
        )

    async def GetTrainerState(
        self,
        request: spb.GetTrainerStateRequest,
        context: grpc.aio.ServicerContext[object, object],
    ) -> spb.GetTrainerStateResponse:
        return spb.GetTrainerStateResponse(state=self._trainer_state())
