"""Turns finished groups into results, in micro-batches, and publishes them in order.

Groups that finish within one short window (``window_s``, a few milliseconds) are reduced in
one vectorized call of the AdvantageReducer over all their rewards, instead of one NumPy call
per group; a batch that reaches ``max_batch`` groups is reduced at once without waiting. Each
result gets the next cursor, in finish order, and then goes to the feed, to the stream whose
reward finished the group, and to listeners (logs, metrics).

With a journal there is one more step between the two: a result is journaled, and published
only once the journal says it is durable. A subscriber that has seen cursor 41 must never see
cursor 41 given to another group after a crash, and a trainer must never receive advantages of
a group that a restarted router would finalize again. ``drain()`` reduces and journals;
``flush()`` also waits for durability and publishes. The fsync wait doubles as the batching
window: groups that finish while one batch is being written are reduced together next.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from sessionrouter.server.core.errors import Unavailable
from sessionrouter.server.core.estimators import EstimatorParams
from sessionrouter.server.core.events import GroupFinalized, JournalSink
from sessionrouter.server.core.feed import GroupFeed, GroupOutcome, GroupResult
from sessionrouter.server.core.groups import GroupRecord, SessionRecord
from sessionrouter.server.core.reducer import AdvantageReducer
from sessionrouter.server.core.streams import StreamOrigin

log = logging.getLogger("sessionrouter.finalizer")

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
    origin: StreamOrigin | None
    """The stream and request whose reward finished the group, if any."""
    trainer_version: int = 0
    """The trainer's version when the group finished."""

    def versions(self) -> tuple[int, int]:
        """(min, max) policy version of the members that count, or of all members when
        none counts; (0, 0) for a group without members."""
        members = self.counted or self.excluded
        if not members:
            return 0, 0
        return min(s.min_version for s in members), max(s.max_version for s in members)


Listener = Callable[[GroupResult, GroupRecord], None]


def _filter_metrics(counted: tuple[SessionRecord, ...]) -> NDArray[np.float64]:
    """(n,) filter metrics of the counted members when every one has one, else (0,)."""
    if not counted or any(s.filter_metric is None for s in counted):
        return _EMPTY
    return np.array([s.filter_metric for s in counted], dtype=np.float64)


def _own_params(finished: FinishedGroup) -> EstimatorParams:
    """The estimator a finished group is reduced with: its own, except that a dropped group
    never joins the batch of a batch-std reduction."""
    params = finished.group.settings.estimator
    if finished.outcome is GroupOutcome.DROPPED and params.batch_std:
        return dataclasses.replace(params, batch_std=False)
    return params


