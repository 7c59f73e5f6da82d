"""Placement and membership against a real server on 127.0.0.1: what each input gets."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import grpc
import pytest

from sessionrouter.v1 import resources_pb2 as pb
from sessionrouter.v1 import session_service_pb2 as spb
from sessionrouter.v1 import worker_service_pb2 as wpb
from tests.support import Harness, details_of


async def register(h: Harness, n: int, capacity: int = 4, prefix: str = "w") -> list[str]:
    ids = [f"{prefix}{i}" for i in range(n)]
    for worker_id in ids:
        await h.workers.RegisterWorker(
            wpb.RegisterWorkerRequest(
                worker_id=worker_id,
                address=f"10.1.0.{len(worker_id)}:{1000 + int(worker_id[len(prefix) :])}",
                capacity=capacity,
            )
        )
    return ids


async def start(h: Harness, **fields: object) -> spb.StartSessionResponse:
    fields.setdefault("task_id", "prompt-1")
    return await h.sessions.StartSession(spb.StartSessionRequest(**fields))  # type: ignore[arg-type]


async def expect_error(call: object, code: grpc.StatusCode, reason: str) -> dict[str, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    details = details_of(info.value)
    assert details.code == code, details
    assert details.reason == reason, details
    return details.metadata


async def test_members_of_a_group_land_on_distinct_workers(harness: Harness) -> None:
    await register(harness, 8)
    replies = [await start(harness, group_id="g", group_size=8) for _ in range(8)]
    workers = [r.session.worker_id for r in replies]
    assert len(set(workers)) == 8
    assert [r.session.name for r in replies] == [f"groups/g/sessions/{i}" for i in range(8)]
    assert [r.group_created for r in replies] == [True] + [False] * 7
    assert not any(r.shared_worker for r in replies)


async def test_least_loaded_worker_is_chosen(harness: Harness) -> None:
    await register(harness, 3, capacity=10)
    # Load w0 with 3 sessions and w1 with 1 (separate groups of one, placed least-loaded).
    for _ in range(4):
        await start(harness)
    loads = {
        w.worker_id: w.open_sessions
        for w in (await harness.workers.ListWorkers(wpb.ListWorkersRequest())).workers
    }
    assert sorted(loads.values()) == [1, 1, 2]
    reply = await start(harness)
    assert loads[reply.session.worker_id] == 1

    # Capacity matters: load is a fraction of capacity.
    await harness.workers.RegisterWorker(
        wpb.RegisterWorkerRequest(worker_id="big", address="10.9.9.9:1", capacity=1000)
    )
    for _ in range(3):
        assert (await start(harness)).session.worker_id == "big"


async def test_scarce_workers_are_shared_evenly_and_flagged(harness: Harness) -> None:
    await register(harness, 3, capacity=10)
    replies = [await start(harness, group_id="g", group_size=7) for _ in range(7)]
    per_worker = Counter(r.session.worker_id for r in replies)
    assert sorted(per_worker.values()) == [2, 2, 3]
    assert [r.shared_worker for r in replies] == [False] * 3 + [True] * 4


async def test_strict_placement_refuses_to_share(harness: Harness) -> None:
    await register(harness, 2)
    for _ in range(2):
        await start(harness, group_id="g", group_size=3, placement_mode=spb.PLACEMENT_MODE_STRICT)
    meta = await expect_error(
        start(harness, group_id="g", placement_mode=spb.PLACEMENT_MODE_STRICT),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "NOT_ENOUGH_DISTINCT_WORKERS",
    )
    assert meta["group_id"] == "g"
    # StartGroup is all or none: a refused strict group leaves no slot taken.
    await expect_error(
        harness.sessions.StartGroup(
            spb.StartGroupRequest(
                task_id="t", group_size=3, placement_mode=spb.PLACEMENT_MODE_STRICT
            )
        ),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "NOT_ENOUGH_DISTINCT_WORKERS",
    )
    workers = (await harness.workers.ListWorkers(wpb.ListWorkersRequest())).workers
    assert sum(w.open_sessions for w in workers) == 2


async def test_no_eligible_worker_is_unavailable_with_retry_hint(harness: Harness) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await start(harness)
    details = details_of(info.value)
    assert details.code == grpc.StatusCode.UNAVAILABLE
    assert details.reason == "NO_ELIGIBLE_WORKER"
    assert details.retry_delay_s == pytest.approx(1.0)
    # A refused start creates no group.
    groups = await harness.sessions.ListGroups(spb.ListGroupsRequest())
    assert list(groups.groups) == []


async def test_full_workers_are_not_eligible(harness: Harness) -> None:
    await register(harness, 2, capacity=1)
    await start(harness)
    await start(harness)
    await expect_error(start(harness), grpc.StatusCode.UNAVAILABLE, "NO_ELIGIBLE_WORKER")


async def test_drained_worker_gets_no_new_sessions_but_keeps_its_own(harness: Harness) -> None:
    await register(harness, 2)
    first = await start(harness, group_id="g", group_size=4)
    drained = first.session.worker_id
    reply = await harness.workers.DrainWorker(wpb.DrainWorkerRequest(worker_id=drained))
    assert reply.worker.draining and reply.worker.open_sessions == 1
    for _ in range(3):
        assert (await start(harness)).session.worker_id != drained
    looked_up = await harness.sessions.GetSession(spb.GetSessionRequest(session=first.session.name))
    assert looked_up.session.state == pb.SESSION_STATE_OPEN
    await harness.workers.DrainWorker(wpb.DrainWorkerRequest(worker_id=drained, resume=True))
    assert (await start(harness)).session.worker_id == drained


async def test_silent_worker_turns_unhealthy_and_recovers(harness: Harness) -> None:
    await register(harness, 2)
    session = (await start(harness, group_id="g", group_size=2)).session
    other = "w1" if session.worker_id == "w0" else "w0"
    harness.clock.advance(6)
    await harness.workers.Heartbeat(wpb.HeartbeatRequest(worker_id=other))
    harness.clock.advance(6)  # session's worker silent for 12 s > 10 s timeout
    harness.expire()
    lost = await harness.workers.GetWorker(wpb.GetWorkerRequest(worker_id=session.worker_id))
    assert lost.worker.health == pb.WORKER_HEALTH_UNHEALTHY
    looked_up = await harness.sessions.GetSession(spb.GetSessionRequest(session=session.name))
    assert looked_up.session.worker_lost
    for _ in range(3):
        assert (await start(harness)).session.worker_id == other
    back = await harness.workers.Heartbeat(wpb.HeartbeatRequest(worker_id=session.worker_id))
    assert back.worker.health == pb.WORKER_HEALTH_HEALTHY
    assert (await start(harness)).session.worker_id == session.worker_id


async def test_deregistered_worker_marks_its_sessions_lost(harness: Harness) -> None:
    await register(harness, 2)
    session = (await start(harness, group_id="g", group_size=2)).session
    reply = await harness.workers.DeregisterWorker(
        wpb.DeregisterWorkerRequest(worker_id=session.worker_id)
    )
    assert reply.lost_sessions == 1
    looked_up = await harness.sessions.GetSession(spb.GetSessionRequest(session=session.name))
    assert looked_up.session.worker_lost
    await expect_error(
        harness.workers.GetWorker(wpb.GetWorkerRequest(worker_id=session.worker_id)),
        grpc.StatusCode.NOT_FOUND,
        "WORKER_NOT_FOUND",
    )


async def test_retry_with_same_request_id_returns_same_session(harness: Harness) -> None:
    await register(harness, 4)
    first = await start(harness, group_id="g", group_size=4, request_id="req-1")
    again = await start(harness, group_id="g", group_size=4, request_id="req-1")
    assert again.replayed and not first.replayed
    assert again.session.name == first.session.name
    assert again.session.worker_id == first.session.worker_id
    group = await harness.sessions.GetGroup(spb.GetGroupRequest(group_id="g"))
    assert len(group.group.members) == 1
    # The same id for another request is refused, not replayed.
    await expect_error(
        start(harness, group_id="other", request_id="req-1"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "REQUEST_ID_REUSED",
    )
    # StartGroup retries too.
    g1 = await harness.sessions.StartGroup(
        spb.StartGroupRequest(task_id="t", group_size=3, request_id="grp-1")
    )
    g2 = await harness.sessions.StartGroup(
        spb.StartGroupRequest(task_id="t", group_size=3, request_id="grp-1")
    )
    assert g2.replayed and g1.group.group_id == g2.group.group_id
    workers = (await harness.workers.ListWorkers(wpb.ListWorkersRequest())).workers
    assert sum(w.open_sessions for w in workers) == 4


async def test_group_size_mismatch_overflow_and_task_mismatch(harness: Harness) -> None:
    await register(harness, 4)
    await start(harness, group_id="g", group_size=2)
    meta = await expect_error(
        start(harness, group_id="g", group_size=3),
        grpc.StatusCode.INVALID_ARGUMENT,
        "GROUP_SIZE_MISMATCH",
    )
    assert meta == {"group_id": "g", "expected": "2", "got": "3"}
    meta = await expect_error(
        start(harness, group_id="g", task_id="prompt-2"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "TASK_MISMATCH",
    )
    assert meta["expected"] == "prompt-1"
    await start(harness, group_id="g")  # size 0 means "the group's"
    meta = await expect_error(
        start(harness, group_id="g", group_size=2),
        grpc.StatusCode.FAILED_PRECONDITION,
        "GROUP_FULL",
    )
    assert meta["group_size"] == "2"
    await expect_error(
        start(
            harness,
            group_id="g",
            group_options=pb.GroupOptions(estimator=pb.EstimatorConfig(name="rloo")),
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "GROUP_OPTIONS_MISMATCH",
    )
    await expect_error(
        harness.sessions.StartGroup(spb.StartGroupRequest(task_id="t", group_id="g", group_size=2)),
        grpc.StatusCode.ALREADY_EXISTS,
        "GROUP_EXISTS",
    )


async def test_without_group_id_every_start_makes_its_own_group(harness: Harness) -> None:
    """The seed bug: unrelated sessions must never share a group by accident."""
    await register(harness, 4)
    replies = await asyncio.gather(*(start(harness, group_size=2) for _ in range(6)))
    assert len({r.session.group_id for r in replies}) == 6
    assert all(r.group_created for r in replies)


async def test_concurrent_joins_from_many_clients_fill_one_group_exactly(
    harness: Harness,
) -> None:
    await register(harness, 16, capacity=8)
    channels = [grpc.aio.insecure_channel(harness.address) for _ in range(8)]
    try:
        from sessionrouter.v1 import session_service_pb2_grpc as spb_grpc

        stubs = [spb_grpc.SessionServiceStub(c) for c in channels]

        async def join(i: int) -> spb.StartSessionResponse | grpc.StatusCode:
            try:
                return await stubs[i % 8].StartSession(
                    spb.StartSessionRequest(
                        task_id="p", group_id="race", group_size=16, request_id=f"r{i}"
                    )
                )
            except grpc.aio.AioRpcError as error:
                return error.code()

        outcomes = await asyncio.gather(*(join(i) for i in range(48)))
    finally:
        for channel in channels:
            await channel.close()
    joined = [o for o in outcomes if isinstance(o, spb.StartSessionResponse)]
    refused = [o for o in outcomes if not isinstance(o, spb.StartSessionResponse)]
    assert len(joined) == 16
    assert refused == [grpc.StatusCode.FAILED_PRECONDITION] * 32
    assert sorted(r.session.index for r in joined) == list(range(16))
    assert len({r.session.worker_id for r in joined}) == 16
    assert sum(r.group_created for r in joined) == 1


async def test_start_group_places_all_members_in_one_call(harness: Harness) -> None:
    await register(harness, 8)
    reply = await harness.sessions.StartGroup(
        spb.StartGroupRequest(
            task_id="t", group_id="whole", group_size=8, metadata={"prompt_len": "512"}
        )
    )
    members = reply.group.members
    assert [m.index for m in members] == list(range(8))
    assert len({m.worker_id for m in members}) == 8
    assert not reply.shared_worker
    assert all(m.metadata["prompt_len"] == "512" for m in members)
    await expect_error(
        start(harness, task_id="t", group_id="whole"),
        grpc.StatusCode.FAILED_PRECONDITION,
        "GROUP_FULL",
    )


async def test_abort_frees_the_slot_and_is_remembered(harness: Harness) -> None:
    await register(harness, 1, capacity=1)
    session = (await start(harness, group_id="g", group_size=2)).session
    await expect_error(start(harness), grpc.StatusCode.UNAVAILABLE, "NO_ELIGIBLE_WORKER")
    aborted = await harness.sessions.AbortSession(
        spb.AbortSessionRequest(session=session.name, reason="client gave up")
    )
    assert aborted.session.state == pb.SESSION_STATE_ABORTED
    again = await harness.sessions.AbortSession(spb.AbortSessionRequest(session=session.name))
    assert again.session.state == pb.SESSION_STATE_ABORTED
    await start(harness)  # the slot is free again


@pytest.mark.parametrize(
    ("fields", "reason", "field"),
    [
        ({"task_id": ""}, "INVALID_ID", "task_id"),
        ({"task_id": "x" * 129}, "INVALID_ID", "task_id"),
        ({"task_id": "has space"}, "INVALID_ID", "task_id"),
        ({"group_id": ""}, "INVALID_ID", "group_id"),
        ({"group_id": "a/b"}, "INVALID_ID", "group_id"),
        ({"request_id": "r" * 200}, "INVALID_ID", "request_id"),
        ({"metadata": {f"k{i}": "v" for i in range(33)}}, "MAP_TOO_LARGE", "metadata"),
        ({"metadata": {"k": "v" * 1025}}, "MAP_ENTRY_INVALID", "metadata[k]"),
        ({"metadata": {"": "v"}}, "MAP_ENTRY_INVALID", "metadata[]"),
        ({"group_size": 1025}, "OUT_OF_BOUNDS", "group_size"),
        ({"placement_mode": 9}, "UNKNOWN_ENUM_VALUE", "placement_mode"),
        (
            {"group_options": pb.GroupOptions(estimator=pb.EstimatorConfig(name="ppo"))},
            "INVALID_ESTIMATOR",
            "group_options.estimator",
        ),
        (
            {"group_options": pb.GroupOptions(min_members=3), "group_size": 2},
            "OUT_OF_BOUNDS",
            "group_options.min_members",
        ),
    ],
)
async def test_bad_start_session_input_is_invalid_argument(
    harness: Harness, fields: dict[str, object], reason: str, field: str
) -> None:
    await register(harness, 2)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await start(harness, **fields)
    details = details_of(info.value)
    assert details.code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.reason == reason
    assert details.fields == [field]


@pytest.mark.parametrize(
    ("request_", "code", "reason"),
    [
        (
            wpb.RegisterWorkerRequest(worker_id="", address="a:1", capacity=1),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ID",
        ),
        (
            wpb.RegisterWorkerRequest(worker_id="w", address="", capacity=1),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_FIELD",
        ),
        (
            wpb.RegisterWorkerRequest(worker_id="w", address="a:1", capacity=0),
            grpc.StatusCode.INVALID_ARGUMENT,
            "OUT_OF_BOUNDS",
        ),
        (
            wpb.RegisterWorkerRequest(
                worker_id="w", address="a:1", capacity=1, labels={"k": "v" * 300}
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "MAP_ENTRY_INVALID",
        ),
    ],
)
async def test_bad_worker_registration(
    harness: Harness, request_: wpb.RegisterWorkerRequest, code: grpc.StatusCode, reason: str
) -> None:
    await expect_error(harness.workers.RegisterWorker(request_), code, reason)


async def test_reregistering_is_idempotent_but_not_at_another_address(harness: Harness) -> None:
    req = wpb.RegisterWorkerRequest(worker_id="w", address="10.0.0.1:1", capacity=2)
    await harness.workers.RegisterWorker(req)
    again = await harness.workers.RegisterWorker(
        wpb.RegisterWorkerRequest(worker_id="w", address="10.0.0.1:1", capacity=5)
    )
    assert again.worker.capacity == 5
    await expect_error(
        harness.workers.RegisterWorker(
            wpb.RegisterWorkerRequest(worker_id="w", address="10.0.0.2:1", capacity=5)
        ),
        grpc.StatusCode.ALREADY_EXISTS,
        "WORKER_ADDRESS_CONFLICT",
    )


@pytest.mark.parametrize(
    "call",
    [
        "get_session_unknown_group",
        "get_session_index_past_members",
        "get_group",
        "abort",
        "heartbeat",
        "drain",
        "deregister",
    ],
)
async def test_unknown_ids_are_not_found(harness: Harness, call: str) -> None:
    await register(harness, 1)
    await start(harness, group_id="known", group_size=3)
    calls: dict[str, grpc.aio.UnaryUnaryCall[Any, Any]] = {
        "get_session_unknown_group": harness.sessions.GetSession(
            spb.GetSessionRequest(session="groups/nope/sessions/0")
        ),
        "get_session_index_past_members": harness.sessions.GetSession(
            spb.GetSessionRequest(session="groups/known/sessions/2")
        ),
        "get_group": harness.sessions.GetGroup(spb.GetGroupRequest(group_id="nope")),
        "abort": harness.sessions.AbortSession(
            spb.AbortSessionRequest(session="groups/nope/sessions/1")
        ),
        "heartbeat": harness.workers.Heartbeat(wpb.HeartbeatRequest(worker_id="nope")),
        "drain": harness.workers.DrainWorker(wpb.DrainWorkerRequest(worker_id="nope")),
        "deregister": harness.workers.DeregisterWorker(
            wpb.DeregisterWorkerRequest(worker_id="nope")
        ),
    }
    chosen = calls.pop(call)
    for other in calls.values():
        other.cancel()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await chosen
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_malformed_session_name_is_invalid_argument(harness: Harness) -> None:
    await expect_error(
        harness.sessions.GetSession(spb.GetSessionRequest(session="sessions/1")),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_SESSION_NAME",
    )


async def test_listing_pages_through_workers_and_groups(harness: Harness) -> None:
    await register(harness, 5, capacity=10)
    page1 = await harness.workers.ListWorkers(wpb.ListWorkersRequest(page_size=2))
    page2 = await harness.workers.ListWorkers(
        wpb.ListWorkersRequest(page_size=2, page_token=page1.next_page_token)
    )
    page3 = await harness.workers.ListWorkers(
        wpb.ListWorkersRequest(page_size=2, page_token=page2.next_page_token)
    )
    ids = [w.worker_id for p in (page1, page2, page3) for w in p.workers]
    assert ids == ["w0", "w1", "w2", "w3", "w4"] and page3.next_page_token == ""
    for i in range(5):
        await start(harness, group_id=f"g{i}", group_size=2)
    seen: list[str] = []
    token = ""
    while True:
        page = await harness.sessions.ListGroups(
            spb.ListGroupsRequest(page_size=2, page_token=token)
        )
        seen += [g.group_id for g in page.groups]
        token = page.next_page_token
        if not token:
            break
    assert seen == [f"g{i}" for i in range(5)]
    await expect_error(
        harness.sessions.ListGroups(spb.ListGroupsRequest(page_token="garbage")),
        grpc.StatusCode.INVALID_ARGUMENT,
        "INVALID_PAGE_TOKEN",
    )


async def test_ids_are_checked_on_every_start_whatever_the_earlier_starts_gave(
    harness: Harness,
) -> None:
    """Task and group ids that passed once are remembered as valid (the members of a group
    repeat both): a valid start of the group does not let an invalid id through, an invalid
    id is refused each time it comes, and the group still takes its members after that."""
    await register(harness, 4)
    first = await start(harness, task_id="task-1", group_id="g-1", group_size=3)
    assert first.group_created
    for _ in range(2):
        metadata = await expect_error(
            start(harness, task_id="task 1", group_id="g-1", group_size=3),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ID",
        )
        assert metadata == {"field": "task_id"}
        metadata = await expect_error(
            start(harness, task_id="task-1", group_id="g/1", group_size=3),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ID",
        )
        assert metadata == {"field": "group_id"}
        metadata = await expect_error(
            start(harness, task_id="task-1", group_id="g-1", group_size=3, request_id="r 1"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ID",
        )
        assert metadata == {"field": "request_id"}
    joined = await start(harness, task_id="task-1", group_id="g-1", group_size=3)
    assert joined.session.name == "groups/g-1/sessions/1"
    assert not joined.group_created
