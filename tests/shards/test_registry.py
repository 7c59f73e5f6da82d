"""The shard registry and start-up refusals: NATS unreachable, a shard count that disagrees
with a live shard's (at start: exit 2; later: SHARD_COUNT_MISMATCH), bad --shard values."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import grpc
import nats
import pytest

from sessionrouter.server.config import ConfigError, build_config
from sessionrouter.server.core.router import RouterSettings
from sessionrouter.server.shards.link import SHARDS_BUCKET, ShardStartError
from sessionrouter.v1 import session_service_pb2 as spb
from tests.router_process import RouterProcess
from tests.shards.support import NatsServer, eventually, owned_group, start_shard
from tests.support import details_of, stop_harness


@pytest.mark.slow
def test_nats_unreachable_at_start_exits_2_naming_the_url(tmp_path: Path) -> None:
    # Port 9 (discard) on loopback: nothing listens there.
    url = "nats://127.0.0.1:9"
    started = time.monotonic()
    code, log = RouterProcess(tmp_path, "--in-memory", "--shard", "0/2", "--nats-url", url).exits()
    assert code == 2
    errors = [line for line in log.splitlines() if line.startswith("sessionrouter: error:")]
    assert len(errors) == 1
    assert f"NATS at {url} is unreachable (tried for 5 s)" in errors[0]
    assert time.monotonic() - started < 30


def test_shard_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"shards.shard 1/2 needs shards.nats_url"):
        build_config({"shard": "1/2", "in_memory": True})
    with pytest.raises(ConfigError, match=r"shard index must be in \[0, 2\), got 2"):
        build_config({"shard": "2/2", "nats_url": "nats://x:1"})
    with pytest.raises(ConfigError, match="expected INDEX/COUNT such as 0/3, got 'two'"):
        build_config({"shard": "two"})
    assert build_config({"in_memory": True}).shards is None
    config = build_config({"shard": "1/3", "nats_url": "nats://h:4222", "advertise": "h:1"})
    assert config.shards is not None
    assert (str(config.shards.shard), config.shards.nats_url, config.shards.advertise) == (
        "1/3",
        "nats://h:4222",
        "h:1",
    )


async def test_a_shard_of_another_count_refuses_to_start(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    s0 = await start_shard(nats_server.url, 0, 2)
    try:
        with pytest.raises(
            ShardStartError,
            match=r"shard 1/2 at 127\.0\.0\.1:\d+ is live|"
            r"shard 0/2 at 127\.0\.0\.1:\d+ is live",
        ):
            await start_shard(nats_server.url, 1, 3)
        process = RouterProcess(
            tmp_path, "--in-memory", "--shard", "2/3", "--nats-url", nats_server.url
        )
        code, log = await asyncio.to_thread(process.exits)
        assert code == 2
        (error,) = [line for line in log.splitlines() if line.startswith("sessionrouter: error:")]
        assert "is live with 2 shards, this one was started with 3" in error
        # The same count joins.
        s1 = await start_shard(nats_server.url, 1, 2)
        assert sorted(s1.server.shards.registry.peers) == [0, 1]
        await stop_harness(s1)
    finally:
        await stop_harness(s0)


async def test_a_count_mismatch_seen_while_serving_refuses_group_calls(
    nats_server: NatsServer,
) -> None:
    s0 = await start_shard(nats_server.url, 0, 2)
    nc = await nats.connect(nats_server.url)
    try:
        group = owned_group(0, 2)
        kv = await nc.jetstream().key_value(SHARDS_BUCKET)
        entry = {"index": 4, "count": 5, "address": "10.9.9.9:1", "started_at": time.time()}
        await kv.put("shard-4", json.dumps(entry).encode())

        async def mismatch_seen() -> bool:
            return bool(s0.server.shards.registry.mismatched)

        await eventually(mismatch_seen)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await s0.sessions.GetGroup(spb.GetGroupRequest(group_id=group))
        details = details_of(caught.value)
        assert details.code is grpc.StatusCode.FAILED_PRECONDITION
        assert details.reason == "SHARD_COUNT_MISMATCH"
        assert details.metadata == {
            "shard_count": "2",
            "other_shard_count": "5",
            "other_address": "10.9.9.9:1",
        }
        await kv.delete("shard-4")

        async def mismatch_gone() -> bool:
            return not s0.server.shards.registry.mismatched

        await eventually(mismatch_gone)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await s0.sessions.GetGroup(spb.GetGroupRequest(group_id=group))
        assert details_of(caught.value).reason == "GROUP_NOT_FOUND"
    finally:
        await nc.close()
        await stop_harness(s0)


async def test_shards_with_another_heartbeat_timeout_share_the_buckets(
    nats_server: NatsServer,
) -> None:
    """The first shard's buckets stay as made (their TTL is its heartbeat timeout)."""
    s0 = await start_shard(nats_server.url, 0, 2)
    s1 = await start_shard(nats_server.url, 1, 2, settings=RouterSettings(heartbeat_timeout_s=4))
    try:
        assert sorted(s1.server.shards.registry.peers) == [0, 1]
    finally:
        await stop_harness(s1)
        await stop_harness(s0)
