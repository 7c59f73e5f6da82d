"""Lost and aborted members: replacement (replace_lost) and finishing a group at once when
nothing is left to wait for, through gRPC against a real server on 127.0.0.1."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from sessionrouter.server.core.clock import ManualClock
from sessionrouter.v1 import resources_pb2 as pb
from sessionrouter.v1 import session_service_pb2 as spb
from sessionrouter.v1 import worker_service_pb2 as wpb
from tests.integration.test_journal import restart, start_durable
from tests.integration.test_placement import expect_error
from tests.integration.test_placement_policies import register
from tests.integration.test_rewards import RewardClient
from tests.support import Harness, read_feed, stop_harness


async def start_group(
    h: Harness, size: int, replace_lost: bool = True, min_members: int = 0, gid: str = "g"
) -> list[pb.Session]:
    reply = await h.sessions.StartGroup(
        spb.StartGroupRequest(
            task_id="t",
            group_size=size,
            group_id=gid,
            group_options=pb.GroupOptions(replace_lost=replace_lost, min_members=min_members),
        )
    )
    return list(reply.group.members)


async def get_group(h: Harness, gid: str = "g") -> pb.Group:
    return (await h.sessions.GetGroup(spb.GetGroupRequest(group_id=gid))).group


async def test_a_lost_member_is_replaced_on_an_unused_worker_and_the_stream_is_told(
    harness: Harness,
) -> None:
    await register(harness, 4)
    members = await start_group(harness, 3)
    stream = RewardClient(harness)
    await stream.send([("groups/none/sessions/0", 1.0)])  # the stream is live once acked
    await stream.ack()
    await harness.workers.DeregisterWorker(
        wpb.DeregisterWorkerRequest(worker_id=members[0].worker_id)
    )
    response = await asyncio.wait_for(stream.call.read(), 5)
    assert isinstance(response, spb.SubmitRewardsResponse)
    (notice,) = response.replacements
    assert notice.replaced_session == "groups/g/sessions/0" and notice.reason == "worker_lost"
    assert notice.replacement.name == "groups/g/sessions/3"
    assert notice.replacement.worker_id not in {m.worker_id for m in members}
    group = await get_group(harness)
    assert group.state == pb.GROUP_STATE_OPEN and len(group.members) == 4
    assert group.members[0].state == pb.SESSION_STATE_ABORTED
    assert group.members[0].replaced_by == "groups/g/sessions/3"
    assert group.members[3].replaces == "groups/g/sessions/0"
    await stream.send([(f"groups/g/sessions/{i}", float(i)) for i in (1, 2, 3)])
    await stream.ack()
    (result,) = await stream.results(1)
    assert result.outcome == pb.GROUP_OUTCOME_COMPLETE and result.group_size == 3
    assert list(result.sessions) == [f"groups/g/sessions/{i}" for i in (1, 2, 3)]
    assert list(result.replaced_sessions) == ["groups/g/sessions/0"]
    assert "groups/g/sessions/0" in result.excluded_sessions
    await stream.close()


async def test_a_member_aborted_as_retryable_is_replaced(harness: Harness) -> None:
    await register(harness, 3)
    await start_group(harness, 2)
    await harness.sessions.AbortSession(
        spb.AbortSessionRequest(session="groups/g/sessions/0", retryable=True)
    )
    await harness.sessions.AbortSession(spb.AbortSessionRequest(session="groups/g/sessions/1"))
    group = await get_group(harness)
    assert [m.replaced_by for m in group.members] == ["groups/g/sessions/2", "", ""]
    assert group.members[2].state == pb.SESSION_STATE_OPEN


async def test_without_the_option_nothing_is_replaced(harness: Harness) -> None:
    await register(harness, 3)
    members = await start_group(harness, 2, replace_lost=False)
    await harness.sessions.AbortSession(
        spb.AbortSessionRequest(session=members[0].name, retryable=True)
    )
    await harness.workers.DeregisterWorker(
        wpb.DeregisterWorkerRequest(worker_id=members[1].worker_id)
    )
    group = await get_group(harness)
    assert len(group.members) == 2 and not any(m.replaced_by for m in group.members)


async def test_replacing_a_rewarded_member_is_refused_and_changes_nothing(
    harness: Harness,
) -> None:
    await register(harness, 3)
    members = await start_group(harness, 2)
    stream = RewardClient(harness)
    await stream.send([(members[0].name, 1.0)])
    await stream.ack()
    await expect_error(
        harness.sessions.AbortSession(
            spb.AbortSessionRequest(session=members[0].name, retryable=True)
        ),
        grpc.StatusCode.FAILED_PRECONDITION,
        "SESSION_REWARDED",
    )
    group = await get_group(harness)
    assert len(group.members) == 2 and group.members[0].state == pb.SESSION_STATE_REWARDED
    await stream.close()


async def test_a_group_whose_remaining_members_are_lost_finishes_at_once(
    harness: Harness,
) -> None:
    """No deadline wait: one member rewarded, the other's worker lost, no replacement."""
    await register(harness, 2)
    members = await start_group(harness, 2, replace_lost=False, min_members=1, gid="p")
    dropped = await start_group(harness, 2, replace_lost=False, min_members=2, gid="d")
    stream = RewardClient(harness)
    await stream.send([(members[0].name, 1.0), (dropped[0].name, 1.0)])
    await stream.ack()
    lost = {members[1].worker_id, dropped[1].worker_id}
    for worker_id in lost:
        await harness.workers.DeregisterWorker(wpb.DeregisterWorkerRequest(worker_id=worker_id))
    harness.reduce()
    results = {r.group_id: r for r in await read_feed(harness, 0, 2)}
    assert results["p"].outcome == pb.GROUP_OUTCOME_PARTIAL
    assert results["d"].outcome == pb.GROUP_OUTCOME_DROPPED
    await stream.close()


