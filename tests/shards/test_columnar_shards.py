"""The columnar form over shards: 3 shards and a real nats-server on 127.0.0.1.

- A sharded router's session handles name their shard (bit 63 set, the shard in bits 48-62,
  as the proto says); a shard answers another shard's handle WRONG_SHARD with the owner, in
  both entry forms, and a handle naming no shard UNKNOWN_SESSION.
- The sharded client's columnar calls (``submit_arrays`` by handle, ``result_batches``) give
  the same per-entry statuses and the same group results as the message form (``submit_many``
  by name, ``results``) for the same inputs over groups of every shard.
- The merged feed in columnar form has the same groups, values, cursors, skip counts and
  ``last_cursor``s as in message form, from any shard, resumes after a cursor, and the
  client's ``subscribe_result_batches`` fails over to the next shard as ``subscribe_groups``
  does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import AsyncIterator

import numpy as np
import pytest

from sessionrouter.client import (
    GroupResult,
    RetryPolicy,
    RewardStatus,
    SessionRouterClient,
    StartGroupResult,
    _convert,
)
from sessionrouter.client.shardmap import shard_of, shard_of_handle
from sessionrouter.server.app import WorkerSpec
from sessionrouter.server.shards.merged_feed import FETCH_WAIT_S
from sessionrouter.v1 import session_service_pb2 as spb
from tests.shards.support import eventually, finish_group, owned_group
from tests.support import Harness, stop_harness

N = 3
WORKERS = tuple(WorkerSpec(f"w{i}", f"10.0.0.{i}:30000", 64) for i in range(4))
FAST = RetryPolicy(max_attempts=4, initial_backoff=0.01, max_backoff=0.05)


@pytest.fixture
async def client(shards: list[Harness]) -> AsyncIterator[SessionRouterClient]:
    async with SessionRouterClient.connect(
        [h.address for h in shards], default_timeout=10.0, retry_policy=FAST
    ) as c:
        yield c


async def _pool_ready(client: SessionRouterClient) -> None:
    async def ready() -> bool:
        try:
            await client.start_group("probe", 1, group_id=owned_group(0, N, "probe"))
        except Exception:
            return False
        return True

    await eventually(ready)


async def _published(shards: list[Harness]) -> None:
    async def all_out() -> bool:
        return all(h.server.shards.publisher.backlog == 0 for h in shards)

    await eventually(all_out)


async def _start_family(
    client: SessionRouterClient, tag: str, per_shard: int, size: int
) -> list[StartGroupResult]:
    """``per_shard`` groups of ``size`` on each shard, interleaved by shard."""
    groups = []
    for k in range(per_shard):
        for shard in range(N):
            group_id = owned_group(shard, N, prefix=f"{tag}-{k}")
            groups.append(await client.start_group("t", size, group_id=group_id))
    return groups


async def test_handles_name_their_shard_and_a_foreign_one_is_wrong_shard(
    shards: list[Harness], client: SessionRouterClient
) -> None:
    await _pool_ready(client)
    started = await _start_family(client, "handles", 1, 2)
    for group in started:
        owner = shard_of(group.group_id, N)
        for session in group.sessions:
            assert session.handle >> 63 == 0
            assert shard_of_handle(session.handle) == owner
    # Shard 0 is sent shard 1's handle, one of its own range that names no session, and its
    # own: WRONG_SHARD naming shard 1 and its address, UNKNOWN_SESSION, ACCEPTED.
    mine = next(g for g in started if shard_of(g.group_id, N) == 0).sessions[0]
    theirs = next(g for g in started if shard_of(g.group_id, N) == 1).sessions[0]
    nobody = (5 << 16) | 1  # seq 5: below where an in-memory shard starts numbering
    call = shards[0].sessions.SubmitRewards()
    handles = [theirs.handle, nobody, mine.handle]
    await call.write(
        spb.SubmitRewardsRequest(
            sequence=1, columns=spb.RewardColumns(handles=handles, rewards=[1.0, 1.0, 1.0])
        )
    )
    response = await asyncio.wait_for(call.read(), 5)
    assert isinstance(response, spb.SubmitRewardsResponse)
    assert list(response.ack.statuses) == [
        spb.REWARD_STATUS_WRONG_SHARD,
        spb.REWARD_STATUS_UNKNOWN_SESSION,
        spb.REWARD_STATUS_ACCEPTED,
    ]
    assert list(response.ack.detail_entries) == [0, 1]
    assert "shard 1 of 3" in response.ack.details[0]
    assert shards[1].address in response.ack.details[0]
    # The message form: the owner in its fields too.
    await call.write(
        spb.SubmitRewardsRequest(sequence=2, entries=[spb.RewardEntry(handle=theirs.handle)])
    )
    response = await asyncio.wait_for(call.read(), 5)
    assert isinstance(response, spb.SubmitRewardsResponse)
    (result,) = response.ack.results
    assert result.status == spb.REWARD_STATUS_WRONG_SHARD
    assert (result.owner_shard, result.owner_address) == (1, shards[1].address)
    await call.done_writing()
    call.cancel()
    # Shard 1 never heard of it: its session is still open.
    assert (await client.get_session(theirs.name)).state.name == "OPEN"


def _inputs(
    family: list[StartGroupResult],
) -> list[tuple[int, int, float]]:
    """(group, member, reward) per entry: every member once, and on the way a duplicate, a
    conflict and a non-finite reward, in an order that mixes the shards."""
    entries: list[tuple[int, int, float]] = []
    for g, group in enumerate(family):
        for m in range(len(group.sessions)):
            entries.append((g, m, float((g * 7 + m * 3) % 5)))
    entries.insert(4, (0, 0, float("nan")))  # before member 0's reward: NOT_FINITE
    entries.append((0, 0, entries[0][2]))  # DUPLICATE
    entries.append((1, 0, entries[1][2] + 1.0))  # CONFLICT
    return entries


def _view(result: GroupResult) -> tuple[object, ...]:
    """What must agree between the forms, less the group's own id and time."""
    return (
        result.outcome,
        result.group_size,
        tuple(s.rsplit("/", 1)[1] for s in result.sessions),
        result.rewards,
        result.advantages,
        result.mean,
        result.std,
        result.degenerate,
        result.shard,
    )


