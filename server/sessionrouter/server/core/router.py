"""The router core: every command that changes sessions, groups and workers.

Each public method is synchronous and runs to completion without awaiting, so on one asyncio
event loop it is atomic: dozens of clients joining one group at the same moment are simply
served one after the other, and the group-size, overflow and distinct-worker rules hold without
locks. Nothing here imports grpc or protobuf.

With a journal, every change is also appended to it as an event (``core.events``), at the
point where the change is final (after placement succeeded, so an all-or-none StartGroup that
fails leaves no trace). Appending does not wait: the servicer awaits the journal's commit
before it replies. ``restore`` rebuilds the state from what a journal read back.
"""

from __future__ import annotations

import heapq
import logging
import math
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from sessionrouter.server.core.clock import Clock, SystemClock
from sessionrouter.server.core.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    Unavailable,
)
from sessionrouter.server.core.estimators import EstimatorParams, validate_params
from sessionrouter.server.core.events import (
    GroupCreated,
    GroupRow,
    JournalSink,
    RecoveredState,
    RequestSaved,
    SessionAborted,
    SessionLost,
    SessionStarted,
    WorkerRemoved,
    WorkerSaved,
)
from sessionrouter.server.core.feed import GroupFeed, GroupOutcome, GroupResult
from sessionrouter.server.core.finalizer import FinishedGroup, GroupFinalizer
from sessionrouter.server.core.groups import (
    GroupLedger,
    GroupRecord,
    GroupSettings,
    GroupState,
    RequestRecord,
    SessionRecord,
    SessionState,
)
from sessionrouter.server.core.placement import PlacementMode, choose_worker
from sessionrouter.server.core.rewards import ACCEPTED, RewardOutcome, RewardStatus
from sessionrouter.server.core.streams import RewardStream
from sessionrouter.server.core.validation import (
    MAX_DEADLINE_S,
    MAX_GROUP_SIZE,
    METADATA_VALUE_MAX_LEN,
    REASON_MAX_LEN,
    check_id,
    check_optional_id,
    check_range,
    check_string_map,
    check_text,
    parse_session_name,
    try_parse_session_name,
)
from sessionrouter.server.core.workers import SessionKey, WorkerRecord, WorkerRegistry

log = logging.getLogger("sessionrouter.router")


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """Server-wide defaults and limits of the core."""

    heartbeat_timeout_s: float = 10.0
    estimator: EstimatorParams = field(default_factory=EstimatorParams)
    deadline_s: float = 600.0
    """Default time from group creation to its deadline."""
    min_members: int = 2
    """Default least number of rewarded members of a partial group (capped at its size)."""
    placement_mode: PlacementMode = PlacementMode.SPREAD
    reducer_window_s: float = 0.002
    reducer_max_batch: int = 4096
    feed_retention: int = 100_000
    finished_group_retention: int = 100_000
    retry_after_s: float = 1.0
    """Delay suggested to callers refused with Unavailable."""


@dataclass(slots=True)
class RouterStats:
    """Running totals for metrics; plain integers, updated in place."""

    sessions_distinct: int = 0
    sessions_shared: int = 0
    rewards: Counter[RewardStatus] = field(default_factory=Counter)
    groups_finished: Counter[GroupOutcome] = field(default_factory=Counter)


@dataclass(frozen=True, slots=True)
class OptionsSpec:
    """Group options as a caller gave them: unset fields take the server defaults."""

    estimator: str = ""
    eps: float | None = None
    ddof: int | None = None
    batch_std: bool | None = None
    deadline_s: float = 0.0
    min_members: int = 0

    def is_empty(self) -> bool:
        return self == OptionsSpec()


@dataclass(frozen=True, slots=True)
class StartSessionCommand:
    task_id: str
    group_id: str | None = None
    group_size: int = 0
    request_id: str = ""
    metadata: Mapping[str, str] = field(default_factory=dict)
    options: OptionsSpec = field(default_factory=OptionsSpec)
    placement_mode: PlacementMode | None = None


