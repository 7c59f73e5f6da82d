"""Versions, staleness-bounded admission and weight updates on the core, with a ManualClock."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from simulate_staleness import simulate

from sessionrouter.server import convert
from sessionrouter.server.core.clock import ManualClock
from sessionrouter.server.core.commands import OptionsSpec, StartGroupCommand, StartSessionCommand
from sessionrouter.server.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    RouterError,
    Unavailable,
)
from sessionrouter.server.core.feed import GroupOutcome
from sessionrouter.server.core.groups import GroupState
from sessionrouter.server.core.rewards import RewardStatus
from sessionrouter.server.core.router import RouterSettings, SessionRouter
from sessionrouter.server.core.staleness import (
    MAX_BATCH_SIZE,
    MAX_STALENESS,
    StalenessGate,
    StalenessPolicy,
)
from sessionrouter.server.journal import SqliteJournal

SETTINGS = RouterSettings(
    deadline_s=10.0, min_members=1, reducer_window_s=0.0, heartbeat_timeout_s=3600.0
)


def make_router(workers: int = 4, clock: ManualClock | None = None) -> SessionRouter:
    router = SessionRouter(SETTINGS, clock or ManualClock())
    for i in range(workers):
        router.register_worker(f"w{i}", f"10.0.0.{i}:1", 64, {}, policy_version=1)
    return router


def start(router: SessionRouter, size: int = 2, group_id: str | None = None) -> str:
    return router.start_group(StartGroupCommand("t", size, group_id=group_id)).group.group_id


def finish(router: SessionRouter, group_id: str, reward: float = 1.0) -> None:
    group = router.groups.get(group_id)
    router.submit_rewards([(m.name, reward + m.index) for m in group.members])
    router.finalizer.drain()


# -- the admission rule ------------------------------------------------------------------------


def test_admission_stops_at_v_plus_k_plus_1_times_b_and_opens_when_the_trainer_steps() -> None:
    router = make_router()
    router.set_trainer_state(0, StalenessPolicy(max_staleness=1, batch_size=2))
    assert router.trainer.limit == 4
    groups = [start(router) for _ in range(4)]
    with pytest.raises(ResourceExhausted) as info:
        start(router)
    assert info.value.reason == "STALENESS_LIMIT"
    assert info.value.retry_after_s == SETTINGS.retry_after_s
    assert info.value.metadata["limit"] == "4" and info.value.metadata["in_flight"] == "4"
    # Finishing groups does not reopen admission: they still count until the trainer steps.
    for gid in groups:
        finish(router, gid)
    with pytest.raises(ResourceExhausted):
        router.start_session(StartSessionCommand("t", group_size=2))
    router.set_trainer_state(1)
    assert router.trainer.limit == 6
    start(router)
    start(router)
    with pytest.raises(ResourceExhausted):
        start(router)


def test_joining_an_admitted_group_is_never_refused_by_the_limit() -> None:
    router = make_router()
    router.set_trainer_state(0, StalenessPolicy(max_staleness=0, batch_size=1))
    first = router.start_session(StartSessionCommand("t", group_id="g", group_size=3))
    assert first.group_created
    with pytest.raises(ResourceExhausted):
        router.start_session(StartSessionCommand("t", group_id="other", group_size=3))
    for _ in range(2):
        joined = router.start_session(StartSessionCommand("t", group_id="g"))
        assert not joined.group_created
    assert router.trainer.started == 1


def test_dropped_groups_leave_the_count_so_admission_never_deadlocks() -> None:
    clock = ManualClock()
    router = make_router(clock=clock)
    router.set_trainer_state(0, StalenessPolicy(max_staleness=0, batch_size=2))
    start(router)
    partial = start(router)
    with pytest.raises(ResourceExhausted):
        start(router)
    # One gets one reward (partial at its deadline), the other none (dropped).
    group = router.groups.get(partial)
    router.submit_rewards([(group.members[0].name, 1.0)])
    clock.advance(SETTINGS.deadline_s + 1)
    assert router.expire_due() == 2
    router.finalizer.drain()
    outcomes = sorted(r.outcome.value for r in router.feed.read_after(0, 10))
    assert outcomes == ["dropped", "partial"]
    assert router.trainer.dropped == 1 and router.trainer.in_flight == 1
    start(router)  # the dropped group's slot is free again
    with pytest.raises(ResourceExhausted):
        start(router)


def test_a_counter_reset_does_not_count_drops_of_groups_admitted_before_it() -> None:
    clock = ManualClock()
    router = make_router(clock=clock)
    router.set_trainer_state(0, StalenessPolicy(max_staleness=0, batch_size=1))
    start(router)
    router.set_trainer_state(0, reset_counters=True)
    assert router.trainer.in_flight == 0
    start(router)
    clock.advance(SETTINGS.deadline_s + 1)
    router.expire_due()
    assert router.trainer.dropped == 1  # only the group of this epoch
    assert router.trainer.in_flight == 0


def test_without_a_policy_nothing_is_limited_and_nothing_counted() -> None:
    router = make_router()
    for _ in range(20):
        start(router)
    assert router.trainer.limit == 0 and router.trainer.started == 0
    router.set_trainer_state(3, StalenessPolicy(0, 1))
    assert router.trainer.started == 0  # counting starts with the policy
    start(router)
    router.set_trainer_state(3, clear_policy=True)
    start(router)


def _trainer_fields(gate: StalenessGate) -> dict[str, object]:
    return {f: getattr(gate, f) for f in StalenessGate.__slots__}


def test_bad_trainer_states_are_refused_and_change_nothing() -> None:
    router = make_router()
    router.set_trainer_state(4, StalenessPolicy(1, 2))
    start(router)
    before = _trainer_fields(router.trainer)
    with pytest.raises(FailedPrecondition) as backwards:
        router.set_trainer_state(3)
    assert backwards.value.reason == "VERSION_BACKWARDS"
    with pytest.raises(InvalidArgument) as both:
        router.set_trainer_state(6, StalenessPolicy(1, 2), clear_policy=True)
    assert both.value.reason == "INVALID_STALENESS_POLICY"
    assert _trainer_fields(router.trainer) == before


@pytest.mark.parametrize(("k", "b"), [(1, 0), (-1, 4), (0, 2_000_000)])
def test_a_staleness_policy_needs_a_batch_of_at_least_one_group(k: int, b: int) -> None:
    with pytest.raises(InvalidArgument) as info:
        StalenessPolicy(k, b)
    assert info.value.reason == "INVALID_STALENESS_POLICY"
    assert info.value.field_violations


# -- the guarantee, with a simulated trainer ----------------------------------------------------


@pytest.mark.parametrize("speed", [1, 8])
@pytest.mark.parametrize("k", [0, 2])
def test_every_consumed_group_was_admitted_at_most_k_versions_ago(speed: int, k: int) -> None:
    run = simulate(speed=speed, steps=15, batch=4, max_staleness=k)
    assert run.steps == 15
    ages = [v - admitted for v, admitted in run.consumed]
    assert max(ages) <= k
    # Versions stamped by the workers agree: no consumed group was generated by a policy
    # more than k versions older than the trainer's.
    assert all(v - low <= k for v, low in run.min_versions)
    if speed >= 2:
        assert run.idle_share > 0.3  # fast producers wait instead of flooding


def test_without_the_limit_fast_producers_feed_the_trainer_stale_groups() -> None:
    run = simulate(speed=8, steps=15, batch=4, max_staleness=None)
    assert max(v - admitted for v, admitted in run.consumed) > 5
    assert run.idle_s == 0


@pytest.mark.parametrize("speed", [1, 8])
def test_drops_partials_and_stragglers_neither_deadlock_nor_break_the_bound(speed: int) -> None:
    """Every 3rd group loses its rewards (dropped or partial at its deadline, long after
    the groups admitted with it) and durations vary by 60%: groups finish out of order. The
    trainer reads with the feed's min_version filter; it still makes every step."""
    run = simulate(
        speed=speed,
        steps=12,
        batch=4,
        max_staleness=1,
        jitter=0.6,
        lose_every=3,
        feed_filter=True,
    )
    assert run.steps == 12
    assert run.dropped > 0
    assert all(v - low <= 1 for v, low in run.min_versions)
    assert all(v - admitted <= 1 for v, admitted in run.consumed)