async def test_heartbeat_expiry_replaces_and_the_replacement_survives_a_restart(
    tmp_path: Path,
) -> None:
    h = await start_durable(tmp_path, ManualClock())
    try:
        await register(h, 3)
        members = await start_group(h, 2)
        h.clock.advance(h.server.router.settings.heartbeat_timeout_s / 2)
        for worker in ("w0", "w1", "w2"):
            if worker != members[0].worker_id:
                await h.workers.Heartbeat(wpb.HeartbeatRequest(worker_id=worker))
        h.clock.advance(h.server.router.settings.heartbeat_timeout_s * 0.75)
        h.expire()
        group = await get_group(h)
        assert group.members[0].worker_lost and group.members[0].replaced_by
        assert group.members[2].worker_id not in {m.worker_id for m in members}
        h = await restart(h, tmp_path)
        group = await get_group(h)
        assert group.members[0].replaced_by == "groups/g/sessions/2"
        assert group.members[2].replaces == "groups/g/sessions/0"
        assert group.members[0].state == pb.SESSION_STATE_ABORTED
    finally:
        await stop_harness(h)


async def test_the_last_reward_beside_lost_members_finishes_the_group_at_once(
    harness: Harness,
) -> None:
    await register(harness, 2)
    members = await start_group(harness, 2, replace_lost=False, min_members=1)
    await harness.workers.DeregisterWorker(
        wpb.DeregisterWorkerRequest(worker_id=members[0].worker_id)
    )
    assert (await get_group(harness)).state == pb.GROUP_STATE_OPEN  # member 1 may still come
    stream = RewardClient(harness)
    await stream.send([(members[1].name, 1.0)])
    await stream.ack()
    (result,) = await stream.results(1)
    assert result.outcome == pb.GROUP_OUTCOME_PARTIAL
    assert list(result.excluded_sessions) == [members[0].name]
    await stream.close()
