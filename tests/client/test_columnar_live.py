"""The client's array forms against a real router: rewards submitted as arrays of handles get
the statuses the per-entry form gives, and group results read as ``ResultBatch`` arrays hold
what the typed ``GroupResult`` view of the same groups holds (on the stream and the feed)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import uuid
from collections.abc import AsyncIterator

import numpy as np
import pytest

from sessionrouter.client import (
    GroupOutcome,
    GroupResult,
    ResultBatch,
    RewardStatus,
    SessionRouterClient,
)


@pytest.fixture
async def live(router_address: str) -> AsyncIterator[SessionRouterClient]:
    async with SessionRouterClient.connect(router_address, default_timeout=10.0) as client:
        yield client


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


async def test_rewards_as_arrays_get_the_statuses_of_single_submits(
    live: SessionRouterClient,
) -> None:
    started = await live.start_group(unique("task"), 3)
    handles = np.array([s.handle for s in started.sessions], dtype=np.uint64)
    assert len(set(handles.tolist())) == 3 and handles.all()
    async with live.reward_stream(columnar_results=True) as stream:
        watched = stream.watch_group(started.group_id)
        first = await stream.submit_arrays(handles[:2], [1.0, 0.0])
        assert first.statuses.dtype == np.uint8 and first.all_ok
        again = await stream.submit_arrays(
            np.concatenate([handles, [handles[0] + 100]]), [1.0, 0.5, math.nan, 2.0]
        )
        assert [r.status for r in again.results()] == [
            RewardStatus.DUPLICATE,
            RewardStatus.CONFLICT,
            RewardStatus.NOT_FINITE,
            RewardStatus.UNKNOWN_SESSION,
        ]
        assert again.ok.tolist() == [True, False, False, False]
        assert again.detail_entries.tolist() == [0, 1, 2, 3]  # every entry not ACCEPTED
        single = await stream.submit(started.sessions[1].name, 0.5)
        assert single.status is RewardStatus.CONFLICT and single.detail == again.details[1]
        last = await stream.submit_arrays(None, [0.5], sessions=[started.sessions[2].name])
        assert last.all_ok
        result = await asyncio.wait_for(watched, 5)
    assert result.group_id == started.group_id and result.outcome is GroupOutcome.COMPLETE
    assert result.rewards == (1.0, 0.0, 0.5)
    with pytest.raises(ValueError, match="2 values for 3 rewards"):
        await stream.submit_arrays(handles[:2], [1.0, 2.0, 3.0])


async def test_result_batches_hold_what_the_typed_results_hold(live: SessionRouterClient) -> None:
    before = 0  # a fresh router: nothing finalized yet
    starts = [await live.start_group(unique("task"), size) for size in (2, 3, 1)]
    sessions = [s for started in starts for s in started.sessions]
    rewards = np.array([1.0, 0.0, 0.25, 0.5, 1.0, 3.0])
    metrics = np.ones(len(sessions))
    async with live.reward_stream(columnar_results=True) as stream:
        ack = await stream.submit_arrays(
            [s.handle for s in sessions], rewards, filter_metrics=metrics
        )
        assert ack.all_ok
    on_stream = [batch async for batch in stream.result_batches()]
    assert sum(len(b) for b in on_stream) == 3
    typed: list[GroupResult] = []
    async with contextlib.aclosing(live.subscribe_groups(after_cursor=before)) as feed:
        async for group in feed:
            typed.append(group)
            if len(typed) == 3:
                break
    batches: list[ResultBatch] = []
    async with contextlib.aclosing(live.subscribe_result_batches(after_cursor=before)) as feed:
        async for batch in feed:
            batches.append(batch)
            if sum(len(b) for b in batches) == 3:
                break
    from_feed = [g for b in batches for g in b.groups]
    assert from_feed == typed
    assert [g for b in on_stream for g in b.groups] == typed
    if len(batches) == 1:  # one message, as a quiet router sends it: check the arrays too
        (batch,) = batches
        assert batch.cursors.dtype == np.uint64 and batch.member_offsets.tolist() == [0, 2, 5, 6]
        np.testing.assert_array_equal(batch.rewards, rewards)
        assert batch.group_of_member.tolist() == [0, 0, 1, 1, 1, 2]
        assert batch.degenerate.tolist() == [True, True, True]  # every filter metric equal
        np.testing.assert_array_equal(batch.filter_metrics, metrics)
        assert batch.last_cursor == typed[-1].cursor
        tail = batch.after(typed[0].cursor)
        assert tail.groups == tuple(typed[1:]) and tail.member_offsets.tolist() == [0, 3, 4]
