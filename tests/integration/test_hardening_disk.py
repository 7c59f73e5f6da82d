"""A full disk: said once with the path, NOT_SERVING and no new sessions while it lasts,
nothing acknowledged before it is durable, and everything back once a write succeeds.

The router runs in-process on a real journal; its tables raise a real SQLITE_FULL (from a
database capped by ``max_page_count``) while the test says the disk is full: the error a
full file system gives, without filling one.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sessionrouter.server.app import JournalConfig, WorkerSpec
from sessionrouter.server.journal import JournalTables, SyncMode
from sessionrouter.v1 import resources_pb2 as pb
from sessionrouter.v1 import session_service_pb2 as spb
from tests.support import details_of, start_harness, stop_harness


def _sqlite_full() -> sqlite3.Error:
    """A genuine SQLITE_FULL, raised by SQLite itself."""
    con = sqlite3.connect(":memory:")
    con.execute("PRAGMA max_page_count=2")
    con.execute("CREATE TABLE t (b BLOB)")
    try:
        con.execute("INSERT INTO t VALUES (?)", (b"x" * 100_000,))
    except sqlite3.Error as exc:
        return exc
    finally:
        con.close()
    raise AssertionError("SQLite did not report a full database")


class FillableTables(JournalTables):
    def __init__(self, state_dir: Path, sync: SyncMode) -> None:
        super().__init__(state_dir, sync)
        self.full = threading.Event()
        self.failed_writes = 0

    def append_log(self, data: bytes) -> int:
        if self.full.is_set():
            self.failed_writes += 1
            raise _sqlite_full()
        return super().append_log(data)


async def _health(channel: grpc.aio.Channel) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    return int(reply.status)


async def test_a_full_disk_is_said_once_and_not_serving_until_writes_succeed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert _sqlite_full().sqlite_errorcode == sqlite3.SQLITE_FULL
    opened: list[FillableTables] = []

    def open_tables(state_dir: Path, sync: SyncMode) -> JournalTables:
        opened.append(FillableTables(state_dir, sync))
        return opened[-1]

    workers = tuple(WorkerSpec(f"w{i}", f"10.0.0.{i}:1", 8) for i in range(2))
    journal = JournalConfig(str(tmp_path / "state"))
    h = await start_harness(workers=workers, journal=journal, tables=open_tables)  # type: ignore[arg-type]
    try:
        started = await h.sessions.StartGroup(spb.StartGroupRequest(task_id="t", group_size=2))
        names = [m.name for m in started.group.members]
        tables = opened[-1]
        caplog.set_level(logging.INFO, logger="sessionrouter")
        tables.full.set()

        call = h.sessions.SubmitRewards()
        await call.write(
            spb.SubmitRewardsRequest(
                sequence=7, entries=[spb.RewardEntry(session=names[0], reward=1.0)]
            )
        )
        read = asyncio.ensure_future(call.read())
        await asyncio.sleep(1.5)
        assert not read.done(), "a reward was acknowledged before it was durable"
        assert tables.failed_writes >= 2, "the writer retries the batch"
        assert await _health(h.channel) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.sessions.StartGroup(spb.StartGroupRequest(task_id="t", group_size=1))
        found = details_of(info.value)
        assert found.code == grpc.StatusCode.UNAVAILABLE and found.reason == "DISK_FULL"
        said = [r for r in caplog.records if getattr(r, "event", "") == "journal_disk_full"]
        assert len(said) == 1, "said once, not at every retry"
        assert str(tables.path) in said[0].getMessage() and "disk full" in said[0].getMessage()

        tables.full.clear()
        reply = await asyncio.wait_for(read, 5)
        assert isinstance(reply, spb.SubmitRewardsResponse)
        assert reply.ack.sequence == 7
        assert reply.ack.results[0].status == spb.REWARD_STATUS_ACCEPTED
        await call.done_writing()
        for _ in range(50):
            if await _health(h.channel) == health_pb2.HealthCheckResponse.SERVING:
                break
            await asyncio.sleep(0.05)
        assert await _health(h.channel) == health_pb2.HealthCheckResponse.SERVING
        await h.sessions.StartGroup(spb.StartGroupRequest(task_id="t", group_size=1))
        assert any(getattr(r, "event", "") == "journal_disk_writable" for r in caplog.records)
        assert not h.server.failed.is_set()
    finally:
        await stop_harness(h)

    h = await start_harness(workers=workers, journal=journal)
    try:
        session = await h.sessions.GetSession(spb.GetSessionRequest(session=names[0]))
        assert session.session.state == pb.SESSION_STATE_REWARDED
        assert session.session.reward == 1.0
    finally:
        await stop_harness(h)
