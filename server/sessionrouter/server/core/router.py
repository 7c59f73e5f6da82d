"""The router core: every command that changes sessions, groups and workers.

Each public method is synchronous and runs to completion without awaiting, so on one asyncio
event loop it is atomic: dozens of clients joining one group at the same moment are simply
served one after the other, and the group-size, overflow and distinct-worker rules hold without
locks. Nothing here imports grpc or protobuf.

With a journal, every change is also appended to it as an event (``core.events``), at the
point where the change is final (after placement succeeded, so an all-or-none StartGroup that
fails leaves no trace). Appending does not wait: the servicer awaits the journal's commit
before it replies. ``restore`` rebuilds the state from what a journal read back (``core.recovery``).

The command and result types are in ``core.commands``, the settings in ``core.settings``, the
checks of a start request in ``core.admission``: this module holds the rules that change state.
It is over 700 lines because every command that changes state is here, on purpose: each must
run to completion on the loop, and their invariants (slots, members per worker, deadlines,
the events they journal) interlock; split across modules they would need each other's
internals.
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import logging
import math
import operator
import secrets
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import numpy as np
from numpy.typing import NDArray

from sessionrouter.server.core.admission import check_joinable, check_start, resolve_options
from sessionrouter.server.core.clock import Clock, SystemClock
from sessionrouter.server.core.commands import (
    NO_OPTIONS,
    OptionsSpec,
    StartedGroup,
    StartedSession,
    StartGroupCommand,
    StartSessionCommand,
)
from sessionrouter.server.core.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from sessionrouter.server.core.estimators import validate_params
from sessionrouter.server.core.events import (
    FilterMetricSaved,
    JournalSink,
    RecoveredState,
    RequestSaved,
    SessionAborted,
    SessionInterrupted,
    SessionLost,
    SessionVersions,
    TrainerSaved,
    WorkerRemoved,
    WorkerSaved,
    group_created,
    session_started,
)
from sessionrouter.server.core.feed import GroupFeed, GroupOutcome
from sessionrouter.server.core.finalizer import FinishedGroup, GroupFinalizer
from sessionrouter.server.core.groups import (
    GROUP_BYTES,
    GroupLedger,
    GroupRecord,
    GroupSettings,
    GroupState,
    RequestRecord,
    RewardArena,
    SessionRecord,
    SessionState,
    member_cost,
)
from sessionrouter.server.core.intake import Resolved, Uniform, resolve, screen, uniform
from sessionrouter.server.core.placement import (
    PlacementMode,
    PlacementPolicy,
    choose_worker,
    fresh_worker,
)
from sessionrouter.server.core.recovery import RestoreSummary, rebuild
from sessionrouter.server.core.rewards import (
    STATUS_CODES,
    BatchOutcome,
    RewardBatch,
    RewardOutcome,
    RewardStatus,
)
from sessionrouter.server.core.settings import RouterSettings, RouterSnapshot, RouterStats
from sessionrouter.server.core.sizes import map_bytes, member_bytes
from sessionrouter.server.core.staleness import StalenessGate, StalenessPolicy
from sessionrouter.server.core.streams import (
    Entry,
    MemberReplaced,
    RewardFlow,
    StreamOrigin,
)
from sessionrouter.server.core.validation import (
    ID_MAX_LEN,
    MAX_REWARD_MAGNITUDE,
    REASON_MAX_LEN,
    check_id,
    check_text,
    parse_session_name,
    try_parse_session_name,
)
from sessionrouter.server.core.weight_updates import (
    WeightUpdate,
    check_completion,
    distinct_versions,
    refuse_during_update,
    select_for_update,
)
from sessionrouter.server.core.workers import (
    SessionKey,
    WorkerRecord,
    WorkerRegistry,
    check_room,
)

_T = TypeVar("_T")

WAITABLE_REASONS = frozenset({"STALENESS_LIMIT", "WEIGHT_UPDATE_IN_PROGRESS"})
"""Refusals a start may wait out (``start_when_admitted``) instead of returning them."""
WAIT_MARGIN_S = 0.05
"""A waiting start gives up this long before the caller's deadline, so that the caller
gets the refusal with its RetryInfo rather than a bare DEADLINE_EXCEEDED."""

__all__ = [  # the command, result and settings types live in their own modules
    "OptionsSpec",
    "RestoreSummary",
    "RouterSettings",
    "RouterStats",
    "SessionRouter",
    "StartGroupCommand",
    "StartSessionCommand",
    "StartedGroup",
    "StartedSession",
]

log = logging.getLogger("sessionrouter.router")

_WORKER_LOST = operator.attrgetter("worker_lost")
_CREATE_TIME = operator.attrgetter("create_time")
_MIN_VERSION = operator.attrgetter("min_version")
_MAX_VERSION = operator.attrgetter("max_version")
_ACCEPTED = STATUS_CODES[RewardStatus.ACCEPTED]
_NOT_FINITE = STATUS_CODES[RewardStatus.NOT_FINITE]
_GROUP_CLOSED = STATUS_CODES[RewardStatus.GROUP_CLOSED]
_INVALID_VERSIONS = STATUS_CODES[RewardStatus.INVALID_VERSIONS]
_UNKNOWN_SESSION = STATUS_CODES[RewardStatus.UNKNOWN_SESSION]
_WRONG_SHARD = STATUS_CODES[RewardStatus.WRONG_SHARD]


def _not_finite_detail(reward: float, metric: float | None) -> str:
    """Why a reward or its filter metric is refused NOT_FINITE (the reward is checked first)."""
    if not math.isfinite(reward):
        return f"reward {reward} is not finite"
    if abs(reward) > MAX_REWARD_MAGNITUDE:
        return (
            f"reward {reward:g} is beyond the magnitude bound {MAX_REWARD_MAGNITUDE:g}"
            " (its group statistics could overflow)"
        )
    return f"filter_metric {metric} is not finite"


def _refused_detail(session: SessionRecord, reward: float, metric: float | None) -> tuple[int, str]:
    """The status and detail of a reward for a session that is no longer open."""
    name = session.name
    if session.state is SessionState.ABORTED:
        return STATUS_CODES[RewardStatus.SESSION_ABORTED], f"session {name[:200]!r} was aborted"
    if session.reward == reward and session.filter_metric == metric:
        return STATUS_CODES[RewardStatus.DUPLICATE], "the same reward is recorded"
    return (
        STATUS_CODES[RewardStatus.CONFLICT],
        f"session {name[:200]!r} already has reward {session.reward!r}"
        f" (filter_metric {session.filter_metric!r})",
    )


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
        self.groups = GroupLedger(
            self.settings.finished_group_retention, self.settings.max_retained_bytes
        )
        # Group seqs, and so session handles, start at a random multiple of 2**32 in a router
        # kept in memory: restarted, it gives new groups seqs the previous process did not
        # use, so a handle a client kept from that process is unknown here instead of naming
        # another session. A journaled router numbers on from its journal (``restore``), so
        # its handles survive restarts. Seqs stay below 2**47, handles below 2**63.
        if journal is None:
            self.groups.restart_seqs((secrets.randbelow(1 << 14) << 32) + 1)
        self.feed = GroupFeed(
            self.settings.feed_retention, bytes_limit=self.settings.max_retained_bytes
        )
        self.journal: JournalSink | None = None
        """Where changes are appended as events; None keeps the router in memory only."""
        self.finalizer = GroupFinalizer(
            self.feed,
            self.settings.reducer_window_s,
            self.settings.reducer_max_batch,
            book=self.groups.cursor_book,
        )
        if journal is not None:
            self.attach_journal(journal)
        self._deadlines: list[tuple[float, int, str]] = []
        self._default_settings: dict[tuple[int, PlacementMode | None], GroupSettings] = {}
        """``_group_settings``' memory: the settings of groups started without options."""
        self.stats = RouterStats()
        self.on_group_finished: Callable[[GroupOutcome, float], None] | None = None
        """Called with each finished group's outcome and its seconds from creation to
        finalization (wall clock), for the completion-time histogram; None: not measured."""
        self.on_groups_finished: Callable[[GroupOutcome, NDArray[np.float64]], None] | None = None
        """``on_group_finished`` for many groups of one outcome at once, with their (n,)
        seconds: the complete groups a reward request finalizes (dozens per request). Set
        both or neither."""
        self._accepting = True
        self.reward_flows: set[RewardFlow] = set()
        """Open SubmitRewards streams (the transport adds and removes them): where
        replacement notices go."""
        self._refusal = ("SHUTTING_DOWN", "the router is shutting down and takes no new sessions")
        self._stopped = False
        self.trainer = StalenessGate()
        """The trainer's version and staleness policy, with the admission counters."""
        self.weight_update: WeightUpdate | None = None
        """The weight update in progress, if any (its workers have ``updating_to`` set)."""
        self._admission_changed = asyncio.Event()
        self.admission_waiting = 0
        """Starts parked in ``start_when_admitted`` until admission changes (refused now)."""
        self.new_group_id: Callable[[], str] = _random_group_id
        """Makes the id of a group started without one (a sharded router mints ids it owns)."""
        self.foreign_reward: Callable[[str], RewardOutcome | None] | None = None
        """For a reward entry naming a group this router does not hold: the outcome when the
        group is another shard's (WRONG_SHARD), None to answer UNKNOWN_SESSION."""
        self.foreign_handle: Callable[[int], RewardOutcome | None] | None = None
        """The same for a handle this router cannot resolve: WRONG_SHARD when it names
        another shard (sharded routers' handles carry their shard), None otherwise."""
        self.worker_versions: Callable[[], int] = lambda: distinct_versions(self.workers)
        """How many distinct known policy versions the healthy workers report, for the
        MIXED_VERSIONS check and the trainer state (a shard counts the whole shared pool, not
        only the workers it has a share of)."""

    # -- the router's life -----------------------------------------------------------------

    def attach_journal(self, journal: JournalSink) -> None:
        """Journals every change from now on, results included (before ``restore``)."""
        self.journal = journal
        self.finalizer.journal = journal

    @property
    def accepting(self) -> bool:
        """False once ``stop_accepting`` was called: new sessions are refused."""
        return self._accepting

    def stop_accepting(self) -> None:
        """Refuses new sessions from now on (draining for shutdown, or a failed journal);
        rewards, lookups and aborts still work. Starts waiting for admission are woken, to be
        refused now rather than at their deadline."""
        self._accepting = False
        self._stopped = True
        self._refusal = ("SHUTTING_DOWN", "the router is shutting down and takes no new sessions")
        self._notify_admission()

    def pause_accepting(self, reason: str, message: str) -> None:
        """Refuses new sessions (Unavailable ``reason``) until ``resume_accepting``: a
        condition that passes, such as a full disk."""
        if not self._stopped:
            self._accepting = False
            self._refusal = (reason, message)
            self._notify_admission()  # a waiting start gets this refusal now

    def resume_accepting(self) -> None:
        """Ends a pause; a router that stopped accepting for good stays stopped."""
        if not self._stopped:
            self._accepting = True

    def snapshot(self) -> RouterSnapshot:
        """The figures metrics export, copied now (call on the loop that owns the router)."""
        workers = self.workers
        healthy = sum(1 for w in workers if w.healthy)
        return RouterSnapshot(
            workers_healthy=healthy,
            workers_unhealthy=len(workers) - healthy,
            workers_draining=sum(1 for w in workers if w.draining),
            workers_eligible=workers.eligible_count,
            open_sessions=sum(len(w.open_sessions) for w in workers),
            open_groups=self.groups.open_groups,
            sessions_distinct=self.stats.sessions_distinct,
            sessions_shared=self.stats.sessions_shared,
            rewards=dict(self.stats.rewards),
            groups_finished=dict(self.stats.groups_finished),
            reducer_batches=self.finalizer.batches,
            groups_degenerate=self.finalizer.degenerate,
            feed_cursor=self.feed.last_cursor,
            workers_updating=sum(1 for w in workers if w.updating_to),
            worker_versions_distinct=self.worker_versions(),
            trainer_version=self.trainer.version,
            admission_in_flight=self.trainer.in_flight,
            admission_limit=self.trainer.limit,
        )

    # -- workers ---------------------------------------------------------------------------

    def register_worker(
        self,
        worker_id: str,
        address: str,
        capacity: int,
        labels: Mapping[str, str],
        policy_version: int = 0,
    ) -> WorkerRecord:
        known = self.workers.find(worker_id) is not None
        check_room(len(self.workers), self.settings.max_workers, known)
        worker, created = self.workers.register(
            worker_id,
            address,
            capacity,
            labels,
            self.clock.monotonic(),
            self.clock.wall(),
            policy_version,
        )
        self._journal_worker(worker)
        self._update_progressed()
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

    def heartbeat(self, worker_id: str, policy_version: int = 0) -> WorkerRecord:
        """Records a heartbeat; a new policy version is journaled (heartbeats are not), and
        the target version of a weight update ends the worker's update."""
        worker, recovered, changed = self.workers.heartbeat(
            worker_id, self.clock.monotonic(), self.clock.wall(), policy_version
        )
        if changed:
            self._journal_worker(worker)
            self._update_progressed()
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
        self._update_progressed()
        log.info(
            "worker deregistered",
            extra={"event": "worker_deregistered", "worker_id": worker_id, "lost_sessions": lost},
        )
        return worker, lost

    def get_worker(self, worker_id: str) -> WorkerRecord:
        return self.workers.get(worker_id)

    def find_worker(self, worker_id: str) -> WorkerRecord | None:
        return self.workers.find(worker_id)

    def list_workers(self, limit: int, after: str) -> tuple[list[WorkerRecord], str]:
        """Up to ``limit`` workers in id order after ``after``, and the last id given."""
        return self.workers.page(limit, after)

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
                    worker.policy_version,
                    worker.updating_to,
                )
            )

    # -- versions, staleness and weight updates --------------------------------------------

    def set_trainer_state(
        self,
        version: int,
        policy: StalenessPolicy | None = None,
        *,
        clear_policy: bool = False,
        reset_counters: bool = False,
        refuse_mixed_versions: bool | None = None,
    ) -> StalenessGate:
        """The trainer reports its version (and optionally its staleness policy); admission
        reopens at once when the limit grows. Refusals change nothing."""
        self.trainer.set_state(version, policy, clear_policy, reset_counters, refuse_mixed_versions)
        self._journal_trainer()
        self._notify_admission()
        log.info(
            "trainer state",
            extra={
                "event": "trainer_state",
                "trainer_version": version,
                "admission_limit": self.trainer.limit,
            },
        )
        return self.trainer

    def begin_weight_update(
        self, version: int, worker_ids: Sequence[str], interrupt_sessions: bool
    ) -> tuple[list[WorkerRecord], int]:
        """Takes the selected workers (all when none is named) out of placement until they
        serve ``version``; returns them and how many open sessions were marked interrupted."""
        chosen = select_for_update(self.workers, version, worker_ids)
        interrupted = 0
        for worker in chosen:
            self.workers.begin_update(worker, version)
            self._journal_worker(worker)
            if interrupt_sessions:
                interrupted += self._interrupt_sessions(worker)
        self.weight_update = WeightUpdate(version, fleet_wide=not worker_ids)
        self._journal_trainer()
        log.info(
            "weight update begun",
            extra={
                "event": "weight_update_begun",
                "version": version,
                "workers": len(chosen),
                "interrupted": interrupted,
            },
        )
        self._update_progressed()
        return chosen, interrupted

    def complete_weight_update(self, worker_id: str, version: int) -> tuple[WorkerRecord, bool]:
        """Puts a worker back with its new version; returns it and whether the update is
        over (no worker left updating)."""
        worker = self.workers.get(worker_id)
        self.workers.complete_update(worker, check_completion(worker, version))
        self._journal_worker(worker)
        self._update_progressed()
        return worker, self.weight_update is None

    def follow_worker_update(self, worker_id: str, updating_to: int, version: int) -> None:
        """Takes a worker's update state as decided elsewhere (a shard applying the shared
        pool's record, checked where it was written): begins an update to ``updating_to``,
        or with 0 ends it at ``version``."""
        worker = self.workers.get(worker_id)
        if updating_to and worker.updating_to != updating_to:
            self.workers.begin_update(worker, updating_to)
        elif not updating_to and worker.updating_to:
            self.workers.complete_update(worker, max(version, worker.policy_version))
        else:
            return
        self._journal_worker(worker)
        self._update_progressed()

    def interrupt_open_sessions(self, worker_id: str) -> int:
        """Marks the worker's open sessions interrupted, skipping those marked already, and
        returns how many it marked: a shard calls it each time it applies a pool record
        whose update asks for it, so it must be idempotent."""
        return self._interrupt_sessions(self.workers.get(worker_id), skip_marked=True)

    def _interrupt_sessions(self, worker: WorkerRecord, skip_marked: bool = False) -> int:
        count = 0
        for group_id, index in sorted(s.key for s in worker.open_sessions):
            group = self.groups.find(group_id)
            session = self.groups.find_session(group_id, index)
            if group is None or session is None or session.state is not SessionState.OPEN:
                continue
            if skip_marked and session.interrupted:
                continue
            session.interrupted = True
            count += 1
            if self.journal is not None:
                self.journal.append(SessionInterrupted(group.seq, index))
        return count

    def _update_progressed(self) -> None:
        """Ends the update in progress once none of its workers is updating any more."""
        update = self.weight_update
        if update is not None and not any(w.updating_to for w in self.workers):
            self.weight_update = None
            self._journal_trainer()
            log.info(
                "weight update finished",
                extra={"event": "weight_update_finished", "version": update.version},
            )
        self._notify_admission()

    def _journal_trainer(self) -> None:
        if self.journal is None:
            return
        gate, update = self.trainer, self.weight_update
        self.journal.append(
            TrainerSaved(
                gate.version,
                gate.policy.max_staleness if gate.policy else 0,
                gate.policy.batch_size if gate.policy else 0,
                gate.refuse_mixed_versions,
                gate.started,
                gate.dropped,
                gate.epoch,
                update.version if update else 0,
                update.fleet_wide if update else False,
            )
        )

    def trainer_changed(self) -> None:
        """Journals ``trainer`` and wakes waiting starts after a change made from outside
        the router: a shard applying the fleet's trainer state or a new admission lease."""
        self._journal_trainer()
        self._notify_admission()

    def _notify_admission(self) -> None:
        changed, self._admission_changed = self._admission_changed, asyncio.Event()
        changed.set()

    def _check_fleet_update(self) -> None:
        update = self.weight_update
        if update is not None and update.fleet_wide:
            raise refuse_during_update(update, self.settings.retry_after_s)

    def _check_admission(self) -> None:
        """What a start that creates a group must pass beyond placement: no fleet-wide
        update, the staleness limit, and (by option) a fleet of one version."""
        self._check_fleet_update()
        self.trainer.check_admit(self.settings.retry_after_s)
        if self.trainer.refuse_mixed_versions:
            versions = self.worker_versions()
            if versions > 1:
                raise FailedPrecondition(
                    "MIXED_VERSIONS",
                    f"healthy workers serve {versions} different policy versions; new groups"
                    " are refused until they agree",
                    metadata={"distinct_versions": versions},
                )

    async def start_when_admitted(self, start: Callable[[], _T], timeout_s: float) -> _T:
        """Calls ``start`` until it is not refused for staleness or a fleet-wide update,
        waiting for each change of admission, for at most ``timeout_s`` seconds (minus a
        small margin, so the last refusal reaches the caller before its deadline)."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + timeout_s - WAIT_MARGIN_S
        while True:
            changed = self._admission_changed
            try:
                return start()
            except (ResourceExhausted, Unavailable) as error:
                if error.reason not in WAITABLE_REASONS:
                    raise
                remaining = give_up - loop.time()
                if remaining <= 0:
                    raise
                self.admission_waiting += 1
                try:
                    await asyncio.wait_for(changed.wait(), remaining)
                except TimeoutError:
                    raise error from None
                finally:
                    self.admission_waiting -= 1

    def _on_worker_lost(self, worker: WorkerRecord, sessions: set[SessionKey]) -> None:
        touched: dict[str, GroupRecord] = {}
        for group_id, index in sorted(sessions):
            group = self.groups.find(group_id)
            session = self.groups.find_session(group_id, index)
            if group is not None and session is not None and session.state is SessionState.OPEN:
                session.worker_lost = True
                group.lost += 1
                if self.journal is not None:
                    self.journal.append(SessionLost(group.seq, index))
                if group.state is GroupState.OPEN:
                    self._replace(group, session, "worker_lost")
                    touched[group_id] = group
        for group in touched.values():
            if group.state is GroupState.OPEN and (group.settled or group.stranded):
                self._finish(group, None)
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
        task_id, request_id, metadata = check_start(cmd, min_group_size=0)
        fingerprint = ("session", task_id, cmd.group_id, cmd.group_size)
        if request_id:
            replay = self.groups.find_request(request_id)
            if replay is not None:
                self._check_replay(replay, request_id, fingerprint)
                replayed = self.groups.get(replay.group_id)
                assert replay.index is not None
                # Member 0 of a group is placed by the StartSession that created it (a
                # StartGroup request records no index), so the first reply said created.
                created_it = replay.index == 0
                return StartedSession(replayed.members[replay.index], replayed, created_it, True)
        if not self._accepting:
            self._check_accepting()
        existing = self.groups.find(cmd.group_id) if cmd.group_id is not None else None
        if existing is not None:
            group = existing
            check_joinable(
                group, task_id, cmd.group_size, cmd.options, self.settings, cmd.placement_mode
            )
            if self.weight_update is not None:
                self._check_fleet_update()
            cost = member_cost(group, metadata)
            self._check_bytes(cost)
            session = self._place_member(group, request_id, metadata, cost=cost)
            created = False
        else:
            size = cmd.group_size or 1
            self._check_room(size, task_id, metadata)
            settings = self._group_settings(cmd.options, size, cmd.placement_mode)
            self._check_admission()
            group_id = cmd.group_id or self.new_group_id()
            group = self._new_group(group_id, task_id, size, settings)
            try:
                session = self._place_member(group, request_id, metadata)
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
                self.journal.append(group_created(group))
            self.journal.append(session_started(group, session))
            if request_id:
                self.journal.append(RequestSaved(request_id, group.seq, session.index, fingerprint))
        return StartedSession(session, group, created, False)

    def start_group(self, cmd: StartGroupCommand) -> StartedGroup:
        """Creates a group and places all its members at once: all or none."""
        task_id, request_id, metadata = check_start(cmd, min_group_size=1)
        fingerprint = ("group", task_id, cmd.group_id, cmd.group_size)
        if request_id:
            replay = self.groups.find_request(request_id)
            if replay is not None:
                self._check_replay(replay, request_id, fingerprint)
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
        self._check_room(cmd.group_size, task_id, metadata)
        settings = self._group_settings(cmd.options, cmd.group_size, cmd.placement_mode)
        self._check_admission()
        group = self._new_group(
            cmd.group_id or self.new_group_id(), task_id, cmd.group_size, settings
        )
        try:
            for _ in range(cmd.group_size):
                self._place_member(group, request_id, metadata)
        except BaseException:
            self._forget_empty_group(group)
            raise
        self._add_group(group)
        if request_id:
            self.groups.add_request(request_id, RequestRecord(group.group_id, None, fingerprint))
        if self.journal is not None:
            self.journal.append(group_created(group))
            for session in group.members:
                self.journal.append(session_started(group, session))
            if request_id:
                self.journal.append(RequestSaved(request_id, group.seq, None, fingerprint))
        return StartedGroup(group, any(s.shared_worker for s in group.members), False)

    def _group_settings(
        self, options: OptionsSpec, size: int, mode: PlacementMode | None
    ) -> GroupSettings:
        """``resolve_options``, remembered per (size, mode) for a start that gave no options
        (the settings are frozen values, so groups may share one; a refusal raises and is
        not remembered). At most ``MAX_GROUP_SIZE`` sizes times four modes."""
        if options is not NO_OPTIONS:
            return resolve_options(options, size, self.settings, mode)
        key = (size, mode)
        settings = self._default_settings.get(key)
        if settings is None:
            settings = self._default_settings[key] = resolve_options(
                options, size, self.settings, mode
            )
        return settings

    @staticmethod
    def _check_replay(
        record: RequestRecord, request_id: str, fingerprint: tuple[object, ...]
    ) -> None:
        """Refuses a start whose request id an earlier start of another request used
        (``record``, found for ``request_id``); a start finds the record itself, so the
        usual new request id costs one lookup and no call."""
        if record.fingerprint != fingerprint:
            raise InvalidArgument(
                "REQUEST_ID_REUSED",
                f"request_id {request_id!r} was used before for a different request",
                metadata={"request_id": request_id},
                field_violations=[("request_id", "already used for a different request")],
            )

    def _check_accepting(self) -> None:
        if not self.accepting:
            reason, message = self._refusal
            raise Unavailable(reason, message, retry_after_s=self.settings.retry_after_s)

    def _check_bytes(self, added: int) -> None:
        """ResourceExhausted when ``added`` more bytes would pass the open-bytes limit."""
        limit = self.settings.max_open_bytes
        if self.groups.open_bytes + added > limit:
            raise ResourceExhausted(
                "OPEN_BYTES_LIMIT",
                f"open groups hold about {self.groups.open_bytes} bytes; {added} more would"
                f" pass the limit of {limit}: finish or abort some first",
                metadata={"open_bytes": self.groups.open_bytes, "added": added, "limit": limit},
            )

    def _check_room(self, size: int, task_id: str, metadata: Mapping[str, str]) -> None:
        """ResourceExhausted when one more open group of ``size`` members would pass the
        open-group, open-session or open-bytes limit (the details name the limit and its
        value)."""
        limits = self.settings
        groups = self.groups
        self._check_bytes(
            GROUP_BYTES + size * member_bytes(ID_MAX_LEN, len(task_id), map_bytes(metadata))
        )
        if groups.open_groups >= limits.max_open_groups:
            raise ResourceExhausted(
                "OPEN_GROUPS_LIMIT",
                f"{groups.open_groups} groups are open, at most {limits.max_open_groups}"
                " allowed: finish or abort some first",
                metadata={"open_groups": groups.open_groups, "limit": limits.max_open_groups},
            )
        if groups.open_sessions + size > limits.max_open_sessions:
            raise ResourceExhausted(
                "OPEN_SESSIONS_LIMIT",
                f"open groups hold {groups.open_sessions} members; {size} more would pass the"
                f" limit of {limits.max_open_sessions}",
                metadata={
                    "open_sessions": groups.open_sessions,
                    "group_size": size,
                    "limit": limits.max_open_sessions,
                },
            )

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
        group.admitted_version = self.trainer.version
        group.admission_epoch = self.trainer.admitted()
        if group.admission_epoch:
            self._journal_trainer()
        self.groups.add_group(group)
        heapq.heappush(self._deadlines, (group.deadline, group.seq, group.group_id))
        if log.isEnabledFor(logging.DEBUG):  # not at the default level: no extra dict built
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
            self.workers.release_session(session.worker_id, session)
        group.members.clear()

    def _place_member(
        self,
        group: GroupRecord,
        request_id: str,
        metadata: dict[str, str],
        policy: PlacementPolicy | None = None,
        cost: int = -1,
    ) -> SessionRecord:
        """Places one more member of ``group``; ``cost`` is its ``member_cost`` when the
        caller has it already, which it has only for a group the ledger holds (-1: computed
        here, when the ledger holds the group)."""
        policy = policy or group.settings.placement
        per_worker = group.members_per_worker
        workers = self.workers
        worker = fresh_worker(workers, per_worker, policy)
        shared = False
        if worker is None:
            choice = choose_worker(
                workers,
                group.group_id,
                group.size,
                per_worker,
                group.members[-1].worker_id if group.members else "",
                policy,
                self.settings.retry_after_s,
                fresh_tried=True,
            )
            worker, shared = choice.worker, choice.shared
        version = worker.policy_version
        session = SessionRecord(  # the first nine fields by position: cheaper than keywords
            group.group_id,
            len(group.members),
            group.task_id,
            worker.worker_id,
            worker.address,
            request_id,
            metadata,
            self.clock.wall(),
            shared,
            start_version=version,
            min_version=version,
            max_version=version,
        )
        ledger = self.groups
        # A caller that has the cost joins a group the ledger holds (no lookup to know it).
        if cost >= 0 or ledger.find(group.group_id) is group:
            ledger.member_joined(group, metadata, cost)
        group.members.append(session)
        group.count_start_version(version)
        per_worker[worker.worker_id] = per_worker.get(worker.worker_id, 0) + 1
        workers.add_session(worker, session, True)  # placement picks eligible workers only
        if shared:
            self.stats.sessions_shared += 1
        else:
            self.stats.sessions_distinct += 1
        return session

    def _replace(self, group: GroupRecord, old: SessionRecord, reason: str) -> None:
        """Starts a replacement for ``old`` when the group asked for it (``replace_lost``),
        on a worker the group does not use yet when possible (STRICT: only then); ``old``
        leaves the group (aborted). Nothing happens when no worker can take it, or after
        ``size`` replacements: ``old`` then stays as it is."""
        policy = group.settings.placement
        if not policy.replace_lost or group.replaced >= group.size or old.replaced_by >= 0:
            return
        mode = PlacementMode.STRICT if policy.mode is PlacementMode.STRICT else PlacementMode.SPREAD
        try:
            new = self._place_member(
                group, "", dict(old.metadata), dataclasses.replace(policy, mode=mode)
            )
        except (Unavailable, ResourceExhausted) as error:
            log.warning(
                "member not replaced",
                extra={"event": "member_not_replaced", "session": old.name, "error": error.reason},
            )
            return
        new.replaces, old.replaced_by = old.index, new.index
        group.replaced += 1
        if old.state is SessionState.OPEN:
            old.state = SessionState.ABORTED
            group.aborted += 1
            self.workers.release_session(old.worker_id, old)
            if self.journal is not None:
                self.journal.append(SessionAborted(group.seq, old.index))
        if self.journal is not None:
            self.journal.append(session_started(group, new))
        notice = MemberReplaced(group.group_id, old.name, new, group, reason)
        for flow in self.reward_flows:
            flow.notify(notice)
        log.info(
            "member replaced",
            extra={"event": "member_replaced", "session": old.name, "replacement": new.name},
        )

    # -- sessions and groups ---------------------------------------------------------------

    def get_session(self, name: str) -> SessionRecord:
        group_id, index = parse_session_name(name)
        return self.groups.get_session(group_id, index)

    def get_group(self, group_id: str) -> GroupRecord:
        check_id("group_id", group_id)
        return self.groups.get(group_id)

    def find_group(self, group_id: str) -> GroupRecord | None:
        return self.groups.find(group_id)

    def list_groups(
        self, limit: int, after_seq: int, state: GroupState | None
    ) -> tuple[list[GroupRecord], int]:
        """Up to ``limit`` groups in creation order after ``after_seq`` (optionally only
        those in ``state``), and the seq to continue after (0: no more)."""
        return self.groups.page(limit, after_seq, state)

    def abort_session(self, name: str, reason: str, retryable: bool = False) -> SessionRecord:
        """Ends a session early: frees its slot; it leaves the group's statistics. With
        ``retryable``, a group with ``replace_lost`` gets a replacement member."""
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
        self.workers.release_session(session.worker_id, session)
        log.info(
            "session aborted", extra={"event": "session_aborted", "session": name, "reason": reason}
        )
        if retryable:
            self._replace(group, session, "aborted")
        if group.settled or group.stranded:
            self._finish(group, None)
        return session

    # -- rewards ---------------------------------------------------------------------------

    def submit_rewards(
        self,
        entries: Sequence[Entry],
        origin: StreamOrigin | None = None,
    ) -> list[RewardOutcome]:
        """Records a batch of (session name, reward[, filter metric[, min_version,
        max_version]]) entries; one outcome per entry, in order (``submit_batch`` over the
        same entries)."""
        metrics = [e[2] if len(e) > 2 else None for e in entries]
        has_metric = [m is not None for m in metrics]
        versions = [(e[3], e[4]) if len(e) > 4 else (0, 0) for e in entries]
        versioned = any(len(e) > 4 for e in entries)
        batch = RewardBatch(
            rewards=[e[1] for e in entries],
            names=[e[0] for e in entries],
            metrics=[m or 0.0 for m in metrics] if any(has_metric) else None,
            has_metric=has_metric if any(has_metric) else None,
            min_versions=[low for low, _ in versions] if versioned else None,
            max_versions=[high for _, high in versions] if versioned else None,
        )
        return self.submit_batch(batch, origin).outcomes()

    def submit_batch(self, batch: RewardBatch, origin: StreamOrigin | None = None) -> BatchOutcome:
        """Records one request's rewards; one status per entry, in order.

        Only ACCEPTED entries change state, one after the other, so a later entry of the same
        request for the same session is DUPLICATE or CONFLICT. A group whose last reward
        arrives here is finished and queued for reduction, and its result is owed to
        ``origin``.

        The checks that need no state run over the whole request first (``core.intake``:
        magnitudes and finiteness with NumPy, handles split with NumPy, each group looked up
        once per run of its entries); the loop below then applies the entries run by run.
        A group is tested for completion once per run (a group without lost members can
        only settle on the last reward it was missing, and no entry after that one can be
        accepted for it), freed slots are given back once per worker at the end, and the
        statuses are counted once.

        A request ``core.intake.uniform`` finds wholly acceptable (the common columnar one)
        is applied by ``_submit_uniform`` instead, with arrays and once per group."""
        whole = uniform(batch, self.groups.find_seq, self.groups.find)
        if whole is not None:
            return self._submit_uniform(whole, batch.columnar, origin)
        n = len(batch.rewards)
        codes = bytearray(b"\x01") * n
        refused: dict[int, str] = {}
        owners: dict[int, tuple[int, str]] = {}
        checked = screen(batch)
        resolved = resolve(batch, self.groups.find_seq, self.groups.find)
        sessions = resolved.sessions
        bad_versions, versions_of = checked.bad_versions, checked.versions
        bad_values, metrics = checked.bad_values, checked.metrics
        flagged = bool(bad_versions or bad_values)
        rewards = batch.rewards
        journal = self.journal
        record_rewards = self.groups.record_rewards
        with_metrics = metrics is not None
        freed: dict[str, list[SessionRecord]] = {}
        completed: list[GroupRecord] = []
        """Groups this request completed (every member rewarded, none replaced), handed to
        the finalizer together, in finish order (before any other group finishes)."""
        arena = self._one_arena(resolved) if metrics is None else None
        """Set when the accepted rewards go into the arena in one write after the loop."""
        OPEN, REWARDED = SessionState.OPEN, SessionState.REWARDED  # noqa: N806
        for group, start, end in resolved.runs:
            if group is None:
                for i in range(start, end):
                    if i in bad_versions:
                        codes[i] = _INVALID_VERSIONS
                        refused[i] = bad_versions[i]
                        continue
                    foreign = self._foreign(batch, i)
                    if foreign is None:
                        codes[i] = _UNKNOWN_SESSION
                        refused[i] = resolved.unknown[i]
                    else:
                        codes[i] = _WRONG_SHARD
                        refused[i] = foreign.detail
                        owners[i] = (foreign.owner_shard or 0, foreign.owner_address)
                continue
            # Stranded (only lost members left open) is possible only with a lost member,
            # and whether a member is lost cannot change during this call: look once.
            lost = any(map(_WORKER_LOST, group.members))
            rewarded: list[SessionRecord] = []
            low, high = group.counted_min_version, group.counted_max_version
            for i in range(start, end):
                if flagged:
                    if i in bad_versions:
                        codes[i] = _INVALID_VERSIONS
                        refused[i] = bad_versions[i]
                        continue
                    if i in bad_values:
                        codes[i] = _NOT_FINITE
                        refused[i] = _not_finite_detail(
                            rewards[i], metrics[i] if metrics is not None else None
                        )
                        continue
                session = sessions[i]
                assert session is not None
                metric = metrics[i] if metrics is not None else None
                if session.state is not OPEN:
                    code, refused[i] = _refused_detail(session, rewards[i], metric)
                    codes[i] = code
                    continue
                if group.state is not GroupState.OPEN:
                    codes[i] = _GROUP_CLOSED
                    refused[i] = (
                        f"group {group.group_id!r} was {group.state.value} without this session"
                    )
                    continue
                if versions_of and i in versions_of:
                    versions = versions_of[i]
                    session.min_version, session.max_version = versions
                    if journal is not None:
                        journal.append(SessionVersions(group.seq, session.index, *versions))
                session.reward = reward = float(rewards[i])
                session.state = REWARDED
                group.rewarded += 1
                if metric is not None:
                    session.filter_metric = metric = float(metric)
                if session.min_version < low:
                    low = session.min_version
                if session.max_version > high:
                    high = session.max_version
                rewarded.append(session)
                if journal is not None:
                    journal.reward(group.seq, session.index, reward)
                    if metric is not None:
                        journal.append(FilterMetricSaved(group.seq, session.index, metric))
                worker = freed.get(session.worker_id)
                if worker is None:
                    worker = freed[session.worker_id] = []
                worker.append(session)
                if lost and group.stranded:
                    record_rewards(group, rewarded, with_metrics)
                    rewarded = []
                    self._finish_after(completed, group, origin)
            if rewarded:
                if arena is None:
                    record_rewards(group, rewarded, with_metrics)
                else:
                    self.groups.widen_versions(group, low, high)
                if group.settled:
                    if group.rewarded == group.size == len(group.members):
                        completed.append(group)
                    else:
                        self._finish_after(completed, group, origin)
        if arena is not None:
            self._record_accepted(arena, resolved, codes, refused, checked.values)
        if completed:
            self._finish_complete(completed, origin)
        for worker_id, keys in freed.items():
            self.workers.release_sessions(worker_id, keys)
        detail_entries = sorted(refused)
        outcome = BatchOutcome(
            codes,
            detail_entries,
            [refused[i] for i in detail_entries],
            batch.columnar,
            owners or None,
        )
        counts = self.stats.rewards
        if refused:
            for status, count in outcome.counts().items():
                counts[status] += count
        else:
            counts[RewardStatus.ACCEPTED] += n
        return outcome

    def _submit_uniform(
        self, request: Uniform, columnar: bool, origin: StreamOrigin | None
    ) -> BatchOutcome:
        """Applies a request whose every entry is ACCEPTED (``core.intake.uniform``): the
        same state as the per-entry loop leaves, reached with one NumPy write of the
        rewards into the arena, one pass setting the session records (what GetSession, the
        journal and recovery read), and the groups' counts, versions and completion once per
        group. Every group it completes is complete with every member rewarded."""
        sessions, rewards = request.sessions, request.rewards
        rewarded_state = SessionState.REWARDED
        freed: dict[str, list[SessionRecord]] = {}
        for session, reward in zip(sessions, rewards, strict=True):
            session.reward = reward
            session.state = rewarded_state
            held = freed.get(session.worker_id)
            if held is None:
                freed[session.worker_id] = [session]
            else:
                held.append(session)
        self.groups.record_columns(request.arena, request.rows, request.slots, request.values)
        journal = self.journal
        bounds = request.bounds
        widen = self.groups.widen_versions
        completed: list[GroupRecord] = []
        done: list[int] = []
        """Positions in ``request.groups`` of the ``completed`` groups."""
        for k, group in enumerate(request.groups):
            start, end = bounds[k], bounds[k + 1]
            run = sessions[start:end]
            if journal is not None:
                seq = group.seq
                for session, reward in zip(run, rewards[start:end], strict=True):
                    journal.reward(seq, session.index, reward)
            low, high = group.start_min_version, group.start_max_version
            if low != high:  # members started at different versions: read this run's
                low, high = min(map(_MIN_VERSION, run)), max(map(_MAX_VERSION, run))
            widen(group, low, high)
            group.rewarded += end - start
            if group.rewarded == group.size == len(group.members):
                completed.append(group)
                done.append(k)
        if completed:
            rows = request.group_rows  # the arena rows ``uniform`` found, as the queue takes them
            last = request.last
            if last is not None and len(done) > 1:
                # Taken group by group: finish in the order of each group's last reward in
                # the request, as the per-entry path does.
                done.sort(key=last.__getitem__)
                completed = [request.groups[k] for k in done]
            if len(done) < len(rows) or last is not None:  # some, or reordered: their rows
                rows = rows[done]
            self._finish_complete(completed, origin, rows)
        for worker_id, held in freed.items():
            self.workers.release_sessions(worker_id, held)
        n = len(sessions)
        self.stats.rewards[RewardStatus.ACCEPTED] += n
        return BatchOutcome(bytearray(b"\x01") * n, [], [], columnar, None)

    @staticmethod
    def _one_arena(resolved: Resolved) -> RewardArena | None:
        """The arena of every group a request names, when its entries all resolved by handle
        (``Resolved.slots``) to groups of one size without replaced members: then the
        accepted rewards are written in one NumPy assignment (``_record_accepted``) instead
        of one scalar write per session. None otherwise."""
        if resolved.slots is None or not resolved.runs:
            return None
        arena = resolved.runs[0][0].arena if resolved.runs[0][0] is not None else None
        for group, _, _ in resolved.runs:
            if group is None or group.arena is not arena or group.replaced:
                return None
        return arena

    def _record_accepted(
        self,
        arena: RewardArena,
        resolved: Resolved,
        codes: bytearray,
        refused: dict[int, str],
        values: NDArray[np.float64],
    ) -> None:
        """Writes the accepted entries' rewards into their groups' arena rows at once (the
        request ``_one_arena`` found writable so)."""
        runs = resolved.runs
        slots = resolved.slots
        assert slots is not None
        rows = np.repeat(
            np.array([g.arena_row if g is not None else -1 for g, _, _ in runs], dtype=np.intp),
            [end - start for _, start, end in runs],
        )
        if refused:
            accepted = np.frombuffer(codes, dtype=np.uint8) == _ACCEPTED
            if not accepted.any():
                return
            rows, slots, values = rows[accepted], slots[accepted], values[accepted]
        self.groups.record_columns(arena, rows, slots, values)

    def _foreign(self, batch: RewardBatch, i: int) -> RewardOutcome | None:
        """Entry i's WRONG_SHARD outcome when its handle names another shard, or its name
        a session of another shard's group (sharded routers only)."""
        handle = batch.handles[i] if batch.handles is not None else 0
        if handle and self.foreign_handle is not None:
            return self.foreign_handle(handle)
        if self.foreign_reward is None or batch.names is None or not batch.names[i]:
            return None
        parsed = try_parse_session_name(batch.names[i])
        return None if parsed is None else self.foreign_reward(parsed[0])

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

    def _finish_complete(
        self,
        groups: list[GroupRecord],
        origin: StreamOrigin | None,
        rows: NDArray[np.int64] | None = None,
    ) -> None:
        """``_finish`` for groups that are complete with every member rewarded and none
        replaced (nothing to release, nothing to exclude): one finalizer call for all of
        them, with no per-group record built; ``rows``: their arena rows, as
        ``GroupFinalizer.submit_complete`` takes them, when the caller holds them."""
        now = self.clock.wall()
        mark_finished = self.groups.mark_finished
        complete = GroupOutcome.COMPLETE
        for group in groups:
            group.state = GroupState.FINALIZED
            mark_finished(group)
        if self.on_groups_finished is not None:
            created = np.fromiter(map(_CREATE_TIME, groups), np.float64, len(groups))
            self.on_groups_finished(complete, np.maximum(now - created, 0.0))
        self.stats.groups_finished[complete] += len(groups)
        self.finalizer.submit_complete(groups, origin, now, self.trainer.version, rows)
        if log.isEnabledFor(logging.DEBUG):
            for group in groups:
                _log_finished(logging.DEBUG, group, complete, group.size)

    def _finish_after(
        self, completed: list[GroupRecord], group: GroupRecord, origin: StreamOrigin | None
    ) -> None:
        """``_finish`` of ``group``, after handing on the complete groups a request collected
        before it (``completed``, emptied): groups reach the finalizer in finish order. Only
        a group that ends otherwise than complete (stranded, or settled with aborted or
        replaced members) comes here, so the common request pays no call for it."""
        if completed:
            self._finish_complete(completed, origin)
            completed.clear()
        self._finish(group, origin)

    def _finish(self, group: GroupRecord, origin: StreamOrigin | None) -> None:
        members = group.members
        counted: tuple[SessionRecord, ...]
        excluded: tuple[SessionRecord, ...]
        if group.rewarded == len(members):  # the common case: no pass over the states
            counted, excluded = tuple(members), ()
        else:
            counted = tuple(s for s in members if s.state is SessionState.REWARDED)
            excluded = tuple(s for s in members if s.state is not SessionState.REWARDED)
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
            self.workers.release_session(session.worker_id, session)
        self.groups.mark_finished(group)
        self.stats.groups_finished[outcome] += 1
        now = self.clock.wall()
        if self.on_group_finished is not None:
            self.on_group_finished(outcome, max(0.0, now - group.create_time))
        if outcome is GroupOutcome.DROPPED and self.trainer.dropped_one(group.admission_epoch):
            self._journal_trainer()
            self._notify_admission()
        self.finalizer.submit(
            FinishedGroup(group, outcome, counted, excluded, now, origin, self.trainer.version)
        )
        # A complete group at debug (the activity line sums them up at info); one that ended
        # partial or dropped (deadline, aborts, lost workers) at info.
        level = logging.DEBUG if outcome is GroupOutcome.COMPLETE else logging.INFO
        if log.isEnabledFor(level):  # the extra dict is not built for nothing
            _log_finished(level, group, outcome, len(counted))

    # -- recovery --------------------------------------------------------------------------

    def restore(self, state: RecoveredState) -> RestoreSummary:
        """Rebuilds an empty router from what a journal read back, before it serves (see
        ``core.recovery``), then finalizes the groups that had nothing left to wait for."""
        self.groups.restart_seqs(1)  # the journal's numbering, not the in-memory random one
        rebuilt = rebuild(
            state, self.workers, self.groups, self.feed, self.clock.monotonic(), self.clock.wall()
        )
        saved = state.trainer
        if saved is not None:
            self.trainer = StalenessGate(
                version=saved.version,
                policy=StalenessPolicy(saved.max_staleness, saved.batch_size)
                if saved.batch_size
                else None,
                refuse_mixed_versions=saved.refuse_mixed_versions,
                started=saved.started,
                dropped=saved.dropped,
                epoch=saved.epoch,
            )
            if saved.update_version:
                self.weight_update = WeightUpdate(saved.update_version, saved.update_fleet_wide)
        for group in rebuilt.open_groups:
            heapq.heappush(self._deadlines, (group.deadline, group.seq, group.group_id))
        for group in rebuilt.settled:
            self._finish(group, None)
        for group in rebuilt.open_groups:
            if group.state is GroupState.OPEN and group.stranded:
                self._finish(group, None)
        return RestoreSummary(
            workers=len(state.workers),
            groups_open=self.groups.open_groups,
            groups_finished=rebuilt.groups_finished,
            sessions=rebuilt.sessions,
            open_rewards=rebuilt.open_rewards,
            requests=rebuilt.requests,
            feed_cursor=self.feed.last_cursor,
            finalized_on_restore=len(rebuilt.settled),
        )


def _random_group_id() -> str:
    return uuid.uuid4().hex


def _log_finished(level: int, group: GroupRecord, outcome: GroupOutcome, rewarded: int) -> None:
    """The ``group_finished`` event of one group (callers check ``isEnabledFor`` first, so
    nothing is built at a level that is off)."""
    log.log(
        level,
        "group %s",
        outcome.value,
        extra={
            "event": "group_finished",
            "group_id": group.group_id,
            "outcome": outcome.value,
            "rewarded": rewarded,
            "group_size": group.size,
        },
    )
