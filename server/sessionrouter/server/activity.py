"""One info line now and then that sums up what the router did, instead of a line per group.

At the default level nothing is logged per reward or per finished group (a JSON line per
group cost about a quarter of the event loop's time under a reward load); a complete group is
logged at debug, and groups that ended partial or dropped, refusals and worker changes stay at
info or warning. What an operator watching the logs still wants to see, that the router is
busy and how, is this ``activity`` line: the sessions, rewards (by status) and finished groups
(by outcome) since the previous line, and the open groups and sessions now. A router with
nothing new since the previous line stays silent.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from sessionrouter.server.core.settings import RouterSnapshot

log = logging.getLogger("sessionrouter.activity")

__all__ = ["ActivityLog"]


class ActivityLog:
    """Differences between successive router snapshots, logged as one ``activity`` line."""

    def __init__(self, interval_s: float) -> None:
        """``interval_s``: seconds between lines at most (0 or less: never, but ``flush``)."""
        self.interval_s = interval_s
        self._last: RouterSnapshot | None = None
        self._since = time.monotonic()

    def due(self) -> bool:
        return self.interval_s > 0 and time.monotonic() - self._since >= self.interval_s

    def start(self, snapshot: RouterSnapshot) -> None:
        """What the router holds when it starts serving (a recovered journal's totals are not
        activity of this run)."""
        self._last, self._since = snapshot, time.monotonic()

    def flush(self, snapshot: RouterSnapshot) -> dict[str, Any] | None:
        """Logs what changed since the previous line (or ``start``), if anything did; returns
        the fields logged, None when nothing changed."""
        now = time.monotonic()
        fields = activity_fields(self._last, snapshot)
        if fields is not None:
            fields["interval_s"] = round(now - self._since, 3)
            log.info("activity", extra={"event": "activity", **fields})
        self._last, self._since = snapshot, now
        return fields


def _deltas(before: dict[Any, int], after: dict[Any, int]) -> dict[str, int]:
    """Per key (an enum: its value), how much ``after`` grew over ``before``; keys that did
    not grow are left out."""
    grown = {key: count - before.get(key, 0) for key, count in after.items()}
    return {key.value: n for key, n in sorted(grown.items(), key=lambda kv: kv[0].value) if n}


def activity_fields(before: RouterSnapshot | None, after: RouterSnapshot) -> dict[str, Any] | None:
    """The ``activity`` line's fields from two snapshots; None when nothing happened."""
    sessions = after.sessions_distinct + after.sessions_shared
    rewards = _deltas(before.rewards if before else {}, after.rewards)
    groups = _deltas(before.groups_finished if before else {}, after.groups_finished)
    started = sessions - (before.sessions_distinct + before.sessions_shared if before else 0)
    batches = after.reducer_batches - (before.reducer_batches if before else 0)
    if not (started or rewards or groups):
        return None
    return {
        "sessions_started": started,
        "rewards": rewards,
        "groups_finished": groups,
        "reducer_batches": batches,
        "open_groups": after.open_groups,
        "open_sessions": after.open_sessions,
        "feed_cursor": after.feed_cursor,
        "workers_healthy": after.workers_healthy,
    }
