"""Three shard processes, NATS and the nginx shard map on loopback, used as clients use them.

One cluster serves the module (each test isolates itself by run-unique group and worker ids):
groups are never split whichever way their members reach the cluster, the worker pool is one
pool whose capacity no worker exceeds across shards, and the trainer's feed is one sequence
of every group, the same through nginx and through each shard. Restarts and kills are in
``test_cluster_faults.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest

from sessionrouter.client import (
    GroupOptions,
    GroupOutcome,
    GroupResult,
    NotFoundError,
    ResourceExhaustedError,
    RetryPolicy,
    Session,
    SessionRouterClient,
    UnavailableError,
)
from sessionrouter.client.shardmap import shard_of
from sessionrouter.v1 import session_service_pb2 as spb
from sessionrouter.v1 import session_service_pb2_grpc as spb_grpc
from tests.support import details_of

from ._cluster import Cluster, read_feed, running

N = 3
ONE_TRY = RetryPolicy(max_attempts=1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running(
        Cluster(tmp_path_factory.mktemp("cluster"), N, "--worker=base=10.9.0.1:1,1000")
    ) as c:
        yield c


@pytest.fixture
async def direct(cluster: Cluster) -> AsyncIterator[SessionRouterClient]:
    """The sharded client, one channel per shard."""
    async with SessionRouterClient.connect(cluster.addresses, default_timeout=20.0) as client:
        yield client


@pytest.fixture
async def proxied(cluster: Cluster) -> AsyncIterator[SessionRouterClient]:
    """The sharded client through nginx: one channel, x-group-id on every call."""
    async with SessionRouterClient.connect(
        cluster.nginx.target, shard_count=N, default_timeout=20.0
    ) as client:
        yield client


def run_id() -> str:
    return uuid.uuid4().hex[:8]


def owned_ids(prefix: str, per_shard: int) -> list[str]:
    """Group ids, ``per_shard`` of them owned by each shard."""
    by_shard: dict[int, list[str]] = {i: [] for i in range(N)}
    k = 0
    while min(len(ids) for ids in by_shard.values()) < per_shard:
        group = f"{prefix}-{k}"
        if len(by_shard[shard_of(group, N)]) < per_shard:
            by_shard[shard_of(group, N)].append(group)
        k += 1
    return [g for ids in by_shard.values() for g in ids]


async def groups_on(address: str) -> set[str]:
    """The groups one shard holds, asked directly."""
    async with SessionRouterClient.connect(address) as one:
        return {g.group_id async for g in one.iter_groups(page_size=1000)}


async def test_groups_are_never_split(
    cluster: Cluster, direct: SessionRouterClient, proxied: SessionRouterClient
) -> None:
    run = run_id()
    groups = [f"split-{run}-{i}" for i in range(12)]
    clients = [direct, proxied]

    async def join(group: str, member: int) -> Session:
        client = clients[member % 2]  # members of one group come both ways
        started = await client.start_session("t", group_id=group, group_size=4)
        return started.session

    joined = await asyncio.gather(*(join(g, m) for g in groups for m in range(4)))
    for group in groups:
        members = [s for s in joined if s.group_id == group]
        assert sorted(s.index for s in members) == [0, 1, 2, 3]
        assert len((await direct.get_group(group)).members) == 4
    # A shard asked directly about another shard's group refuses; it never makes a twin.
    group = groups[0]
    other = (shard_of(group, N) + 1) % N
    async with grpc.aio.insecure_channel(cluster.addresses[other]) as channel:
        stub = spb_grpc.SessionServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.StartSession(
                spb.StartSessionRequest(task_id="t", group_id=group, group_size=4)
            )
        refused = details_of(caught.value)
        assert refused.reason == "WRONG_SHARD"
        assert refused.metadata["owner_address"] == cluster.addresses[shard_of(group, N)]
        with pytest.raises(grpc.aio.AioRpcError) as caught:  # the header must agree too
            await stub.GetGroup(
                spb.GetGroupRequest(group_id=group), metadata=(("x-group-id", groups[1]),)
            )
        assert details_of(caught.value).reason == "GROUP_HEADER_MISMATCH"
    held = [await groups_on(a) for a in cluster.addresses]
    for group in groups:
        assert [i for i in range(N) if group in held[i]] == [shard_of(group, N)]
    # StartSession without a group id: the shard reached mints one it owns.
    for client in clients:
        for _ in range(N):
            minted = (await client.start_session("t", group_size=1)).session.group_id
            assert minted in await groups_on(cluster.addresses[shard_of(minted, N)])


async def test_the_pool_is_shared_and_no_worker_is_overfilled(
    cluster: Cluster, direct: SessionRouterClient
) -> None:
    run = run_id()
    capacity = 4
    workers = [f"pool-{run}-{i}" for i in range(3)]
    labels = {"run": run}
    registrar = cluster.addresses[0]
    async with SessionRouterClient.connect(registrar) as first:
        for i, worker in enumerate(workers):
            await first.register_worker(worker, f"10.1.0.{i}:1", capacity, labels=labels)

    async def heartbeats() -> None:
        async with SessionRouterClient.connect(registrar) as beat:
            while True:
                for worker in workers:
                    await beat.heartbeat(worker)
                await asyncio.sleep(1.0)

    beating = asyncio.create_task(heartbeats())
    try:
        # Registered on shard 0 once; every shard sees the worker, with its share.
        for address in cluster.addresses:
            async with SessionRouterClient.connect(address) as one:
                async with asyncio.timeout(10):
                    while True:
                        with contextlib.suppress(NotFoundError):
                            seen = await one.get_worker(workers[0])
                            if seen.shard_capacity > 0 or seen.capacity == capacity:
                                break
                        await asyncio.sleep(0.1)
        options = GroupOptions(selector=labels)
        async with SessionRouterClient.connect(
            cluster.addresses, retry_policy=ONE_TRY, default_timeout=10.0
        ) as eager:

            async def fill(group: str) -> int:
                try:
                    await eager.start_group("t", 1, group_id=group, options=options)
                except (UnavailableError, ResourceExhaustedError):
                    return 0
                return 1

            # Each shard is asked for more sessions than the whole pool holds.
            attempts = owned_ids(f"pool-{run}", per_shard=capacity * len(workers) + 2)
            placed = sum(await asyncio.gather(*(fill(g) for g in attempts)))
        # Every slot of the pool is used once: each shard filled its share and no more.
        assert placed == capacity * len(workers)
        for worker in workers:
            per_shard = []
            for address in cluster.addresses:
                async with SessionRouterClient.connect(address) as one:
                    per_shard.append((await one.get_worker(worker)).open_sessions)
            assert sum(per_shard) == capacity, (worker, per_shard)
    finally:
        beating.cancel()
        await asyncio.gather(beating, return_exceptions=True)


async def complete(client: SessionRouterClient, group: str) -> GroupResult:
    async def rollout(session: Session) -> float:
        return float(session.index)

    return await client.run_group("t", 2, rollout, group_id=group)


async def test_the_feed_is_one_sequence_of_every_group(
    cluster: Cluster, direct: SessionRouterClient, proxied: SessionRouterClient
) -> None:
    run = run_id()
    groups = [f"feed-{run}-{i}" for i in range(15)]
    results = await asyncio.gather(*(complete(direct, g) for g in groups))
    assert all(r.outcome is GroupOutcome.COMPLETE for r in results)
    assert {shard_of(g, N) for g in groups} == set(range(N))
    through_nginx = await read_feed(proxied, set(groups))
    cursors = [g.cursor for g in through_nginx]
    assert cursors == list(range(1, len(cursors) + 1))  # one sequence, no gap
    ids = [g.group_id for g in through_nginx]
    assert len(ids) == len(set(ids))  # every group once
    mine = [g for g in through_nginx if g.group_id in set(groups)]
    assert sorted(g.group_id for g in mine) == sorted(groups)
    assert all(g.shard == shard_of(g.group_id, N) for g in mine)
    # Every shard serves the same merged feed.
    for address in cluster.addresses:
        async with SessionRouterClient.connect(address) as one:
            again = await read_feed(one, set(groups))
        assert [(g.cursor, g.group_id) for g in again[: len(through_nginx)]] == list(
            zip(cursors, ids, strict=True)
        )
    # wait_group_result finds a group on the merged feed by its shard's cursor.
    found = await direct.wait_group_result(groups[-1])
    assert found.group_id == groups[-1] and found.advantages == results[-1].advantages