@dataclass(frozen=True, slots=True)
class StartGroupCommand:
    task_id: str
    group_size: int
    group_id: str | None = None
    request_id: str = ""
    metadata: Mapping[str, str] = field(default_factory=dict)
    options: OptionsSpec = field(default_factory=OptionsSpec)
    placement_mode: PlacementMode | None = None


@dataclass(frozen=True, slots=True)
class StartedSession:
    session: SessionRecord
    group: GroupRecord
    group_created: bool
    replayed: bool


@dataclass(frozen=True, slots=True)
class StartedGroup:
    group: GroupRecord
    shared_worker: bool
    replayed: bool


@dataclass(frozen=True, slots=True)
class RestoreSummary:
    """What a restore rebuilt, for the ``recovered`` log line."""

    workers: int
    groups_open: int
    groups_finished: int
    sessions: int
    open_rewards: int
    """Rewards held by groups still open (waiting for more members or rewards)."""
    requests: int
    feed_cursor: int
    finalized_on_restore: int
    """Groups the journal held open although nothing was left to wait for (the process died
    between their last reward and their finalization): finalized now, exactly once."""


def _check_start(
    cmd: StartSessionCommand | StartGroupCommand, min_group_size: int
) -> tuple[str, str, dict[str, str]]:
    """Checks the fields both start commands share; returns (task_id, request_id, metadata)."""
    task_id = check_id("task_id", cmd.task_id)
    request_id = check_optional_id("request_id", cmd.request_id)
    if cmd.group_id is not None:
        check_id("group_id", cmd.group_id)
    metadata = check_string_map("metadata", cmd.metadata, METADATA_VALUE_MAX_LEN)
    check_range("group_size", cmd.group_size, min_group_size, MAX_GROUP_SIZE)
    return task_id, request_id, metadata


