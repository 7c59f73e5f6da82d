"""The values the client takes and returns: frozen dataclasses and enums, no protobuf.

Conventions, so that a trainer never has to guess:

- Durations inside values (``GroupOptions.deadline``, ``RegisterWorkerResult.heartbeat_timeout``)
  are ``datetime.timedelta``; timestamps are timezone-aware UTC ``datetime``, or ``None`` when the
  server left them unset. Call timeouts and backoffs elsewhere in the client are ``float``
  seconds, as in ``grpc`` itself.
- Sequences are tuples, so values stay immutable and comparable. ``GroupResult`` keeps rewards
  and advantages as ``tuple[float, ...]`` (float64, exact wire values) and offers
  ``rewards_array`` / ``advantages_array`` for NumPy: arrays inside a frozen dataclass would
  break ``==`` and ``hash``, and most trainers copy into a tensor anyway.
- Maps (labels, metadata) are plain ``dict`` typed as ``Mapping``: treat them as read-only.
  A value holding one is not hashable.
- Enum values equal the proto numbers. ``UNSPECIFIED`` stands for "unset", and also for a value
  added to the proto after this client was built, so an older client never crashes on a newer
  server.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Generic, TypeVar

import numpy as np
import numpy.typing as npt

__all__ = [
    "DeregisterWorkerResult",
    "EstimatorConfig",
    "Group",
    "GroupOptions",
    "GroupOutcome",
    "GroupResult",
    "GroupState",
    "Page",
    "PlacementMode",
    "RegisterWorkerResult",
    "Replacement",
    "ResultBatch",
    "RewardAckBatch",
    "RewardResult",
    "RewardStatus",
    "Session",
    "SessionState",
    "StalenessPolicy",
    "StartGroupResult",
    "StartSessionResult",
    "SubmitRewardsResult",
    "TrainerState",
    "WeightUpdate",
    "Worker",
    "WorkerHealth",
]

T = TypeVar("T")
_E = TypeVar("_E", bound=enum.Enum)


class WorkerHealth(enum.Enum):
    """Health of a worker as the router sees it from its heartbeats."""

    UNSPECIFIED = 0
    HEALTHY = 1
    """Heartbeats arrive in time; the worker takes new sessions unless draining."""
    UNHEALTHY = 2
    """No heartbeat within the timeout, or deregistered: no new sessions."""


class SessionState(enum.Enum):
    """Life cycle of a session."""

    UNSPECIFIED = 0
    OPEN = 1
    """Placed and running; holds a worker slot until rewarded or aborted."""
    REWARDED = 2
    ABORTED = 3
    """Ended early; left out of its group's statistics."""


class GroupState(enum.Enum):
    """Life cycle of a group."""

    UNSPECIFIED = 0
    OPEN = 1
    FINALIZED = 2
    """Advantages computed and on the feed."""
    DROPPED = 3
    """Too few rewarded members when it ended: no advantages."""


class GroupOutcome(enum.Enum):
    """How a group ended."""

    UNSPECIFIED = 0
    COMPLETE = 1
    """Every member has a reward."""
    PARTIAL = 2
    """Some members left out (aborted, worker lost, no reward by the deadline)."""
    DROPPED = 3
    """Fewer than ``min_members`` rewarded members: ``advantages`` is empty."""


class RewardStatus(enum.Enum):
    """What happened to one submitted reward."""

    UNSPECIFIED = 0
    ACCEPTED = 1
    DUPLICATE = 2
    """The same reward was already recorded: nothing changed (so a resubmission is safe)."""
    CONFLICT = 3
    """Another reward is recorded for this session: nothing changed."""
    UNKNOWN_SESSION = 4
    NOT_FINITE = 5
    SESSION_ABORTED = 6
    GROUP_CLOSED = 7
    INVALID_VERSIONS = 8
    """min_version above max_version: refused."""
    WRONG_SHARD = 9
    """Sharded routers: the session's group is another shard's (``RewardResult.owner_shard``);
    the sharded client resends such an entry to its owner once."""


class PlacementMode(enum.Enum):
    """Where members of a group may go when workers are scarce; ``None`` means server default."""

    SPREAD = 1
    """Distinct workers while possible, then some workers take a second member, evenly."""
    STRICT = 2
    """Distinct workers or ``ResourceExhaustedError``."""
    PACK = 3
    """Together on one worker up to a cap (``GroupOptions.max_members_per_worker``, or the
    fair share), then the next least-loaded, so a shared prompt prefix is prefilled once."""