# -- waiting for admission ------------------------------------------------------------------------


async def test_a_start_that_waits_is_admitted_when_the_trainer_steps() -> None:
    router = make_router()
    router.set_trainer_state(0, StalenessPolicy(0, 1))
    start(router)
    waiting = asyncio.create_task(router.start_when_admitted(lambda: start(router), 5.0))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    router.set_trainer_state(1)
    gid = await asyncio.wait_for(waiting, 1.0)
    assert router.groups.get(gid).admitted_version == 1


async def test_a_start_that_waits_gives_up_with_the_refusal_at_its_deadline() -> None:
    router = make_router()
    router.set_trainer_state(0, StalenessPolicy(0, 1))
    start(router)
    with pytest.raises(ResourceExhausted, match="staleness limit"):
        await router.start_when_admitted(lambda: start(router), 0.2)


async def test_a_waiting_start_is_refused_at_once_when_the_router_stops_accepting() -> None:
    router = make_router()
    router.set_trainer_state(0, StalenessPolicy(0, 1))
    start(router)
    waiting = asyncio.create_task(router.start_when_admitted(lambda: start(router), 30.0))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    router.stop_accepting()  # a drain: the start gets SHUTTING_DOWN now, not at its deadline
    with pytest.raises(Unavailable) as info:
        await asyncio.wait_for(waiting, 1.0)
    assert info.value.reason == "SHUTTING_DOWN"


