"""Time sources for the core.

Deadlines and heartbeat expiry are computed from a monotonic clock (seconds, float) so that a
wall-clock step cannot expire every worker at once; wall time (Unix seconds) is only used for
the timestamps that replies show. Tests drive a ManualClock instead of sleeping.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Where the core reads time."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back; only differences mean anything."""
        ...

    def wall(self) -> float:
        """Unix time in seconds, for timestamps shown to callers."""
        ...


class SystemClock:
    """The real clocks of the process."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()


class ManualClock:
    """A clock that moves only when told to, for deterministic tests of expiry."""

    def __init__(self, start_wall: float = 1_700_000_000.0) -> None:
        self._now = 0.0
        self._wall_offset = start_wall

    def monotonic(self) -> float:
        return self._now

    def wall(self) -> float:
        return self._wall_offset + self._now

    def advance(self, seconds: float) -> None:
        """Moves time forward by ``seconds`` (never backwards)."""
        if seconds < 0:
            raise ValueError("a clock does not go backwards")
        self._now += seconds