@dataclass(frozen=True, slots=True)
class Worker:
    """An inference worker and its current load."""

    worker_id: str
    address: str
    capacity: int
    """Sessions the worker runs at once."""
    labels: Mapping[str, str] = field(default_factory=dict)
    health: WorkerHealth = WorkerHealth.UNSPECIFIED
    draining: bool = False
    open_sessions: int = 0
    """Sessions placed here that have neither a reward nor an abort yet."""
    last_heartbeat_time: datetime | None = None
    policy_version: int = 0
    """The policy (weight) version the worker serves; 0 is unknown."""
    updating_to_version: int = 0
    """Non-zero while the worker is in a weight update to this version (no new sessions)."""
    shard_capacity: int = 0
    """Sharded routers: the slots of ``capacity`` the answering shard may fill (0 otherwise)."""
    cluster_open_sessions: int = 0
    """Sharded routers: open sessions on this worker over every shard, about a second old;
    ``open_sessions`` is then the answering shard's own."""


@dataclass(frozen=True, slots=True)
class RegisterWorkerResult:
    worker: Worker
    heartbeat_timeout: timedelta
    """Heartbeat more often than this, or the worker turns unhealthy."""


@dataclass(frozen=True, slots=True)
class DeregisterWorkerResult:
    worker: Worker
    """The worker as it was when removed."""
    lost_sessions: int
    """Open sessions that were marked ``worker_lost``."""


@dataclass(frozen=True, slots=True)
class Session:
    """One rollout, member of exactly one group. ``name`` is ``groups/{group_id}/sessions/{i}``."""

    name: str
    group_id: str
    index: int
    """Position in the group, 0 to group_size - 1, in order of joining."""
    task_id: str
    worker_id: str
    worker_address: str
    """Where to send this session's generation requests."""
    state: SessionState = SessionState.UNSPECIFIED
    worker_lost: bool = False
    reward: float | None = None
    """The accepted reward, set once the state is ``REWARDED``."""
    metadata: Mapping[str, str] = field(default_factory=dict)
    request_id: str = ""
    create_time: datetime | None = None
    shares_worker: bool = False
    """True when another member of the group runs on the same worker (before or after)."""
    filter_metric: float | None = None
    """The raw task outcome given with the reward, if any."""
    replaces: str = ""
    """On a replacement member: the name of the member it replaces."""
    replaced_by: str = ""
    """On a replaced (hence aborted) member: the name of its replacement."""
    start_version: int = 0
    """The worker's policy version when the session was placed (0: unknown)."""
    min_version: int = 0
    """Oldest and newest policy versions the generation used (from the reward entry, else
    ``start_version``)."""
    max_version: int = 0
    interrupted: bool = False
    """A weight update of the worker asked for its open sessions to be reported interrupted."""
    handle: int = 0
    """A number naming this session for rewards in array form (``submit_arrays``): resolved
    without parsing a name, stable across restarts of a router with a journal; 0 from a
    router too old to give one."""


@dataclass(frozen=True, slots=True)
class EstimatorConfig:
    """How advantages are computed; ``None`` fields take the server's defaults.

    ``name`` is ``"grpo"`` ((r - mean) / (std + eps)), ``"dr_grpo"`` (r - mean) or ``"rloo"``
    (r minus the mean of the others). ``eps`` is added to the std (grpo). ``ddof`` is 1 for the
    sample std (what most trainers use), 0 for the population std. ``batch_std`` divides by the
    std of the whole reduction micro-batch instead of the group's own (grpo).
    """

    name: str | None = None
    eps: float | None = None
    ddof: int | None = None
    batch_std: bool | None = None


@dataclass(frozen=True, slots=True)
class GroupOptions:
    """Per-group settings, fixed by the call that creates the group; ``None`` = server default.

    ``deadline`` runs from group creation: an incomplete group is then finalized as partial
    (if at least ``min_members`` members have rewards) or dropped. At most 24 hours.
    """

    estimator: EstimatorConfig | None = None
    deadline: timedelta | None = None
    min_members: int | None = None
    max_members_per_worker: int | None = None
    """PACK only: the most members on one worker; ``None`` is the fair share."""
    selector: Mapping[str, str] = field(default_factory=dict)
    """Labels a worker must all carry to take members of the group; empty: any worker."""
    replace_lost: bool = False
    """Start a replacement member when a member's worker is lost (or it is aborted as
    retryable)."""


