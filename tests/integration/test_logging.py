"""What the router logs at which level: nothing per reward or complete group at the default
(info) level, groups that ended partial or dropped at info, and an ``activity`` line that sums
up the sessions, rewards and groups since the previous one."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import grpc
import pytest

from sessionrouter.server.app import WorkerSpec
from sessionrouter.server.core.router import RouterSettings
from sessionrouter.v1 import session_service_pb2 as spb
from sessionrouter.v1 import session_service_pb2_grpc as spb_grpc
from tests.router_process import RouterProcess, static_workers
from tests.support import Harness, start_harness, stop_harness

WORKERS = tuple(WorkerSpec(f"w{i}", f"10.0.0.{i}:1", 100) for i in range(4))
SIZE = 4


async def start_groups(h: Harness, count: int) -> list[list[str]]:
    """``count`` groups of ``SIZE``; their member names."""
    groups = []
    for _ in range(count):
        reply = await h.sessions.StartGroup(spb.StartGroupRequest(task_id="t", group_size=SIZE))
        groups.append([m.name for m in reply.group.members])
    return groups


async def reward(h: Harness, names: list[str]) -> list[int]:
    """Rewards ``names`` (0, 1, 2...) on one stream; the status of each entry."""
    entries = [spb.RewardEntry(session=n, reward=float(i)) for i, n in enumerate(names)]
    call = h.sessions.SubmitRewards()
    await call.write(spb.SubmitRewardsRequest(sequence=1, entries=entries))
    await call.done_writing()
    statuses: list[int] = []
    while (response := await call.read()) is not grpc.aio.EOF:
        assert isinstance(response, spb.SubmitRewardsResponse)
        if response.HasField("ack"):
            statuses += [r.status for r in response.ack.results]
    return statuses


def events(caplog: pytest.LogCaptureFixture, event: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", None) == event]


async def test_no_line_per_reward_or_complete_group_at_info_only_at_debug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="sessionrouter")
    h = await start_harness(workers=WORKERS)
    try:
        groups = await start_groups(h, 5)
        statuses = await reward(h, [n for names in groups for n in names])
        assert statuses == [spb.REWARD_STATUS_ACCEPTED] * 5 * SIZE
    finally:
        await stop_harness(h)
    finished = events(caplog, "group_finished")
    assert [r.levelno for r in finished] == [logging.DEBUG] * 5
    assert all(r.outcome == "complete" for r in finished)  # type: ignore[attr-defined]
    assert [r.levelno for r in events(caplog, "group_created")] == [logging.DEBUG] * 5
    loud = {
        getattr(r, "event", None)
        for r in caplog.records
        if r.name == "sessionrouter.router" and r.levelno >= logging.INFO
    }
    assert loud == {"worker_registered"}  # the start-up pool, nothing per group or reward


async def test_partial_and_dropped_groups_are_logged_at_info(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="sessionrouter")
    h = await start_harness(
        RouterSettings(deadline_s=10.0, heartbeat_timeout_s=3600.0), workers=WORKERS
    )
    try:
        partial, dropped = await start_groups(h, 2)
        await reward(h, [*partial[:2], *dropped[:1]])  # min_members is 2
        h.clock.advance(11.0)
        assert h.expire() == 2
    finally:
        await stop_harness(h)
    finished = events(caplog, "group_finished")
    assert [(r.levelno, r.outcome, r.rewarded) for r in finished] == [  # type: ignore[attr-defined]
        (logging.INFO, "partial", 2),
        (logging.INFO, "dropped", 1),
    ]


async def test_the_activity_line_sums_up_what_happened_since_the_previous_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="sessionrouter")
    h = await start_harness(workers=WORKERS)
    try:
        groups = await start_groups(h, 3)
        await reward(h, [*groups[0], *groups[1], "groups/nope/sessions/0"])
        h.reduce()
        fields = h.server.activity.flush(h.server.router.snapshot())
        assert fields is not None
        assert fields["sessions_started"] == 3 * SIZE
        assert fields["rewards"] == {"accepted": 2 * SIZE, "unknown_session": 1}
        assert fields["groups_finished"] == {"complete": 2}
        assert fields["open_groups"] == 1 and fields["open_sessions"] == SIZE
        assert fields["feed_cursor"] == 2 and fields["reducer_batches"] >= 1
        assert fields["workers_healthy"] == len(WORKERS)
        assert h.server.activity.flush(h.server.router.snapshot()) is None  # nothing new

        await reward(h, groups[2])
        h.reduce()
        second = h.server.activity.flush(h.server.router.snapshot())
        assert second is not None and second["sessions_started"] == 0
        assert second["rewards"] == {"accepted": SIZE}
        assert second["groups_finished"] == {"complete": 1}
    finally:
        await stop_harness(h)
    lines = events(caplog, "activity")
    assert [r.levelno for r in lines] == [logging.INFO, logging.INFO]  # stop had nothing new
    assert [r.groups_finished for r in lines] == [{"complete": 2}, {"complete": 1}]  # type: ignore[attr-defined]


def test_a_router_at_its_default_level_writes_a_summary_not_a_line_per_group(
    tmp_path: Path,
) -> None:
    """The real process and its JSON log lines, as an operator sees them."""
    router = RouterProcess(tmp_path, "--in-memory", *static_workers(4, 100))
    address = router.start()
    try:
        with grpc.insecure_channel(address) as channel:
            stub = spb_grpc.SessionServiceStub(channel)
            names = []
            for _ in range(10):
                reply = stub.StartGroup(spb.StartGroupRequest(task_id="t", group_size=SIZE))
                names += [m.name for m in reply.group.members]
            entries = [spb.RewardEntry(session=n, reward=float(i % 3)) for i, n in enumerate(names)]
            list(stub.SubmitRewards(iter([spb.SubmitRewardsRequest(sequence=1, entries=entries)])))
    finally:
        assert router.stop() == 0, router.tail()
    lines = [json.loads(line) for line in router.log.read_text().splitlines() if line[:1] == "{"]
    said = [line.get("event") for line in lines]
    assert "group_finished" not in said and "group_created" not in said
    assert {line["level"] for line in lines} <= {"info", "warning"}
    [activity] = [line for line in lines if line.get("event") == "activity"]
    assert activity["level"] == "info"
    assert activity["sessions_started"] == 10 * SIZE
    assert activity["rewards"] == {"accepted": 10 * SIZE}
    assert activity["groups_finished"] == {"complete": 10}


async def test_the_server_logs_the_activity_line_every_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="sessionrouter")
    logged = asyncio.Event()
    handler = logging.Handler()
    handler.emit = lambda record: logged.set()  # type: ignore[method-assign]
    logging.getLogger("sessionrouter.activity").addHandler(handler)
    h = await start_harness(workers=WORKERS, tick_s=0.02, activity_log_s=0.1)
    try:
        [names] = await start_groups(h, 1)
        await reward(h, names)

        def finished_groups() -> int:
            counts: list[int] = [
                sum(line.groups_finished.values())  # type: ignore[attr-defined]
                for line in events(caplog, "activity")
            ]
            return sum(counts)

        # A loaded machine may cut the starts and the rewards into two intervals: the lines
        # together hold every session and the finished group, each counted once.
        async with asyncio.timeout(5):
            while finished_groups() < 1:
                logged.clear()
                await logged.wait()
        lines = events(caplog, "activity")
        assert sum(line.sessions_started for line in lines) == SIZE  # type: ignore[attr-defined]
        assert finished_groups() == 1
        assert all(line.interval_s >= 0.1 for line in lines)  # type: ignore[attr-defined]
        await asyncio.sleep(0.3)  # three more intervals with nothing new: no line
        assert len(events(caplog, "activity")) == len(lines)
    finally:
        logging.getLogger("sessionrouter.activity").removeHandler(handler)
        await stop_harness(h)
