"""The client against a real router: what the unit tests' fake cannot prove.

``router_address`` (tests/conftest.py) is an in-process router on 127.0.0.1 with workers
w1..w3 of capacity 4. Expectations come from the contract in protos/, not from the server's
code: placement on distinct workers, idempotent starts, the error reasons and details the
service documents, reward statuses, group results on the stream and on the feed.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import AsyncIterator

import numpy as np
import pytest

from sessionrouter.client import (
    AlreadyExistsError,
    FailedPreconditionError,
    GroupOutcome,
    GroupState,
    InvalidArgumentError,
    NotFoundError,
    OutOfRangeError,
    PlacementMode,
    ResourceExhaustedError,
    RetryPolicy,
    RewardStatus,
    Session,
    SessionRouterClient,
    SessionState,
    UnavailableError,
    WorkerHealth,
)


@pytest.fixture
async def live(router_address: str) -> AsyncIterator[SessionRouterClient]:
    async with SessionRouterClient.connect(router_address, default_timeout=10.0) as client:
        yield client


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


async def test_the_three_workers_are_listed_healthy(live: SessionRouterClient) -> None:
    workers = [w async for w in live.iter_workers(page_size=2)]  # two pages
    assert [w.worker_id for w in workers] == ["w1", "w2", "w3"]
    assert all(w.capacity == 4 and w.health is WorkerHealth.HEALTHY for w in workers)
    assert (await live.get_worker("w2")).address == "10.0.0.2:30000"


async def test_worker_life_cycle(live: SessionRouterClient) -> None:
    registered = await live.register_worker("w4", "10.0.0.4:30000", 2, labels={"gpu": "h100"})
    assert registered.worker.labels == {"gpu": "h100"}
    assert registered.heartbeat_timeout.total_seconds() > 0
    assert (await live.heartbeat("w4")).health is WorkerHealth.HEALTHY
    assert (await live.drain_worker("w4")).draining
    assert not (await live.drain_worker("w4", resume=True)).draining
    gone = await live.deregister_worker("w4")
    assert (gone.worker.worker_id, gone.lost_sessions) == ("w4", 0)
    with pytest.raises(NotFoundError):
        await live.get_worker("w4")


async def test_start_group_places_members_on_distinct_workers(live: SessionRouterClient) -> None:
    started = await live.start_group(unique("task"), 3)
    assert not started.shared_worker
    assert len({s.worker_id for s in started.sessions}) == 3
    assert [s.index for s in started.sessions] == [0, 1, 2]
    assert all(s.name == f"groups/{started.group_id}/sessions/{s.index}" for s in started.sessions)
    assert all(s.state is SessionState.OPEN for s in started.sessions)


async def test_more_members_than_workers_share_or_are_refused(live: SessionRouterClient) -> None:
    spread = await live.start_group(unique("task"), 4, placement=PlacementMode.SPREAD)
    assert spread.shared_worker
    assert len({s.worker_id for s in spread.sessions}) == 3
    with pytest.raises(ResourceExhaustedError):
        await live.start_group(unique("task"), 4, placement=PlacementMode.STRICT)


async def test_start_session_is_idempotent_by_request_id(live: SessionRouterClient) -> None:
    task, group_id, request_id = unique("task"), unique("g"), unique("req")
    first = await live.start_session(task, group_id=group_id, group_size=2, request_id=request_id)
    again = await live.start_session(task, group_id=group_id, group_size=2, request_id=request_id)
    assert first.group_created and not first.replayed
    assert again.replayed
    assert again.session.name == first.session.name
    assert len((await live.get_group(group_id)).members) == 1  # no second slot taken


async def test_refusals_carry_reasons_and_details(live: SessionRouterClient) -> None:
    task, group_id = unique("task"), unique("g")
    await live.start_session(task, group_id=group_id, group_size=2)

    with pytest.raises(InvalidArgumentError) as size:
        await live.start_session(task, group_id=group_id, group_size=3)
    assert size.value.reason == "GROUP_SIZE_MISMATCH"
    assert size.value.metadata == {"group_id": group_id, "expected": "2", "got": "3"}

    with pytest.raises(InvalidArgumentError) as other_task:
        await live.start_session(unique("task"), group_id=group_id)
    assert other_task.value.reason == "TASK_MISMATCH"

    await live.start_session(task, group_id=group_id)
    with pytest.raises(FailedPreconditionError) as full:
        await live.start_session(task, group_id=group_id)
    assert full.value.reason == "GROUP_FULL"

    with pytest.raises(AlreadyExistsError):
        await live.start_group(task, 2, group_id=group_id)

    with pytest.raises(InvalidArgumentError) as malformed:
        await live.start_session("no/slashes")
    assert [f for f, _ in malformed.value.field_violations] == ["task_id"]

    with pytest.raises(NotFoundError):
        await live.get_session(f"groups/{unique('g')}/sessions/0")


async def test_no_eligible_worker_is_unavailable_with_a_retry_delay(
    live: SessionRouterClient, router_address: str
) -> None:
    for worker in ("w1", "w2", "w3"):
        await live.drain_worker(worker)
    async with SessionRouterClient.connect(
        router_address, retry_policy=RetryPolicy(max_attempts=1)
    ) as impatient:
        with pytest.raises(UnavailableError) as caught:
            await impatient.start_session(unique("task"))
    assert caught.value.reason == "NO_ELIGIBLE_WORKER"
    assert caught.value.retry_delay is not None and caught.value.retry_delay > 0

    # A patient call waits the advertised delay and gets in once a worker is back.
    pending = asyncio.create_task(live.start_session(unique("task")))
    await asyncio.sleep(0.1)
    await live.drain_worker("w2", resume=True)
    started = await pending
    assert started.session.worker_id == "w2"


async def test_reward_statuses_and_the_group_result_on_the_stream(
    live: SessionRouterClient,
) -> None:
    started = await live.start_group(unique("task"), 2)
    s0, s1 = (s.name for s in started.sessions)
    async with live.reward_stream() as rewards:
        done = rewards.watch_group(started.group_id)
        assert (await rewards.submit(s0, 1.0)).status is RewardStatus.ACCEPTED
        assert (await rewards.submit(s0, 1.0)).status is RewardStatus.DUPLICATE
        assert (await rewards.submit(s0, 2.0)).status is RewardStatus.CONFLICT
        assert (await rewards.submit(s1, math.nan)).status is RewardStatus.NOT_FINITE
        unknown = await rewards.submit(f"groups/{unique('g')}/sessions/0", 1.0)
        assert unknown.status is RewardStatus.UNKNOWN_SESSION
        assert (await rewards.submit(s1, 0.0)).status is RewardStatus.ACCEPTED
        result = await done
    assert result.outcome is GroupOutcome.COMPLETE
    assert result.sessions == (s0, s1)
    assert result.rewards == (1.0, 0.0)
    assert [g.group_id async for g in rewards.results()] == [started.group_id]


async def test_run_group_returns_grpo_advantages(live: SessionRouterClient) -> None:
    seen_workers: set[str] = set()

    async def rollout(session: Session) -> float:
        seen_workers.add(session.worker_id)
        await asyncio.sleep(0.01 * session.index)
        return float(session.index)

    result = await live.run_group(unique("task"), 3, rollout)
    assert result.outcome is GroupOutcome.COMPLETE
    assert len(seen_workers) == 3
    assert result.estimator.name == "grpo"
    assert result.estimator.eps is not None and result.estimator.ddof is not None
    rewards = result.rewards_array
    expected = (rewards - rewards.mean()) / (
        rewards.std(ddof=result.estimator.ddof) + result.estimator.eps
    )
    np.testing.assert_allclose(result.advantages_array, expected, rtol=1e-12)
    assert abs(float(result.advantages_array.sum())) < 1e-9
    assert not result.degenerate


async def test_a_failed_rollout_leaves_a_partial_group(live: SessionRouterClient) -> None:
    async def rollout(session: Session) -> float:
        if session.index == 0:
            raise RuntimeError("inference server fell over")
        return float(session.index)

    result = await live.run_group(unique("task"), 3, rollout)
    assert result.outcome is GroupOutcome.PARTIAL
    assert len(result.sessions) == 2
    assert len(result.excluded_sessions) == 1
    assert result.excluded_sessions[0].endswith("/sessions/0")
    session = await live.get_session(result.excluded_sessions[0])
    assert session.state is SessionState.ABORTED


async def test_equal_rewards_are_degenerate_with_zero_advantages(
    live: SessionRouterClient,
) -> None:
    async def rollout(session: Session) -> float:
        return 0.5

    result = await live.run_group(unique("task"), 3, rollout)
    assert result.degenerate
    assert result.advantages == (0.0, 0.0, 0.0)


async def test_the_feed_replays_from_a_cursor_and_matches_wait_group_result(
    live: SessionRouterClient,
) -> None:
    started = await live.start_group(unique("task"), 2)
    submitted = await live.submit_rewards({s.name: float(s.index) for s in started.sessions})
    assert all(r.ok for r in submitted.results)
    waited = await live.wait_group_result(started.group_id)
    assert waited.group_id == started.group_id
    assert [g.cursor for g in submitted.group_results] in ([], [waited.cursor])

    feed = live.subscribe_groups(after_cursor=waited.cursor - 1)
    try:
        replayed = await asyncio.wait_for(anext(feed), 5.0)
    finally:
        await feed.aclose()
    assert replayed == waited

    group = await live.get_group(started.group_id)
    assert group.state is GroupState.FINALIZED
    assert group.cursor == waited.cursor
    finalized = [g.group_id async for g in live.iter_groups(state=GroupState.FINALIZED)]
    assert started.group_id in finalized


async def test_a_cursor_beyond_the_feed_is_out_of_range(live: SessionRouterClient) -> None:
    feed = live.subscribe_groups(after_cursor=10**9)
    try:
        with pytest.raises(OutOfRangeError):
            await asyncio.wait_for(anext(feed), 5.0)
    finally:
        await feed.aclose()


async def test_abort_session_frees_the_slot(live: SessionRouterClient) -> None:
    started = await live.start_session(unique("task"), group_size=2)
    worker_before = await live.get_worker(started.session.worker_id)
    aborted = await live.abort_session(started.session.name, reason="test")
    assert aborted.state is SessionState.ABORTED
    worker_after = await live.get_worker(started.session.worker_id)
    assert worker_after.open_sessions == worker_before.open_sessions - 1
