"""A journaled router restarted on its state directory, against a real server on 127.0.0.1:0.

Each test runs a server with a journal in ``tmp_path``, stops it, and starts a new one on the
same directory with a new ManualClock whose wall time has moved on (a new process starts its
monotonic clock afresh), then checks what a client sees.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
import numpy as np
import pytest
from google.protobuf.duration_pb2 import Duration
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sessionrouter.server.app import JournalConfig, RouterServer, ServerConfig, WorkerSpec
from sessionrouter.server.core.clock import ManualClock
from sessionrouter.server.core.router import RouterSettings
from sessionrouter.server.journal import JOURNAL_FILE, JournalError, SqliteJournal
from sessionrouter.v1 import resources_pb2 as pb
from sessionrouter.v1 import session_service_pb2 as spb
from sessionrouter.v1 import worker_service_pb2 as wpb
from tests.support import (
    Harness,
    TablesOpener,
    details_of,
    read_feed,
    start_harness,
    stop_harness,
)

SERVE = (sys.executable, "-m", "sessionrouter.server", "serve")


async def start_durable(
    state_dir: Path,
    clock: ManualClock,
    settings: RouterSettings | None = None,
    workers: tuple[WorkerSpec, ...] = (),
    tables: TablesOpener | None = None,
) -> Harness:
    return await start_harness(
        settings, workers, clock=clock, tables=tables, journal=JournalConfig(str(state_dir))
    )


async def restart(h: Harness, state_dir: Path, down_s: float = 5.0, **kwargs: object) -> Harness:
    """Stops ``h`` and starts a new server on the same directory, ``down_s`` seconds later."""
    await stop_harness(h)
    clock = ManualClock(start_wall=h.clock.wall() + down_s)
    return await start_durable(state_dir, clock, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def tables() -> TablesOpener:
    """Opens the durable router's journal tables, so a test can hold or fail its writes."""
    return TablesOpener()


@pytest.fixture
async def durable(tmp_path: Path, tables: TablesOpener) -> AsyncIterator[Harness]:
    h = await start_durable(tmp_path, ManualClock(), tables=tables)
    try:
        yield h
    finally:
        await stop_harness(h)


async def register_pool(h: Harness, n: int = 4) -> None:
    for i in range(n):
        await h.workers.RegisterWorker(
            wpb.RegisterWorkerRequest(worker_id=f"w{i}", address=f"10.0.0.{i}:1", capacity=16)
        )


async def heartbeat_all(h: Harness, n: int = 4) -> None:
    for i in range(n):
        await h.workers.Heartbeat(wpb.HeartbeatRequest(worker_id=f"w{i}"))


async def send_rewards(
    h: Harness, entries: Sequence[tuple[str, float]]
) -> list[spb.SubmitRewardsResponse]:
    """One request on a fresh stream, half-closed at once: every response, results included."""
    request = spb.SubmitRewardsRequest(
        entries=[spb.RewardEntry(session=s, reward=r) for s, r in entries], sequence=1
    )
    return [r async for r in h.sessions.SubmitRewards(iter([request]))]


def statuses(responses: list[spb.SubmitRewardsResponse]) -> list[int]:
    return [r.status for m in responses if m.HasField("ack") for r in m.ack.results]


def group_results(responses: list[spb.SubmitRewardsResponse]) -> list[pb.GroupResult]:
    return [g for m in responses for g in m.group_results]


async def test_groups_rewards_and_request_ids_survive_a_restart(tmp_path: Path) -> None:
    h = await start_durable(tmp_path, ManualClock())
    await register_pool(h)
    started = await h.sessions.StartGroup(
        spb.StartGroupRequest(task_id="t", group_id="g", group_size=3, request_id="req-g")
    )
    joined = await h.sessions.StartSession(
        spb.StartSessionRequest(task_id="u", group_id="j", group_size=2, request_id="req-j0")
    )
    names = [m.name for m in started.group.members]
    assert (
        statuses(await send_rewards(h, [(names[0], 1.0), (names[1], 0.0)]))
        == [spb.REWARD_STATUS_ACCEPTED] * 2
    )
    h = await restart(h, tmp_path)
    try:
        group = (await h.sessions.GetGroup(spb.GetGroupRequest(group_id="g"))).group
        assert group.state == pb.GROUP_STATE_OPEN and group.task_id == "t"
        assert [m.name for m in group.members] == names
        assert [m.worker_id for m in group.members] == [m.worker_id for m in started.group.members]
        assert [m.reward for m in group.members[:2]] == [1.0, 0.0]
        assert not group.members[2].HasField("reward")
        # Retries after the restart are replays, not new sessions.
        again = await h.sessions.StartGroup(
            spb.StartGroupRequest(task_id="t", group_id="g", group_size=3, request_id="req-g")
        )
        assert again.replayed and [m.name for m in again.group.members] == names
        rejoined = await h.sessions.StartSession(
            spb.StartSessionRequest(task_id="u", group_id="j", group_size=2, request_id="req-j0")
        )
        assert rejoined.replayed and rejoined.session.name == joined.session.name
        # The same reward again is a duplicate, another one a conflict, as before.
        await heartbeat_all(h)
        responses = await send_rewards(h, [(names[0], 1.0), (names[1], 0.5), (names[2], 0.5)])
        assert statuses(responses) == [
            spb.REWARD_STATUS_DUPLICATE,
            spb.REWARD_STATUS_CONFLICT,
            spb.REWARD_STATUS_ACCEPTED,
        ]
        (result,) = group_results(responses)
        rewards = np.array([1.0, 0.0, 0.5])
        expected = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6)
        np.testing.assert_allclose(result.advantages, expected, rtol=0, atol=1e-12)
        assert result.cursor == 1
    finally:
        await stop_harness(h)


