"""Placement policies through the client, against a real router on 127.0.0.1.

Each test gets its own router (so worker loss and labels stay local) with workers registered
through the client. Expectations come from the contract in protos/: PACK with a cap, label
selectors, ``replace_lost`` replacement notices on the reward stream, and the filter metric
making groups degenerate that ``skip_degenerate`` then leaves off the feed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator

import pytest

from sessionrouter.client import (
    GroupOptions,
    GroupOutcome,
    PlacementMode,
    Replacement,
    RetryPolicy,
    RewardStatus,
    Session,
    SessionRouterClient,
    UnavailableError,
)
from tests.support import start_harness, stop_harness

ZONES = {"w1": "a", "w2": "a", "w3": "b", "w4": "b"}


@pytest.fixture
async def live() -> AsyncIterator[SessionRouterClient]:
    """A client of a fresh router with w1..w4 (capacity 4), zone a (w1, w2) or b (w3, w4)."""
    h = await start_harness()
    try:
        async with SessionRouterClient.connect(
            h.address,
            default_timeout=10.0,
            retry_policy=RetryPolicy(max_attempts=2, initial_backoff=0.01, max_backoff=0.02),
        ) as client:
            for worker_id, zone in ZONES.items():
                await client.register_worker(
                    worker_id, f"10.0.0.{worker_id[1]}:30000", 4, labels={"zone": zone}
                )
            yield client
    finally:
        await stop_harness(h)


async def test_pack_with_a_cap_shares_workers_up_to_the_cap(live: SessionRouterClient) -> None:
    started = await live.start_group(
        "prefix-heavy",
        4,
        group_id="packed",
        placement=PlacementMode.PACK,
        options=GroupOptions(max_members_per_worker=2),
    )
    per_worker = Counter(s.worker_id for s in started.sessions)
    assert sorted(per_worker.values()) == [2, 2]
    assert all(s.shares_worker for s in started.sessions)
    assert started.shared_worker
    group = await live.get_group("packed")
    assert (group.distinct_workers, group.shared_worker) == (2, True)
    assert group.options.max_members_per_worker == 2


async def test_spread_by_default_shares_nothing(live: SessionRouterClient) -> None:
    started = await live.start_group("t", 4, group_id="spread")
    assert len({s.worker_id for s in started.sessions}) == 4
    assert not any(s.shares_worker for s in started.sessions)
    assert (started.group.distinct_workers, started.group.shared_worker) == (4, False)


async def test_run_group_places_members_only_on_selected_workers(
    live: SessionRouterClient,
) -> None:
    placed: list[Session] = []

    async def rollout(session: Session) -> float:
        placed.append(session)
        return float(session.index)

    result = await live.run_group(
        "t", 2, rollout, group_id="zoned", options=GroupOptions(selector={"zone": "b"})
    )
    assert result.outcome is GroupOutcome.COMPLETE
    assert {s.worker_id for s in placed} == {"w3", "w4"}
    assert (await live.get_group("zoned")).options.selector == {"zone": "b"}


async def test_a_selector_no_worker_matches_is_unavailable_naming_it(
    live: SessionRouterClient,
) -> None:
    with pytest.raises(UnavailableError) as caught:
        await live.start_group("t", 2, options=GroupOptions(selector={"zone": "mars"}))
    assert caught.value.reason == "NO_MATCHING_WORKER"
    assert "zone=mars" in str(caught.value)


async def test_a_lost_worker_is_replaced_and_the_reward_stream_says_so(
    live: SessionRouterClient,
) -> None:
    started = await live.start_group(
        "t", 2, group_id="healing", options=GroupOptions(replace_lost=True)
    )
    notices: list[Replacement] = []
    told = asyncio.Event()

    def on_replacement(notice: Replacement) -> None:
        notices.append(notice)
        told.set()

    async with live.reward_stream(on_replacement=on_replacement) as rewards:
        # An answered entry shows the stream is registered with the router: notices go to
        # the streams open when the member is replaced.
        unknown = await rewards.submit("groups/none/sessions/0", 1.0)
        assert unknown.status is RewardStatus.UNKNOWN_SESSION
        lost, kept = started.sessions
        gone = await live.deregister_worker(lost.worker_id)
        assert gone.lost_sessions == 1
        async with asyncio.timeout(5):
            await told.wait()
        (notice,) = notices
        assert (notice.group_id, notice.replaced_session, notice.reason) == (
            "healing",
            lost.name,
            "worker_lost",
        )
        replacement = notice.session
        assert replacement.replaces == lost.name
        assert replacement.worker_id not in {lost.worker_id, kept.worker_id}
        finished = rewards.watch_group("healing")
        results = await rewards.submit_many([(kept.name, 1.0), (replacement.name, 0.0)])
        assert all(r.ok for r in results)
        result = await asyncio.wait_for(finished, 5)
    assert result.outcome is GroupOutcome.COMPLETE
    assert result.replaced_sessions == (lost.name,)
    assert lost.name in result.excluded_sessions
    assert set(result.sessions) == {kept.name, replacement.name}


async def test_a_retryable_abort_is_replaced(live: SessionRouterClient) -> None:
    started = await live.start_group(
        "t", 2, group_id="retry", options=GroupOptions(replace_lost=True)
    )
    first = started.sessions[0]
    aborted = await live.abort_session(first.name, reason="oom", retryable=True)
    assert aborted.replaced_by
    group = await live.get_group("retry")
    assert [m.replaces for m in group.members] == ["", "", first.name]


async def test_filter_metric_makes_a_group_degenerate_and_the_feed_can_skip_it(
    live: SessionRouterClient,
) -> None:
    same = (await live.start_group("t", 2, group_id="all-passed")).sessions
    mixed = (await live.start_group("t", 2, group_id="one-passed")).sessions
    # Shaped rewards differ, raw outcomes equal: degenerate. The other way round: not.
    first = await live.submit_rewards(
        {same[0].name: 0.3, same[1].name: 0.8},
        filter_metrics={same[0].name: 1.0, same[1].name: 1.0},
    )
    second = await live.submit_rewards(
        {mixed[0].name: 0.5, mixed[1].name: 0.5},
        filter_metrics={mixed[0].name: 1.0, mixed[1].name: 0.0},
    )
    assert all(r.ok for r in first.results + second.results)
    (degenerate,), (useful,) = first.group_results, second.group_results
    assert degenerate.degenerate and degenerate.filter_metrics == (1.0, 1.0)
    assert any(a != 0.0 for a in degenerate.advantages)  # the rewards still differ
    assert not useful.degenerate and useful.filter_metrics == (1.0, 0.0)
    assert (await live.get_session(same[0].name)).filter_metric == 1.0

    skipped: list[tuple[int, int]] = []
    feed = live.subscribe_groups(
        skip_degenerate=True, on_skipped=lambda count, cursor: skipped.append((count, cursor))
    )
    async with contextlib.aclosing(feed):
        delivered = await asyncio.wait_for(anext(feed), 5)
    assert delivered.group_id == "one-passed"
    # One group left out, covered by a message that reaches at least its cursor.
    assert [count for count, _ in skipped] == [1]
    assert skipped[0][1] >= degenerate.cursor
