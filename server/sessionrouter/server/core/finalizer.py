"""Turns finished groups into results, in micro-batches, and publishes them in order.

Groups that finish within one short window (``window_s``, a few milliseconds) are reduced in
one vectorized call of the AdvantageReducer over all their rewards, instead of one NumPy call
per group; a batch that reaches ``max_batch`` groups is reduced at once without waiting. The
results then go, in finish order, to the feed (which gives each its cursor), to the stream
whose reward finished the group, and to listeners (logs, metrics, journal).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from sessionrouter.server.core.feed import GroupFeed, GroupOutcome, GroupResult
from sessionrouter.server.core.groups import GroupRecord, SessionRecord
from sessionrouter.server.core.reducer import AdvantageReducer
from sessionrouter.server.core.streams import RewardStream

_EMPTY = np.zeros(0, dtype=np.float64)


@dataclass(frozen=True, slots=True)
class FinishedGroup:
    """A group whose membership and rewards are final, waiting for its advantages."""

    group: GroupRecord
    outcome: GroupOutcome
    counted: tuple[SessionRecord, ...]
    """Rewarded members, in index order: the ones the statistics use."""
    excluded: tuple[SessionRecord, ...]
    finalize_time: float
    """Unix seconds."""
    origin: tuple[RewardStream, int] | None
    """The stream and request number whose reward finished the group, if any."""


Listener = Callable[[GroupResult, GroupRecord], None]


class GroupFinalizer:
    """Micro-batching reducer stage between the router and the feed."""

    def __init__(self, feed: GroupFeed, window_s: float, max_batch: int) -> None:
        self.feed = feed
        self.window_s = window_s
        self.max_batch = max_batch
        self.reducer = AdvantageReducer()
        self.listeners: list[Listener] = []
        self.batches = 0
        """How many micro-batches were reduced (for metrics and tests)."""
        self._pending: list[FinishedGroup] = []
        self._wake = asyncio.Event()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def submit(self, finished: FinishedGroup) -> None:
        """Queues a finished group; the run loop reduces it within ``window_s``."""
        if finished.origin is not None:
            finished.origin[0].expect_group()
        self._pending.append(finished)
        self._wake.set()

    def drain(self) -> list[GroupResult]:
        """Reduces and publishes everything queued now, in one vectorized call."""
        batch, self._pending = self._pending, []
        if not batch:
            return []
        self.batches += 1
        reducible = [f for f in batch if f.counted]
        reduced = iter(
            self.reducer.reduce(
                [
                    (
                        [s.reward for s in f.counted if s.reward is not None],
                        f.group.settings.estimator,
                    )
                    for f in reducible
                ]
            )
        )
        results = []
        for finished in batch:
            group = finished.group
            rewards = np.fromiter(
                (s.reward for s in finished.counted if s.reward is not None),
                dtype=np.float64,
                count=len(finished.counted),
            )
            if finished.counted:
                stats = next(reduced)
                mean, std, degenerate = stats.mean, stats.std, stats.degenerate
                advantages = stats.advantages
            else:
                mean, std, degenerate, advantages = 0.0, 0.0, True, _EMPTY
            if finished.outcome is GroupOutcome.DROPPED:
                advantages = _EMPTY
            result = GroupResult(
                cursor=self.feed.next_cursor(),
                group_id=group.group_id,
                task_id=group.task_id,
                outcome=finished.outcome,
                group_size=group.size,
                sessions=tuple(s.name for s in finished.counted),
                rewards=rewards,
                advantages=advantages,
                mean=mean,
                std=std,
                estimator=group.settings.estimator,
                degenerate=degenerate,
                excluded_sessions=tuple(s.name for s in finished.excluded),
                finalize_time=finished.finalize_time,
            )
            group.cursor = result.cursor
            self.feed.publish(result)
            if finished.origin is not None:
                stream, request_number = finished.origin
                stream.deliver(request_number, result)
            for listener in self.listeners:
                listener(result, group)
            results.append(result)
        return results

    async def run(self) -> None:
        """Reduces queued groups every ``window_s`` until cancelled."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            if len(self._pending) < self.max_batch and self.window_s > 0:
                await asyncio.sleep(self.window_s)
            self.drain()
