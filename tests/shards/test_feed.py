"""The merged feed: every shard's groups exactly once in one cursor sequence (the JetStream
stream's), the same from any shard, resumable, with the filters of a single router."""

from __future__ import annotations

import functools

import grpc
import pytest

from sessionrouter.client.shardmap import shard_of
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


async def _published(shards: list[Harness]) -> None:
    async def all_out() -> bool:
        return all(h.server.shards.publisher.backlog == 0 for h in shards)

    await eventually(all_out)


async def test_every_group_once_in_one_sequence_from_any_shard(shards: list[Harness]) -> None:
    await eventually(functools.partial(_pool_ready, shards))
    expected = []
    for n in range(4):
        for index, h in enumerate(shards):
            group = owned_group(index, 3, prefix=f"feed{n}")
            await finish_group(h, group, [1.0, 0.0])
            expected.append(group)
    await _published(shards)
    views = []
    for h in shards:
        groups = [g for m in await read_merged(h, 0, len(expected)) for g in m.groups]
        assert [g.cursor for g in groups] == list(range(1, len(expected) + 1))
        assert sorted(g.group_id for g in groups) == sorted(expected)
        for g in groups:
            assert g.shard == shard_of(g.group_id, 3)
            assert list(g.advantages) != []
        views.append([(g.cursor, g.group_id) for g in groups])
    assert views[0] == views[1] == views[2]
    # Resume after a cursor, on another shard: the rest, in the same order.
    rest = [g for m in await read_merged(shards[1], 5, len(expected) - 5) for g in m.groups]
    assert [(g.cursor, g.group_id) for g in rest] == views[0][5:]
    # New groups keep coming to a live subscription.
    call = shards[2].sessions.SubscribeGroups(
        spb.SubscribeGroupsRequest(after_cursor=len(expected))
    )
    late = owned_group(0, 3, prefix="late")
    await finish_group(shards[0], late, [0.5, 0.25])
    response = await call.read()
    assert isinstance(response, spb.SubscribeGroupsResponse)
    assert [(g.cursor, g.group_id) for g in response.groups] == [(len(expected) + 1, late)]
    call.cancel()

    async def no_consumers_left() -> bool:  # each ended subscription removed its consumer
        info = await shards[0].server.shards.link.js.stream_info(FEED_STREAM)
        return int(info.state.consumer_count) == 0

    await eventually(no_consumers_left)


async def _pool_ready(shards: list[Harness]) -> bool:
    return all(h.server.router.workers.eligible_count == len(WORKERS) for h in shards)


async def test_skip_degenerate_and_cursor_bounds(shards: list[Harness]) -> None:
    await eventually(functools.partial(_pool_ready, shards))
    degenerate = owned_group(1, 3, prefix="flat")
    useful = owned_group(2, 3, prefix="useful")
    await finish_group(shards[1], degenerate, [1.0, 1.0])
    await _published(shards)
    await finish_group(shards[2], useful, [1.0, 0.0])
    await _published(shards)
    messages = await read_merged(shards[0], 0, 2, skip_degenerate=True)
    assert sum(m.skipped_degenerate for m in messages) == 1
    assert [g.group_id for m in messages for g in m.groups] == [useful]
    assert messages[-1].last_cursor == 2
    call = shards[0].sessions.SubscribeGroups(spb.SubscribeGroupsRequest(after_cursor=99))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call.read()
    details = details_of(caught.value)
    assert details.code is grpc.StatusCode.OUT_OF_RANGE
    assert details.reason == "CURSOR_AHEAD_OF_FEED"
    assert details.metadata == {"cursor": "99", "last_cursor": "2"}
    # from_latest starts after the newest sequence, named in the response header.
    latest = shards[1].sessions.SubscribeGroups(spb.SubscribeGroupsRequest(from_latest=True))
    headers = dict(await latest.initial_metadata())
    assert headers["sessionrouter-after-cursor"] == "2"
    latest.cancel()


async def test_policy_versions_travel_with_the_pool_and_filter_the_merged_feed(
    nats_server: NatsServer,
) -> None:
    s0 = await start_shard(nats_server.url, 0, 2)
    s1 = await start_shard(nats_server.url, 1, 2)
    try:
        await s0.workers.RegisterWorker(
            wpb.RegisterWorkerRequest(
                worker_id="v", address="10.0.0.9:1", capacity=8, policy_version=3
            )
        )

        async def version_seen() -> bool:
            worker = s1.server.router.find_worker("v")
            return worker is not None and worker.policy_version == 3

        await eventually(version_seen)
        old = owned_group(1, 2, prefix="old")
        await finish_group(s1, old, [1.0, 0.0])
        await s1.workers.Heartbeat(wpb.HeartbeatRequest(worker_id="v", policy_version=5))

        async def newer_seen() -> bool:
            worker = s0.server.router.find_worker("v")
            return worker is not None and worker.policy_version == 5

        await eventually(newer_seen)
        new = owned_group(0, 2, prefix="new")
        await finish_group(s0, new, [1.0, 0.0])
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await s0.workers.Heartbeat(wpb.HeartbeatRequest(worker_id="v", policy_version=4))
        assert details_of(caught.value).reason == "VERSION_BACKWARDS"
        for h in (s0, s1):
            await eventually(functools.partial(_published_one, h))
        messages = await read_merged(s0, 0, 2, min_version=5)
        assert sum(m.skipped_groups for m in messages) == 1
        assert [(g.group_id, g.min_version) for m in messages for g in m.groups] == [(new, 5)]
        assert messages[-1].last_cursor == 2
    finally:
        await stop_harness(s0)
        await stop_harness(s1)


async def _published_one(h: Harness) -> bool:
    return bool(h.server.shards.publisher.backlog == 0)
