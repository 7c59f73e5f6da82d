"""The promise of one SubmitRewards stream, kept in one place.

A stream answers every request with one ack, in request order, and also carries the results
of the groups that its rewards completed. Those results are reduced asynchronously (in
micro-batches), and an ack waits for the journal, so either can be ready first. ``RewardFlow``
makes the order on the wire the one the contract promises:

- acks go out in request order, each once the changes of its request are durable;
- a group result always goes out after the ack of the request that completed it;
- the stream ends only once every group it completed has been delivered, so that a client
  that half-closes right after its last reward still receives the advantages;
- the flow stops reading when the client does not read its responses
  (``STREAM_BACKLOG_LIMIT`` events or ``STREAM_BACKLOG_BYTES``) or the journal falls behind
  (``MAX_UNACKED_REQUESTS`` requests or ``MAX_UNACKED_ENTRIES`` entries), instead of
  queueing without bound; gRPC flow control then holds the client back;
- a request with no entries, or more than ``MAX_ENTRIES_PER_REQUEST``, is refused
  (InvalidArgument), ending the stream after the acks of the requests before it.

A request does not wait for its own durability before the next one is read: the flow takes
the durability point at once and hands it, with the ack, to a sender that acks in request
order as each becomes durable. So consecutive requests of one stream share journal batches,
and one stream sending small requests is not held to one request per fsync.

The transport only converts: it feeds ``read`` with (sequence, entries) pairs and writes
what ``batches`` yields.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from sessionrouter.server.core.errors import InvalidArgument
from sessionrouter.server.core.feed import GroupResult
from sessionrouter.server.core.groups import GroupRecord, SessionRecord
from sessionrouter.server.core.results import ResultRows
from sessionrouter.server.core.rewards import BatchOutcome, RewardBatch, RewardOutcome
from sessionrouter.server.core.sizes import map_bytes, member_bytes, result_bytes

MAX_ENTRIES_PER_REQUEST = 4096
STREAM_BACKLOG_LIMIT = 1024
"""Queued responses of one stream beyond which its reader stops reading."""
MAX_UNACKED_REQUESTS = 256
"""Requests of one stream applied but not yet acked (waiting for the journal) beyond which
the stream stops reading: bounds what a fast sender can queue."""
STREAM_BACKLOG_BYTES = 4 * 1024 * 1024
"""Wire bytes (estimated) of the responses queued for one stream beyond which its reader
stops reading: a client that sends 4,096-entry requests and never reads its acks holds the
router to this, not to 1,024 such acks (about 200 MB)."""
MAX_UNACKED_ENTRIES = 65_536
"""Entries of one stream applied but not yet acked beyond which the stream stops reading."""


def event_bytes(event: StreamEvent) -> int:
    """Wire-size estimate of one queued response event."""
    if isinstance(event, RewardAck):
        results = event.results
        if isinstance(results, BatchOutcome):
            return (
                16
                + (2 if results.columnar else 8) * len(results)
                + sum(8 + len(d) for d in results.details)
            )
        return 16 + sum(8 + len(r.detail) for r in results)
    if isinstance(event, ResultRows):
        return event.wire_bytes()
    if isinstance(event, MemberReplaced):
        new = event.replacement
        return (
            member_bytes(len(event.group_id), len(event.group.task_id), map_bytes(new.metadata))
            + len(event.group_id)
            + len(event.replaced_session)
            + len(event.reason)
            + 32
        )
    return result_bytes(
        len(event.sessions) + len(event.excluded_sessions) + len(event.replaced_sessions),
        len(event.group_id),
        len(event.task_id),
    )


@dataclass(frozen=True, slots=True)
class RewardAck:
    """Answer to one request: ``results[i]`` is about entry i."""

    sequence: int
    results: Sequence[RewardOutcome] | BatchOutcome


@dataclass(frozen=True, slots=True)
class MemberReplaced:
    """A member replaced by a new one (a group with ``replace_lost``); sent on every open
    reward stream."""

    group_id: str
    replaced_session: str
    replacement: SessionRecord
    group: GroupRecord
    reason: str
    """``worker_lost`` or ``aborted``."""


StreamEvent = RewardAck | GroupResult | ResultRows | MemberReplaced
"""``ResultRows``: results of one finalizer batch owed to the stream, as one event."""

Entry = (
    tuple[str, float] | tuple[str, float, float | None] | tuple[str, float, float | None, int, int]
)
"""One reward entry: (session name, reward), optionally followed by the filter metric (None:
none given), optionally followed by the (min_version, max_version) the generation used (0 and
0: the session's start version)."""
Entries = Sequence[Entry] | RewardBatch
"""The entries of one request: ``Entry`` tuples, or the columns of a ``RewardBatch``."""
Submit = Callable[[Any, "StreamOrigin"], Sequence[RewardOutcome] | BatchOutcome]
"""Applies one request's entries (``SessionRouter.submit_batch`` for a ``RewardBatch``,
``submit_rewards`` for tuples) and says what happened to each."""
Commit = Callable[[], Awaitable[None]]
"""Returns an awaitable that resolves once every state change made *before the call* is
durable; it raises the core's Unavailable once the journal has failed."""


class _AlreadyDurable:
    """The commit of a router without a journal: nothing to wait for. Not a coroutine, so one
    taken and never awaited (a stream cancelled with acks queued) leaves no warning behind."""

    __slots__ = ()

    def __await__(self) -> Generator[None, None, None]:
        yield from ()


ALREADY_DURABLE = _AlreadyDurable()


def no_journal() -> Awaitable[None]:
    """The Commit of a router that keeps its state in memory only."""
    return ALREADY_DURABLE


class StreamOrigin(NamedTuple):
    """Where a reward came from: the flow and the number of its request in that flow. A
    group that reward finishes owes its result to that flow, after that request's ack."""

    flow: RewardFlow
    request: int


def check_entries(count: int) -> None:
    """InvalidArgument NO_ENTRIES for a request without entries (the contract says 1 to
    ``MAX_ENTRIES_PER_REQUEST``), TOO_MANY_ENTRIES for one of more than the allowed."""
    if count == 0:
        raise InvalidArgument(
            "NO_ENTRIES",
            f"a request carries no entries; send 1 to {MAX_ENTRIES_PER_REQUEST}",
            metadata={"entries": 0, "limit": MAX_ENTRIES_PER_REQUEST},
            field_violations=[("entries", f"at least 1, at most {MAX_ENTRIES_PER_REQUEST}")],
        )
    if count > MAX_ENTRIES_PER_REQUEST:
        raise InvalidArgument(
            "TOO_MANY_ENTRIES",
            f"a request carries {count} entries, at most {MAX_ENTRIES_PER_REQUEST} allowed",
            metadata={"entries": count, "limit": MAX_ENTRIES_PER_REQUEST},
            field_violations=[("entries", f"at most {MAX_ENTRIES_PER_REQUEST}")],
        )


class RewardFlow:
    """One SubmitRewards stream: reads requests, applies them, and queues acks and results
    in the promised order (see the module docstring)."""

    def __init__(self, submit: Submit, commit: Commit) -> None:
        self._submit = submit
        self._commit = commit
        self._events: deque[StreamEvent] = deque()
        self._ready = asyncio.Event()
        self._room = asyncio.Event()
        self._next_request = 0
        self._acked = -1
        self._held: list[tuple[int, GroupResult]] = []
        self._held_rows: list[tuple[NDArray[np.int64], ResultRows]] = []
        """Rows whose requests are not acked yet, with the request of each."""
        self._pending_groups = 0
        self._input_done = False
        self._intake: asyncio.Task[None] | None = None
        self._backlog_bytes = 0

    # -- the reading side ------------------------------------------------------------------

    async def read(self, requests: AsyncIterable[tuple[int, Entries]]) -> None:
        """Applies every (sequence, entries) request until the input ends; raises what
        ended it early (a RouterError for the client, after the acks of earlier requests),
        or CancelledError once ``stop_intake`` stopped it (after the acks too)."""
        acks = _DurableAcks(self)
        # The intake is its own task so that stop_intake() can stop the reading alone: the
        # acks of what was applied still go out below.
        intake = asyncio.create_task(self._take_in(requests, acks))
        self._intake = intake
        try:
            try:
                await intake
            finally:
                # Also when this request failed: the earlier ones still get their acks.
                await acks.close()
        finally:
            acks.cancel()
            self.end_input()

    async def _take_in(
        self, requests: AsyncIterable[tuple[int, Entries]], acks: _DurableAcks
    ) -> None:
        async for sequence, entries in requests:
            await self.room(STREAM_BACKLOG_LIMIT, STREAM_BACKLOG_BYTES)
            check_entries(len(entries))
            number = self.begin_request()
            outcomes = self._submit(entries, StreamOrigin(self, number))
            durable = self._commit()
            if durable is ALREADY_DURABLE and acks.idle:
                # Nothing to wait for and no earlier ack waiting: acked here, without a hop
                # through the sender task (one task wake per request fewer).
                self.ack(number, RewardAck(sequence, outcomes))
                continue
            acks.add(durable, number, RewardAck(sequence, outcomes))
            await acks.room(MAX_UNACKED_REQUESTS, MAX_UNACKED_ENTRIES)

    def stop_intake(self) -> None:
        """Stops reading requests (a graceful drain): what was applied is still acked and the
        results owed are still delivered, then ``read`` ends cancelled. No effect before
        ``read`` started or after its intake ended."""
        if self._intake is not None and not self._intake.done():
            self._intake.cancel()

    def begin_request(self) -> int:
        """Numbers the next request of this stream (0, 1, 2...)."""
        number = self._next_request
        self._next_request += 1
        return number

    def expect_groups(self, count: int) -> None:
        """Rewards of this stream finalized ``count`` groups: their results are owed to this
        stream."""
        self._pending_groups += count

    def ack(self, request_number: int, ack: RewardAck) -> None:
        """Queues the ack of request ``request_number`` and any results it unblocks."""
        self._acked = request_number
        self._events.append(ack)
        self._backlog_bytes += event_bytes(ack)
        still_held = []
        for number, result in self._held:
            if number <= self._acked:
                self._events.append(result)
            else:
                still_held.append((number, result))
        self._held = still_held
        if self._held_rows:
            held_rows, self._held_rows = self._held_rows, []
            for requests, rows in held_rows:
                self._queue_rows(rows, requests)
        self._ready.set()

    def deliver_rows(self, rows: ResultRows, requests: NDArray[np.int64]) -> None:
        """Queues the results of ``rows`` (groups of one batch), group i completed by
        request ``requests[i]``: one event for those whose request was acked, the others
        held until it is."""
        self._pending_groups -= len(rows)
        self._backlog_bytes += event_bytes(rows)  # held ones count too, as in ``deliver``
        self._queue_rows(rows, requests)
        self._ready.set()

    def _queue_rows(self, rows: ResultRows, requests: NDArray[np.int64]) -> None:
        ready = requests <= self._acked
        if not ready.all():
            waiting = ~ready
            self._held_rows.append(
                (requests[waiting], ResultRows(rows.source, rows.positions[waiting]))
            )
            if not ready.any():
                return
            rows = ResultRows(rows.source, rows.positions[ready])
        self._events.append(rows)

    def deliver(self, request_number: int, result: GroupResult) -> None:
        """Queues a group result completed by request ``request_number``."""
        self._pending_groups -= 1
        self._backlog_bytes += event_bytes(result)
        if request_number <= self._acked:
            self._events.append(result)
        else:
            self._held.append((request_number, result))
        self._ready.set()

    def notify(self, notice: MemberReplaced) -> None:
        """Queues a replacement notice: it goes out with the next message, in no order
        relative to acks and results."""
        self._events.append(notice)
        self._backlog_bytes += event_bytes(notice)
        self._ready.set()

    def end_input(self) -> None:
        """The client half-closed: end once every owed result is out."""
        self._input_done = True
        self._ready.set()

    @property
    def backlog(self) -> int:
        """Events queued but not yet written: the reader waits while this is large."""
        return len(self._events) + len(self._held) + len(self._held_rows)

    @property
    def backlog_bytes(self) -> int:
        """Wire-size estimate of the events queued but not yet written."""
        return self._backlog_bytes

    async def room(self, limit: int, limit_bytes: int = STREAM_BACKLOG_BYTES) -> None:
        """Waits until at most ``limit`` events and ``limit_bytes`` bytes are queued: a
        client that sends without reading its responses is slowed down instead of growing
        the queue without bound."""
        while self.backlog > limit or self._backlog_bytes > limit_bytes:
            self._room.clear()
            await self._room.wait()

    # -- the writing side ------------------------------------------------------------------

    async def batches(self) -> AsyncIterator[list[StreamEvent]]:
        """Yields everything queued, in wire order, as soon as anything is; ends once input
        ended and nothing is owed. Batching lets the writer pack many group results into
        one message."""
        while True:
            if self._events:
                batch = list(self._events)
                self._events.clear()
                self._backlog_bytes -= sum(event_bytes(e) for e in batch)
                self._room.set()
                yield batch
                continue
            if (
                self._input_done
                and self._pending_groups <= 0
                and not self._held
                and not self._held_rows
            ):
                return
            self._ready.clear()
            await self._ready.wait()


class _DurableAcks:
    """Acks of one flow, sent in request order, each once durable.

    The reader adds (barrier, ack) pairs without waiting; one task awaits the barriers in
    order and queues the acks on the flow. Barriers of one journal resolve in order, so
    awaiting them in order costs nothing extra."""

    def __init__(self, flow: RewardFlow) -> None:
        self._flow = flow
        self._queue: deque[tuple[Awaitable[None], int, RewardAck]] = deque()
        self._entries = 0
        self._added = asyncio.Event()
        self._sent = asyncio.Event()
        self._closing = False
        self._task = asyncio.create_task(self._send(), name="reward-acks")

    @property
    def idle(self) -> bool:
        """No ack is waiting to be sent: one that is already durable may go out at once."""
        return not self._queue

    def add(self, durable: Awaitable[None], number: int, ack: RewardAck) -> None:
        self._queue.append((durable, number, ack))
        self._entries += len(ack.results)
        self._added.set()

    async def room(self, limit: int, limit_entries: int) -> None:
        """Waits while more than ``limit`` acks or ``limit_entries`` entries are queued;
        raises what failed the sender."""
        while (len(self._queue) > limit or self._entries > limit_entries) and not self._task.done():
            self._sent.clear()
            await self._sent.wait()
        if self._task.done():
            self._task.result()

    async def close(self) -> None:
        """Waits until every ack added so far is sent; raises what failed the sender."""
        self._closing = True
        self._added.set()
        await self._task

    def cancel(self) -> None:
        if not self._task.done():
            self._task.cancel()
        elif not self._task.cancelled():
            self._task.exception()  # retrieved: whoever needed it got it from close()

    async def _send(self) -> None:
        try:
            while True:
                while self._queue:
                    durable, number, ack = self._queue[0]
                    await durable
                    self._queue.popleft()
                    self._entries -= len(ack.results)
                    self._flow.ack(number, ack)
                    self._sent.set()
                if self._closing:
                    return
                self._added.clear()
                await self._added.wait()
        finally:
            self._sent.set()