# -- versions on workers, sessions and results ------------------------------------------------


def test_sessions_are_stamped_and_results_carry_min_max_and_trainer_versions() -> None:
    router = make_router(workers=2)
    router.heartbeat("w1", 3)
    router.set_trainer_state(2)
    gid = start(router, size=2)
    group = router.groups.get(gid)
    assert sorted(m.start_version for m in group.members) == [1, 3]
    assert group.admitted_version == 2
    a, b = group.members
    router.set_trainer_state(5)  # the trainer stepped while the group ran
    outcomes = router.submit_rewards([(a.name, 1.0, None, 2, 4), (b.name, 0.0)])
    assert [o.status for o in outcomes] == [RewardStatus.ACCEPTED] * 2
    assert (a.min_version, a.max_version) == (2, 4)
    router.set_trainer_state(6)  # after the last reward: the group finished at 5
    (result,) = router.finalizer.drain()
    assert result.min_version == min(2, b.start_version)
    assert result.max_version == max(4, b.max_version)
    assert result.trainer_version == 5 and result.admitted_version == 2


def test_reward_versions_with_min_above_max_are_refused_and_change_nothing() -> None:
    router = make_router()
    gid = start(router, size=1)
    (member,) = router.groups.get(gid).members
    (outcome,) = router.submit_rewards([(member.name, 1.0, None, 5, 4)])
    assert outcome.status is RewardStatus.INVALID_VERSIONS
    assert member.reward is None and member.max_version == 1
    (one_sided,) = router.submit_rewards([(member.name, 1.0, None, 0, 6)])
    assert one_sided.status is RewardStatus.ACCEPTED
    assert (member.min_version, member.max_version) == (6, 6)


def test_a_worker_version_going_backwards_is_refused_and_records_nothing() -> None:
    clock = ManualClock()
    router = make_router(clock=clock)
    router.heartbeat("w0", 5)
    clock.advance(3.0)
    worker = router.get_worker("w0")
    seen = worker.last_heartbeat
    with pytest.raises(FailedPrecondition) as info:
        router.heartbeat("w0", 4)
    assert info.value.reason == "VERSION_BACKWARDS"
    assert worker.policy_version == 5 and worker.last_heartbeat == seen
    with pytest.raises(FailedPrecondition):
        router.register_worker("w0", "10.0.0.0:1", 64, {}, policy_version=2)
    assert worker.policy_version == 5
    router.heartbeat("w0")  # 0 reports nothing: the version stands
    assert worker.policy_version == 5 and worker.last_heartbeat > seen


# -- weight updates ------------------------------------------------------------------------------