async def test_columnar_and_message_forms_agree_over_shards(
    shards: list[Harness], client: SessionRouterClient
) -> None:
    await _pool_ready(client)
    by_name = await _start_family(client, "names", 2, 3)
    by_handle = await _start_family(client, "handles", 2, 3)
    entries = _inputs(by_name)
    unknown_group = owned_group(2, N, prefix="never-started")

    async with client.reward_stream() as stream:
        names = [f"groups/{by_name[g].group_id}/sessions/{m}" for g, m, _ in entries]
        names.append(f"groups/{unknown_group}/sessions/0")
        rewards = [r for *_, r in entries] + [1.0]
        message_results = await stream.submit_many(zip(names, rewards, strict=True))
    message_groups = {r.group_id: r async for r in stream.results()}

    async with client.reward_stream(columnar_results=True) as stream:
        handles = np.array(
            [by_handle[g].sessions[m].handle for g, m, _ in entries], dtype=np.uint64
        )
        unknown_handle = (2 << 48) | (12345 << 16)  # shard 2's range, no group
        ack = await stream.submit_arrays(
            np.append(handles, np.uint64(unknown_handle)), np.array(rewards)
        )
    batches = [b async for b in stream.result_batches()]

    assert [RewardStatus(int(s)) for s in ack.statuses] == [r.status for r in message_results]
    assert {r.status for r in message_results} >= {
        RewardStatus.ACCEPTED,
        RewardStatus.DUPLICATE,
        RewardStatus.CONFLICT,
        RewardStatus.NOT_FINITE,
        RewardStatus.UNKNOWN_SESSION,
    }
    not_ok = [i for i, r in enumerate(message_results) if r.status is not RewardStatus.ACCEPTED]
    assert ack.detail_entries.tolist() == not_ok
    assert len(ack.details) == len(not_ok)
    # The same groups finished, with the same values; each batch is one shard's.
    columnar_groups = {g.group_id: g for b in batches for g in b.groups}
    for batch in batches:
        shard = {shard_of(i, N) for i in batch.group_ids}
        assert len(shard) == 1
        assert [g.shard for g in batch.groups] == [*shard] * len(batch)
        # The column itself: empty for shard 0's groups (0 is the default), filled otherwise.
        assert batch.shards.tolist() == ([] if shard == {0} else [*shard] * len(batch))
    assert len(message_groups) == len(columnar_groups) == len(by_name) == 2 * N
    for named, handled in zip(by_name, by_handle, strict=True):
        assert _view(message_groups[named.group_id]) == _view(columnar_groups[handled.group_id])
        assert message_groups[named.group_id].shard == shard_of(named.group_id, N)


async def _read_form(
    h: Harness, columnar: bool, covering: int, **request: object
) -> list[spb.SubscribeGroupsResponse]:
    call = h.sessions.SubscribeGroups(
        spb.SubscribeGroupsRequest(columnar=columnar, **request)  # type: ignore[arg-type]
    )
    got: list[spb.SubscribeGroupsResponse] = []
    try:
        while not got or got[-1].last_cursor < covering:
            message = await asyncio.wait_for(call.read(), 10)
            assert isinstance(message, spb.SubscribeGroupsResponse)
            got.append(message)
    finally:
        call.cancel()
    return got


