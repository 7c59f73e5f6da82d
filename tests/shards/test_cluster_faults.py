"""Faults of a sharded cluster (3 shard processes, NATS, nginx), under load from real clients.

- kill -9 of one shard while producers run on every shard: its groups are UNAVAILABLE (to the
  client, through nginx) and refused by the other shards, never served there; the others go
  on; once it is back, every acknowledged reward is there, no group exists twice, and the feed
  has every group once with no gap.
- a restart of the shard the trainer's feed is on, then a kill of NATS: the feed moves to
  another shard and later waits out NATS; during the NATS outage the shards keep serving their
  own groups; once NATS is back they publish their backlog, and the trainer has every group
  exactly once, in one gapless cursor sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import pytest

from sessionrouter.client import (
    GroupResult,
    RetryPolicy,
    SessionRouterClient,
    SessionState,
    UnavailableError,
)
from sessionrouter.client.shardmap import shard_of
from sessionrouter.v1 import session_service_pb2 as spb
from sessionrouter.v1 import session_service_pb2_grpc as spb_grpc
from tests.support import details_of

from ._cluster import Cluster, read_feed, running

N = 3
ONE_TRY = RetryPolicy(max_attempts=1)
UNTIL_BACK = RetryPolicy(max_attempts=1_000_000, max_backoff=1.0)
"""Retries until the shard answers (with no call deadline: the test's timeout bounds it), at
most 1 s apart. The default policy gives up after 12 attempts, about 15 s of waits on
average and under 10 s one time in twenty, which a restart on a loaded machine (a new
process, its journal, NATS, then the channel's own reconnect backoff of up to 5 s) outlasts:
the call then fails with the channel's last error, "connection refused"."""
STATIC_WORKERS = tuple(f"--worker=w{i}=10.0.0.{i}:1,100000" for i in range(4))

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running(Cluster(tmp_path_factory.mktemp("faults"), N, *STATIC_WORKERS)) as c:
        yield c


def ids_of_shard(prefix: str, shard: int) -> Iterator[str]:
    """Endless group ids owned by ``shard``."""
    k = 0
    while True:
        group = f"{prefix}-{k}"
        k += 1
        if shard_of(group, N) == shard:
            yield group


@dataclass
class Load:
    """What the producers were told: acknowledged rewards, started and completed groups."""

    acked: dict[str, float] = field(default_factory=dict)
    started: list[str] = field(default_factory=list)
    completed: dict[str, float] = field(default_factory=dict)
    """group id -> monotonic time its last reward was acknowledged."""
    failures: list[BaseException] = field(default_factory=list)


async def produce(
    client: SessionRouterClient, ids: Iterator[str], load: Load, stop: asyncio.Event
) -> None:
    """Groups of 4, one after another: start, then one reward batch, until ``stop``."""
    while not stop.is_set():
        group = next(ids)
        try:
            started = await client.start_group("t", 4, group_id=group)
            load.started.append(group)
            batch = {s.name: float(s.index % 2) for s in started.sessions}
            done = await client.submit_rewards(batch)
        except (UnavailableError, grpc.aio.AioRpcError) as error:
            load.failures.append(error)
            continue
        for result, (name, reward) in zip(done.results, batch.items(), strict=True):
            if result.ok:
                load.acked[name] = reward
        if all(r.ok for r in done.results):
            load.completed[group] = time.monotonic()


def assert_one_gapless_sequence(feed: list[GroupResult], want: set[str]) -> None:
    cursors = [g.cursor for g in feed]
    assert cursors == list(range(1, len(cursors) + 1)), "the feed has a gap"
    ids = [g.group_id for g in feed]
    assert len(ids) == len(set(ids)), "a group is on the feed twice"
    assert want <= set(ids)


async def test_kill9_of_a_shard_under_load(cluster: Cluster) -> None:
    run = uuid.uuid4().hex[:6]
    load = Load()
    stop = asyncio.Event()
    down_shard = 1
    victim = cluster.shards[down_shard]
    async with SessionRouterClient.connect(cluster.addresses) as client:
        producers = [
            asyncio.create_task(produce(client, ids_of_shard(f"k-{run}-p{p}", p % N), load, stop))
            for p in range(2 * N)
        ]
        await asyncio.sleep(2.0)
        victim.kill9()
        killed_at = time.monotonic()
        probe = next(ids_of_shard(f"probe-{run}", down_shard))
        # Its groups are UNAVAILABLE, directly and through nginx...
        async with SessionRouterClient.connect(
            cluster.addresses, retry_policy=ONE_TRY, default_timeout=5.0
        ) as eager:
            with pytest.raises(UnavailableError):
                await eager.start_group("t", 4, group_id=probe)
        async with SessionRouterClient.connect(
            cluster.nginx.target, shard_count=N, retry_policy=ONE_TRY, default_timeout=5.0
        ) as eager:
            with pytest.raises(UnavailableError):
                await eager.start_group("t", 4, group_id=probe)
        # ...and never served by another shard.
        for other in (0, 2):
            async with grpc.aio.insecure_channel(cluster.addresses[other]) as channel:
                stub = spb_grpc.SessionServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stub.StartGroup(
                        spb.StartGroupRequest(task_id="t", group_id=probe, group_size=4)
                    )
                assert details_of(caught.value).reason == "WRONG_SHARD"
        await asyncio.sleep(1.0)
        await asyncio.to_thread(victim.start)  # in place: same port, same journal
        back_at = time.monotonic()
        await asyncio.sleep(2.0)
        stop.set()
        await asyncio.gather(*producers)

        assert not load.failures, load.failures[:3]  # the clients' retries outlasted the kill
        during = [g for g, at in load.completed.items() if killed_at < at < back_at]
        assert {shard_of(g, N) for g in during} >= {0, 2}, "the other shards kept serving"
        assert any(
            shard_of(g, N) == down_shard for g in load.completed if load.completed[g] > back_at
        )
        # Nothing acknowledged is lost.
        for name, reward in load.acked.items():
            session = await client.get_session(name)
            assert session.state is SessionState.REWARDED and session.reward == reward, name
        # No group exists twice: each is on its owner only.
        for i, address in enumerate(cluster.addresses):
            async with SessionRouterClient.connect(address) as one:
                held = {g.group_id async for g in one.iter_groups(page_size=1000)}
            assert {g for g in held if g in set(load.started)} == {
                g for g in load.started if shard_of(g, N) == i
            }
        feed = await read_feed(client, set(load.completed), seconds=30)
    assert_one_gapless_sequence(feed, set(load.completed))


async def test_feed_outlives_a_restart_of_its_shard_and_of_nats(cluster: Cluster) -> None:
    run = uuid.uuid4().hex[:6]
    trained: list[GroupResult] = []
    retries: list[str] = []
    groups: list[str] = []

    async def complete(client: SessionRouterClient, per_shard: int, tag: str) -> list[str]:
        made = []
        for shard in range(N):
            ids = ids_of_shard(f"{tag}-{run}", shard)
            for _ in range(per_shard):
                group = next(ids)
                started = await client.start_group("t", 2, group_id=group)
                done = await client.submit_rewards(
                    {s.name: float(s.index) for s in started.sessions}
                )
                assert all(r.ok for r in done.results)
                assert len(done.group_results) == 1  # the shard finalizes it, NATS or not
                made.append(group)
        return made

    arrived = asyncio.Event()

    async def until_trained(want: list[str], seconds: float) -> None:
        async with asyncio.timeout(seconds):
            while not set(want) <= {g.group_id for g in trained}:
                arrived.clear()
                await arrived.wait()

    async with SessionRouterClient.connect(
        cluster.addresses, retry_policy=UNTIL_BACK, default_timeout=None
    ) as client:

        async def trainer() -> None:
            feed = client.subscribe_groups(on_retry=lambda n, error, *_: retries.append(str(error)))
            async with contextlib.aclosing(feed):
                async for group in feed:
                    trained.append(group)
                    arrived.set()

        following = asyncio.create_task(trainer())  # a fresh client's feed starts on shard 0
        try:
            groups += await complete(client, 2, "before")
            await until_trained(groups, 15)

            assert await asyncio.to_thread(cluster.shards[0].stop) == 0  # the feed's shard
            restarting = asyncio.create_task(asyncio.to_thread(cluster.shards[0].start))
            groups += await complete(client, 2, "restart")  # shard 0's calls wait for it
            await restarting
            await until_trained(groups, 30)
            assert retries, "the feed did not notice its shard going away"

            cluster.nats.kill()
            outage = await complete(client, 2, "outage")  # every shard serves its own
            groups += outage
            await asyncio.sleep(1.0)
            assert not set(outage) & {g.group_id for g in trained}  # no merged feed now
            await asyncio.to_thread(cluster.nats.restart)
            await until_trained(groups, 60)  # the backlog is published, the feed resumes
        finally:
            following.cancel()
            await asyncio.gather(following, return_exceptions=True)
    assert_one_gapless_sequence(trained, set(groups))
