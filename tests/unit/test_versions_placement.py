"""Placement policies meet versions: a worker in a weight update gets no new member in any
mode or pool, a replacement member obeys the same admission as a join, and a start waiting
for admission never passes a limit."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from sessionrouter.server.core.clock import ManualClock
from sessionrouter.server.core.commands import OptionsSpec, StartGroupCommand, StartSessionCommand
from sessionrouter.server.core.errors import ResourceExhausted, Unavailable
from sessionrouter.server.core.placement import PlacementMode
from sessionrouter.server.core.router import RouterSettings, SessionRouter
from sessionrouter.server.core.staleness import StalenessPolicy

SETTINGS = RouterSettings(
    deadline_s=10.0, min_members=1, reducer_window_s=0.0, heartbeat_timeout_s=3600.0
)


def make_router(
    labels: tuple[dict[str, str], ...] = ({}, {}, {}), settings: RouterSettings = SETTINGS
) -> SessionRouter:
    router = SessionRouter(settings, ManualClock())
    for i, worker_labels in enumerate(labels):
        router.register_worker(f"w{i}", f"10.0.0.{i}:1", 8, worker_labels, policy_version=1)
    return router


@pytest.mark.parametrize("mode", list(PlacementMode))
def test_a_worker_in_a_weight_update_gets_no_member_in_any_mode(mode: PlacementMode) -> None:
    router = make_router()
    router.begin_weight_update(2, ["w1"], interrupt_sessions=False)
    options = OptionsSpec(max_members_per_worker=2) if mode is PlacementMode.PACK else OptionsSpec()
    group = router.start_group(
        StartGroupCommand("t", 2, options=options, placement_mode=mode)
    ).group
    assert "w1" not in {m.worker_id for m in group.members}
    assert {m.start_version for m in group.members} == {1}


def test_pack_leaves_the_worker_it_packs_on_once_that_worker_updates() -> None:
    router = make_router()
    first = router.start_session(
        StartSessionCommand(
            "t",
            group_size=4,
            options=OptionsSpec(max_members_per_worker=4),
            placement_mode=PlacementMode.PACK,
        )
    )
    packed_on = first.session.worker_id
    gid = first.group.group_id
    second = router.start_session(StartSessionCommand("t", group_id=gid, group_size=4))
    assert second.session.worker_id == packed_on  # PACK keeps members together...
    router.begin_weight_update(2, [packed_on], interrupt_sessions=False)
    rest = [
        router.start_session(StartSessionCommand("t", group_id=gid, group_size=4)).session
        for _ in range(2)
    ]
    assert all(s.worker_id != packed_on for s in rest)  # ...but not on a worker updating
    assert len({s.worker_id for s in rest}) == 1  # and packs the rest on the next one
    router.complete_weight_update(packed_on, 2)
    assert router.get_worker(packed_on).eligible


def test_a_selector_pool_leaves_out_its_workers_in_an_update() -> None:
    router = make_router(({"zone": "a"}, {"zone": "a"}, {"zone": "b"}))
    in_a = OptionsSpec(selector={"zone": "a"})
    router.begin_weight_update(2, ["w0"], interrupt_sessions=False)
    group = router.start_group(StartGroupCommand("t", 2, options=in_a)).group
    assert {m.worker_id for m in group.members} == {"w1"}  # shared: w0 updates, w2 is b
    with pytest.raises(ResourceExhausted, match="strict"):
        router.start_group(
            StartGroupCommand("t", 2, options=in_a, placement_mode=PlacementMode.STRICT)
        )
    router.begin_weight_update(2, ["w1"], interrupt_sessions=False)
    with pytest.raises(Unavailable) as info:
        router.start_group(StartGroupCommand("t", 1, options=in_a))
    assert info.value.reason == "NO_ELIGIBLE_WORKER"
    router.complete_weight_update("w0", 2)
    (member,) = router.start_group(StartGroupCommand("t", 1, options=in_a)).group.members
    assert (member.worker_id, member.start_version) == ("w0", 2)


def test_a_replacement_member_obeys_the_same_admission_as_a_join() -> None:
    """The group was admitted once: its replacement member is neither refused by the
    staleness limit nor counted again, goes to no worker in an update, and is stamped with
    the version of the worker it lands on."""
    router = make_router(({}, {}, {}, {}))
    router.set_trainer_state(0, StalenessPolicy(max_staleness=0, batch_size=1))  # limit 1
    group = router.start_group(
        StartGroupCommand("t", 2, options=OptionsSpec(replace_lost=True))
    ).group
    with pytest.raises(ResourceExhausted, match="staleness limit"):
        router.start_group(StartGroupCommand("t", 1))
    lost = group.members[0]
    others = {f"w{i}" for i in range(4)} - {m.worker_id for m in group.members}
    updating, serving = sorted(others)
    router.begin_weight_update(3, [updating], interrupt_sessions=False)
    router.heartbeat(serving, 2)
    router.deregister_worker(lost.worker_id)
    replacement = group.members[-1]
    assert replacement.replaces == lost.index and lost.replaced_by == replacement.index
    assert replacement.worker_id == serving and replacement.start_version == 2
    assert router.trainer.started == 1  # the group counts once
    with pytest.raises(ResourceExhausted, match="staleness limit"):
        router.start_group(StartGroupCommand("t", 1))
    router.submit_rewards([(m.name, float(m.index)) for m in group.members[1:]])
    (result,) = router.finalizer.drain()
    assert (result.min_version, result.max_version) == (1, 2)
    assert lost.name in result.replaced_sessions


def test_a_replacement_waits_for_no_fleet_wide_update() -> None:
    """During a fleet-wide update no worker is eligible: the lost member is not replaced
    (as when no worker is free) and the group finishes without it."""
    router = make_router()
    group = router.start_group(
        StartGroupCommand("t", 2, options=OptionsSpec(replace_lost=True))
    ).group
    router.begin_weight_update(2, [], interrupt_sessions=False)
    lost, kept = group.members
    router.deregister_worker(lost.worker_id)
    assert len(group.members) == 2 and lost.worker_lost and lost.replaced_by == -1
    router.submit_rewards([(kept.name, 1.0)])
    (result,) = router.finalizer.drain()
    assert result.sessions == (kept.name,)


async def test_a_waiting_start_does_not_pass_the_open_groups_limit() -> None:
    settings = dataclasses.replace(SETTINGS, max_open_groups=2)
    router = make_router(settings=settings)
    router.set_trainer_state(0, StalenessPolicy(max_staleness=0, batch_size=1))  # limit 1
    router.start_group(StartGroupCommand("t", 2))

    def start() -> str:
        return router.start_group(StartGroupCommand("t", 2)).group.group_id

    waiting = asyncio.create_task(router.start_when_admitted(start, 5.0))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    router.set_trainer_state(1)  # admission opens for one more group...
    start()  # ...which another caller takes first, reaching the open-groups limit
    with pytest.raises(ResourceExhausted) as info:
        await asyncio.wait_for(waiting, 1.0)
    assert info.value.reason == "OPEN_GROUPS_LIMIT"
    assert router.groups.open_groups == 2


async def test_a_waiting_start_gets_the_refusal_of_a_full_disk_at_once() -> None:
    router = make_router()
    router.set_trainer_state(0, StalenessPolicy(max_staleness=0, batch_size=1))
    router.start_group(StartGroupCommand("t", 1))
    waiting = asyncio.create_task(
        router.start_when_admitted(lambda: router.start_group(StartGroupCommand("t", 1)), 30.0)
    )
    await asyncio.sleep(0.05)
    router.pause_accepting("DISK_FULL", "the disk is full")
    with pytest.raises(Unavailable) as info:
        await asyncio.wait_for(waiting, 1.0)
    assert info.value.reason == "DISK_FULL"
