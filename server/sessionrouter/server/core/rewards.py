"""What can happen to one submitted reward.

Each entry of a SubmitRewards request gets exactly one of these; only ACCEPTED changes state,
so a bad entry can never corrupt a group nor end the stream it came on.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class RewardStatus(enum.Enum):
    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"
    """The same reward again: a no-op, so that client retries are safe."""
    CONFLICT = "conflict"
    """A different reward for a session that has one: refused, the first one stands."""
    UNKNOWN_SESSION = "unknown_session"
    NOT_FINITE = "not_finite"
    SESSION_ABORTED = "session_aborted"
    GROUP_CLOSED = "group_closed"
    """The group was finalized or dropped without this session."""
    INVALID_VERSIONS = "invalid_versions"
    """min_version above max_version."""
    WRONG_SHARD = "wrong_shard"
    """The session's group belongs to another shard (sharded routers): send it there."""


@dataclass(frozen=True, slots=True)
class RewardOutcome:
    status: RewardStatus
    detail: str = ""
    owner_shard: int | None = None
    """WRONG_SHARD: the shard that owns the session's group."""
    owner_address: str = ""
    """WRONG_SHARD: that shard's advertised address, when known."""


ACCEPTED = RewardOutcome(RewardStatus.ACCEPTED)
