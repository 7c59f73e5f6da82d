"""Placement policies (spread, strict, pack), selectors and the start/reward fixes, through
gRPC against a real server on 127.0.0.1, with concurrent joiners."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import grpc
import pytest

from sessionrouter.server.core.clock import ManualClock
from sessionrouter.v1 import resources_pb2 as pb
from sessionrouter.v1 import session_service_pb2 as spb
from sessionrouter.v1 import worker_service_pb2 as wpb
from tests.integration.test_journal import restart, start_durable
from tests.integration.test_placement import expect_error, start
from tests.integration.test_rewards import RewardClient
from tests.support import Harness, details_of, stop_harness


async def register(h: Harness, n: int, capacity: int = 8, **labels: str) -> None:
    prefix = "".join(labels.values()) or "w"
    for i in range(n):
        await h.workers.RegisterWorker(
            wpb.RegisterWorkerRequest(
                worker_id=f"{prefix}{i}",
                address=f"10.2.0.{i}:{len(prefix)}",
                capacity=capacity,
                labels=labels,
            )
        )


async def open_sessions(h: Harness) -> dict[str, int]:
    workers = (await h.workers.ListWorkers(wpb.ListWorkersRequest())).workers
    return {w.worker_id: w.open_sessions for w in workers}


async def join_concurrently(
    h: Harness, n: int, mode: int, options: pb.GroupOptions | None = None
) -> list[spb.StartSessionResponse | BaseException]:
    calls = [
        start(
            h,
            group_id="g",
            group_size=n,
            placement_mode=mode,
            group_options=options or pb.GroupOptions(),
        )
        for _ in range(n)
    ]
    return await asyncio.gather(*calls, return_exceptions=True)


async def test_spread_with_concurrent_joiners_uses_distinct_workers(harness: Harness) -> None:
    await register(harness, 6)
    replies = await join_concurrently(harness, 6, spb.PLACEMENT_MODE_SPREAD)
    assert all(isinstance(r, spb.StartSessionResponse) for r in replies)
    group = (await harness.sessions.GetGroup(spb.GetGroupRequest(group_id="g"))).group
    assert group.distinct_workers == 6 and not group.shared_worker
    assert not any(m.shares_worker for m in group.members)


async def test_strict_with_concurrent_joiners_places_some_and_says_so(harness: Harness) -> None:
    """Strict through StartSession: the members that fit stay placed, the others are
    refused with members_placed in the details, and the group stays open."""
    await register(harness, 3)
    replies = await join_concurrently(harness, 5, spb.PLACEMENT_MODE_STRICT)
    placed = [r for r in replies if isinstance(r, spb.StartSessionResponse)]
    refused = [r for r in replies if isinstance(r, grpc.aio.AioRpcError)]
    assert len(placed) == 3 and len(refused) == 2
    assert len({r.session.worker_id for r in placed}) == 3
    for error in refused:
        details = details_of(error)
        assert details.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert details.reason == "NOT_ENOUGH_DISTINCT_WORKERS"
        assert details.metadata["members_placed"] == "3"
    reply = await harness.sessions.GetGroup(spb.GetGroupRequest(group_id="g"))
    assert reply.group.state == pb.GROUP_STATE_OPEN and len(reply.group.members) == 3
    assert reply.placement_mode == spb.PLACEMENT_MODE_STRICT


async def test_pack_with_concurrent_joiners_fills_to_the_cap(harness: Harness) -> None:
    await register(harness, 4)
    options = pb.GroupOptions(max_members_per_worker=3)
    replies = await join_concurrently(harness, 8, spb.PLACEMENT_MODE_PACK, options)
    assert all(isinstance(r, spb.StartSessionResponse) for r in replies)
    group = (await harness.sessions.GetGroup(spb.GetGroupRequest(group_id="g"))).group
    per_worker = Counter(m.worker_id for m in group.members)
    assert sorted(per_worker.values()) == [2, 3, 3]
    assert group.distinct_workers == 3 and group.shared_worker
    assert all(m.shares_worker for m in group.members)
    assert group.options.max_members_per_worker == 3


async def test_pack_default_cap_is_the_fair_share(harness: Harness) -> None:
    # 2 workers of capacity 8: fair share of a group of 8 is ceil(8 * 8 / 16) = 4.
    await register(harness, 2)
    reply = await harness.sessions.StartGroup(
        spb.StartGroupRequest(task_id="t", group_size=8, placement_mode=spb.PLACEMENT_MODE_PACK)
    )
    per_worker = Counter(m.worker_id for m in reply.group.members)
    assert sorted(per_worker.values()) == [4, 4]
    assert reply.shared_worker and reply.placement_mode == spb.PLACEMENT_MODE_PACK


async def test_pack_cap_reached_is_resource_exhausted_and_start_group_takes_nothing(
    harness: Harness,
) -> None:
    await register(harness, 2)
    before = await open_sessions(harness)
    meta = await expect_error(
        harness.sessions.StartGroup(
            spb.StartGroupRequest(
                task_id="t",
                group_size=5,
                placement_mode=spb.PLACEMENT_MODE_PACK,
                group_options=pb.GroupOptions(max_members_per_worker=2),
            )
        ),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "PACK_CAP_REACHED",
    )
    assert meta["max_members_per_worker"] == "2"
    assert await open_sessions(harness) == before


async def test_joiner_follows_the_group_policy_and_may_not_change_it(harness: Harness) -> None:
    await register(harness, 4)
    # 4 idle workers of capacity 8: the fair share of a group of 3 is 1 (as SPREAD); a cap of
    # 3 packs them.
    await start(
        harness,
        group_id="g",
        group_size=3,
        placement_mode=spb.PLACEMENT_MODE_PACK,
        group_options=pb.GroupOptions(max_members_per_worker=3),
    )
    second = await start(harness, group_id="g")
    assert second.placement_mode == spb.PLACEMENT_MODE_PACK and second.shared_worker
    await expect_error(
        start(harness, group_id="g", placement_mode=spb.PLACEMENT_MODE_SPREAD),
        grpc.StatusCode.INVALID_ARGUMENT,
        "PLACEMENT_MODE_MISMATCH",
    )
    # The first member now also reports that it shares its worker.
    first = await harness.sessions.GetSession(spb.GetSessionRequest(session="groups/g/sessions/0"))
    assert first.session.shares_worker


@pytest.mark.parametrize(
    ("mode", "options", "reason", "field"),
    [
        (spb.PLACEMENT_MODE_PACK, {"max_members_per_worker": 0}, "OUT_OF_BOUNDS", "cap"),
        (spb.PLACEMENT_MODE_PACK, {"max_members_per_worker": 5}, "OUT_OF_BOUNDS", "cap"),
        (spb.PLACEMENT_MODE_SPREAD, {"max_members_per_worker": 2}, "CAP_WITHOUT_PACK", "cap"),
        (7, {}, "UNKNOWN_ENUM_VALUE", "placement_mode"),
    ],
)
async def test_bad_placement_inputs_are_invalid_and_change_nothing(
    harness: Harness, mode: int, options: dict[str, int], reason: str, field: str
) -> None:
    await register(harness, 2)
    await expect_error(
        harness.sessions.StartGroup(
            spb.StartGroupRequest(
                task_id="t",
                group_size=4,
                group_id="bad",
                placement_mode=mode,  # type: ignore[arg-type]
                group_options=pb.GroupOptions(**options),  # type: ignore[arg-type]
            )
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        reason,
    )
    assert sum((await open_sessions(harness)).values()) == 0
    await expect_error(
        harness.sessions.GetGroup(spb.GetGroupRequest(group_id="bad")),
        grpc.StatusCode.NOT_FOUND,
        "GROUP_NOT_FOUND",
    )


async def test_selector_chooses_the_pool(harness: Harness) -> None:
    await register(harness, 3, model="small")
    await register(harness, 3, model="large")
    reply = await harness.sessions.StartGroup(
        spb.StartGroupRequest(
            task_id="t", group_size=3, group_options=pb.GroupOptions(selector={"model": "large"})
        )
    )
    assert {m.worker_id for m in reply.group.members} == {"large0", "large1", "large2"}
    assert dict(reply.group.options.selector) == {"model": "large"}


async def test_selector_no_worker_matches_is_unavailable_with_the_selector(
    harness: Harness,
) -> None:
    await register(harness, 2, model="small")
    meta = await expect_error(
        start(harness, group_options=pb.GroupOptions(selector={"zone": "eu"})),
        grpc.StatusCode.UNAVAILABLE,
        "NO_MATCHING_WORKER",
    )
    assert meta["selector"] == "zone=eu"
    assert sum((await open_sessions(harness)).values()) == 0
    assert not (await harness.sessions.ListGroups(spb.ListGroupsRequest())).groups


async def test_selector_matching_workers_all_busy_is_no_eligible_worker(harness: Harness) -> None:
    await register(harness, 1, capacity=1, model="small")
    await start(harness, group_options=pb.GroupOptions(selector={"model": "small"}))
    meta = await expect_error(
        start(harness, group_options=pb.GroupOptions(selector={"model": "small"})),
        grpc.StatusCode.UNAVAILABLE,
        "NO_ELIGIBLE_WORKER",
    )
    assert meta["selector"] == "model=small"


async def test_start_session_retry_returns_the_first_reply(harness: Harness) -> None:
    await register(harness, 2)
    first = await start(harness, group_id="r", group_size=2, request_id="req-1")
    again = await start(harness, group_id="r", group_size=2, request_id="req-1")
    assert first.group_created and again.group_created and again.replayed
    assert again.session == first.session
    joiner = await start(harness, group_id="r", request_id="req-2")
    joiner_again = await start(harness, group_id="r", request_id="req-2")
    assert not joiner.group_created and not joiner_again.group_created


async def test_a_reward_request_without_entries_is_refused(harness: Harness) -> None:
    stream = RewardClient(harness)
    await stream.send([])
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stream.ack()
    details = details_of(info.value)
    assert details.code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.reason == "NO_ENTRIES"


async def test_the_placement_policy_survives_a_restart(tmp_path: Path) -> None:
    h = await start_durable(tmp_path, ManualClock())
    try:
        await register(h, 3, model="m")
        await start(
            h,
            group_id="p",
            group_size=4,
            placement_mode=spb.PLACEMENT_MODE_PACK,
            group_options=pb.GroupOptions(max_members_per_worker=2, selector={"model": "m"}),
        )
        h = await restart(h, tmp_path)
        for i in range(3):
            await h.workers.Heartbeat(wpb.HeartbeatRequest(worker_id=f"m{i}"))
        joined = await start(h, group_id="p")
        assert joined.placement_mode == spb.PLACEMENT_MODE_PACK
        group = (await h.sessions.GetGroup(spb.GetGroupRequest(group_id="p"))).group
        assert group.options.max_members_per_worker == 2
        assert dict(group.options.selector) == {"model": "m"}
        assert group.members[0].worker_id == group.members[1].worker_id  # packed, then capped
        assert group.members[0].shares_worker and group.members[1].shares_worker
    finally:
        await stop_harness(h)
