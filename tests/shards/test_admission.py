"""Staleness-bounded admission across shards, with real processes: 3 shards and NATS.

The trainer state is one NATS KV entry every shard applies, and each shard admits only within
the slots it leased from the fleet's limit ``(v + k + 1) * B`` (``shards.admission``). So the
number of groups admitted over all shards, less those dropped, never exceeds the limit, however
the starts spread; a higher trainer version admits more on every shard; a dropped group reopens
a slot; a shard killed with -9 comes back with its lease set to what its journal holds.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator

import grpc
import nats
import pytest

from sessionrouter.client.shardmap import shard_of
from sessionrouter.server.shards.admission import STATE_KEY, FleetState
from sessionrouter.server.shards.link import TRAINER_BUCKET
from sessionrouter.server.shards.pool import LOAD_PUBLISH_S
from sessionrouter.v1 import resources_pb2 as pb
from sessionrouter.v1 import session_service_pb2 as spb
from sessionrouter.v1 import session_service_pb2_grpc as spb_grpc
from tests.support import details_of

from ._cluster import Cluster, running

N = 3
CHUNK = 2
pytestmark = pytest.mark.slow


def policy(max_staleness: int, batch_size: int) -> pb.StalenessPolicy:
    return pb.StalenessPolicy(max_staleness=max_staleness, batch_size=batch_size)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running(
        Cluster(
            tmp_path_factory.mktemp("admission"),
            N,
            "--worker=base=10.9.0.1:1,1000",
            "--admission-lease-chunk",
            str(CHUNK),
        )
    ) as c:
        yield c


@pytest.fixture
async def stubs(cluster: Cluster) -> AsyncIterator[list[spb_grpc.SessionServiceAsyncStub]]:
    channels = [grpc.aio.insecure_channel(a) for a in cluster.addresses]
    try:
        yield [spb_grpc.SessionServiceStub(c) for c in channels]
    finally:
        for channel in channels:
            await channel.close()


def group_on(shard: int) -> str:
    while True:
        group = uuid.uuid4().hex
        if shard_of(group, N) == shard:
            return group


async def start(
    stub: spb_grpc.SessionServiceAsyncStub, shard: int, wait: bool = False
) -> str | None:
    """Starts a group of one on ``shard``: its id, or None when refused for staleness."""
    group = group_on(shard)
    try:
        await stub.StartGroup(
            spb.StartGroupRequest(
                task_id="t", group_id=group, group_size=1, wait_for_admission=wait
            ),
            timeout=20,
        )
    except grpc.aio.AioRpcError as error:
        refused = error
    else:
        return group
    details = details_of(refused)
    assert details.code is grpc.StatusCode.RESOURCE_EXHAUSTED, refused
    assert details.reason == "STALENESS_LIMIT"
    assert {"in_flight", "limit", "trainer_version"} <= details.metadata.keys()
    return None


async def fleet_state(cluster: Cluster) -> FleetState:
    nc = await nats.connect(cluster.nats.url)
    try:
        kv = await nc.jetstream().key_value(TRAINER_BUCKET)
        entry = await kv.get(STATE_KEY)
        return FleetState.decode(entry.value or b"")
    finally:
        await nc.close()


async def views(stubs: list[spb_grpc.SessionServiceAsyncStub]) -> list[int]:
    """``groups_started - groups_dropped`` of the fleet as each shard reports it."""
    states = [
        (await s.GetTrainerState(spb.GetTrainerStateRequest(), timeout=10)).state for s in stubs
    ]
    return [s.groups_started - s.groups_dropped for s in states]


async def in_flight(stubs: list[spb_grpc.SessionServiceAsyncStub]) -> int:
    """The fleet's groups in flight once every shard agrees on it. Each shard counts its own
    live and the others' as they last published them (every LOAD_PUBLISH_S = 1 s), so the
    views are read after that long, when the publications of an idle fleet have caught up."""
    await asyncio.sleep(LOAD_PUBLISH_S + 0.3)
    for _ in range(200):
        seen = await views(stubs)
        if len(set(seen)) == 1:
            return seen[0]
        await asyncio.sleep(0.05)
    raise AssertionError(f"the shards never agreed on the fleet's groups in flight: {seen}")


async def fill(stubs: list[spb_grpc.SessionServiceAsyncStub], limit: int) -> list[str]:
    """Starts groups on every shard until the fleet is at ``limit`` (the unused slots of
    idle shards come back within seconds), never beyond it."""
    admitted: list[str] = []
    for _ in range(60):
        got = await asyncio.gather(*(start(stub, i) for i, stub in enumerate(stubs)))
        admitted += [g for g in got if g is not None]
        now = await in_flight(stubs)
        assert now <= limit
        if now == limit:
            return admitted
        await asyncio.sleep(0.25)
    raise AssertionError(f"the fleet never reached its limit {limit}: {await in_flight(stubs)}")


async def test_the_bound_is_exact_across_shards(
    cluster: Cluster, stubs: list[spb_grpc.SessionServiceAsyncStub]
) -> None:
    # k = 1, B = 2 at version 0: limit 4 for the whole fleet, set through one shard only.
    reply = await stubs[1].SetTrainerState(
        spb.SetTrainerStateRequest(version=0, policy=policy(1, 2), reset_counters=True),
        timeout=10,
    )
    assert reply.state.admission_limit == 4

    async def all_applied(limit: int, version: int) -> None:
        for _ in range(200):
            states = [
                (await s.GetTrainerState(spb.GetTrainerStateRequest(), timeout=10)).state
                for s in stubs
            ]
            if all(s.admission_limit == limit and s.version == version for s in states):
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"not every shard applied limit {limit}")

    await all_applied(4, 0)
    # Many starts at once, spread over the shards: never more than 4 admitted.
    burst = await asyncio.gather(*(start(stubs[i % N], i % N) for i in range(45)))
    assert 1 <= sum(g is not None for g in burst) <= 4
    assert await in_flight(stubs) == sum(g is not None for g in burst)
    await fill(stubs, 4)
    state = await fleet_state(cluster)
    assert sum(state.leases.values()) <= state.limit == 4
    for i, stub in enumerate(stubs):  # full: refused on every shard
        assert await start(stub, i) is None

    # A start waiting for admission on shard 2; the trainer steps to version 2 through
    # shard 0: limit 8, the waiting start is admitted and every shard admits more.
    waiting = asyncio.create_task(start(stubs[2], 2, wait=True))
    await asyncio.sleep(0.5)
    assert not waiting.done()
    await stubs[0].SetTrainerState(spb.SetTrainerStateRequest(version=2), timeout=10)
    assert await asyncio.wait_for(waiting, 15) is not None
    await all_applied(8, 2)
    before = await in_flight(stubs)
    for i in (0, 1):
        assert await start(stubs[i], i) is not None
    assert await in_flight(stubs) == before + 2
    admitted = await fill(stubs, 8)
    assert await in_flight(stubs) == 8

    # A dropped group (its only member aborted) reopens one slot.
    dropped = admitted[-1]
    owner = shard_of(dropped, N)
    await stubs[owner].AbortSession(
        spb.AbortSessionRequest(session=f"groups/{dropped}/sessions/0", reason="gone"),
        timeout=10,
    )
    assert await in_flight(stubs) == 7
    await fill(stubs, 8)
    for i, stub in enumerate(stubs):
        assert await start(stub, i) is None


async def test_a_killed_shard_comes_back_with_its_lease_reconciled(
    cluster: Cluster, stubs: list[spb_grpc.SessionServiceAsyncStub]
) -> None:
    await stubs[0].SetTrainerState(
        spb.SetTrainerStateRequest(
            version=10,
            policy=policy(0, 4),
            reset_counters=True,
        ),
        timeout=10,
    )
    # Shard 1 leases a chunk and fills one slot of it: one slot unused.
    for _ in range(100):
        state = await fleet_state(cluster)
        if state.epoch and state.limit == 44:
            break
        await asyncio.sleep(0.05)
    assert await start(stubs[1], 1) is not None
    state = await fleet_state(cluster)
    assert state.leases[1] == CHUNK
    cluster.shards[1].kill9()
    assert (await fleet_state(cluster)).leases[1] == CHUNK  # the lease outlives the process
    started = asyncio.get_running_loop().time()
    await asyncio.to_thread(cluster.shards[1].start)  # same port and journal: in place
    assert asyncio.get_running_loop().time() - started < 15
    state = await fleet_state(cluster)
    assert state.leases[1] == await in_flight(stubs) == 1  # the only group since the reset
    assert sum(state.leases.values()) <= state.limit
    assert await start(stubs[1], 1) is not None