class GroupFinalizer:
    """Micro-batching reducer stage between the router and the feed."""

    def __init__(
        self,
        feed: GroupFeed,
        window_s: float,
        max_batch: int,
        journal: JournalSink | None = None,
    ) -> None:
        self.feed = feed
        self.window_s = window_s
        self.max_batch = max_batch
        self.journal = journal
        """Where results are made durable before publication; None publishes at once."""
        self.reducer = AdvantageReducer()
        self.listeners: list[Listener] = []
        self.batches = 0
        """How many micro-batches were reduced (for metrics and tests)."""
        self.degenerate = 0
        """How many finalized (not dropped) groups were degenerate (for metrics)."""
        self._pending: list[FinishedGroup] = []
        self._wake = asyncio.Event()
        self._unpublished: deque[tuple[GroupResult, FinishedGroup]] = deque()
        """Journaled results waiting for durability, in cursor order."""
        self._journaled = 0
        self._published = 0

    @property
    def pending(self) -> int:
        """Groups queued for reduction."""
        return len(self._pending)

    @property
    def unpublished(self) -> int:
        """Results reduced and journaled but not yet durable, hence not yet published."""
        return len(self._unpublished)

    def submit(self, finished: FinishedGroup) -> None:
        """Queues a finished group; the run loop reduces it within ``window_s``."""
        if finished.origin is not None:
            finished.origin.flow.expect_group()
        self._pending.append(finished)
        self._wake.set()

    def drain(self) -> list[GroupResult]:
        """Reduces everything queued now, in one vectorized call, and gives each result its
        cursor. Without a journal the results are published at once; with one they are
        journaled and wait for ``flush()``."""
        batch, self._pending = self._pending, []
        if not batch:
            return []
        self.batches += 1
        # Each group's rewards become one float64 array, used both as the reducer's input
        # and as the result's rewards.
        rewards_of = [
            np.fromiter(
                (s.reward for s in f.counted if s.reward is not None),
                dtype=np.float64,
                count=len(f.counted),
            )
            for f in batch
        ]
        # A dropped group's rewards are reduced only for its mean and std: never with
        # batch_std, so they stay out of the statistics of the groups reduced with it.
        reduced = iter(
            self.reducer.reduce(
                [
                    (rewards, _own_params(f))
                    for f, rewards in zip(batch, rewards_of, strict=True)
                    if f.counted
                ]
            )
        )
        results = []
        for finished, rewards in zip(batch, rewards_of, strict=True):
            group = finished.group
            if finished.counted:
                stats = next(reduced)
                mean, std, degenerate = stats.mean, stats.std, stats.degenerate
                advantages = stats.advantages
            else:
                mean, std, degenerate, advantages = 0.0, 0.0, True, _EMPTY
            metrics = _filter_metrics(finished.counted)
            if metrics.size:
                degenerate = bool(metrics.size <= 1 or (metrics == metrics[0]).all())
            if finished.outcome is GroupOutcome.DROPPED:
                advantages = _EMPTY
            elif degenerate:
                self.degenerate += 1
            min_version, max_version = finished.versions()
            result = GroupResult(
                cursor=self.feed.next_cursor() + len(self._unpublished),
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
                filter_metrics=metrics,
                replaced_sessions=tuple(s.name for s in finished.excluded if s.replaced_by >= 0),
                min_version=min_version,
                max_version=max_version,
                trainer_version=finished.trainer_version,
                admitted_version=group.admitted_version,
            )
            if self.journal is None:
                self._publish(result, finished)
            else:
                self.journal.append(
                    GroupFinalized(
                        group.seq,
                        result,
                        tuple(s.index for s in finished.counted),
                        tuple(s.index for s in finished.excluded),
                        tuple(s.index for s in finished.excluded if s.replaced_by >= 0),
                    )
                )
                self._unpublished.append((result, finished))
                self._journaled += 1
            results.append(result)
        if self._unpublished:
            self._wake.set()  # the run loop waits for durability and publishes them
        return results

    async def flush(self) -> list[GroupResult]:
        """Reduces everything queued, waits until every result journaled so far is durable,
        and publishes them in cursor order; returns the results this call reduced.

        Safe to run concurrently (the run loop and a shutdown, say): each caller publishes
        what its own wait covered, and a result is published once."""
        results = self.drain()
        if self.journal is not None and self._published < self._journaled:
            target = self._journaled
            await self.journal.commit()
            while self._published < target:
                result, finished = self._unpublished.popleft()
                self._published += 1
                self._publish(result, finished)
        return results

    def _publish(self, result: GroupResult, finished: FinishedGroup) -> None:
        finished.group.cursor = result.cursor
        self.feed.publish(result)
        if finished.origin is not None:
            finished.origin.flow.deliver(finished.origin.request, result)
        for listener in self.listeners:
            listener(result, finished.group)

    async def run(self) -> None:
        """Reduces queued groups every ``window_s`` until cancelled, or until the journal
        fails (nothing can be published any more; the server is stopping)."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            if len(self._pending) < self.max_batch and self.window_s > 0:
                await asyncio.sleep(self.window_s)
            try:
                await self.flush()
            except Unavailable as error:
                log.error(
                    "results cannot be made durable; publication stopped",
                    extra={"event": "finalizer_stopped", "error": error.message},
                )
                return
