"""Turns finished groups into results, in micro-batches, and publishes them in order.

Groups that finish within one short window (``window_s``, a few milliseconds) are reduced in
one vectorized call of the AdvantageReducer over all their rewards, instead of one NumPy call
per group; a batch that reaches ``max_batch`` groups is reduced at once without waiting. Each
result gets the next cursor, in finish order, and then goes to the feed, to the stream whose
reward finished the group, and to listeners (logs, metrics).

The rewards come from the groups' ``RewardArena`` rows, written as each reward was accepted:
a batch of complete groups of one size and estimator (the common case) is one gather of their
rows into a (G, n) matrix and one row-path reduction, with O(1) NumPy calls and no per-group
array. Other batches (several sizes or estimators, partial, dropped or replaced groups) take a
general path with the same numbers. Either way the batch comes out as one ``FinalizedBatch``
of arrays; a ``GroupResult`` per group is built only to publish to per-group consumers (the
feed, streams, journal, listeners), and ``batch_listeners`` get the arrays themselves.

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
from array import array
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
_EMPTY.flags.writeable = False

OUTCOME_CODES: dict[GroupOutcome, int] = {
    GroupOutcome.COMPLETE: 0,
    GroupOutcome.PARTIAL: 1,
    GroupOutcome.DROPPED: 2,
}
"""``FinalizedBatch.outcome`` codes."""
_DROPPED = OUTCOME_CODES[GroupOutcome.DROPPED]


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


@dataclass(frozen=True, slots=True, eq=False)
class FinalizedBatch:
    """One micro-batch of finished groups as arrays: G groups in cursor order, N counted
    rewards in all. Every array is read-only.

    - ``finished``: the G ``FinishedGroup`` records (ids, names, origins), in cursor order.
    - ``cursors``: int64 (G,), consecutive: ``cursors[g] == cursors[0] + g``.
    - ``outcome``: int8 (G,), ``OUTCOME_CODES`` (0 complete, 1 partial, 2 dropped).
    - ``offsets``: int64 (G + 1,), from 0 to N: group g's members are
      ``offsets[g]:offsets[g + 1]`` of the per-member arrays (empty for a group dropped
      without any reward).
    - ``values``: float64 (N,), the counted members' rewards, group-major, members in index
      order (as ``GroupResult.sessions``). Reward units.
    - ``advantages``: float64 (N,), aligned with ``values``; 0.0 for the members of a dropped
      group (it has no advantages: check ``outcome``).
    - ``mean``, ``std``: float64 (G,), reward units (0.0 for a dropped group without rewards).
    - ``degenerate``: bool (G,), from the filter metrics when every counted member gave one,
      else from the rewards (one member, or all equal).
    - ``filter_metrics``: float64 (N,), aligned with ``values``, NaN where none was given.
    - ``has_filter_metrics``: bool (G,), every counted member of the group gave one.
    - ``width``: n when every group has n counted members and the row path was taken, else 0.
    """

    finished: tuple[FinishedGroup, ...]
    cursors: NDArray[np.int64]
    outcome: NDArray[np.int8]
    offsets: NDArray[np.int64]
    values: NDArray[np.float64]
    advantages: NDArray[np.float64]
    mean: NDArray[np.float64]
    std: NDArray[np.float64]
    degenerate: NDArray[np.bool_]
    filter_metrics: NDArray[np.float64]
    has_filter_metrics: NDArray[np.bool_]
    width: int

    def __len__(self) -> int:
        return len(self.finished)

    def member_indices(self) -> NDArray[np.int32]:
        """int32 (N,): the member index (``groups/{id}/sessions/{index}``) of each value."""
        lengths = np.diff(self.offsets)
        indices = np.arange(self.values.shape[0], dtype=np.int64) - np.repeat(
            self.offsets[:-1], lengths
        )
        bounds = self.offsets.tolist()
        for g, f in enumerate(self.finished):
            counted = f.counted
            if counted and counted[-1].index != len(counted) - 1:  # a gap: not 0..n-1
                indices[bounds[g] : bounds[g + 1]] = [s.index for s in counted]
        return indices.astype(np.int32)

    def result(self, g: int) -> GroupResult:
        """Group g as the feed's ``GroupResult`` (its arrays are views into the batch's)."""
        return self.results(g, g + 1)[0]

    def results(self, start: int = 0, stop: int | None = None) -> list[GroupResult]:
        """One ``GroupResult`` per group of ``start:stop``, in cursor order: O(members)
        Python (names of sessions), which is why it is only built for per-group consumers."""
        stop = len(self) if stop is None else stop
        bounds = self.offsets[start : stop + 1].tolist()
        cursors = self.cursors[start:stop].tolist()
        means = self.mean[start:stop].tolist()
        stds = self.std[start:stop].tolist()
        degenerate = self.degenerate[start:stop].tolist()
        has_metrics = self.has_filter_metrics[start:stop].tolist()
        values, advantages, metrics = self.values, self.advantages, self.filter_metrics
        out = []
        for k, f in enumerate(self.finished[start:stop]):
            begin, end = bounds[k], bounds[k + 1]
            group = f.group
            dropped = f.outcome is GroupOutcome.DROPPED
            min_version, max_version = f.versions()
            out.append(
                GroupResult(
                    cursor=cursors[k],
                    group_id=group.group_id,
                    task_id=group.task_id,
                    outcome=f.outcome,
                    group_size=group.size,
                    sessions=tuple(s.name for s in f.counted),
                    rewards=values[begin:end],
                    advantages=_EMPTY if dropped else advantages[begin:end],
                    mean=means[k],
                    std=stds[k],
                    estimator=group.settings.estimator,
                    degenerate=degenerate[k],
                    excluded_sessions=tuple(s.name for s in f.excluded),
                    finalize_time=f.finalize_time,
                    filter_metrics=metrics[begin:end] if has_metrics[k] else _EMPTY,
                    replaced_sessions=tuple(s.name for s in f.excluded if s.replaced_by >= 0),
                    min_version=min_version,
                    max_version=max_version,
                    trainer_version=f.trainer_version,
                    admitted_version=group.admitted_version,
                )
            )
        return out

    def versions(self) -> NDArray[np.uint64]:
        """uint64 (G, 4), per group: min and max policy version of the members that count
        (``FinishedGroup.versions``), the trainer's version at finalization and at admission.
        Built on demand: it reads every member's record (O(members) Python)."""
        rows = [(*f.versions(), f.trainer_version, f.group.admitted_version) for f in self.finished]
        return np.array(rows, dtype=np.uint64).reshape(len(rows), 4)