async def test_workers_come_back_unhealthy_until_they_heartbeat(tmp_path: Path) -> None:
    settings = RouterSettings(heartbeat_timeout_s=10.0)
    h = await start_durable(tmp_path, ManualClock(), settings)
    await register_pool(h, 2)
    await h.workers.DrainWorker(wpb.DrainWorkerRequest(worker_id="w1"))
    started = await h.sessions.StartGroup(spb.StartGroupRequest(task_id="t", group_size=2))
    await h.workers.DrainWorker(wpb.DrainWorkerRequest(worker_id="w1", resume=False))
    h = await restart(h, tmp_path, settings=settings)
    try:
        workers = (await h.workers.ListWorkers(wpb.ListWorkersRequest())).workers
        assert [(w.worker_id, w.health, w.draining, w.open_sessions) for w in workers] == [
            ("w0", pb.WORKER_HEALTH_UNHEALTHY, False, 2),
            ("w1", pb.WORKER_HEALTH_UNHEALTHY, True, 0),
        ]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.sessions.StartSession(spb.StartSessionRequest(task_id="t"))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        await h.workers.Heartbeat(wpb.HeartbeatRequest(worker_id="w0"))
        placed = await h.sessions.StartSession(spb.StartSessionRequest(task_id="t"))
        assert placed.session.worker_id == "w0"
        # w1 never heartbeats; w0 does: after the timeout only w1's sessions would be lost,
        # and it has none; w0's members are not marked lost.
        h.clock.advance(5)
        await h.workers.Heartbeat(wpb.HeartbeatRequest(worker_id="w0"))
        h.clock.advance(6)
        h.expire()
        group = (
            await h.sessions.GetGroup(spb.GetGroupRequest(group_id=started.group.group_id))
        ).group
        assert not any(m.worker_lost for m in group.members)
    finally:
        await stop_harness(h)


async def test_sessions_of_a_worker_that_never_returns_are_marked_lost(tmp_path: Path) -> None:
    settings = RouterSettings(heartbeat_timeout_s=10.0)
    h = await start_durable(tmp_path, ManualClock(), settings)
    await register_pool(h, 1)
    started = await h.sessions.StartGroup(spb.StartGroupRequest(task_id="t", group_size=2))
    h = await restart(h, tmp_path, settings=settings)
    try:
        h.clock.advance(9)
        h.expire()
        name = started.group.members[0].name
        session = (await h.sessions.GetSession(spb.GetSessionRequest(session=name))).session
        assert not session.worker_lost
        h.clock.advance(2)
        h.expire()
        session = (await h.sessions.GetSession(spb.GetSessionRequest(session=name))).session
        assert session.worker_lost
        h = await restart(h, tmp_path, settings=settings)  # the mark itself is journaled
        session = (await h.sessions.GetSession(spb.GetSessionRequest(session=name))).session
        assert session.worker_lost
    finally:
        await stop_harness(h)


async def test_aborts_and_deregistrations_survive_a_restart(tmp_path: Path) -> None:
    h = await start_durable(tmp_path, ManualClock())
    await register_pool(h, 3)
    started = await h.sessions.StartGroup(spb.StartGroupRequest(task_id="t", group_size=3))
    names = [m.name for m in started.group.members]
    await h.sessions.AbortSession(spb.AbortSessionRequest(session=names[0], reason="oom"))
    lost = started.group.members[1].worker_id
    await h.workers.DeregisterWorker(wpb.DeregisterWorkerRequest(worker_id=lost))
    h = await restart(h, tmp_path)
    try:
        group = (
            await h.sessions.GetGroup(spb.GetGroupRequest(group_id=started.group.group_id))
        ).group
        assert group.members[0].state == pb.SESSION_STATE_ABORTED
        assert group.members[1].worker_lost and group.members[1].state == pb.SESSION_STATE_OPEN
        assert not group.members[2].worker_lost
        workers = (await h.workers.ListWorkers(wpb.ListWorkersRequest())).workers
        assert lost not in [w.worker_id for w in workers] and len(workers) == 2
    finally:
        await stop_harness(h)