def test_selected_workers_leave_placement_until_they_complete() -> None:
    router = make_router(workers=3)
    before = start(router, size=3)
    workers, interrupted = router.begin_weight_update(2, ["w0", "w1"], interrupt_sessions=False)
    assert [w.worker_id for w in workers] == ["w0", "w1"] and interrupted == 0
    assert router.snapshot().workers_updating == 2
    gid = start(router, size=2)
    assert {m.worker_id for m in router.groups.get(gid).members} == {"w2"}
    # In-flight sessions keep running, unmarked.
    assert not any(m.interrupted for m in router.groups.get(before).members)
    worker, finished = router.complete_weight_update("w0", 0)
    assert worker.policy_version == 2 and worker.updating_to == 0 and not finished
    router.heartbeat("w1", 2)  # the heartbeat with the target completes it too
    assert router.get_worker("w1").updating_to == 0
    assert router.weight_update is None
    assert router.snapshot().worker_versions_distinct == 2  # w2 still at 1: mixed
    with pytest.raises(FailedPrecondition) as info:
        router.complete_weight_update("w2", 2)
    assert info.value.reason == "WORKER_NOT_UPDATING"
    assert router.get_worker("w2").policy_version == 1


def test_a_fleet_wide_update_refuses_starts_and_can_interrupt_sessions() -> None:
    router = make_router(workers=2)
    gid = start(router, size=2)
    router.start_session(StartSessionCommand("t", group_id="half", group_size=2))
    workers, interrupted = router.begin_weight_update(2, [], interrupt_sessions=True)
    assert len(workers) == 2 and interrupted == 3
    assert all(m.interrupted for m in router.groups.get(gid).members)
    for attempt in (
        lambda: start(router),
        lambda: router.start_session(StartSessionCommand("t", group_id="half")),
    ):
        with pytest.raises(Unavailable) as info:
            attempt()
        assert info.value.reason == "WEIGHT_UPDATE_IN_PROGRESS"
    # Rewards of interrupted sessions are still taken.
    finish(router, gid)
    assert router.groups.get(gid).state is GroupState.FINALIZED
    router.complete_weight_update("w0", 2)
    _, finished = router.complete_weight_update("w1", 3)
    assert finished and router.weight_update is None
    start(router)


@pytest.mark.parametrize(
    ("version", "workers", "error", "reason"),
    [
        (0, [], InvalidArgument, "INVALID_VERSION"),
        (1, [], FailedPrecondition, "VERSION_BACKWARDS"),
        (2, ["w0", "nope"], NotFound, "WORKER_NOT_FOUND"),
    ],
)
def test_bad_weight_updates_change_nothing(
    version: int, workers: list[str], error: type[RouterError], reason: str
) -> None:
    router = make_router(workers=2)
    with pytest.raises(error) as info:
        router.begin_weight_update(version, workers, interrupt_sessions=False)
    assert info.value.reason == reason
    assert router.weight_update is None
    assert all(w.updating_to == 0 and w.eligible for w in router.workers)


def test_a_mixed_fleet_can_be_refused_new_groups() -> None:
    router = make_router(workers=2)
    router.set_trainer_state(0, refuse_mixed_versions=True)
    gid = router.start_session(StartSessionCommand("t", group_id="g", group_size=2)).group
    router.heartbeat("w1", 2)
    with pytest.raises(FailedPrecondition) as info:
        start(router)
    assert info.value.reason == "MIXED_VERSIONS"
    router.start_session(StartSessionCommand("t", group_id=gid.group_id))  # joins still work
    router.heartbeat("w0", 2)
    start(router)


# -- a restart keeps it all ------------------------------------------------------------------------