@dataclass(frozen=True, slots=True)
class Group:
    """A group of sessions answering one task (the N samples of one GRPO prompt)."""

    group_id: str
    name: str
    task_id: str
    group_size: int
    state: GroupState = GroupState.UNSPECIFIED
    members: tuple[Session, ...] = ()
    """Members that joined so far, in index order; empty in ``list_groups`` pages."""
    options: GroupOptions = GroupOptions()
    """Options in force, with the server's defaults filled in."""
    create_time: datetime | None = None
    deadline_time: datetime | None = None
    cursor: int = 0
    """Position of this group's result on the feed; 0 while the group is open."""
    distinct_workers: int = 0
    """How many workers the members were placed on."""
    shared_worker: bool = False
    """True when at least two members share a worker (``Session.shares_worker`` says which)."""
    admitted_trainer_version: int = 0
    """The trainer's version when the group was admitted."""


@dataclass(frozen=True, slots=True)
class StartSessionResult:
    session: Session
    group_size: int
    group_created: bool
    """True when this call created the group."""
    shared_worker: bool
    """True when the session shares its worker with another member (too few workers)."""
    replayed: bool
    """True when the server answered an earlier call with the same request id."""


@dataclass(frozen=True, slots=True)
class StartGroupResult:
    group: Group
    shared_worker: bool
    replayed: bool

    @property
    def group_id(self) -> str:
        return self.group.group_id

    @property
    def sessions(self) -> tuple[Session, ...]:
        """All members, in index order (StartGroup places every member in one round trip)."""
        return self.group.members


@dataclass(frozen=True, slots=True)
class GroupResult:
    """A finalized (or dropped) group as a trainer consumes it.

    ``sessions``, ``rewards`` and ``advantages`` are aligned, entry i of each about the same
    session, shape (n,) with n the members that count; ``advantages`` is empty when the
    outcome is ``DROPPED``. ``std`` uses the estimator's ddof and is 0 for one member.
    ``degenerate`` means the advantages are exactly zero (one member, or all rewards equal),
    so a trainer can filter such groups as DAPO does.
    """

    cursor: int
    """Position on the completed-group feed: from 1, strictly increasing, no gaps."""
    group_id: str
    task_id: str
    outcome: GroupOutcome
    group_size: int
    sessions: tuple[str, ...]
    rewards: tuple[float, ...]
    advantages: tuple[float, ...]
    mean: float
    std: float
    estimator: EstimatorConfig
    degenerate: bool
    excluded_sessions: tuple[str, ...] = ()
    """Members that do not count: aborted, or without a reward when the group ended."""
    finalize_time: datetime | None = None
    filter_metrics: tuple[float, ...] = ()
    """Aligned with ``sessions`` when every counted member's reward carried a filter metric
    (``degenerate`` then means those are all equal); else empty."""
    replaced_sessions: tuple[str, ...] = ()
    """Members replaced by another (``replace_lost``); also in ``excluded_sessions``."""
    min_version: int = 0
    """Oldest and newest policy versions of the members that count; 0 when unknown. The
    group's staleness for a trainer at version v is ``v - min_version``."""
    max_version: int = 0
    trainer_version: int = 0
    """The trainer's version when the group was finalized."""
    admitted_trainer_version: int = 0
    """The trainer's version when the group was admitted."""
    shard: int = 0
    """Sharded routers: the shard that owns the group (0 for a single router). On the feed
    of a sharded router ``cursor`` is the merged feed's; on a reward stream, the shard's own."""

    @property
    def rewards_array(self) -> npt.NDArray[np.float64]:
        """A fresh float64 array of shape (n,)."""
        return np.asarray(self.rewards, dtype=np.float64)

    @property
    def advantages_array(self) -> npt.NDArray[np.float64]:
        """A fresh float64 array of shape (n,), or (0,) for a dropped group."""
        return np.asarray(self.advantages, dtype=np.float64)


