"""Ownership on a sharded router: what each call gets for a group of another shard, for a
header that disagrees with the request, and the ids a shard mints."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from sessionrouter.client.shardmap import shard_of
from sessionrouter.server.app import WorkerSpec
from sessionrouter.v1 import resources_pb2 as pb
from sessionrouter.v1 import session_service_pb2 as spb
from tests.shards.support import owned_group
from tests.support import Harness, details_of

WORKERS = tuple(WorkerSpec(f"w{i}", f"10.0.0.{i}:30000", 64) for i in range(4))


async def _refused(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call  # type: ignore[misc]
    return caught.value


async def test_calls_for_another_shards_group_are_wrong_shard(shards: list[Harness]) -> None:
    s0, s1, _ = shards
    group = owned_group(1, 3)
    started = await s1.sessions.StartGroup(
        spb.StartGroupRequest(task_id="t", group_id=group, group_size=2)
    )
    member = started.group.members[0].name
    calls = {
        "StartSession": s0.sessions.StartSession(
            spb.StartSessionRequest(task_id="t", group_id=group, group_size=2)
        ),
        "StartGroup": s0.sessions.StartGroup(
            spb.StartGroupRequest(task_id="t", group_id=group, group_size=2)
        ),
        "GetGroup": s0.sessions.GetGroup(spb.GetGroupRequest(group_id=group)),
        "GetSession": s0.sessions.GetSession(spb.GetSessionRequest(session=member)),
        "AbortSession": s0.sessions.AbortSession(spb.AbortSessionRequest(session=member)),
    }
    for name, call in calls.items():
        details = details_of(await _refused(call))
        assert details.code is grpc.StatusCode.FAILED_PRECONDITION, name
        assert details.reason == "WRONG_SHARD", name
        assert details.metadata["owner_shard"] == "1", name
        assert details.metadata["shard_count"] == "3", name
        assert details.metadata["owner_address"] == s1.address, name
        assert details.metadata["group_id"] == group, name
    # A malformed id is the core's INVALID_ARGUMENT on any shard, as on one router.
    for bad in ("", "no spaces"):
        details = details_of(
            await _refused(
                s0.sessions.StartGroup(
                    spb.StartGroupRequest(task_id="t", group_id=bad, group_size=2)
                )
            )
        )
        assert (details.code, details.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ID")
    # The owner still serves it, untouched by the refusals.
    got = await s1.sessions.GetGroup(spb.GetGroupRequest(group_id=group))
    assert len(got.group.members) == 2


async def test_header_that_disagrees_is_invalid_argument(shards: list[Harness]) -> None:
    s0 = shards[0]
    group = owned_group(0, 3)
    other = owned_group(0, 3, prefix="other")
    error = await _refused(
        s0.sessions.StartGroup(
            spb.StartGroupRequest(task_id="t", group_id=group, group_size=2),
            metadata=(("x-group-id", other),),
        )
    )
    details = details_of(error)
    assert details.code is grpc.StatusCode.INVALID_ARGUMENT
    assert details.reason == "GROUP_HEADER_MISMATCH"
    assert details.metadata == {"header_group_id": other, "group_id": group}
    assert "x-group-id" in details.fields
    # Agreeing header: served.
    ok = await s0.sessions.StartGroup(
        spb.StartGroupRequest(task_id="t", group_id=group, group_size=2),
        metadata=(("x-group-id", group),),
    )
    assert ok.group.group_id == group
    # The header is checked before ownership: a mismatch on the wrong shard says mismatch.
    foreign = owned_group(2, 3)
    error = await _refused(
        s0.sessions.GetGroup(
            spb.GetGroupRequest(group_id=foreign), metadata=(("x-group-id", group),)
        )
    )
    assert details_of(error).reason == "GROUP_HEADER_MISMATCH"


async def test_minted_ids_map_to_the_shard_and_retries_replay(shards: list[Harness]) -> None:
    for index, h in enumerate(shards):
        ids = set()
        for n in range(20):
            started = await h.sessions.StartSession(
                spb.StartSessionRequest(task_id="t", group_size=2, request_id=f"r-{index}-{n}")
            )
            assert started.group_created
            ids.add(started.session.group_id)
            assert shard_of(started.session.group_id, 3) == index
        grouped = await h.sessions.StartGroup(spb.StartGroupRequest(task_id="t", group_size=2))
        assert shard_of(grouped.group.group_id, 3) == index
        assert len(ids) == 20
        replay = await h.sessions.StartSession(
            spb.StartSessionRequest(task_id="t", group_size=2, request_id=f"r-{index}-0")
        )
        assert replay.replayed
        # A joiner by the minted id finds it on this shard.
        joined = await h.sessions.StartSession(
            spb.StartSessionRequest(task_id="t", group_id=replay.session.group_id, group_size=2)
        )
        assert not joined.group_created and joined.session.index == 1


async def test_reward_entries_for_another_shard_get_wrong_shard(shards: list[Harness]) -> None:
    s0, s1, _ = shards
    mine = owned_group(0, 3)
    theirs = owned_group(1, 3)
    await s0.sessions.StartGroup(spb.StartGroupRequest(task_id="t", group_id=mine, group_size=2))
    await s1.sessions.StartGroup(spb.StartGroupRequest(task_id="t", group_id=theirs, group_size=2))
    call = s0.sessions.SubmitRewards()
    await call.write(
        spb.SubmitRewardsRequest(
            sequence=1,
            entries=[
                spb.RewardEntry(session=f"groups/{mine}/sessions/0", reward=1.0),
                spb.RewardEntry(session=f"groups/{theirs}/sessions/0", reward=1.0),
                spb.RewardEntry(session=f"groups/{mine}/sessions/9", reward=1.0),
            ],
        )
    )
    response = await asyncio.wait_for(call.read(), 5)
    assert isinstance(response, spb.SubmitRewardsResponse)
    ok, foreign, unknown = response.ack.results
    assert ok.status == spb.REWARD_STATUS_ACCEPTED
    assert foreign.status == spb.REWARD_STATUS_WRONG_SHARD
    assert foreign.HasField("owner_shard") and foreign.owner_shard == 1
    assert foreign.owner_address == s1.address
    assert theirs in foreign.detail and s1.address in foreign.detail
    # A group this shard owns but does not hold is still an unknown session.
    assert unknown.status == spb.REWARD_STATUS_UNKNOWN_SESSION
    assert not unknown.HasField("owner_shard")
    await call.done_writing()
    call.cancel()
    # The other shard's session was not touched.
    group = await s1.sessions.GetGroup(spb.GetGroupRequest(group_id=theirs))
    assert group.group.members[0].state == pb.SESSION_STATE_OPEN


async def test_columnar_entries_for_another_shard_get_wrong_shard(shards: list[Harness]) -> None:
    """The columnar form gives the same statuses: packed 9 for the other shard's entry, with a
    detail naming the owner (the columnar ack carries no per-entry owner fields)."""
    s0, s1, _ = shards
    mine = owned_group(0, 3)
    theirs = owned_group(1, 3)
    await s0.sessions.StartGroup(spb.StartGroupRequest(task_id="t", group_id=mine, group_size=2))
    await s1.sessions.StartGroup(spb.StartGroupRequest(task_id="t", group_id=theirs, group_size=2))
    call = s0.sessions.SubmitRewards()
    names = [f"groups/{mine}/sessions/0", f"groups/{theirs}/sessions/0"]
    await call.write(
        spb.SubmitRewardsRequest(
            sequence=1, columns=spb.RewardColumns(sessions=names, rewards=[1.0, 1.0])
        )
    )
    response = await asyncio.wait_for(call.read(), 5)
    assert isinstance(response, spb.SubmitRewardsResponse)
    assert list(response.ack.statuses) == [
        spb.REWARD_STATUS_ACCEPTED,
        spb.REWARD_STATUS_WRONG_SHARD,
    ]
    assert list(response.ack.detail_entries) == [1]
    assert theirs in response.ack.details[0] and s1.address in response.ack.details[0]
    await call.done_writing()
    call.cancel()


async def test_results_on_a_reward_stream_name_their_shard(shards: list[Harness]) -> None:
    """GroupResult.shard on the reward stream is the shard's index, as on the merged feed."""
    s1 = shards[1]
    group_id = owned_group(1, 3)
    await s1.sessions.StartGroup(
        spb.StartGroupRequest(task_id="t", group_id=group_id, group_size=2)
    )
    call = s1.sessions.SubmitRewards()
    await call.write(
        spb.SubmitRewardsRequest(
            sequence=1,
            entries=[
                spb.RewardEntry(session=f"groups/{group_id}/sessions/{i}", reward=float(i))
                for i in range(2)
            ],
        )
    )
    results: list[pb.GroupResult] = []
    while not results:
        response = await asyncio.wait_for(call.read(), 5)
        assert isinstance(response, spb.SubmitRewardsResponse)
        results.extend(response.group_results)
    assert [(r.group_id, r.shard) for r in results] == [(group_id, 1)]
    await call.done_writing()
    call.cancel()
