"""Ordering of the events of one SubmitRewards stream.

A stream answers every request with one ack, in request order, and also carries the results of
the groups that its rewards completed. Those results are reduced asynchronously (in
micro-batches), and an ack may itself wait for the journal, so either can be ready first. This
class makes the order on the wire the one the contract promises: a group result always goes
out after the ack of the request that completed it. It also lets the stream end only once every
group it completed has been delivered, so that a client that half-closes right after its last
reward still receives the advantages.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from sessionrouter.server.core.feed import GroupResult
from sessionrouter.server.core.rewards import RewardOutcome


@dataclass(frozen=True, slots=True)
class RewardAck:
    """Answer to one request: ``results[i]`` is about entry i."""

    sequence: int
    results: Sequence[RewardOutcome]


StreamEvent = RewardAck | GroupResult


class RewardStream:
    """Per-stream event queue with ack-before-result ordering."""

    def __init__(self) -> None:
        self._events: deque[StreamEvent] = deque()
        self._ready = asyncio.Event()
        self._room = asyncio.Event()
        self._next_request = 0
        self._acked = -1
        self._held: list[tuple[int, GroupResult]] = []
        self._pending_groups = 0
        self._input_done = False

    def begin_request(self) -> int:
        """Numbers the next request of this stream (0, 1, 2...)."""
        number = self._next_request
        self._next_request += 1
        return number

    def expect_group(self) -> None:
        """A reward of this stream finalized a group: its result is owed to this stream."""
        self._pending_groups += 1

    def ack(self, request_number: int, ack: RewardAck) -> None:
        """Queues the ack of request ``request_number`` and any results it unblocks."""
        self._acked = request_number
        self._events.append(ack)
        still_held = []
        for number, result in self._held:
            if number <= self._acked:
                self._events.append(result)
            else:
                still_held.append((number, result))
        self._held = still_held
        self._ready.set()

    def deliver(self, request_number: int, result: GroupResult) -> None:
        """Queues a group result completed by request ``request_number``."""
        self._pending_groups -= 1
        if request_number <= self._acked:
            self._events.append(result)
        else:
            self._held.append((request_number, result))
        self._ready.set()

    def end_input(self) -> None:
        """The client half-closed: end once every owed result is out."""
        self._input_done = True
        self._ready.set()

    @property
    def backlog(self) -> int:
        """Events queued but not yet written: the reader waits while this is large."""
        return len(self._events) + len(self._held)

    async def room(self, limit: int) -> None:
        """Waits until at most ``limit`` events are queued: a client that sends without
        reading its responses is slowed down instead of growing the queue without bound."""
        while self.backlog > limit:
            self._room.clear()
            await self._room.wait()

    async def batches(self) -> AsyncIterator[list[StreamEvent]]:
        """Yields everything queued, in wire order, as soon as anything is; ends once input
        ended and nothing is owed. Batching lets the writer pack many group results into
        one message."""
        while True:
            if self._events:
                batch = list(self._events)
                self._events.clear()
                self._room.set()
                yield batch
                continue
            if self._input_done and self._pending_groups <= 0 and not self._held:
                return
            self._ready.clear()
            await self._ready.wait()