@dataclass(frozen=True, slots=True)
class Replacement:
    """A member of a ``replace_lost`` group was replaced by a new, placed and open member.

    The router sends this to every open reward stream; whoever runs the group runs
    ``session`` (on ``session.worker_address``) in place of ``replaced_session``.
    """

    group_id: str
    replaced_session: str
    """The name of the member replaced (now aborted)."""
    session: Session
    """The new member."""
    reason: str = ""
    """Why: ``"worker_lost"`` or ``"aborted"`` (a retryable abort)."""


@dataclass(frozen=True, slots=True)
class RewardResult:
    """What the router did with one submitted reward."""

    status: RewardStatus
    detail: str = ""
    """Human-readable explanation for any status but ``ACCEPTED``."""
    owner_shard: int | None = None
    """``WRONG_SHARD``: the shard that owns the session's group."""
    owner_address: str = ""
    """``WRONG_SHARD``: that shard's address, when the router knows it."""

    @property
    def ok(self) -> bool:
        """True when the reward is recorded: accepted now, or the same value was already."""
        return self.status in (RewardStatus.ACCEPTED, RewardStatus.DUPLICATE)


@dataclass(frozen=True, slots=True)
class SubmitRewardsResult:
    """The answer to a one-shot ``submit_rewards`` call."""

    results: tuple[RewardResult, ...]
    """``results[i]`` is about the i-th submitted entry."""
    group_results: tuple[GroupResult, ...]
    """Groups that these rewards finalized (they are on the feed as well)."""


@dataclass(frozen=True, slots=True)
class Page(Generic[T]):
    """One page of a listing. Pass ``next_page_token`` back for the next; empty on the last."""

    items: tuple[T, ...]
    next_page_token: str


@dataclass(frozen=True, slots=True)
class StalenessPolicy:
    """Admit a new group only while groups in flight stay within
    ``(version + max_staleness + 1) * batch_size`` (AReaL's rule); ``batch_size`` >= 1."""

    max_staleness: int
    batch_size: int


@dataclass(frozen=True, slots=True)
class TrainerState:
    """The trainer's version and staleness policy as the router holds them."""

    version: int = 0
    policy: StalenessPolicy | None = None
    refuse_mixed_versions: bool = False
    groups_started: int = 0
    groups_dropped: int = 0
    admission_limit: int = 0
    """``(version + k + 1) * B``; 0 without a policy."""
    weight_update_version: int = 0
    """The weight update in progress; 0 when none."""
    weight_update_fleet_wide: bool = False
    workers_updating: int = 0
    distinct_worker_versions: int = 0
    """Distinct known policy versions among healthy workers; above 1 is a mixed fleet."""


@dataclass(frozen=True, slots=True)
class WeightUpdate:
    """A weight update begun by ``begin_weight_update``."""

    version: int
    workers: tuple[Worker, ...]
    """The selected workers, now updating."""
    interrupted_sessions: int = 0


_RECORDED = bytes((RewardStatus.ACCEPTED.value, RewardStatus.DUPLICATE.value))


@dataclass(frozen=True, slots=True, eq=False)
class RewardAckBatch:
    """What the router did with each reward of one ``submit_arrays`` call, as arrays.

    - ``statuses``: uint8 (n,), ``RewardStatus`` numbers, entry i about reward i.
    - ``detail_entries``: int64 (k,), the entries not ACCEPTED, increasing; ``details``: their
      explanations, aligned.
    """

    statuses: npt.NDArray[np.uint8]
    detail_entries: npt.NDArray[np.int64]
    details: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.statuses)

    @property
    def ok(self) -> npt.NDArray[np.bool_]:
        """bool (n,): the reward is recorded (ACCEPTED, or DUPLICATE: the same one was)."""
        statuses = self.statuses
        ok: npt.NDArray[np.bool_] = (statuses == RewardStatus.ACCEPTED.value) | (
            statuses == RewardStatus.DUPLICATE.value
        )
        return ok

    @property
    def all_ok(self) -> bool:
        """Every reward is recorded (the common case, checked without building ``ok``)."""
        return not self.statuses.tobytes().translate(None, _RECORDED)

    def results(self) -> tuple[RewardResult, ...]:
        """One RewardResult per entry (built on request)."""
        found = dict(zip(self.detail_entries.tolist(), self.details, strict=True))
        return tuple(
            RewardResult(_enum_of(RewardStatus, code), found.get(i, ""))
            for i, code in enumerate(self.statuses.tolist())
        )