class SessionRouter:
    """Workers, placement, groups, rewards and deadlines, over one in-memory state."""

    def __init__(
        self,
        settings: RouterSettings | None = None,
        clock: Clock | None = None,
        journal: JournalSink | None = None,
    ) -> None:
        self.settings = settings or RouterSettings()
        validate_params(self.settings.estimator)
        self.clock: Clock = clock or SystemClock()
        self.workers = WorkerRegistry(self.settings.heartbeat_timeout_s)
        self.workers.on_worker_lost = self._on_worker_lost
        self.groups = GroupLedger(self.settings.finished_group_retention)
        self.feed = GroupFeed(self.settings.feed_retention)
        self.journal = journal
        """Where changes are appended as events; None keeps the router in memory only."""
        self.finalizer = GroupFinalizer(
            self.feed, self.settings.reducer_window_s, self.settings.reducer_max_batch, journal
        )
        self._deadlines: list[tuple[float, int, str]] = []
        self.stats = RouterStats()
        self.accepting = True
        """False while draining for shutdown: new sessions are refused."""

    # -- workers ---------------------------------------------------------------------------

    def register_worker(
        self, worker_id: str, address: str, capacity: int, labels: Mapping[str, str]
    ) -> WorkerRecord:
        worker, created = self.workers.register(
            worker_id, address, capacity, labels, self.clock.monotonic(), self.clock.wall()
        )
        self._journal_worker(worker)
        log.info(
            "worker %s",
            "registered" if created else "re-registered",
            extra={
                "event": "worker_registered",
                "worker_id": worker_id,
                "address": address,
                "capacity": capacity,
            },
        )
        return worker

    def heartbeat(self, worker_id: str) -> WorkerRecord:
        worker, recovered = self.workers.heartbeat(
            worker_id, self.clock.monotonic(), self.clock.wall()
        )
        if recovered:
            log.info(
                "worker recovered", extra={"event": "worker_recovered", "worker_id": worker_id}
            )
        return worker

    def drain_worker(self, worker_id: str, resume: bool) -> WorkerRecord:
        worker = self.workers.set_draining(worker_id, not resume)
        self._journal_worker(worker)
        log.info(
            "worker %s",
            "resumed" if resume else "draining",
            extra={"event": "worker_drain", "worker_id": worker_id, "draining": not resume},
        )
        return worker

    def deregister_worker(self, worker_id: str) -> tuple[WorkerRecord, int]:
        worker, lost = self.workers.deregister(worker_id)
        if self.journal is not None:
            self.journal.append(WorkerRemoved(worker_id))
        log.info(
            "worker deregistered",
            extra={"event": "worker_deregistered", "worker_id": worker_id, "lost_sessions": lost},
        )
        return worker, lost

    def _journal_worker(self, worker: WorkerRecord) -> None:
        if self.journal is not None:
            self.journal.append(
                WorkerSaved(
                    worker.worker_id,
                    worker.address,
                    worker.capacity,
                    worker.labels,
                    worker.draining,
                    self.clock.wall(),
                )
            )

    def _on_worker_lost(self, worker: WorkerRecord, sessions: set[SessionKey]) -> None:
        for group_id, index in sessions:
            group = self.groups.find(group_id)
            session = self.groups.find_session(group_id, index)
            if group is not None and session is not None and session.state is SessionState.OPEN:
                session.worker_lost = True
                if self.journal is not None:
                    self.journal.append(SessionLost(group.seq, index))
        log.warning(
            "worker lost",
            extra={
                "event": "worker_lost",
                "worker_id": worker.worker_id,
                "open_sessions": len(sessions),
            },
        )

    # -- starting sessions -----------------------------------------------------------------

    def start_session(self, cmd: StartSessionCommand) -> StartedSession:
        """Places one session, creating or joining its group (see the proto for rules)."""
        task_id, request_id, metadata = _check_start(cmd, min_group_size=0)
        fingerprint = ("session", task_id, cmd.group_id, cmd.group_size)
        if request_id:
            replay = self._replay(request_id, fingerprint)
            if replay is not None:
                replayed = self.groups.get(replay.group_id)
                assert replay.index is not None
                return StartedSession(replayed.members[replay.index], replayed, False, True)
        self._check_accepting()
        mode = cmd.placement_mode or self.settings.placement_mode
        existing = self.groups.find(cmd.group_id) if cmd.group_id is not None else None
        if existing is not None:
            group = existing
            self._check_joinable(group, task_id, cmd.group_size, cmd.options)
            session = self._place_member(group, request_id, metadata, mode)
            created = False
        else:
            size = cmd.group_size or 1
            settings = self._resolve_options(cmd.options, size)
            group_id = cmd.group_id or uuid.uuid4().hex
            group = self._new_group(group_id, task_id, size, settings)
            try:
                session = self._place_member(group, request_id, metadata, mode)
            except BaseException:
                self._forget_empty_group(group)
                raise
            self._add_group(group)
            created = True
        if request_id:
            self.groups.add_request(
                request_id, RequestRecord(group.group_id, session.index, fingerprint)
            )
        if self.journal is not None:
            if created:
                self._journal_group(group)
            self._journal_session(group, session)
            if request_id:
                self.journal.append(RequestSaved(request_id, group.seq, session.index, fingerprint))
        return StartedSession(session, group, created, False)

    def start_group(self, cmd: StartGroupCommand) -> StartedGroup:
        """Creates a group and places all its members at once: all or none."""
        task_id, request_id, metadata = _check_start(cmd, min_group_size=1)
        fingerprint = ("group", task_id, cmd.group_id, cmd.group_size)
        if request_id:
            replay = self._replay(request_id, fingerprint)
            if replay is not None:
                group = self.groups.get(replay.group_id)
                shared = any(s.shared_worker for s in group.members)
                return StartedGroup(group, shared, True)
        self._check_accepting()
        if cmd.group_id is not None and self.groups.find(cmd.group_id) is not None:
            raise AlreadyExists(
                "GROUP_EXISTS",
                f"group {cmd.group_id!r} already exists; StartSession joins an existing group",
                metadata={"group_id": cmd.group_id},
            )
        settings = self._resolve_options(cmd.options, cmd.group_size)
        group = self._new_group(cmd.group_id or uuid.uuid4().hex, task_id, cmd.group_size, settings)
        mode = cmd.placement_mode or self.settings.placement_mode
        try:
            for _ in range(cmd.group_size):
                self._place_member(group, request_id, metadata, mode)
        except BaseException:
            self._forget_empty_group(group)
            raise
        self._add_group(group)
        if request_id:
            self.groups.add_request(request_id, RequestRecord(group.group_id, None, fingerprint))
        if self.journal is not None:
            self._journal_group(group)
            for session in group.members:
                self._journal_session(group, session)
            if request_id:
                self.journal.append(RequestSaved(request_id, group.seq, None, fingerprint))
        return StartedGroup(group, any(s.shared_worker for s in group.members), False)

    def _journal_group(self, group: GroupRecord) -> None:
        assert self.journal is not None
        settings = group.settings
        estimator = settings.estimator
        self.journal.append(
            GroupCreated(
                group.seq,
                group.group_id,
                group.task_id,
                group.size,
                estimator.name,
                estimator.eps,
                estimator.ddof,
                estimator.batch_std,
                settings.deadline_s,
                settings.min_members,
                group.create_time,
                group.deadline_wall,
            )
        )

    def _journal_session(self, group: GroupRecord, session: SessionRecord) -> None:
        assert self.journal is not None
        self.journal.append(
            SessionStarted(
                group.seq,
                session.index,
                session.worker_id,
                session.worker_address,
                session.request_id,
                session.metadata,
                session.create_time,
                session.shared_worker,
            )
        )

    def _replay(self, request_id: str, fingerprint: tuple[object, ...]) -> RequestRecord | None:
        record = self.groups.find_request(request_id)
        if record is None:
            return None
        if record.fingerprint != fingerprint:
            raise InvalidArgument(
                "REQUEST_ID_REUSED",
                f"request_id {request_id!r} was used before for a different request",
                metadata={"request_id": request_id},
                field_violations=[("request_id", "already used for a different request")],
            )
        return record

    def _check_accepting(self) -> None:
        if not self.accepting:
            raise Unavailable(
                "SHUTTING_DOWN",
                "the router is shutting down and takes no new sessions",
                retry_after_s=self.settings.retry_after_s,
            )

    def _check_joinable(
        self, group: GroupRecord, task_id: str, group_size: int, options: OptionsSpec
    ) -> None:
        gid = group.group_id
        if group.task_id != task_id:
            raise InvalidArgument(
                "TASK_MISMATCH",
                f"group {gid!r} answers task {group.task_id!r}, not {task_id!r}; the sessions"
                " of one group must answer one task",
                metadata={"group_id": gid, "expected": group.task_id, "got": task_id},
                field_violations=[("task_id", f"group {gid!r} is for {group.task_id!r}")],
            )
        if group_size and group_size != group.size:
            raise InvalidArgument(
                "GROUP_SIZE_MISMATCH",
                f"group {gid!r} has size {group.size}, the request says {group_size}",
                metadata={"group_id": gid, "expected": group.size, "got": group_size},
                field_violations=[("group_size", f"group {gid!r} has size {group.size}")],
            )
        if not options.is_empty() and self._resolve_options(options, group.size) != group.settings:
            raise InvalidArgument(
                "GROUP_OPTIONS_MISMATCH",
                f"group {gid!r} was created with other options; leave group_options unset"
                " when joining",
                metadata={"group_id": gid},
                field_violations=[("group_options", "differ from the group's")],
            )
        if group.state is not GroupState.OPEN:
            raise FailedPrecondition(
                "GROUP_CLOSED",
                f"group {gid!r} is {group.state.value}",
                metadata={"group_id": gid, "state": group.state.value},
            )
        if group.full:
            raise FailedPrecondition(
                "GROUP_FULL",
                f"group {gid!r} already has all its {group.size} members",
                metadata={"group_id": gid, "group_size": group.size, "members": len(group.members)},
            )

    def _resolve_options(self, spec: OptionsSpec, size: int) -> GroupSettings:
        default = self.settings.estimator
        name = spec.estimator or default.name
        # A server default of grpo with batch_std must not leak into a group that asks for
        # another estimator (batch_std only means something for grpo).
        inherited_batch_std = default.batch_std and name == "grpo"
        estimator = EstimatorParams(
            name=name,
            eps=default.eps if spec.eps is None else spec.eps,
            ddof=default.ddof if spec.ddof is None else spec.ddof,
            batch_std=inherited_batch_std if spec.batch_std is None else spec.batch_std,
        )
        try:
            validate_params(estimator)
        except ValueError as exc:
            raise InvalidArgument(
                "INVALID_ESTIMATOR",
                str(exc),
                field_violations=[("group_options.estimator", str(exc))],
            ) from exc
        deadline_s = spec.deadline_s or self.settings.deadline_s
        check_range("group_options.deadline", deadline_s, 0.001, MAX_DEADLINE_S)
        check_range("group_options.min_members", spec.min_members, 0, size)
        min_members = spec.min_members or min(self.settings.min_members, size)
        return GroupSettings(estimator, deadline_s, max(1, min_members))

    def _new_group(
        self, group_id: str, task_id: str, size: int, settings: GroupSettings
    ) -> GroupRecord:
        now, wall = self.clock.monotonic(), self.clock.wall()
        return GroupRecord(
            group_id=group_id,
            task_id=task_id,
            size=size,
            settings=settings,
            create_time=wall,
            deadline=now + settings.deadline_s,
            deadline_wall=wall + settings.deadline_s,
            seq=self.groups.next_seq(),
        )

    def _add_group(self, group: GroupRecord) -> None:
        self.groups.add_group(group)
        heapq.heappush(self._deadlines, (group.deadline, group.seq, group.group_id))
        log.debug(
            "group created",
            extra={
                "event": "group_created",
                "group_id": group.group_id,
                "task_id": group.task_id,
                "group_size": group.size,
            },
        )

    def _forget_empty_group(self, group: GroupRecord) -> None:
        """Undoes the placements of a group that could not be completed (all or none)."""
        for session in group.members:
            self.workers.release_session(session.worker_id, session.key)
        group.members.clear()

    def _place_member(
        self,
        group: GroupRecord,
        request_id: str,
        metadata: dict[str, str],
        mode: PlacementMode,
    ) -> SessionRecord:
        choice = choose_worker(
            self.workers,
            group.group_id,
            group.members_per_worker,
            mode,
            self.settings.retry_after_s,
        )
        worker = choice.worker
        session = SessionRecord(
            group_id=group.group_id,
            index=len(group.members),
            task_id=group.task_id,
            worker_id=worker.worker_id,
            worker_address=worker.address,
            request_id=request_id,
            metadata=metadata,
            create_time=self.clock.wall(),
            shared_worker=choice.shared,
        )
        group.members.append(session)
        group.members_per_worker[worker.worker_id] = (
            group.members_per_worker.get(worker.worker_id, 0) + 1
        )
        self.workers.add_session(worker, session.key)
        if choice.shared:
            self.stats.sessions_shared += 1
        else:
            self.stats.sessions_distinct += 1
        return session

    # -- sessions and groups ---------------------------------------------------------------

    def get_session(self, name: str) -> SessionRecord:
        group_id, index = parse_session_name(name)
        return self.groups.get_session(group_id, index)

    def get_group(self, group_id: str) -> GroupRecord:
        check_id("group_id", group_id)
        return self.groups.get(group_id)

    def abort_session(self, name: str, reason: str) -> SessionRecord:
        """Ends a session early: frees its slot; it leaves the group's statistics."""
        check_text("reason", reason, REASON_MAX_LEN, required=False)
        session = self.get_session(name)
        group = self.groups.get(session.group_id)
        if session.state is SessionState.ABORTED:
            return session
        if session.state is SessionState.REWARDED:
            raise FailedPrecondition(
                "SESSION_REWARDED",
                f"session {name!r} already has a reward; it cannot be aborted",
                metadata={"session": name},
            )
        if group.state is not GroupState.OPEN:
            raise FailedPrecondition(
                "GROUP_CLOSED",
                f"group {group.group_id!r} is {group.state.value}",
                metadata={"group_id": group.group_id, "state": group.state.value},
            )
        session.state = SessionState.ABORTED
        group.aborted += 1
        if self.journal is not None:
            self.journal.append(SessionAborted(group.seq, session.index))
        self.workers.release_session(session.worker_id, session.key)
        log.info(
            "session aborted", extra={"event": "session_aborted", "session": name, "reason": reason}
        )
        if group.settled:
            self._finish(group, None)
        return session

    # -- rewards ---------------------------------------------------------------------------

    def submit_rewards(
        self,
        entries: Sequence[tuple[str, float]],
        origin: tuple[RewardStream, int] | None = None,
    ) -> list[RewardOutcome]:
        """Records a batch of (session name, reward); one outcome per entry, in order.

        Only ACCEPTED entries change state. A group whose last reward arrives here is
        finished and queued for reduction, and its result is owed to ``origin``."""
        outcomes = [self._submit_one(name, reward, origin) for name, reward in entries]
        counts = self.stats.rewards
        for outcome in outcomes:
            counts[outcome.status] += 1
        return outcomes

    def _submit_one(
        self, name: str, reward: float, origin: tuple[RewardStream, int] | None
    ) -> RewardOutcome:
        parsed = try_parse_session_name(name)
        session = None if parsed is None else self.groups.find_session(*parsed)
        if session is None:
            return RewardOutcome(
                RewardStatus.UNKNOWN_SESSION,
                f"no session named {name[:200]!r}"
                if parsed
                else "session must look like groups/{group_id}/sessions/{index}",
            )
        if not math.isfinite(reward):
            return RewardOutcome(RewardStatus.NOT_FINITE, f"reward {reward} is not finite")
        if session.state is SessionState.ABORTED:
            return RewardOutcome(RewardStatus.SESSION_ABORTED, f"session {name!r} was aborted")
        if session.state is SessionState.REWARDED:
            if session.reward == reward:
                return RewardOutcome(RewardStatus.DUPLICATE, "the same reward is recorded")
            return RewardOutcome(
                RewardStatus.CONFLICT,
                f"session {name!r} already has reward {session.reward!r}",
            )
        group = self.groups.get(session.group_id)
        if group.state is not GroupState.OPEN:
            return RewardOutcome(
                RewardStatus.GROUP_CLOSED,
                f"group {group.group_id!r} was {group.state.value} without this session",
            )
        session.reward = float(reward)
        session.state = SessionState.REWARDED
        group.rewarded += 1
        if self.journal is not None:
            self.journal.reward(group.seq, session.index, session.reward)
        self.workers.release_session(session.worker_id, session.key)
        if group.settled:
            self._finish(group, origin)
        return ACCEPTED

    # -- finishing groups ------------------------------------------------------------------

    def expire_due(self) -> int:
        """Expires workers whose heartbeats stopped and finishes groups past their
        deadline; returns how many groups it finished. Called periodically."""
        now = self.clock.monotonic()
        self.workers.expire(now)
        finished = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            _, seq, group_id = heapq.heappop(self._deadlines)
            group = self.groups.find(group_id)
            if group is not None and group.seq == seq and group.state is GroupState.OPEN:
                self._finish(group, None)
                finished += 1
        return finished

    def _finish(self, group: GroupRecord, origin: tuple[RewardStream, int] | None) -> None:
        counted = tuple(s for s in group.members if s.state is SessionState.REWARDED)
        excluded = tuple(s for s in group.members if s.state is not SessionState.REWARDED)
        if len(counted) == group.size:
            outcome = GroupOutcome.COMPLETE
        elif len(counted) >= group.settings.min_members:
            outcome = GroupOutcome.PARTIAL
        else:
            outcome = GroupOutcome.DROPPED
        group.state = (
            GroupState.DROPPED if outcome is GroupOutcome.DROPPED else GroupState.FINALIZED
        )
        for session in excluded:
            self.workers.release_session(session.worker_id, session.key)
        self.groups.mark_finished(group)
        self.stats.groups_finished[outcome] += 1
        self.finalizer.submit(
            FinishedGroup(group, outcome, counted, excluded, self.clock.wall(), origin)
        )
        log.info(
            "group %s",
            outcome.value,
            extra={
                "event": "group_finished",
                "group_id": group.group_id,
                "outcome": outcome.value,
                "rewarded": len(counted),
                "group_size": group.size,
            },
        )

    # -- recovery --------------------------------------------------------------------------

    def restore(self, state: RecoveredState) -> RestoreSummary:
        """Rebuilds an empty router from what a journal read back, before it serves.

        - Workers come back unhealthy (and keep their drain state) until they heartbeat or
          register again; their open sessions hold their slots meanwhile.
        - Groups keep their members, rewards and request ids; deadlines, stored as wall
          time, are converted to this process's monotonic clock, so they keep counting
          across the restart (a deadline that passed while the router was down fires at
          the next expiry tick).
        - Finalized groups go back on the feed, so a subscriber resumes by cursor and new
          cursors continue after the last one; the newest ``finished_group_retention`` of
          them also back into the ledger (GetGroup, replays), as before the restart.
        - An open group with nothing left to wait for is finalized now: the previous process
          died between its last reward (or abort) and its finalization.
        """
        if len(self.groups) or len(self.workers) or self.feed.last_cursor:
            raise RuntimeError("restore needs an empty router")
        now, wall = self.clock.monotonic(), self.clock.wall()
        for w in state.workers:
            self.workers.restore(
                w.worker_id, w.address, w.capacity, w.labels, w.draining, now, w.seen_wall
            )
        finished = sorted(
            (row for row in state.groups if row.result is not None),
            key=lambda row: row.result.cursor if row.result is not None else 0,
        )
        retention = self.groups.finished_retention
        retained = finished[len(finished) - retention :] if retention < len(finished) else finished
        in_ledger = {id(row) for row in retained}
        # An id can be reused once its old group left the ledger: the newest group wins.
        newest: dict[str, GroupRow] = {}
        for row in state.groups:
            if row.result is None or id(row) in in_ledger:
                newest[row.created.group_id] = row
        by_seq: dict[int, GroupRecord] = {}
        sessions = open_rewards = 0
        for row in state.groups:
            if newest.get(row.created.group_id) is not row:
                continue
            group = self._restored_group(row, now, wall)
            by_seq[group.seq] = group
            self.groups.add_group(group)
            sessions += len(group.members)
            open_rewards += group.rewarded
            if group.state is GroupState.OPEN:
                heapq.heappush(self._deadlines, (group.deadline, group.seq, group.group_id))
        for row in retained:
            restored = by_seq.get(row.created.seq)
            if restored is not None:
                self.groups.mark_finished(restored)
        requests = 0
        for saved in state.requests:
            owner = by_seq.get(saved.group_seq)
            if owner is not None:
                self.groups.add_request(
                    saved.request_id, RequestRecord(owner.group_id, saved.idx, saved.fingerprint)
                )
                requests += 1
        results: list[GroupResult] = [row.result for row in finished if row.result is not None]
        self.feed.restore(results, state.last_cursor)
        self.groups.skip_seqs_below(state.next_seq)
        settled = [g for g in by_seq.values() if g.state is GroupState.OPEN and g.settled]
        for group in settled:
            self._finish(group, None)
        return RestoreSummary(
            workers=len(state.workers),
            groups_open=self.groups.open_groups,
            groups_finished=len(finished),
            sessions=sessions,
            open_rewards=open_rewards,
            requests=requests,
            feed_cursor=self.feed.last_cursor,
            finalized_on_restore=len(settled),
        )

    def _restored_group(self, row: GroupRow, now: float, wall: float) -> GroupRecord:
        c = row.created
        group = GroupRecord(
            group_id=c.group_id,
            task_id=c.task_id,
            size=c.size,
            settings=GroupSettings(
                EstimatorParams(c.estimator, c.eps, c.ddof, c.batch_std),
                c.deadline_s,
                c.min_members,
            ),
            create_time=c.create_time,
            deadline=now + (c.deadline_wall - wall),
            deadline_wall=c.deadline_wall,
            seq=c.seq,
            state=GroupState(row.state),
            cursor=row.result.cursor if row.result is not None else 0,
        )
        group.members = row.members
        if group.state is not GroupState.OPEN:
            return group  # final: only lookups will read it
        per_worker = group.members_per_worker
        for session in group.members:
            per_worker[session.worker_id] = per_worker.get(session.worker_id, 0) + 1
            if session.state is SessionState.REWARDED:
                group.rewarded += 1
            elif session.state is SessionState.ABORTED:
                group.aborted += 1
            else:
                worker = self.workers.find(session.worker_id)
                if worker is not None:
                    self.workers.add_session(worker, session.key)
        return group