async def test_feed_resumes_by_cursor_and_cursors_continue_after_a_restart(
    tmp_path: Path,
) -> None:
    h = await start_durable(tmp_path, ManualClock())
    await register_pool(h)
    for i in range(3):
        group = await h.sessions.StartGroup(
            spb.StartGroupRequest(task_id="t", group_id=f"g{i}", group_size=2)
        )
        await send_rewards(h, [(m.name, float(j)) for j, m in enumerate(group.group.members)])
    before = await read_feed(h, 0, 3)
    assert [g.cursor for g in before] == [1, 2, 3]
    h = await restart(h, tmp_path)
    try:
        await heartbeat_all(h)
        for i in range(3, 5):
            group = await h.sessions.StartGroup(
                spb.StartGroupRequest(task_id="t", group_id=f"g{i}", group_size=2)
            )
            await send_rewards(h, [(m.name, float(j)) for j, m in enumerate(group.group.members)])
        # A trainer that had processed cursor 2 resumes: nothing lost, nothing twice.
        resumed = await read_feed(h, 2, 3)
        assert [(g.cursor, g.group_id) for g in resumed] == [(3, "g2"), (4, "g3"), (5, "g4")]
        assert resumed[0].SerializeToString() == before[2].SerializeToString()
        g1 = (await h.sessions.GetGroup(spb.GetGroupRequest(group_id="g1"))).group
        assert g1.state == pb.GROUP_STATE_FINALIZED and g1.cursor == 2
    finally:
        await stop_harness(h)


async def test_group_deadlines_keep_counting_across_a_restart(tmp_path: Path) -> None:
    # Workers silent for minutes stay healthy: their members are not lost, so the group
    # waits for its deadline (a group with only lost members left would finish at once).
    quiet = RouterSettings(heartbeat_timeout_s=3600.0)
    h = await start_durable(tmp_path, ManualClock(), quiet)
    await register_pool(h)
    options = pb.GroupOptions(min_members=2, deadline=Duration(seconds=600))
    group = await h.sessions.StartGroup(
        spb.StartGroupRequest(task_id="t", group_id="d", group_size=3, group_options=options)
    )
    names = [m.name for m in group.group.members]
    await send_rewards(h, [(names[0], 1.0), (names[1], 0.0)])
    h.clock.advance(400)
    assert h.expire() == 0
    h = await restart(h, tmp_path, down_s=100.0, settings=quiet)  # 500 s of 600 s gone
    try:
        h.clock.advance(99)
        assert h.expire() == 0
        h.clock.advance(2)
        assert h.expire() == 1
        await h.server.router.finalizer.flush()
        (result,) = await read_feed(h, 0, 1)
        assert result.outcome == pb.GROUP_OUTCOME_PARTIAL
        assert list(result.excluded_sessions) == [names[2]]
    finally:
        await stop_harness(h)


async def test_a_deadline_that_passed_while_down_fires_at_the_first_tick(tmp_path: Path) -> None:
    h = await start_durable(tmp_path, ManualClock())
    await register_pool(h)
    options = pb.GroupOptions(min_members=3, deadline=Duration(seconds=60))
    await h.sessions.StartGroup(
        spb.StartGroupRequest(task_id="t", group_id="d", group_size=3, group_options=options)
    )
    h = await restart(h, tmp_path, down_s=3600.0)
    try:
        assert h.expire() == 1
        await h.server.router.finalizer.flush()
        (result,) = await read_feed(h, 0, 1)
        assert result.outcome == pb.GROUP_OUTCOME_DROPPED and result.group_id == "d"
    finally:
        await stop_harness(h)


async def test_a_group_settled_but_not_finalized_in_the_journal_is_finalized_once(
    tmp_path: Path,
) -> None:
    # What a crash between the last reward and the finalization leaves behind.
    from sessionrouter.server.core.router import SessionRouter, StartGroupCommand

    journal = SqliteJournal(tmp_path)
    router = SessionRouter(RouterSettings(), ManualClock(), journal)
    router.register_worker("w0", "10.0.0.0:1", 4, {})
    router.start_group(StartGroupCommand("t", 2, group_id="s"))
    router.submit_rewards([("groups/s/sessions/0", 1.0), ("groups/s/sessions/1", 3.0)])
    journal.write_pending()
    journal.close_now()
    h = await start_durable(tmp_path, ManualClock())
    try:
        await h.server.router.finalizer.flush()
        (result,) = await read_feed(h, 0, 1)
        assert result.group_id == "s" and result.cursor == 1 and list(result.rewards) == [1, 3]
        h = await restart(h, tmp_path)
        await h.server.router.finalizer.flush()
        assert [g.group_id for g in await read_feed(h, 0, 1)] == ["s"]
        assert h.server.router.feed.last_cursor == 1
    finally:
        await stop_harness(h)


