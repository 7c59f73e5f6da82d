"""Policy versions, staleness-bounded admission and weight updates through gRPC."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import AsyncIterator

import grpc
import pytest

from sessionrouter.client import SessionRouterClient, StalenessPolicy
from sessionrouter.v1 import resources_pb2 as pb
from sessionrouter.v1 import session_service_pb2 as spb
from sessionrouter.v1 import worker_service_pb2 as wpb
from tests.support import Harness, details_of, start_harness, stop_harness


@pytest.fixture
async def fleet() -> AsyncIterator[Harness]:
    """A router with workers w0..w2 registered at policy version 1."""
    h = await start_harness()
    try:
        for i in range(3):
            await h.workers.RegisterWorker(
                wpb.RegisterWorkerRequest(
                    worker_id=f"w{i}", address=f"10.0.0.{i}:1", capacity=16, policy_version=1
                )
            )
        yield h
    finally:
        await stop_harness(h)


async def refused(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    return info.value


async def parked(h: Harness, call: asyncio.Future[spb.StartGroupResponse]) -> None:
    """Returns once a start waits in the router for admission to change: the server has
    ``call`` and refused it for now (the router's own count, no clock); fails if ``call``
    ended first."""
    while h.server.router.admission_waiting != 1:
        assert not call.done(), f"the start ended without waiting: {call}"
        await asyncio.sleep(0.005)


def group_request(size: int = 2, *, wait: bool = False) -> spb.StartGroupRequest:
    return spb.StartGroupRequest(task_id="t", group_size=size, wait_for_admission=wait)


async def test_workers_report_versions_and_going_backwards_is_refused(fleet: Harness) -> None:
    reply = await fleet.workers.Heartbeat(wpb.HeartbeatRequest(worker_id="w1", policy_version=4))
    assert reply.worker.policy_version == 4
    error = await refused(
        fleet.workers.Heartbeat(wpb.HeartbeatRequest(worker_id="w1", policy_version=3))
    )
    details = details_of(error)
    assert details.code == grpc.StatusCode.FAILED_PRECONDITION
    assert details.reason == "VERSION_BACKWARDS"
    assert details.metadata == {"worker_id": "w1", "held": "4", "got": "3"}
    listed = await fleet.workers.ListWorkers(wpb.ListWorkersRequest())
    assert [w.policy_version for w in listed.workers] == [1, 4, 1]
    state = await fleet.sessions.GetTrainerState(spb.GetTrainerStateRequest())
    assert state.state.distinct_worker_versions == 2  # a mixed fleet, visible


async def test_the_staleness_limit_refuses_with_retry_info_and_waits_on_request(
    fleet: Harness,
) -> None:
    set_state = spb.SetTrainerStateRequest(
        version=0, policy=pb.StalenessPolicy(max_staleness=0, batch_size=2)
    )
    state = (await fleet.sessions.SetTrainerState(set_state)).state
    assert state.admission_limit == 2 and state.policy.batch_size == 2
    first = await fleet.sessions.StartGroup(group_request())
    await fleet.sessions.StartGroup(group_request())
    error = await refused(fleet.sessions.StartGroup(group_request()))
    details = details_of(error)
    assert details.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert details.reason == "STALENESS_LIMIT" and details.retry_delay_s == 1.0
    assert details.metadata["limit"] == "2"
    # A join of an admitted group is not held back.
    first_id = first.group.group_id
    error = await refused(
        fleet.sessions.StartSession(spb.StartSessionRequest(task_id="t", group_id=first_id))
    )
    assert details_of(error).reason == "GROUP_FULL"  # refused for being full, not stale
    # Waiting: admitted as soon as the trainer steps.
    waiting = asyncio.ensure_future(fleet.sessions.StartGroup(group_request(wait=True)))
    await parked(fleet, waiting)
    assert not waiting.done()
    await fleet.sessions.SetTrainerState(spb.SetTrainerStateRequest(version=1))
    admitted = await waiting  # no deadline: it must be the step that admits it
    assert admitted.group.admitted_trainer_version == 1
    assert fleet.server.router.admission_waiting == 0
    # Waiting within a deadline that passes gives the refusal, not a bare deadline.
    await fleet.sessions.StartGroup(group_request())
    late = asyncio.ensure_future(fleet.sessions.StartGroup(group_request(wait=True), timeout=0.5))
    await parked(fleet, late)
    error = await refused(late)
    assert details_of(error).reason == "STALENESS_LIMIT"
    assert fleet.server.router.admission_waiting == 0


@pytest.mark.parametrize(
    ("request_", "code", "reason"),
    [
        (
            spb.SetTrainerStateRequest(version=5, policy=pb.StalenessPolicy(batch_size=0)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_STALENESS_POLICY",
        ),
        (
            spb.SetTrainerStateRequest(version=1),
            grpc.StatusCode.FAILED_PRECONDITION,
            "VERSION_BACKWARDS",
        ),
    ],
)
async def test_bad_trainer_states_get_a_clear_status_and_change_nothing(
    fleet: Harness, request_: spb.SetTrainerStateRequest, code: grpc.StatusCode, reason: str
) -> None:
    good = spb.SetTrainerStateRequest(
        version=2, policy=pb.StalenessPolicy(max_staleness=1, batch_size=3)
    )
    before = (await fleet.sessions.SetTrainerState(good)).state
    details = details_of(await refused(fleet.sessions.SetTrainerState(request_)))
    assert details.code == code
    assert details.reason == reason
    after = (await fleet.sessions.GetTrainerState(spb.GetTrainerStateRequest())).state
    assert after == before


async def test_a_fleet_wide_update_holds_starts_until_the_workers_come_back(
    fleet: Harness,
) -> None:
    running = await fleet.sessions.StartGroup(group_request(3))
    begun = await fleet.workers.BeginWeightUpdate(
        wpb.BeginWeightUpdateRequest(version=2, interrupt_sessions=True)
    )
    assert [w.updating_to_version for w in begun.workers] == [2, 2, 2]
    assert begun.interrupted_sessions == 3
    member = running.group.members[0].name
    session = await fleet.sessions.GetSession(spb.GetSessionRequest(session=member))
    assert session.session.interrupted
    details = details_of(await refused(fleet.sessions.StartGroup(group_request())))
    assert details.code == grpc.StatusCode.UNAVAILABLE
    assert details.reason == "WEIGHT_UPDATE_IN_PROGRESS" and details.retry_delay_s == 1.0
    state = (await fleet.sessions.GetTrainerState(spb.GetTrainerStateRequest())).state
    assert state.weight_update_fleet_wide and state.workers_updating == 3
    waiting = asyncio.ensure_future(fleet.sessions.StartGroup(group_request(wait=True), timeout=5))
    await fleet.workers.CompleteWeightUpdate(wpb.CompleteWeightUpdateRequest(worker_id="w0"))
    await fleet.workers.Heartbeat(wpb.HeartbeatRequest(worker_id="w1", policy_version=2))
    await asyncio.sleep(0.1)
    assert not waiting.done()
    done = await fleet.workers.CompleteWeightUpdate(
        wpb.CompleteWeightUpdateRequest(worker_id="w2", version=2)
    )
    assert done.update_finished and done.worker.policy_version == 2
    started = await asyncio.wait_for(waiting, 2)
    assert {m.start_version for m in started.group.members} == {2}
    details = details_of(
        await refused(
            fleet.workers.CompleteWeightUpdate(wpb.CompleteWeightUpdateRequest(worker_id="w2"))
        )
    )
    assert details.code == grpc.StatusCode.FAILED_PRECONDITION
    assert details.reason == "WORKER_NOT_UPDATING"


async def test_results_carry_versions_and_the_feed_skips_older_groups(fleet: Harness) -> None:
    await fleet.sessions.SetTrainerState(spb.SetTrainerStateRequest(version=3))
    old = (await fleet.sessions.StartGroup(group_request())).group
    for i in range(3):
        await fleet.workers.Heartbeat(wpb.HeartbeatRequest(worker_id=f"w{i}", policy_version=2))
    new = (await fleet.sessions.StartGroup(group_request())).group
    entries = [
        spb.RewardEntry(session=old.members[0].name, reward=1.0),
        spb.RewardEntry(session=old.members[1].name, reward=0.0),
        spb.RewardEntry(session=new.members[0].name, reward=1.0, min_version=2, max_version=3),
        spb.RewardEntry(session=new.members[1].name, reward=0.5, min_version=4, max_version=3),
        spb.RewardEntry(session=new.members[1].name, reward=0.5),
    ]
    call = fleet.sessions.SubmitRewards()
    await call.write(spb.SubmitRewardsRequest(entries=entries, sequence=1))
    await call.done_writing()
    results: list[pb.GroupResult] = []
    statuses: list[int] = []
    async for response in call:
        statuses += [r.status for r in response.ack.results]
        results += response.group_results
    assert statuses[3] == spb.REWARD_STATUS_INVALID_VERSIONS
    assert statuses.count(spb.REWARD_STATUS_ACCEPTED) == 4
    by_id = {r.group_id: r for r in results}
    assert (by_id[old.group_id].min_version, by_id[old.group_id].max_version) == (1, 1)
    assert (by_id[new.group_id].min_version, by_id[new.group_id].max_version) == (2, 3)
    assert by_id[new.group_id].trainer_version == 3
    assert by_id[new.group_id].admitted_trainer_version == 3
    feed = fleet.sessions.SubscribeGroups(spb.SubscribeGroupsRequest(min_version=2))
    message = await asyncio.wait_for(feed.read(), 5)
    feed.cancel()
    assert isinstance(message, spb.SubscribeGroupsResponse)
    assert [g.group_id for g in message.groups] == [new.group_id]
    assert message.skipped_groups == 1 and message.last_cursor == 2


async def test_the_version_filter_and_skip_degenerate_combine_on_the_feed(fleet: Harness) -> None:
    """Four groups: old or fresh (min_version below 2 or not), degenerate or not. A group
    either filter leaves out is skipped, counted once (skipped_groups for the version filter,
    which is checked first), and last_cursor covers them all."""
    entries: list[spb.RewardEntry] = []
    kinds = [(1, True), (1, False), (2, True), (2, False)]  # (version, degenerate)
    groups: list[str] = []
    for version, degenerate in kinds:
        group = (await fleet.sessions.StartGroup(group_request())).group
        groups.append(group.group_id)
        for i, member in enumerate(group.members):
            reward = 1.0 if degenerate else float(i)
            entries.append(
                spb.RewardEntry(
                    session=member.name, reward=reward, min_version=version, max_version=version
                )
            )
    call = fleet.sessions.SubmitRewards()
    await call.write(spb.SubmitRewardsRequest(entries=entries, sequence=1))
    await call.done_writing()
    async for _ in call:
        pass
    for request, kept, versions, degenerates in [
        (spb.SubscribeGroupsRequest(min_version=2, skip_degenerate=True), [3], 2, 1),
        (spb.SubscribeGroupsRequest(min_version=2), [2, 3], 2, 0),
        (spb.SubscribeGroupsRequest(skip_degenerate=True), [1, 3], 0, 2),
        (spb.SubscribeGroupsRequest(), [0, 1, 2, 3], 0, 0),
    ]:
        feed = fleet.sessions.SubscribeGroups(request)
        message = await asyncio.wait_for(feed.read(), 5)
        feed.cancel()
        assert isinstance(message, spb.SubscribeGroupsResponse)
        assert [g.group_id for g in message.groups] == [groups[i] for i in kept]
        assert (message.skipped_groups, message.skipped_degenerate) == (versions, degenerates)
        assert message.last_cursor == 4
    feed = fleet.sessions.SubscribeGroups(  # resuming past the last group delivered
        spb.SubscribeGroupsRequest(after_cursor=3, min_version=2, skip_degenerate=True)
    )
    message = await asyncio.wait_for(feed.read(), 5)
    feed.cancel()
    assert isinstance(message, spb.SubscribeGroupsResponse)
    assert [g.cursor for g in message.groups] == [4] and message.last_cursor == 4


async def test_the_client_api_steps_the_trainer_and_runs_a_weight_update(
    fleet: Harness,
) -> None:
    async with SessionRouterClient.connect(fleet.address) as client:
        state = await client.set_trainer_state(
            0, policy=StalenessPolicy(max_staleness=0, batch_size=1)
        )
        assert state.admission_limit == 1
        await client.start_group("t", 1)
        waiting = asyncio.ensure_future(
            client.start_group("t", 1, wait_for_admission=True, timeout=5)
        )
        await asyncio.sleep(0.1)
        assert not waiting.done()
        assert (await client.set_trainer_version(1)).version == 1
        assert (await asyncio.wait_for(waiting, 2)).group.admitted_trainer_version == 1
        async with client.weight_update(7, worker_ids=["w0", "w1"]) as update:
            assert {w.updating_to_version for w in update.workers} == {7}
            await client.heartbeat("w1", policy_version=7)  # w1 reports it on its own
            during = await client.get_trainer_state()
            assert during.workers_updating == 1 and not during.weight_update_fleet_wide
        workers = {w.worker_id: w async for w in client.iter_workers()}
        assert {w: (v.policy_version, v.updating_to_version) for w, v in workers.items()} == {
            "w0": (7, 0),
            "w1": (7, 0),
            "w2": (1, 0),
        }
        after = await client.get_trainer_state()
        assert after.weight_update_version == 0 and after.distinct_worker_versions == 2


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


async def test_metrics_show_a_mixed_fleet_an_update_and_the_admission_figures() -> None:
    h = await start_harness(metrics_port=0)
    try:
        for i, version in enumerate((1, 2, 2)):
            await h.workers.RegisterWorker(
                wpb.RegisterWorkerRequest(
                    worker_id=f"w{i}", address=f"a:{i}", capacity=4, policy_version=version
                )
            )
        policy = pb.StalenessPolicy(max_staleness=1, batch_size=4)
        await h.sessions.SetTrainerState(spb.SetTrainerStateRequest(version=2, policy=policy))
        await h.sessions.StartGroup(group_request())
        await h.workers.BeginWeightUpdate(
            wpb.BeginWeightUpdateRequest(version=3, worker_ids=["w0"])
        )
        collector = h.server._metrics
        assert collector is not None
        collector.refresh()
        samples = await asyncio.to_thread(_scrape, h.server.metrics_port)
        assert samples["sessionrouter_worker_versions"] == 2
        assert samples["sessionrouter_workers_updating"] == 1
        assert samples["sessionrouter_trainer_version"] == 2
        assert samples['sessionrouter_admission{figure="in_flight"}'] == 1
        assert samples['sessionrouter_admission{figure="limit"}'] == 16
    finally:
        await stop_harness(h)
