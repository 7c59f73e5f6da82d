"""The worker pool shared by shards: one registration seen by all, capacity split so that a
worker's capacity is never exceeded across shards, drain and deregistration propagated, and
the global load visible from any shard."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest

from sessionrouter.server.shards.identity import ShardIdentity
from sessionrouter.server.shards.pool import share
from sessionrouter.v1 import resources_pb2 as pb
from sessionrouter.v1 import session_service_pb2 as spb
from sessionrouter.v1 import worker_service_pb2 as wpb
from tests.shards.support import NatsServer, eventually, start_shard
from tests.support import Harness, details_of, stop_harness


def test_shares_add_up_to_the_capacity() -> None:
    for count in (1, 2, 3, 5, 8):
        for capacity in (1, 2, 3, 4, 7, 8, 64, 1000):
            for worker in ("w0", "gpu-7", "a~b:c@d+e"):
                shares = [share(worker, capacity, ShardIdentity(i, count)) for i in range(count)]
                assert sum(shares) == capacity
                assert max(shares) - min(shares) <= 1


async def _visible_everywhere(shards: list[Harness], worker_id: str) -> None:
    async def seen() -> bool:
        for h in shards:
            try:
                await h.workers.GetWorker(wpb.GetWorkerRequest(worker_id=worker_id))
            except grpc.aio.AioRpcError:
                return False
        return True

    await eventually(seen)


async def test_capacity_is_never_exceeded_across_shards(shards: list[Harness]) -> None:
    await shards[0].workers.RegisterWorker(
        wpb.RegisterWorkerRequest(worker_id="w", address="10.0.0.1:30000", capacity=4)
    )
    await _visible_everywhere(shards, "w")
    shares = []
    for h in shards:
        worker = (await h.workers.GetWorker(wpb.GetWorkerRequest(worker_id="w"))).worker
        assert worker.capacity == 4
        shares.append(worker.shard_capacity)
    assert sum(shares) == 4 and sorted(shares) == [1, 1, 2]
    placed = [0, 0, 0]
    for index, h in enumerate(shards):
        for _ in range(5):  # more than any share: the extra ones are refused
            try:
                await h.sessions.StartSession(spb.StartSessionRequest(task_id="t", group_size=1))
                placed[index] += 1
            except grpc.aio.AioRpcError as error:
                details = details_of(error)
                assert details.code is grpc.StatusCode.UNAVAILABLE
                assert details.reason == "NO_ELIGIBLE_WORKER"
    assert placed == shares
    assert sum(placed) == 4

    async def global_load_seen() -> bool:
        for h in shards:
            got = await h.workers.GetWorker(wpb.GetWorkerRequest(worker_id="w"))
            if got.worker.cluster_open_sessions != 4:
                return False
        return True

    await eventually(global_load_seen)
    listed = await shards[2].workers.ListWorkers(wpb.ListWorkersRequest())
    assert [(w.worker_id, w.cluster_open_sessions) for w in listed.workers] == [("w", 4)]


async def test_a_worker_with_fewer_slots_than_shards_is_placed_by_some(
    shards: list[Harness],
) -> None:
    await shards[1].workers.RegisterWorker(
        wpb.RegisterWorkerRequest(worker_id="small", address="10.0.0.2:30000", capacity=1)
    )
    await _visible_everywhere(shards, "small")
    total = 0
    for h in shards:
        got = await h.workers.GetWorker(wpb.GetWorkerRequest(worker_id="small"))
        assert got.worker.capacity == 1
        assert got.worker.health == 1  # WORKER_HEALTH_HEALTHY, on every shard
        total += got.worker.shard_capacity
    assert total == 1


async def test_drain_heartbeat_and_deregistration_propagate(shards: list[Harness]) -> None:
    s0, s1, s2 = shards
    await s0.workers.RegisterWorker(
        wpb.RegisterWorkerRequest(worker_id="w", address="10.0.0.1:30000", capacity=30)
    )
    await _visible_everywhere(shards, "w")
    await s1.workers.DrainWorker(wpb.DrainWorkerRequest(worker_id="w"))

    async def drained() -> bool:
        for h in shards:
            got = await h.workers.GetWorker(wpb.GetWorkerRequest(worker_id="w"))
            if not got.worker.draining:
                return False
        return True

    await eventually(drained)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await s2.sessions.StartSession(spb.StartSessionRequest(task_id="t"))
    assert details_of(refused.value).reason == "NO_ELIGIBLE_WORKER"
    await s2.workers.DrainWorker(wpb.DrainWorkerRequest(worker_id="w", resume=True))

    async def resumed() -> bool:
        for h in shards:
            got = await h.workers.GetWorker(wpb.GetWorkerRequest(worker_id="w"))
            if got.worker.draining:
                return False
        return True

    await eventually(resumed)
    before = (await s0.workers.GetWorker(wpb.GetWorkerRequest(worker_id="w"))).worker
    await s2.workers.Heartbeat(wpb.HeartbeatRequest(worker_id="w"))

    async def heartbeat_seen() -> bool:
        got = (await s0.workers.GetWorker(wpb.GetWorkerRequest(worker_id="w"))).worker
        return got.last_heartbeat_time.ToNanoseconds() > before.last_heartbeat_time.ToNanoseconds()

    await eventually(heartbeat_seen)
    # Another address under the same id is refused on any shard, as on one router.
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await s1.workers.RegisterWorker(
            wpb.RegisterWorkerRequest(worker_id="w", address="10.9.9.9:1", capacity=30)
        )
    assert details_of(caught.value).reason == "WORKER_ADDRESS_CONFLICT"
    await s1.workers.DeregisterWorker(wpb.DeregisterWorkerRequest(worker_id="w"))

    async def gone() -> bool:
        return all(
            "w" not in h.server.shards.pool.entries and h.server.router.find_worker("w") is None
            for h in shards
        )

    await eventually(gone)
    for h in shards:
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await h.workers.GetWorker(wpb.GetWorkerRequest(worker_id="w"))
        assert details_of(missing.value).reason == "WORKER_NOT_FOUND"


async def test_metrics_show_the_shard_pool_and_feed(nats_server: NatsServer) -> None:
    h = await start_shard(nats_server.url, 0, 2, metrics_port=0)
    try:
        await h.workers.RegisterWorker(
            wpb.RegisterWorkerRequest(worker_id="w", address="10.0.0.1:30000", capacity=6)
        )
        policy = pb.StalenessPolicy(max_staleness=0, batch_size=100)  # limit 100
        await h.sessions.SetTrainerState(spb.SetTrainerStateRequest(version=0, policy=policy))
        await h.sessions.StartSession(spb.StartSessionRequest(task_id="t", group_size=2))
        h.server.shards.tick()
        url = f"http://127.0.0.1:{h.server.metrics_port}/metrics"
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
        lines = set(text.decode().splitlines())
        assert 'sessionrouter_shard{count="2",index="0"} 1.0' in lines
        assert "sessionrouter_shard_nats_connected 1.0" in lines
        assert "sessionrouter_shard_peers 1.0" in lines
        assert "sessionrouter_shard_pool_workers 1.0" in lines
        assert "sessionrouter_shard_pool_capacity 6.0" in lines
        assert "sessionrouter_shard_pool_open_sessions 1.0" in lines
        assert "sessionrouter_shard_feed_backlog_groups 0.0" in lines
        assert "sessionrouter_shard_admission_lease 16.0" in lines  # one default chunk
        assert "sessionrouter_shard_admission_leased 16.0" in lines
        assert "sessionrouter_shard_admission_lease_requests_total 1.0" in lines
    finally:
        await stop_harness(h)