async def test_nothing_is_acknowledged_or_published_before_it_is_durable(
    durable: Harness, tables: TablesOpener
) -> None:
    await register_pool(durable)
    started = await durable.sessions.StartGroup(spb.StartGroupRequest(task_id="t", group_size=2))
    blocked = tables.opened
    blocked.gate.clear()
    subscriber = durable.sessions.SubscribeGroups(spb.SubscribeGroupsRequest())
    first_group = asyncio.ensure_future(subscriber.read())
    reply = asyncio.ensure_future(
        durable.sessions.StartSession(spb.StartSessionRequest(task_id="t"))
    )
    rewards = asyncio.ensure_future(
        send_rewards(durable, [(m.name, float(i)) for i, m in enumerate(started.group.members)])
    )
    await asyncio.sleep(0.3)
    assert not reply.done() and not rewards.done() and not first_group.done()
    blocked.gate.set()
    assert not (await reply).replayed
    assert statuses(await rewards) == [spb.REWARD_STATUS_ACCEPTED] * 2
    response = await asyncio.wait_for(first_group, 5)
    assert isinstance(response, spb.SubscribeGroupsResponse)
    assert response.groups[0].group_id == started.group.group_id
    subscriber.cancel()


async def test_a_journal_that_cannot_be_written_stops_the_router(
    durable: Harness, tables: TablesOpener
) -> None:
    await register_pool(durable)
    tables.opened.failure = OSError(5, "Input/output error")  # a full disk is retried instead
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await durable.sessions.StartSession(spb.StartSessionRequest(task_id="t"))
    details = details_of(info.value)
    assert details.code == grpc.StatusCode.UNAVAILABLE and details.reason == "JOURNAL_FAILED"
    assert "Input/output error" in details.message
    await asyncio.wait_for(durable.server.failed.wait(), 5)
    health = health_pb2_grpc.HealthStub(durable.channel)
    reply = await health.Check(health_pb2.HealthCheckRequest())
    assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_static_workers_are_registered_again_and_a_moved_one_replaced(
    tmp_path: Path,
) -> None:
    first = (WorkerSpec("a", "10.0.0.1:1", 4), WorkerSpec("b", "10.0.0.2:1", 4))
    h = await start_durable(tmp_path, ManualClock(), workers=first)
    moved = (WorkerSpec("a", "10.0.0.1:1", 8), WorkerSpec("b", "10.0.0.9:1", 4))
    h = await restart(h, tmp_path, workers=moved)
    try:
        workers = (await h.workers.ListWorkers(wpb.ListWorkersRequest())).workers
        assert [(w.worker_id, w.address, w.capacity, w.health) for w in workers] == [
            ("a", "10.0.0.1:1", 8, pb.WORKER_HEALTH_HEALTHY),
            ("b", "10.0.0.9:1", 4, pb.WORKER_HEALTH_HEALTHY),
        ]
    finally:
        await stop_harness(h)


async def test_a_corrupt_journal_is_a_start_up_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / JOURNAL_FILE
    path.write_bytes(b"\x00garbage" * 512)
    server = RouterServer(
        ServerConfig(listen="127.0.0.1:0", journal=JournalConfig(str(tmp_path))),
        clock=ManualClock(),
    )
    with pytest.raises(JournalError) as info:
        await server.start()
    assert str(path) in str(info.value)
    assert path.read_bytes() == b"\x00garbage" * 512  # never reset


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        ("garbage", "not a readable SQLite database"),
        ("future", "written by a newer sessionrouter"),
    ],
)
def test_the_cli_exits_non_zero_on_a_journal_it_cannot_use(
    tmp_path: Path, setup: str, expected: str
) -> None:
    path = tmp_path / JOURNAL_FILE
    if setup == "garbage":
        path.write_bytes(b"not sqlite" * 100)
    else:
        import sqlite3

        SqliteJournal(tmp_path).close_now()
        con = sqlite3.connect(path)
        con.execute("UPDATE meta SET value=99 WHERE key='schema_version'")
        con.commit()
        con.close()
    done = subprocess.run(
        [*SERVE, "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert str(path) in done.stderr and expected in done.stderr