Listener = Callable[[GroupResult, GroupRecord], None]
BatchListener = Callable[[FinalizedBatch], None]


def _own_params(finished: FinishedGroup) -> EstimatorParams:
    """The estimator a finished group is reduced with: its own, except that a dropped group
    never joins the batch of a batch-std reduction."""
    params = finished.group.settings.estimator
    if finished.outcome is GroupOutcome.DROPPED and params.batch_std:
        return dataclasses.replace(params, batch_std=False)
    return params


def _metric_flags(
    metrics: NDArray[np.float64], offsets: NDArray[np.int64]
) -> tuple[NDArray[np.bool_], NDArray[np.bool_]]:
    """Per group (G,): every member gave a metric; and all the metrics are equal."""
    n_groups = offsets.shape[0] - 1
    has = np.zeros(n_groups, dtype=np.bool_)
    equal = np.zeros(n_groups, dtype=np.bool_)
    lengths = np.diff(offsets)
    nonempty = np.flatnonzero(lengths > 0)
    if nonempty.size == 0:
        return has, equal
    starts = offsets[:-1][nonempty]
    segment = np.repeat(np.arange(nonempty.size), lengths[nonempty])
    has[nonempty] = np.logical_and.reduceat(np.isfinite(metrics), starts)
    differs = metrics != metrics[starts][segment]
    equal[nonempty] = ~np.logical_or.reduceat(differs, starts)
    return has, equal


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
        self.batch_listeners: list[BatchListener] = []
        """Called with each batch once all its results are published (durable)."""
        self.batches = 0
        """How many micro-batches were reduced (for metrics and tests)."""
        self.degenerate = 0
        """How many finalized (not dropped) groups were degenerate (for metrics)."""
        self._pending: list[FinishedGroup] = []
        self._keys = array("q")
        """Per queued group: its ``reduce_key`` when complete without replacements, else -1."""
        self._rows = array("q")
        """Per queued group: its arena row (-1 without one); an array, so that the batch
        reads it as an index array without converting an int per group."""
        self._metric_groups = 0
        """Queued groups with at least one filter metric."""
        self._wake = asyncio.Event()
        self._unpublished: deque[tuple[GroupResult, FinishedGroup]] = deque()
        """Journaled results waiting for durability, in cursor order."""
        self._unpublished_batches: deque[tuple[int, FinalizedBatch]] = deque()
        """Journaled batches and the journaled count at their end."""
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
        group = finished.group
        self._pending.append(finished)
        regular = finished.outcome is GroupOutcome.COMPLETE and not group.replaced
        self._keys.append(group.reduce_key if regular else -1)
        self._rows.append(group.arena_row if group.arena is not None else -1)
        if group.with_metrics:
            self._metric_groups += 1
        self._wake.set()

    def reduce_queued(self) -> FinalizedBatch | None:
        """The array half of ``drain``: reduces everything queued now and gives the groups
        their cursors, without publishing anything; None when nothing is queued.

        ``drain()`` is ``publish(reduce_queued())``. A batch taken here must be handed to
        ``publish`` before the next one is reduced, or its cursors are given out again."""
        finished, self._pending = self._pending, []
        keys, self._keys = self._keys, array("q")
        rows, self._rows = self._rows, array("q")
        with_metrics, self._metric_groups = self._metric_groups, 0
        if not finished:
            return None
        self.batches += 1
        first = self.feed.next_cursor() + len(self._unpublished)
        cursors = np.arange(first, first + len(finished), dtype=np.int64)
        head = keys[0]
        if head >= 0 and keys.count(head) == len(keys):
            batch = self._reduce_uniform(tuple(finished), rows, cursors, with_metrics > 0)
        else:
            batch = self._reduce_general(tuple(finished), keys, rows, cursors)
        arrays: tuple[NDArray[np.generic], ...] = (
            batch.cursors,
            batch.outcome,
            batch.offsets,
            batch.values,
            batch.advantages,
            batch.mean,
            batch.std,
            batch.degenerate,
            batch.filter_metrics,
            batch.has_filter_metrics,
        )
        for column in arrays:
            if column.flags.writeable:
                column.flags.writeable = False
        self.degenerate += int(np.count_nonzero(batch.degenerate & (batch.outcome != _DROPPED)))
        return batch

    def _reduce_uniform(
        self,
        finished: tuple[FinishedGroup, ...],
        rows: array[int],
        cursors: NDArray[np.int64],
        with_metrics: bool,
    ) -> FinalizedBatch:
        """Complete groups of one size and estimator: one gather, one row-path reduction."""
        group = finished[0].group
        arena = group.arena
        assert arena is not None  # a reduce_key is only given with an arena row
        at = np.frombuffer(rows, dtype=np.int64).astype(np.intp, copy=False)
        matrix = arena.values[at]
        reduced = self.reducer.reduce_matrix(matrix, group.settings.estimator)
        n_groups, n = matrix.shape
        degenerate = reduced.degenerate
        if with_metrics:
            metrics = arena.metrics[at]
            has = np.asarray(np.isfinite(metrics).all(axis=1))
            equal = (metrics == metrics[:, :1]).all(axis=1)
            degenerate = np.where(has, equal, degenerate)
            flat_metrics = metrics.reshape(-1)
        else:
            has = np.zeros(n_groups, dtype=np.bool_)
            # No metric anywhere: one NaN seen N times (read-only, no 8 bytes per member).
            flat_metrics = np.broadcast_to(np.float64(np.nan), (n_groups * n,))
        arena.release(at)
        return FinalizedBatch(
            finished=finished,
            cursors=cursors,
            outcome=np.zeros(n_groups, dtype=np.int8),
            offsets=reduced.offsets,
            values=reduced.values,
            advantages=reduced.advantages,
            mean=reduced.mean,
            std=reduced.std,
            degenerate=np.array(degenerate, dtype=np.bool_),
            filter_metrics=flat_metrics,
            has_filter_metrics=has,
            width=n,
        )

    def _reduce_general(
        self,
        finished: tuple[FinishedGroup, ...],
        keys: array[int],
        rows: array[int],
        cursors: NDArray[np.int64],
    ) -> FinalizedBatch:
        """Any batch: regular groups gathered per arena, the others read from their records;
        then one reduction per estimator params (what ``batch_std`` spans)."""
        n_groups = len(finished)
        lengths = np.fromiter((len(f.counted) for f in finished), dtype=np.int64, count=n_groups)
        offsets = np.zeros(n_groups + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = np.empty(int(offsets[-1]), dtype=np.float64)
        metrics = np.full(values.shape[0], np.nan)
        regular: dict[int, list[int]] = {}
        for g, key in enumerate(keys):
            if key >= 0:
                regular.setdefault(key, []).append(g)
            else:
                f = finished[g]
                start, end = int(offsets[g]), int(offsets[g + 1])
                values[start:end] = [s.reward for s in f.counted]
                metrics[start:end] = [
                    np.nan if s.filter_metric is None else s.filter_metric for s in f.counted
                ]
                arena = f.group.arena
                if arena is not None and rows[g] >= 0:
                    arena.release(np.array([rows[g]], dtype=np.intp))
        for positions in regular.values():
            arena = finished[positions[0]].group.arena
            assert arena is not None
            at = np.array([rows[g] for g in positions], dtype=np.intp)
            dest = (offsets[positions][:, None] + np.arange(arena.width)).reshape(-1)
            values[dest] = arena.values[at].reshape(-1)
            metrics[dest] = arena.metrics[at].reshape(-1)
            arena.release(at)

        advantages = np.zeros(values.shape[0], dtype=np.float64)
        mean = np.zeros(n_groups, dtype=np.float64)
        std = np.zeros(n_groups, dtype=np.float64)
        degenerate = np.ones(n_groups, dtype=np.bool_)
        by_params: dict[EstimatorParams, list[int]] = {}
        for g, f in enumerate(finished):
            if f.counted:
                by_params.setdefault(_own_params(f), []).append(g)
        for params, positions in by_params.items():
            if len(positions) == n_groups:
                reduced = self.reducer.reduce_segments(values, offsets, params)
                advantages[:] = reduced.advantages
                mean[:], std[:], degenerate[:] = reduced.mean, reduced.std, reduced.degenerate
                continue
            at = np.array(positions, dtype=np.intp)
            sub_lengths = lengths[at]
            sub_offsets = np.zeros(at.shape[0] + 1, dtype=np.int64)
            np.cumsum(sub_lengths, out=sub_offsets[1:])
            source = np.repeat(offsets[at] - sub_offsets[:-1], sub_lengths) + np.arange(
                sub_offsets[-1]
            )
            reduced = self.reducer.reduce_segments(values[source], sub_offsets, params)
            advantages[source] = reduced.advantages
            mean[at], std[at], degenerate[at] = reduced.mean, reduced.std, reduced.degenerate
        outcome = np.fromiter(
            (OUTCOME_CODES[f.outcome] for f in finished), dtype=np.int8, count=n_groups
        )
        dropped_members = np.repeat(outcome == _DROPPED, lengths)
        advantages[dropped_members] = 0.0
        has, equal = _metric_flags(metrics, offsets)
        return FinalizedBatch(
            finished=finished,
            cursors=cursors,
            outcome=outcome,
            offsets=offsets,
            values=values,
            advantages=advantages,
            mean=mean,
            std=std,
            degenerate=np.where(has, equal | (lengths <= 1), degenerate),
            filter_metrics=metrics,
            has_filter_metrics=has,
            width=0,
        )

    def publish(self, batch: FinalizedBatch | None) -> list[GroupResult]:
        """Hands a reduced batch on: without a journal, to the feed, streams and listeners at
        once; with one, to the journal first (``flush`` publishes once durable). Returns the
        batch's results."""
        if batch is None:
            return []
        results = batch.results()
        if self.journal is None:
            for result, finished in zip(results, batch.finished, strict=True):
                self._publish(result, finished)
            for listener in self.batch_listeners:
                listener(batch)
            return results
        for result, finished in zip(results, batch.finished, strict=True):
            self.journal.append(
                GroupFinalized(
                    finished.group.seq,
                    result,
                    tuple(s.index for s in finished.counted),
                    tuple(s.index for s in finished.excluded),
                    tuple(s.index for s in finished.excluded if s.replaced_by >= 0),
                )
            )
            self._unpublished.append((result, finished))
        self._journaled += len(results)
        self._unpublished_batches.append((self._journaled, batch))
        self._wake.set()  # the run loop waits for durability and publishes them
        return results

    def drain(self) -> list[GroupResult]:
        """Reduces everything queued now, in one vectorized call, and gives each result its
        cursor. Without a journal the results are published at once; with one they are
        journaled and wait for ``flush()``."""
        return self.publish(self.reduce_queued())

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
                while self._unpublished_batches and (
                    self._unpublished_batches[0][0] <= self._published
                ):
                    _, batch = self._unpublished_batches.popleft()
                    for listener in self.batch_listeners:
                        listener(batch)
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
