"""``run_group`` and ``wait_group_result`` over the fake channel.

The test plays every RPC the helper makes (StartGroup, SubmitRewards, AbortSession, GetGroup,
SubscribeGroups) through ``FakeAioChannel``; see ``test_client_unary`` for the approach.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import grpc
import pytest

from sessionrouter.client import (
    GroupOutcome,
    ResourceExhaustedError,
    Session,
    SessionRouterClient,
)
from sessionrouter.v1 import resources_pb2 as rpb
from sessionrouter.v1 import session_service_pb2 as spb

from ._fake_channel import FakeAioChannel


def group_of(size: int, group_id: str = "g1") -> rpb.Group:
    members = [
        rpb.Session(
            name=f"groups/{group_id}/sessions/{i}",
            group_id=group_id,
            index=i,
            task_id="t1",
            worker_id=f"w{i + 1}",
            worker_address=f"10.0.0.{i + 1}:30000",
            state=rpb.SESSION_STATE_OPEN,
        )
        for i in range(size)
    ]
    return rpb.Group(
        group_id=group_id, name=f"groups/{group_id}", task_id="t1", group_size=size, members=members
    )


def ack(
    request: spb.SubmitRewardsRequest, status: spb.RewardStatus.ValueType
) -> spb.SubmitRewardsResponse:
    results = [spb.RewardResult(status=status) for _ in request.entries]
    return spb.SubmitRewardsResponse(ack=spb.RewardAck(sequence=request.sequence, results=results))


async def collect_rewards(
    fake: FakeAioChannel,
    rpc: object,
    count: int,
    status: spb.RewardStatus.ValueType = spb.REWARD_STATUS_ACCEPTED,
) -> list[spb.RewardEntry]:
    """Takes requests off a SubmitRewards stream until ``count`` entries came; acks each."""
    entries: list[spb.RewardEntry] = []
    while len(entries) < count:
        request = await fake.in_thread(rpc.take_request)  # type: ignore[attr-defined]
        entries += request.entries
        rpc.send_response(ack(request, status))  # type: ignore[attr-defined]
    return entries


async def end_stream(fake: FakeAioChannel, rpc: object) -> None:
    await fake.in_thread(rpc.requests_closed)  # type: ignore[attr-defined]
    rpc.terminate((), grpc.StatusCode.OK, "")  # type: ignore[attr-defined]


async def test_run_group_runs_members_concurrently_and_aborts_a_failed_rollout(
    fake: FakeAioChannel, client: SessionRouterClient
) -> None:
    both_running = asyncio.Barrier(2)

    async def rollout(session: Session) -> float:
        if session.index == 1:
            raise RuntimeError("worker exploded")
        await both_running.wait()  # passes only if members 0 and 2 run at the same time
        return float(session.index)

    async def router() -> tuple[spb.StartGroupRequest, spb.AbortSessionRequest, list[str]]:
        _, start = await fake.reply("StartGroup", spb.StartGroupResponse(group=group_of(3)))
        _, stream = await fake.take_stream_stream("SubmitRewards")
        reply = spb.AbortSessionResponse(session=group_of(3).members[1])
        _, abort = await fake.reply("AbortSession", reply)
        entries = await collect_rewards(fake, stream, 2)
        result = rpb.GroupResult(
            cursor=1,
            group_id="g1",
            outcome=rpb.GROUP_OUTCOME_PARTIAL,
            sessions=["groups/g1/sessions/0", "groups/g1/sessions/2"],
            rewards=[0.0, 2.0],
            advantages=[-0.7071, 0.7071],
            excluded_sessions=["groups/g1/sessions/1"],
        )
        stream.send_response(spb.SubmitRewardsResponse(group_results=[result]))
        await end_stream(fake, stream)
        return start, abort, sorted(f"{e.session}={e.reward}" for e in entries)

    result, (start, abort, entries) = await asyncio.gather(
        client.run_group("t1", 3, rollout, group_id="g1"), router()
    )
    assert (start.task_id, start.group_size, start.group_id) == ("t1", 3, "g1")
    assert start.request_id  # generated, so a retried start cannot make a second group
    assert abort.session == "groups/g1/sessions/1"
    assert "worker exploded" in abort.reason
    assert entries == ["groups/g1/sessions/0=0.0", "groups/g1/sessions/2=2.0"]
    assert result.outcome is GroupOutcome.PARTIAL
    assert result.excluded_sessions == ("groups/g1/sessions/1",)
    assert result.advantages == (-0.7071, 0.7071)


async def test_run_group_aborts_a_member_whose_reward_is_not_finite(
    fake: FakeAioChannel, client: SessionRouterClient
) -> None:
    async def rollout(session: Session) -> float:
        return math.nan

    async def router() -> Any:
        await fake.reply("StartGroup", spb.StartGroupResponse(group=group_of(1)))
        _, stream = await fake.take_stream_stream("SubmitRewards")
        await collect_rewards(fake, stream, 1, spb.REWARD_STATUS_NOT_FINITE)
        _, abort = await fake.reply(
            "AbortSession", spb.AbortSessionResponse(session=group_of(1).members[0])
        )
        result = rpb.GroupResult(cursor=2, group_id="g1", outcome=rpb.GROUP_OUTCOME_DROPPED)
        # Dropped by the abort, not by a reward: the result is only on the feed.
        await fake.reply(
            "GetGroup",
            spb.GetGroupResponse(
                group=rpb.Group(group_id="g1", state=rpb.GROUP_STATE_DROPPED, cursor=2)
            ),
        )
        _, request, feed = await fake.take_unary_stream("SubscribeGroups")
        feed.send_initial_metadata(())  # a router sends its headers first
        assert request.after_cursor == 1
        feed.send_response(spb.SubscribeGroupsResponse(groups=[result]))
        await fake.in_thread(feed.cancelled)
        await end_stream(fake, stream)
        return abort

    result, abort = await asyncio.gather(client.run_group("t1", 1, rollout), router())
    assert "not finite" in abort.reason
    assert result.outcome is GroupOutcome.DROPPED
    assert result.advantages == ()


async def test_wait_group_result_polls_until_finalized_then_reads_the_feed(
    fake: FakeAioChannel, client: SessionRouterClient
) -> None:
    async def router() -> int:
        open_group = rpb.Group(group_id="g7", state=rpb.GROUP_STATE_OPEN)
        done_group = rpb.Group(group_id="g7", state=rpb.GROUP_STATE_FINALIZED, cursor=9)
        await fake.reply("GetGroup", spb.GetGroupResponse(group=open_group))
        await fake.reply("GetGroup", spb.GetGroupResponse(group=done_group))
        _, request, feed = await fake.take_unary_stream("SubscribeGroups")
        feed.send_initial_metadata(())  # a router sends its headers first
        result = rpb.GroupResult(cursor=9, group_id="g7", outcome=rpb.GROUP_OUTCOME_COMPLETE)
        feed.send_response(spb.SubscribeGroupsResponse(groups=[result]))
        await fake.in_thread(feed.cancelled)
        return int(request.after_cursor)

    result, after = await asyncio.gather(
        client.wait_group_result("g7", poll_interval=0.001), router()
    )
    assert after == 8
    assert (result.group_id, result.cursor) == ("g7", 9)


async def test_run_group_raises_when_the_group_cannot_start(
    fake: FakeAioChannel, client: SessionRouterClient
) -> None:
    async def rollout(session: Session) -> float:
        raise AssertionError("no member may run")

    with pytest.raises(ResourceExhaustedError):
        await asyncio.gather(
            client.run_group("t1", 4, rollout),
            fake.reply("StartGroup", code=grpc.StatusCode.RESOURCE_EXHAUSTED, details="3 workers"),
        )
