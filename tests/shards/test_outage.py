"""Restarts and outages: a shard restarted from its journal republishes only what the
stream lacks (JetStream drops a duplicate by group id), and a NATS outage leaves each shard
serving its own groups on the last known pool, the merged feed UNAVAILABLE, and the backlog
published once NATS is back."""

from __future__ import annotations

import functools
from pathlib import Path

import grpc
import pytest

from sessionrouter.server.app import WorkerSpec
from sessionrouter.server.shards.link import FEED_STREAM
from sessionrouter.v1 import session_service_pb2 as spb
from sessionrouter.v1 import worker_service_pb2 as wpb
from tests.shards.support import (
    NatsServer,
    eventually,
    finish_group,
    owned_group,
    read_merged,
    start_shard,
)
from tests.support import Harness, details_of, stop_harness

WORKERS = tuple(WorkerSpec(f"w{i}", f"10.0.0.{i}:30000", 64) for i in range(4))


async def _published(*shards: Harness) -> None:
    async def all_out() -> bool:
        return all(
            h.server.shards.link.connected and h.server.shards.publisher.backlog == 0
            for h in shards
        )

    await eventually(all_out, 20)


async def _stream_messages(h: Harness) -> int:
    info = await h.server.shards.link.js.stream_info(FEED_STREAM)
    return int(info.state.messages)


async def test_restarted_shard_republishes_only_what_the_stream_lacks(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    state = tmp_path / "shard0"
    s0 = await start_shard(nats_server.url, 0, 2, state_dir=state, workers=WORKERS)
    s1 = await start_shard(nats_server.url, 1, 2, workers=WORKERS)
    try:
        await eventually(functools.partial(_eligible, s0))
        before = [owned_group(0, 2, prefix=f"before{n}") for n in range(3)]
        for group in before:
            await finish_group(s0, group, [1.0, 0.0])
        await _published(s0)
        nats_server.kill()
        # Finished while NATS is down: journaled on the shard, not in the stream yet.
        during = [owned_group(0, 2, prefix=f"during{n}") for n in range(2)]
        await eventually(functools.partial(_down, s0))
        for group in during:
            await finish_group(s0, group, [0.0, 1.0])
        await stop_harness(s0)
        nats_server.restart()
        s0 = await start_shard(nats_server.url, 0, 2, state_dir=state, workers=WORKERS)
        await _published(s0, s1)
        groups = [g for m in await read_merged(s1, 0, 5) for g in m.groups]
        assert [g.group_id for g in groups] == before + during
        assert [g.cursor for g in groups] == [1, 2, 3, 4, 5]
        assert await _stream_messages(s1) == 5
        # Sending a group again (a publish whose ack was lost) is dropped by the stream.
        result = s0.server.router.feed.read_after(0, 1)[0]
        ack = await s0.server.shards.publisher._publish(result)
        assert ack.duplicate
        assert await _stream_messages(s1) == 5
    finally:
        await stop_harness(s0)
        await stop_harness(s1)


async def _eligible(h: Harness) -> bool:
    return h.server.router.workers.eligible_count == len(WORKERS)


async def _down(h: Harness) -> bool:
    return not h.server.shards.link.connected


async def test_nats_outage_keeps_shards_serving_and_publishes_the_backlog(
    nats_server: NatsServer,
) -> None:
    shards = [await start_shard(nats_server.url, i, 2, workers=WORKERS) for i in range(2)]
    try:
        for h in shards:
            await eventually(functools.partial(_eligible, h))
        first = owned_group(1, 2, prefix="first")
        await finish_group(shards[1], first, [1.0, 0.0])
        await _published(*shards)
        nats_server.kill()
        for h in shards:
            await eventually(functools.partial(_down, h))
        # Each shard serves its own groups on the last known pool (and keeps it healthy).
        for h in shards:
            h.server.shards.tick()
        backlog = []
        for index, h in enumerate(shards):
            for n in range(3):
                group = owned_group(index, 2, prefix=f"outage{n}")
                await finish_group(h, group, [float(n), 1.0])
                backlog.append(group)
        # Heartbeats still work locally; pool changes and the feed need NATS.
        await shards[0].workers.Heartbeat(wpb.HeartbeatRequest(worker_id="w0"))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await shards[0].workers.RegisterWorker(
                wpb.RegisterWorkerRequest(worker_id="new", address="10.0.1.1:1", capacity=2)
            )
        details = details_of(caught.value)
        assert (details.code, details.reason) == (grpc.StatusCode.UNAVAILABLE, "NATS_UNAVAILABLE")
        call = shards[1].sessions.SubscribeGroups(spb.SubscribeGroupsRequest(after_cursor=1))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call.read()
        details = details_of(caught.value)
        assert (details.code, details.reason) == (grpc.StatusCode.UNAVAILABLE, "NATS_UNAVAILABLE")
        assert details.metadata["cursor"] == "1" and details.retry_delay_s is not None
        nats_server.restart()
        await _published(*shards)
        groups = [g for m in await read_merged(shards[0], 0, 7) for g in m.groups]
        assert [g.cursor for g in groups] == list(range(1, 8))
        assert groups[0].group_id == first
        assert sorted(g.group_id for g in groups[1:]) == sorted(backlog)
        # The pool works again: a registration reaches both shards.
        await shards[0].workers.RegisterWorker(
            wpb.RegisterWorkerRequest(worker_id="new", address="10.0.1.1:1", capacity=2)
        )

        async def both_see_it() -> bool:
            return all(h.server.shards.pool.entries.get("new") is not None for h in shards)

        await eventually(both_see_it)
    finally:
        for h in shards:
            await stop_harness(h)


async def test_a_shard_without_journal_publishes_its_new_feed_after_a_restart(
    nats_server: NatsServer,
) -> None:
    """Its cursors start again at 1 (another feed epoch): nothing is skipped as published."""
    s0 = await start_shard(nats_server.url, 0, 2, workers=WORKERS)
    s1 = await start_shard(nats_server.url, 1, 2, workers=WORKERS)
    try:
        await eventually(functools.partial(_eligible, s0))
        first = [owned_group(0, 2, prefix=f"mem{n}") for n in range(2)]
        for group in first:
            await finish_group(s0, group, [1.0, 0.0])
        await _published(s0)
        await stop_harness(s0)
        s0 = await start_shard(nats_server.url, 0, 2, workers=WORKERS)
        await eventually(functools.partial(_eligible, s0))
        again = owned_group(0, 2, prefix="mem-after")
        await finish_group(s0, again, [0.0, 1.0])
        await _published(s0)
        groups = [g for m in await read_merged(s1, 0, 3) for g in m.groups]
        assert [(g.cursor, g.group_id) for g in groups] == list(
            zip([1, 2, 3], [*first, again], strict=True)
        )
    finally:
        await stop_harness(s0)
        await stop_harness(s1)
