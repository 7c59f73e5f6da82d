"""The shutdown sequence as probes, meshes and clients see it.

After a stop is asked for (SIGTERM), for ``shutdown_delay_s`` the router answers health checks
with NOT_SERVING over ``grpc.health.v1`` (a probe connecting anew gets an answer, not
"connection refused"), refuses new sessions with UNAVAILABLE and RetryInfo, and keeps serving
the calls already open; then it drains, and the feed and reward streams it ends close with
UNAVAILABLE and ErrorInfo reason ``SHUTTING_DOWN``, which tells a client in any language to
reconnect.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sessionrouter.server.app import WorkerSpec
from sessionrouter.server.config import ConfigError, build_config, file_values
from sessionrouter.server.core.router import RouterSettings
from sessionrouter.v1 import session_service_pb2 as spb
from sessionrouter.v1 import session_service_pb2_grpc as spb_grpc
from tests.integration.processes import durable_router
from tests.support import Harness, details_of, start_harness, stop_harness

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING
WORKERS = tuple(WorkerSpec(f"w{i}", f"10.0.0.{i}:1", 64) for i in range(4))


async def health_of(address: str, service: str = "") -> int:
    """One health check on a fresh channel, as grpc-health-probe makes it."""
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
        status: int = reply.status
        return status


async def start_group(h: Harness, group_id: str) -> list[str]:
    reply = await h.sessions.StartGroup(
        spb.StartGroupRequest(task_id="prompt", group_id=group_id, group_size=2), timeout=5
    )
    return [m.name for m in reply.group.members]


def rewards(names: list[str], sequence: int) -> spb.SubmitRewardsRequest:
    return spb.SubmitRewardsRequest(
        entries=[spb.RewardEntry(session=n, reward=float(i)) for i, n in enumerate(names)],
        sequence=sequence,
    )


async def acked(stream: object, sequence: int) -> None:
    """Reads the reward stream until the ack of ``sequence`` (group results may come first)."""
    while True:
        message = await asyncio.wait_for(stream.read(), 5)  # type: ignore[attr-defined]
        assert isinstance(message, spb.SubmitRewardsResponse)
        if message.HasField("ack"):
            assert message.ack.sequence == sequence
            return


async def groups_of(feed: object) -> list[str]:
    """The group ids of the next SubscribeGroups message."""
    message = await asyncio.wait_for(feed.read(), 5)  # type: ignore[attr-defined]
    assert isinstance(message, spb.SubscribeGroupsResponse)
    return [g.group_id for g in message.groups]


async def read_to_the_end(stream: object) -> None:
    """Reads a stream until it fails; a stream that ends with OK fails the test."""
    while True:
        message = await asyncio.wait_for(stream.read(), 5)  # type: ignore[attr-defined]
        assert message is not grpc.aio.EOF, "a drained stream must not end with OK"


async def test_not_serving_during_the_delay_then_drained_streams_end_unavailable() -> None:
    delay = 1.5
    h = await start_harness(RouterSettings(retry_after_s=0.5), WORKERS, shutdown_delay_s=delay)
    try:
        first = await start_group(h, "before")
        second = await start_group(h, "during")
        feed = h.sessions.SubscribeGroups(spb.SubscribeGroupsRequest(after_cursor=0))
        assert dict(await feed.initial_metadata())["sessionrouter-after-cursor"] == "0"
        stream = h.sessions.SubmitRewards()
        await stream.write(rewards(first, 1))
        await acked(stream, 1)
        assert await groups_of(feed) == ["before"]
        assert await health_of(h.address) == SERVING

        stopping = asyncio.create_task(h.server.stop(grace_s=2.0))
        await asyncio.sleep(0.2)
        began = time.monotonic()

        # The delay: probes see NOT_SERVING, for the server and for each service.
        assert await health_of(h.address) == NOT_SERVING
        assert await health_of(h.address, "sessionrouter.v1.SessionService") == NOT_SERVING
        # New sessions: UNAVAILABLE with the router's RetryInfo.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await start_group(h, "too-late")
        details = details_of(refused.value)
        assert (details.code, details.reason) == (grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN")
        assert details.retry_delay_s == pytest.approx(0.5)
        # Calls already open are served: rewards on the open stream finalize a group, and the
        # open feed delivers it.
        await stream.write(rewards(second, 2))
        await acked(stream, 2)
        assert await groups_of(feed) == ["during"]
        assert time.monotonic() - began < delay - 0.2, "the checks above must fit in the delay"

        # The drain: both streams end with UNAVAILABLE and the reason.
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await asyncio.wait_for(feed.read(), delay + 5)
        details = details_of(ended.value)
        assert (details.code, details.reason) == (grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN")
        assert details.metadata == {"cursor": "2"}
        assert details.retry_delay_s == pytest.approx(0.5)
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await read_to_the_end(stream)  # the second group's result may come after its ack
        details = details_of(ended.value)
        assert (details.code, details.reason) == (grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN")
        await asyncio.wait_for(stopping, 10)
        assert time.monotonic() - began >= delay - 0.3
    finally:
        await stop_harness(h)


async def test_without_a_delay_the_drain_starts_at_once_and_ends_feeds_unavailable() -> None:
    h = await start_harness(workers=WORKERS)
    try:
        feed = h.sessions.SubscribeGroups(spb.SubscribeGroupsRequest(from_latest=True))
        await feed.initial_metadata()
        began = time.monotonic()
        await h.server.stop(grace_s=2.0)
        assert time.monotonic() - began < 1.5
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await asyncio.wait_for(feed.read(), 5)
        assert details_of(ended.value).reason == "SHUTTING_DOWN"
    finally:
        await stop_harness(h)


async def test_a_reward_stream_opened_while_draining_is_told_to_reconnect() -> None:
    h = await start_harness(workers=WORKERS, shutdown_delay_s=0.5)
    try:
        h.server._sessions.drain()  # type: ignore[union-attr]  # what stop() does after the delay
        stream = h.sessions.SubmitRewards()
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await asyncio.wait_for(stream.read(), 5)
        details = details_of(ended.value)
        assert (details.code, details.reason) == (grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN")
    finally:
        await stop_harness(h)


async def test_sigterm_with_shutdown_delay_reports_not_serving_then_exits_0(
    tmp_path: Path,
) -> None:
    router = durable_router(tmp_path, "--shutdown-delay", "2")
    address = router.start()
    try:
        assert await health_of(address) == SERVING
        assert router.proc is not None
        router.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        assert await health_of(address) == NOT_SERVING
        assert router.proc.poll() is None, "the router must keep serving during the delay"
        async with grpc.aio.insecure_channel(address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await spb_grpc.SessionServiceStub(channel).StartSession(
                    spb.StartSessionRequest(task_id="t"), timeout=5
                )
        assert details_of(refused.value).reason == "SHUTTING_DOWN"
        assert await asyncio.to_thread(router.proc.wait, 30) == 0
    finally:
        router.stop()


@pytest.mark.parametrize(
    ("delay", "accepted"), [(None, 0.0), (0.0, 0.0), (7.5, 7.5), (-1.0, None), (4000.0, None)]
)
def test_shutdown_delay_setting(delay: float | None, accepted: float | None) -> None:
    """Default 0 (drain at once, as before); a negative or over-an-hour delay is refused."""
    flags = {"shutdown_delay_s": delay, "in_memory": True}
    if accepted is None:
        with pytest.raises(ConfigError, match="shutdown_delay_s"):
            build_config(flags)
    else:
        assert build_config(flags).shutdown_delay_s == accepted
    from_file = file_values({"shutdown_delay_s": 3})
    assert build_config({"in_memory": True}, from_file).shutdown_delay_s == 3.0