def _at(values: npt.NDArray[np.uint64] | npt.NDArray[np.uint32], g: int) -> int:
    """Entry g of a per-group array, 0 when the router sent none (an older router)."""
    return int(values[g]) if g < len(values) else 0


def _enum_of(enum_type: type[_E], number: int) -> _E:
    try:
        return enum_type(number)
    except ValueError:
        return enum_type(0)


@dataclass(frozen=True, slots=True, eq=False)
class ResultBatch:
    """Finalized groups as flat NumPy arrays, with no Python object per group or per member.

    G groups, M counted members in all (``GroupResult.sessions``), X excluded members:

    - per group, shape (G,): ``cursors`` uint64 (increasing), ``group_ids`` and ``task_ids``
      (tuples of str), ``outcomes`` uint8 (``GroupOutcome`` numbers), ``group_sizes`` uint32,
      ``means`` and ``stds`` float64, ``degenerate`` bool, ``finalize_unix_nanos`` int64,
      ``estimator_of`` uint32 (position in ``estimators``, the distinct estimators);
    - ``member_offsets`` int64 (G + 1,): group g's counted members are entries
      ``member_offsets[g]:member_offsets[g + 1]`` of the per-member arrays;
    - per counted member, shape (M,): ``member_indices`` uint32 (index in its group),
      ``rewards`` and ``advantages`` float64 (a dropped group's advantages are 0 there and
      mean nothing), ``filter_metrics`` float64 (NaN for groups without; shape (0,) when no
      group has them);
    - ``excluded_offsets`` int64 (G + 1,), and per excluded member (X,): ``excluded_indices``
      uint32, ``excluded_replaced`` bool;
    - per group, uint64 (G,): ``min_versions``, ``max_versions``, ``trainer_versions``,
      ``admitted_trainer_versions`` (the version fields of ``GroupResult``; all zeros from
      a router without versions);
    - ``shards`` uint32 (G,): the shard that owns each group (``GroupResult.shard``); shape
      (0,) when every group is shard 0's (a single router, or shard 0's reward stream).

    ``groups`` gives the typed per-group view (``GroupResult``), built the first time it is
    read; ``group_of_member`` maps members to groups for segmented NumPy work.
    """

    cursors: npt.NDArray[np.uint64]
    group_ids: tuple[str, ...]
    task_ids: tuple[str, ...]
    outcomes: npt.NDArray[np.uint8]
    group_sizes: npt.NDArray[np.uint32]
    means: npt.NDArray[np.float64]
    stds: npt.NDArray[np.float64]
    degenerate: npt.NDArray[np.bool_]
    finalize_unix_nanos: npt.NDArray[np.int64]
    estimators: tuple[EstimatorConfig, ...]
    estimator_of: npt.NDArray[np.uint32]
    member_offsets: npt.NDArray[np.int64]
    member_indices: npt.NDArray[np.uint32]
    rewards: npt.NDArray[np.float64]
    advantages: npt.NDArray[np.float64]
    filter_metrics: npt.NDArray[np.float64]
    excluded_offsets: npt.NDArray[np.int64]
    excluded_indices: npt.NDArray[np.uint32]
    excluded_replaced: npt.NDArray[np.bool_]
    min_versions: npt.NDArray[np.uint64]
    max_versions: npt.NDArray[np.uint64]
    trainer_versions: npt.NDArray[np.uint64]
    admitted_trainer_versions: npt.NDArray[np.uint64]
    shards: npt.NDArray[np.uint32] = field(default_factory=lambda: np.zeros(0, dtype=np.uint32))
    _views: tuple[GroupResult, ...] | None = field(default=None, init=False, repr=False)

    def __len__(self) -> int:
        return len(self.group_ids)

    @property
    def last_cursor(self) -> int:
        """The cursor of the last group (0 for an empty batch): resume after it."""
        return int(self.cursors[-1]) if len(self.cursors) else 0

    @property
    def group_of_member(self) -> npt.NDArray[np.int64]:
        """int64 (M,): the group (0 to G - 1) of each counted member."""
        return np.repeat(np.arange(len(self), dtype=np.int64), np.diff(self.member_offsets))

    @property
    def groups(self) -> tuple[GroupResult, ...]:
        """The typed per-group view, equal to the GroupResults of the message form: built on
        first use, then kept."""
        if self._views is None:
            object.__setattr__(self, "_views", tuple(self.group(g) for g in range(len(self))))
        assert self._views is not None
        return self._views

    def group(self, g: int) -> GroupResult:
        """The typed view of group ``g`` alone (``groups`` builds them all)."""
        lo, hi = int(self.member_offsets[g]), int(self.member_offsets[g + 1])
        xlo, xhi = int(self.excluded_offsets[g]), int(self.excluded_offsets[g + 1])
        prefix = f"groups/{self.group_ids[g]}/sessions/"
        outcome = _enum_of(GroupOutcome, int(self.outcomes[g]))
        metrics: tuple[float, ...] = ()
        if len(self.filter_metrics) and hi > lo and not np.isnan(self.filter_metrics[lo]):
            metrics = tuple(self.filter_metrics[lo:hi].tolist())
        excluded = self.excluded_indices[xlo:xhi].tolist()
        replaced = self.excluded_replaced[xlo:xhi].tolist()
        return GroupResult(
            cursor=int(self.cursors[g]),
            group_id=self.group_ids[g],
            task_id=self.task_ids[g],
            outcome=outcome,
            group_size=int(self.group_sizes[g]),
            sessions=tuple(f"{prefix}{i}" for i in self.member_indices[lo:hi].tolist()),
            rewards=tuple(self.rewards[lo:hi].tolist()),
            advantages=()
            if outcome is GroupOutcome.DROPPED
            else tuple(self.advantages[lo:hi].tolist()),
            mean=float(self.means[g]),
            std=float(self.stds[g]),
            estimator=self.estimators[int(self.estimator_of[g])],
            degenerate=bool(self.degenerate[g]),
            excluded_sessions=tuple(f"{prefix}{i}" for i in excluded),
            finalize_time=datetime.fromtimestamp(int(self.finalize_unix_nanos[g]) / 1e9, UTC)
            if self.finalize_unix_nanos[g]
            else None,
            filter_metrics=metrics,
            replaced_sessions=tuple(
                f"{prefix}{i}" for i, r in zip(excluded, replaced, strict=True) if r
            ),
            min_version=_at(self.min_versions, g),
            max_version=_at(self.max_versions, g),
            trainer_version=_at(self.trainer_versions, g),
            admitted_trainer_version=_at(self.admitted_trainer_versions, g),
            shard=_at(self.shards, g),
        )

    def after(self, cursor: int) -> ResultBatch:
        """The groups with a cursor above ``cursor`` (all of them, usually), as a batch."""
        start = int(np.searchsorted(self.cursors, cursor, side="right"))
        if start == 0:
            return self
        lo, xlo = int(self.member_offsets[start]), int(self.excluded_offsets[start])
        metrics = self.filter_metrics
        return ResultBatch(
            cursors=self.cursors[start:],
            group_ids=self.group_ids[start:],
            task_ids=self.task_ids[start:],
            outcomes=self.outcomes[start:],
            group_sizes=self.group_sizes[start:],
            means=self.means[start:],
            stds=self.stds[start:],
            degenerate=self.degenerate[start:],
            finalize_unix_nanos=self.finalize_unix_nanos[start:],
            estimators=self.estimators,
            estimator_of=self.estimator_of[start:],
            member_offsets=self.member_offsets[start:] - lo,
            member_indices=self.member_indices[lo:],
            rewards=self.rewards[lo:],
            advantages=self.advantages[lo:],
            filter_metrics=self.filter_metrics[lo:] if len(self.filter_metrics) else metrics,
            excluded_offsets=self.excluded_offsets[start:] - xlo,
            excluded_indices=self.excluded_indices[xlo:],
            excluded_replaced=self.excluded_replaced[xlo:],
            min_versions=self.min_versions[start:],
            max_versions=self.max_versions[start:],
            trainer_versions=self.trainer_versions[start:],
            admitted_trainer_versions=self.admitted_trainer_versions[start:],
            shards=self.shards[start:],
        )