def _untimed(result: GroupResult) -> GroupResult:
    return dataclasses.replace(result, finalize_time=None)


async def test_merged_feed_columnar_matches_the_message_form(
    shards: list[Harness], client: SessionRouterClient
) -> None:
    await _pool_ready(client)
    family = await _start_family(client, "feed", 3, 2)
    # Every third group degenerate (equal rewards), so skip_degenerate has work.
    rewards = [
        (s.name, 1.0 if g % 3 == 0 else float(m) + g)
        for g, group in enumerate(family)
        for m, s in enumerate(group.sessions)
    ]
    await client.submit_rewards(rewards)
    await _published(shards)
    total = len(family)  # the probe group of _pool_ready stays open: not on the feed
    for skip in (False, True):
        for reader, h in enumerate(shards):
            messages = await _read_form(h, False, total, skip_degenerate=skip)
            columns = await _read_form(shards[(reader + 1) % N], True, total, skip_degenerate=skip)
            typed = [_convert.group_result_from_proto(g) for m in messages for g in m.groups]
            batched = [
                g
                for m in columns
                if m.HasField("batch")
                for g in _convert.result_batch_from_proto(m.batch).groups
            ]
            assert [_untimed(g) for g in typed] == [_untimed(g) for g in batched]
            for a, b in zip(typed, batched, strict=True):
                assert a.finalize_time is not None and b.finalize_time is not None
                assert abs((a.finalize_time - b.finalize_time).total_seconds()) < 2e-6
            assert [m.last_cursor for m in messages] == [m.last_cursor for m in columns]
            assert [m.skipped_degenerate for m in messages] == [
                m.skipped_degenerate for m in columns
            ]
            assert all(not m.groups for m in columns)
            if skip:
                assert sum(m.skipped_degenerate for m in columns) >= len(family) // 3
    # Resuming after a cursor: the rest, in both forms.
    after = 3
    messages = await _read_form(shards[2], False, total, after_cursor=after)
    columns = await _read_form(shards[0], True, total, after_cursor=after)
    cursors = [g.cursor for m in messages for g in m.groups]
    assert cursors == list(range(after + 1, total + 1))
    assert [c for m in columns for c in m.batch.cursors] == cursors
    assert not math.isnan(columns[0].batch.rewards[0])


async def test_an_idle_columnar_subscription_stays_open(shards: list[Harness]) -> None:
    """Fetches that find nothing for several waits (FETCH_WAIT_S each) keep the stream open,
    in both forms: nats-py ends an empty fetch with asyncio's TimeoutError as well as its own,
    and neither means NATS is gone."""
    calls = [
        shards[0].sessions.SubscribeGroups(spb.SubscribeGroupsRequest(columnar=columnar))
        for columnar in (True, False)
    ]
    await asyncio.sleep(3 * FETCH_WAIT_S)
    group_id = owned_group(1, N, prefix="late")
    await finish_group(shards[1], group_id, [0.0, 1.0])
    for call, columnar in zip(calls, (True, False), strict=True):
        message = await asyncio.wait_for(call.read(), 10)
        assert isinstance(message, spb.SubscribeGroupsResponse)
        ids = list(message.batch.group_ids) if columnar else [g.group_id for g in message.groups]
        assert ids == [group_id]
        call.cancel()


async def test_client_result_batches_resume_and_fail_over(
    shards: list[Harness], client: SessionRouterClient
) -> None:
    await _pool_ready(client)
    family = await _start_family(client, "over", 2, 2)
    await client.submit_rewards(
        [(s.name, float(m)) for group in family for m, s in enumerate(group.sessions)]
    )
    await _published(shards)
    total = len(family)
    expected = []
    async for group in client.subscribe_groups():
        expected.append(group)
        if group.cursor == total:
            break
    # The first connection of a fresh client goes to shard 0: stopped, so the feed moves on.
    await stop_harness(shards[0])
    async with SessionRouterClient.connect(
        [h.address for h in shards], default_timeout=10.0, retry_policy=FAST
    ) as fresh:
        retries: list[int] = []
        got: list[GroupResult] = []
        feed = fresh.subscribe_result_batches(
            after_cursor=1, on_retry=lambda failures, *_: retries.append(failures)
        )
        async for batch in feed:
            got.extend(batch.groups)
            if batch.last_cursor >= total:
                break
        await feed.aclose()
    assert retries  # shard 0 was tried and lost
    assert [_untimed(g) for g in got] == [_untimed(g) for g in expected[1:]]
    assert {g.shard for g in got} == set(range(N))