def test_a_restart_keeps_versions_counters_and_the_update_in_progress(tmp_path: Path) -> None:
    clock = ManualClock()
    journal = SqliteJournal(tmp_path)
    router = SessionRouter(SETTINGS, clock, journal)
    router.register_worker("w0", "10.0.0.0:1", 8, {}, policy_version=3)
    router.register_worker("w1", "10.0.0.1:1", 8, {}, policy_version=3)
    router.set_trainer_state(3, StalenessPolicy(1, 2), refuse_mixed_versions=True)
    done = start(router, size=2)
    group = router.groups.get(done)
    router.submit_rewards([(group.members[0].name, 1.0, None, 2, 3), (group.members[1].name, 0.0)])
    journal.write_pending()
    (result,) = router.finalizer.drain()
    open_gid = start(router, size=2)
    router.begin_weight_update(4, ["w1"], interrupt_sessions=True)
    clock.advance(SETTINGS.deadline_s + 1)
    assert router.expire_due() == 1  # the open group is dropped: counted
    router.finalizer.drain()
    journal.write_pending()
    journal.close_now()

    again = SqliteJournal(tmp_path)
    restored = SessionRouter(SETTINGS, ManualClock(), again)
    restored.restore(again.load())
    trainer = restored.trainer
    assert (trainer.version, trainer.policy, trainer.refuse_mixed_versions) == (
        3,
        StalenessPolicy(1, 2),
        True,
    )
    assert (trainer.started, trainer.dropped, trainer.epoch) == (2, 1, router.trainer.epoch)
    assert restored.weight_update == router.weight_update
    w0, w1 = restored.get_worker("w0"), restored.get_worker("w1")
    assert (w0.policy_version, w0.updating_to, w1.policy_version, w1.updating_to) == (3, 0, 3, 4)
    members = restored.groups.get(done).members
    assert [(m.start_version, m.min_version, m.max_version) for m in members] == [
        (3, 2, 3),
        (3, 3, 3),
    ]
    (on_feed, dropped) = restored.feed.read_after(0, 10)
    assert (on_feed.min_version, on_feed.max_version, on_feed.trainer_version) == (2, 3, 3)
    assert on_feed.admitted_version == result.admitted_version == 3
    assert dropped.outcome is GroupOutcome.DROPPED
    dropped_group = restored.groups.get(open_gid)
    interrupted = [m.interrupted for m in dropped_group.members if m.worker_id == "w1"]
    assert interrupted == [True]
    # The update in progress still holds w1 out, and completing it still works.
    restored.heartbeat("w0")
    restored.heartbeat("w1")
    assert not w1.eligible
    _, finished = restored.complete_weight_update("w1", 4)
    assert finished and restored.weight_update is None


def test_options_for_a_new_group_do_not_bypass_admission() -> None:
    router = make_router()
    router.set_trainer_state(0, StalenessPolicy(0, 1))
    router.start_group(StartGroupCommand("t", 1, options=OptionsSpec(deadline_s=5.0)))
    with pytest.raises(ResourceExhausted):
        router.start_group(StartGroupCommand("t", 1, options=OptionsSpec(deadline_s=5.0)))


def test_versions_beyond_what_the_journal_stores_are_refused_and_change_nothing(
    tmp_path: Path,
) -> None:
    """Versions are uint64 on the wire but SQLite INTEGER (signed 64 bits) in the journal:
    above 2**63 - 1 each way in is refused, before anything changes."""
    journal = SqliteJournal(tmp_path)
    router = SessionRouter(SETTINGS, ManualClock(), journal)
    router.register_worker("w0", "10.0.0.0:1", 8, {}, policy_version=1)
    too_big = 2**64 - 1
    for call in (
        lambda: router.register_worker("w9", "10.0.0.9:1", 1, {}, policy_version=too_big),
        lambda: router.heartbeat("w0", too_big),
        lambda: router.set_trainer_state(too_big),
        lambda: router.begin_weight_update(too_big, [], interrupt_sessions=False),
    ):
        with pytest.raises(InvalidArgument) as info:
            call()
        assert info.value.reason == "VERSION_TOO_LARGE"
    assert router.workers.find("w9") is None and router.get_worker("w0").policy_version == 1
    assert router.trainer.version == 0 and router.weight_update is None
    router.begin_weight_update(2, ["w0"], interrupt_sessions=False)
    with pytest.raises(InvalidArgument, match="largest policy version"):
        router.complete_weight_update("w0", too_big)
    assert router.get_worker("w0").updating_to == 2
    router.complete_weight_update("w0", 2)
    (member,) = router.groups.get(start(router, size=1)).members
    (outcome,) = router.submit_rewards([(member.name, 1.0, None, 0, too_big)])
    assert outcome.status is RewardStatus.INVALID_VERSIONS and member.reward is None
    largest = 2**63 - 1  # the largest is taken, and journaled
    router.heartbeat("w0", largest)
    router.set_trainer_state(largest, StalenessPolicy(MAX_STALENESS, MAX_BATCH_SIZE))
    assert convert.trainer_state_to_proto(router).admission_limit == 2**64 - 1  # saturated
    journal.write_pending()
    journal.close_now()
    again = SqliteJournal(tmp_path)
    restored = SessionRouter(SETTINGS, ManualClock(), again)
    restored.restore(again.load())
    assert restored.trainer.version == largest
    assert restored.get_worker("w0").policy_version == largest
    again.close_now()
