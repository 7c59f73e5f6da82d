"""The completed-group feed: every finalized or dropped group, in order, with a cursor.

Cursors start at 1 and grow by one per group with no gaps, so a trainer that remembers the
last cursor it processed can resume after a disconnect and miss nothing, receive nothing twice.
The feed keeps the newest ``retention`` results in memory; subscribers read slices of it, so a
slow subscriber costs no memory of its own (gRPC flow control holds it back) and many
subscribers share one copy.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from sessionrouter.server.core.errors import OutOfRange
from sessionrouter.server.core.estimators import EstimatorParams
from sessionrouter.server.core.sizes import result_bytes

_NO_METRICS = np.zeros(0, dtype=np.float64)


class GroupOutcome(enum.Enum):
    COMPLETE = "complete"
    """Every member has a reward."""
    PARTIAL = "partial"
    """Finalized without some members, with at least min_members rewarded."""
    DROPPED = "dropped"
    """Too few rewarded members: no advantages."""


@dataclass(frozen=True, slots=True, eq=False)
class GroupResult:
    """A finalized group as trainers consume it.

    ``sessions``, ``rewards`` and ``advantages`` are aligned, shape (n,) for the n members
    that count; ``advantages`` is empty for a dropped group.
    """

    cursor: int
    group_id: str
    task_id: str
    outcome: GroupOutcome
    group_size: int
    sessions: tuple[str, ...]
    rewards: NDArray[np.float64]
    advantages: NDArray[np.float64]
    mean: float
    std: float
    estimator: EstimatorParams
    degenerate: bool
    excluded_sessions: tuple[str, ...]
    finalize_time: float
    """Unix seconds."""
    filter_metrics: NDArray[np.float64] = field(default_factory=lambda: _NO_METRICS)
    """(n,) aligned with ``sessions`` when every counted member gave one; else (0,)."""
    replaced_sessions: tuple[str, ...] = ()
    """Members replaced by another (``replace_lost``); also in ``excluded_sessions``."""
    min_version: int = 0
    """Oldest and newest policy versions of the members that count (of all members when
    none counts); 0 when unknown."""
    max_version: int = 0
    trainer_version: int = 0
    """The trainer's version at finalization."""
    admitted_version: int = 0
    """The trainer's version when the group was admitted."""


@dataclass(slots=True, eq=False)
class Subscription:
    """One live subscriber of the feed, for the lag metrics: ``cursor`` is the newest group
    handed to its stream (written by the stream's handler after each message)."""

    subscription_id: int
    peer: str
    cursor: int


def _result_bytes(result: GroupResult) -> int:
    members = len(result.sessions) + len(result.excluded_sessions) + len(result.replaced_sessions)
    return result_bytes(members, len(result.group_id), len(result.task_id))


