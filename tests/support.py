"""Test support: real routers on 127.0.0.1:0, stubs to call them, error-detail decoding.

Servers run in-process on the test's event loop with a ManualClock, so tests that need time
to pass (heartbeat expiry, group deadlines) advance the clock instead of sleeping; the port is
the one ``add_insecure_port`` returned, never a port picked and released beforehand.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from sessionrouter.server.app import RouterServer, ServerConfig, WorkerSpec
from sessionrouter.server.core.clock import ManualClock
from sessionrouter.server.core.router import RouterSettings
from sessionrouter.server.journal import JournalTables, SyncMode
from sessionrouter.v1 import resources_pb2 as pb
from sessionrouter.v1 import session_service_pb2 as spb
from sessionrouter.v1 import session_service_pb2_grpc as spb_grpc
from sessionrouter.v1 import worker_service_pb2_grpc as wpb_grpc


@dataclass
class Harness:
    """A running router and what a test needs to drive it."""

    server: RouterServer
    clock: ManualClock
    address: str
    channel: grpc.aio.Channel
    sessions: spb_grpc.SessionServiceAsyncStub
    workers: wpb_grpc.WorkerServiceAsyncStub

    def expire(self) -> int:
        """Runs the periodic expiry once, at the clock's current time."""
        return self.server.router.expire_due()

    def reduce(self) -> None:
        """Reduces queued groups now instead of waiting for the micro-batch window."""
        self.server.router.finalizer.drain()


async def start_harness(
    settings: RouterSettings | None = None,
    workers: tuple[WorkerSpec, ...] = (),
    clock: ManualClock | None = None,
    tables: TablesOpener | None = None,
    **config: object,
) -> Harness:
    """Starts a router on 127.0.0.1:0; ``config`` sets further ServerConfig fields, and
    ``tables`` opens the journal's tables (to hold or fail its writes)."""
    clock = clock or ManualClock()
    cfg = ServerConfig(
        listen="127.0.0.1:0",
        router=settings or RouterSettings(),
        workers=workers,
        static_workers_heartbeat=False,
        **{"tick_s": 3600.0, "grace_s": 1.0, **config},  # type: ignore[arg-type]
    )
    server = RouterServer(cfg, clock=clock, open_tables=tables or JournalTables)
    port = await server.start()
    address = f"127.0.0.1:{port}"
    channel = grpc.aio.insecure_channel(address)
    return Harness(
        server,
        clock,
        address,
        channel,
        spb_grpc.SessionServiceStub(channel),
        wpb_grpc.WorkerServiceStub(channel),
    )


async def stop_harness(h: Harness) -> None:
    await h.channel.close()
    await h.server.stop(grace_s=0.5)


class ControlledTables(JournalTables):
    """Journal tables whose batches a test can hold before they are durable (``gate``, on
    the server's loop), whose log writes it can fail (``failure``) or whose fsync it can
    fail (``sync_failure``): the journal's real seams for faults, a store passed in instead
    of the default one."""

    def __init__(self, state_dir: Path, sync: SyncMode) -> None:
        super().__init__(state_dir, sync)
        self.gate = asyncio.Event()
        self.gate.set()
        self.failure: BaseException | None = None
        self.sync_failure: BaseException | None = None

    def append_log(self, data: bytes) -> int:
        if self.failure is not None:
            raise self.failure
        return super().append_log(data)

    def durable(self, sync: Callable[[], Awaitable[None]]) -> Awaitable[None]:
        return self._held(sync)

    async def _held(self, sync: Callable[[], Awaitable[None]]) -> None:
        await asyncio.wait_for(self.gate.wait(), 10)
        await sync()
        if self.sync_failure is not None:
            raise self.sync_failure


class TablesOpener:
    """Opens ControlledTables and keeps the last one opened, for the test to steer."""

    def __init__(self) -> None:
        self.tables: ControlledTables | None = None

    def __call__(self, state_dir: Path, sync: SyncMode) -> JournalTables:
        self.tables = ControlledTables(state_dir, sync)
        return self.tables

    @property
    def opened(self) -> ControlledTables:
        assert self.tables is not None, "no journal opened yet"
        return self.tables


@dataclass(frozen=True)
class StatusDetails:
    """What a failed call carried: code, ErrorInfo reason and metadata, field violations."""

    code: grpc.StatusCode
    message: str
    reason: str
    metadata: dict[str, str]
    fields: list[str]
    retry_delay_s: float | None


def details_of(error: grpc.aio.AioRpcError) -> StatusDetails:
    """Decodes the rich error details (grpcio-status) of a failed call."""
    status = rpc_status.from_call(error)
    reason, metadata, fields, delay = "", {}, [], None
    for detail in status.details if status is not None else []:
        info = error_details_pb2.ErrorInfo()
        bad = error_details_pb2.BadRequest()
        retry = error_details_pb2.RetryInfo()
        if detail.Unpack(info):
            reason, metadata = info.reason, dict(info.metadata)
        elif detail.Unpack(bad):
            fields = [v.field for v in bad.field_violations]
        elif detail.Unpack(retry):
            delay = retry.retry_delay.ToNanoseconds() / 1e9
    return StatusDetails(error.code(), error.details() or "", reason, metadata, fields, delay)


async def read_feed(h: Harness, after: int, count: int) -> list[pb.GroupResult]:
    """The next ``count`` groups of SubscribeGroups after cursor ``after`` (5 s at most)."""
    call = h.sessions.SubscribeGroups(spb.SubscribeGroupsRequest(after_cursor=after))
    got: list[pb.GroupResult] = []
    try:
        while len(got) < count:
            response = await asyncio.wait_for(call.read(), 5)
            assert isinstance(response, spb.SubscribeGroupsResponse)
            got += response.groups
    finally:
        call.cancel()
    return got
