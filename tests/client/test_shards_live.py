"""The sharded client against three real routers on 127.0.0.1:0, run unsharded.

Each router only knows what reached it, so its own ``GetGroup`` proves where the client sent
each call: a group named by the caller lands on ``shard_of(group_id, 3)`` and nowhere else, a
group the router names lands on the next shard round-robin, a reward batch that mixes groups
of all shards is split and answered in the caller's order, and the feed moves on to the next
router when its stream is lost. (The routers' own sharding, WRONG_SHARD included, is tested
with the sharded server in tests/shards.)
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

import pytest

from sessionrouter.client import (
    GroupOutcome,
    NotFoundError,
    RetryPolicy,
    RewardStatus,
    Session,
    SessionRouterClient,
)
from sessionrouter.client._shard_rewards import ShardedRewardStream
from sessionrouter.client.shardmap import shard_of
from sessionrouter.server.app import WorkerSpec
from tests.support import Harness, start_harness, stop_harness

N = 3
FAST = RetryPolicy(max_attempts=4, initial_backoff=0.01, max_backoff=0.05)


@pytest.fixture
async def routers() -> AsyncIterator[list[Harness]]:
    workers = tuple(WorkerSpec(f"w{i}", f"10.0.0.{i}:30000", 64) for i in range(4))
    started = [await start_harness(workers=workers) for _ in range(N)]
    try:
        yield started
    finally:
        for h in started:
            with contextlib.suppress(Exception):
                await stop_harness(h)


@pytest.fixture
async def client(routers: list[Harness]) -> AsyncIterator[SessionRouterClient]:
    async with SessionRouterClient.connect(
        [h.address for h in routers], default_timeout=10.0, retry_policy=FAST
    ) as c:
        yield c


def groups_on_each_shard(per_shard: int) -> list[str]:
    """Group ids, ``per_shard`` owned by each of the N shards, interleaved."""
    run = uuid.uuid4().hex[:8]
    by_shard: dict[int, list[str]] = {i: [] for i in range(N)}
    k = 0
    while min(len(v) for v in by_shard.values()) < per_shard:
        group = f"run-{run}-g{k}"
        if len(by_shard[shard_of(group, N)]) < per_shard:
            by_shard[shard_of(group, N)].append(group)
        k += 1
    return [by_shard[i][j] for j in range(per_shard) for i in range(N)]


async def where(routers: list[Harness], group_id: str) -> list[int]:
    """The routers that know ``group_id``, asked directly."""
    found = []
    for i, h in enumerate(routers):
        async with SessionRouterClient.connect(h.address, default_timeout=5.0) as one:
            with contextlib.suppress(NotFoundError):
                await one.get_group(group_id)
                found.append(i)
    return found


async def test_a_named_group_lives_on_its_shard_only(
    routers: list[Harness], client: SessionRouterClient
) -> None:
    groups = groups_on_each_shard(2)
    for group in groups:
        started = await client.start_session("t", group_id=group, group_size=2)
        joined = await client.start_session("t", group_id=group, group_size=2)
        assert {started.session.index, joined.session.index} == {0, 1}
        assert (await client.get_group(group)).group_id == group
        assert (await client.get_session(joined.session.name)).group_id == group
    for group in groups:
        assert await where(routers, group) == [shard_of(group, N)]


async def test_a_group_without_id_goes_to_the_next_shard(
    routers: list[Harness], client: SessionRouterClient
) -> None:
    minted = [(await client.start_group("t", 2)).group_id for _ in range(N)]
    assert sorted([(await where(routers, g))[0] for g in minted]) == list(range(N))


async def test_a_mixed_reward_batch_is_split_and_answered_in_order(
    routers: list[Harness], client: SessionRouterClient
) -> None:
    groups = groups_on_each_shard(2)
    members: list[Session] = []
    for group in groups:
        members += (await client.start_group("t", 2, group_id=group)).sessions
    batch = [(s.name, float(n % 3)) for n, s in enumerate(members)]
    batch.insert(3, ("groups/no-such-group/sessions/0", 1.0))
    done = await client.submit_rewards(batch)
    statuses = [r.status for r in done.results]
    assert statuses[3] is RewardStatus.UNKNOWN_SESSION
    assert statuses[:3] + statuses[4:] == [RewardStatus.ACCEPTED] * len(members)
    assert sorted(g.group_id for g in done.group_results) == sorted(groups)
    again = await client.submit_rewards(batch)  # resubmitting is a no-op, shard by shard
    assert [r.status for r in again.results][4:] == [RewardStatus.DUPLICATE] * (len(batch) - 4)


async def test_a_reward_stream_opens_one_stream_per_shard(
    routers: list[Harness], client: SessionRouterClient
) -> None:
    groups = groups_on_each_shard(3)
    started = [await client.start_group("t", 4, group_id=g) for g in groups]
    async with client.reward_stream() as stream:
        assert isinstance(stream, ShardedRewardStream)
        watched = {g: stream.watch_group(g) for g in groups}
        entries = [(s.name, float(s.index)) for st in started for s in st.sessions]
        first, rest = entries[::2], entries[1::2]
        results = await stream.submit_many(first)
        results += await asyncio.gather(*(stream.submit(name, r) for name, r in rest))
        assert all(r.status is RewardStatus.ACCEPTED for r in results)
        finished = await asyncio.gather(*watched.values())
        assert stream.shards_open == (0, 1, 2)
    assert [f.group_id for f in finished] == groups
    assert all(f.outcome is GroupOutcome.COMPLETE for f in finished)
    on_stream = [r.group_id async for r in stream.results()]
    assert sorted(on_stream) == sorted(groups)


async def test_run_group_and_abort_route_by_group(
    routers: list[Harness], client: SessionRouterClient
) -> None:
    async def rollout(session: Session) -> float:
        return float(session.index)

    for group in groups_on_each_shard(1):
        result = await client.run_group("t", 3, rollout, group_id=group)
        assert result.group_id == group and result.outcome is GroupOutcome.COMPLETE
        assert await where(routers, group) == [shard_of(group, N)]
    other = groups_on_each_shard(1)[1]
    started = await client.start_group("t", 2, group_id=other)
    aborted = await client.abort_session(started.sessions[0].name, reason="test")
    assert aborted.group_id == other


async def test_list_groups_covers_every_shard_once(
    routers: list[Harness], client: SessionRouterClient
) -> None:
    groups = groups_on_each_shard(2)
    for group in groups:
        await client.start_group("t", 1, group_id=group)
    listed = [g.group_id async for g in client.iter_groups(page_size=1)]
    assert sorted(listed) == sorted(groups)


async def test_the_feed_moves_to_the_next_shard_when_its_stream_is_lost(
    routers: list[Harness], client: SessionRouterClient
) -> None:
    group = groups_on_each_shard(1)[1]  # on shard 1
    await client.submit_rewards(
        {
            s.name: float(s.index)
            for s in (await client.start_group("t", 2, group_id=group)).sessions
        }
    )
    await stop_harness(routers[0])  # the feed's first connection goes to shard 0
    retries: list[int] = []
    feed = client.subscribe_groups(on_retry=lambda failures, *_: retries.append(failures))
    async with asyncio.timeout(10), contextlib.aclosing(feed):
        first = await anext(feed)
    assert first.group_id == group  # shard 1's feed (unsharded routers: each has its own)
    assert retries == [1]