class GroupFeed:
    """Ordered, bounded, resumable log of group results."""

    def __init__(self, retention: int, last_cursor: int = 0, bytes_limit: int = 1 << 62) -> None:
        if retention < 1:
            raise ValueError("feed retention must be at least 1")
        self.retention = retention
        self.bytes_limit = bytes_limit
        """Wire-size estimate of the results kept, at most: beyond it the oldest go, as
        beyond ``retention`` (the newest result always stays)."""
        self.retained_bytes = 0
        self._items: list[GroupResult] = []
        self._sizes: list[int] = []
        self._first = last_cursor + 1
        """Cursor of _items[0]."""
        self._changed = asyncio.Event()
        self._closed = False
        self.subscriptions: dict[int, Subscription] = {}
        """Live subscribers by id (``subscribe``/``unsubscribe``)."""
        self._subscription_ids = 0

    @property
    def last_cursor(self) -> int:
        """Cursor of the newest result; 0 before the first."""
        return self._first + len(self._items) - 1

    @property
    def oldest_cursor(self) -> int:
        """Cursor of the oldest retained result (last_cursor + 1 when empty)."""
        return self._first

    @property
    def closed(self) -> bool:
        return self._closed

    def next_cursor(self) -> int:
        return self.last_cursor + 1

    def publish(self, result: GroupResult) -> None:
        """Appends a result (its cursor must be next_cursor()) and wakes subscribers."""
        if result.cursor != self.next_cursor():
            raise ValueError(f"cursor {result.cursor} published out of order")
        self._items.append(result)
        size = _result_bytes(result)
        self._sizes.append(size)
        self.retained_bytes += size
        excess = len(self._items) - self.retention
        if excess >= max(1, self.retention // 8):
            # Evict in chunks so that appends stay O(1) amortised.
            self._evict(excess)
        if self.retained_bytes > self.bytes_limit:
            self._evict_to_bytes()
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def restore(self, results: list[GroupResult], last_cursor: int) -> None:
        """Refills an empty feed from a journal: ``results`` in cursor order, contiguous and
        ending at ``last_cursor`` (or empty, when every group was compacted away), so cursors
        continue where the previous process stopped. Only the newest ``retention`` are kept."""
        if self._items or self.last_cursor != 0:
            raise ValueError("only an empty feed can be restored")
        kept = results[-self.retention :]
        cursors = [r.cursor for r in kept]
        first = cursors[0] if cursors else last_cursor + 1
        if cursors != list(range(first, last_cursor + 1)):
            raise ValueError(f"restored cursors are not a contiguous run ending at {last_cursor}")
        self._items = list(kept)
        self._sizes = [_result_bytes(r) for r in kept]
        self.retained_bytes = sum(self._sizes)
        self._first = first
        if self.retained_bytes > self.bytes_limit:
            self._evict_to_bytes()

    def _evict(self, count: int) -> None:
        self.retained_bytes -= sum(self._sizes[:count])
        del self._items[:count]
        del self._sizes[:count]
        self._first += count

    def _evict_to_bytes(self) -> None:
        """Evicts the oldest results down to 7/8 of the byte limit (in one chunk, so that
        appends stay O(1) amortised), keeping at least the newest."""
        target = self.bytes_limit - self.bytes_limit // 8
        total, count = self.retained_bytes, 0
        while total > target and count < len(self._sizes) - 1:
            total -= self._sizes[count]
            count += 1
        self._evict(count)

    def start_after(self, cursor: int) -> int:
        """The cursor a subscription asking for the groups after ``cursor`` starts after.

        0 means "from the oldest retained group", whatever was evicted before it, so it
        becomes the cursor just before that group; any other cursor stays as it is.
        """
        return self._first - 1 if cursor == 0 else cursor

    def read_after(self, cursor: int, limit: int) -> list[GroupResult]:
        """Up to ``limit`` results with cursors greater than ``cursor``.

        0 reads from the oldest retained result (``start_after``). A cursor beyond the newest
        is OutOfRange (the router lost its feed, e.g. restarted without a journal, and the
        trainer must know); so is one whose successor was evicted.
        """
        cursor = self.start_after(cursor)
        if cursor > self.last_cursor:
            raise OutOfRange(
                "CURSOR_AHEAD_OF_FEED",
                f"cursor {cursor} is beyond the newest group ({self.last_cursor})",
                metadata={"cursor": cursor, "last_cursor": self.last_cursor},
            )
        if cursor + 1 < self._first:
            raise OutOfRange(
                "CURSOR_EXPIRED",
                f"groups after cursor {cursor} are no longer retained; the oldest retained"
                f" cursor is {self._first}",
                metadata={"cursor": cursor, "oldest_cursor": self._first},
            )
        start = cursor + 1 - self._first
        return self._items[start : start + limit]

    def read_fresh_after(
        self, cursor: int, limit: int, min_version: int
    ) -> tuple[list[GroupResult], int, int]:
        """Like ``read_after``, leaving out groups whose ``min_version`` is below
        ``min_version``: returns (results, how many were skipped, the last cursor covered,
        skipped ones included; ``cursor`` when nothing was read)."""
        read = self.read_after(cursor, limit)
        if not read:
            return [], 0, cursor
        if not min_version:
            return read, 0, read[-1].cursor
        fresh = [r for r in read if r.min_version >= min_version]
        return fresh, len(read) - len(fresh), read[-1].cursor

    async def wait_beyond(self, cursor: int) -> bool:
        """Waits until a result with a cursor greater than ``cursor`` exists; False when the
        feed closed first."""
        while self.last_cursor <= cursor:
            if self._closed:
                return False
            await self._changed.wait()
        return True

    def subscribe(self, peer: str, cursor: int) -> Subscription:
        """Tracks a subscriber reading after ``cursor`` until ``unsubscribe``."""
        self._subscription_ids += 1
        sub = Subscription(self._subscription_ids, peer, cursor)
        self.subscriptions[sub.subscription_id] = sub
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self.subscriptions.pop(sub.subscription_id, None)

    def lags(self) -> list[tuple[Subscription, int]]:
        """Each live subscriber and how many published groups it has not been sent yet."""
        last = self.last_cursor
        return [(sub, max(0, last - sub.cursor)) for sub in self.subscriptions.values()]

    def close(self) -> None:
        """Wakes every subscriber so that it ends its stream (graceful shutdown)."""
        self._closed = True
        self._changed.set()
