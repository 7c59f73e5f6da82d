"""The filter metric beside the reward, through gRPC: degenerate from the raw outcome, the
result carries the metrics, the feed can skip degenerate groups and counts them."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from pathlib import Path

from sessionrouter.server.core.clock import ManualClock
from sessionrouter.v1 import session_service_pb2 as spb
from tests.integration.test_journal import restart, start_durable
from tests.integration.test_placement_policies import register
from tests.support import Harness, read_feed, stop_harness


def entry(session: str, reward: float, metric: float | None) -> spb.RewardEntry:
    msg = spb.RewardEntry(session=session, reward=reward)
    if metric is not None:
        msg.filter_metric = metric
    return msg


async def submit(
    h: Harness, *requests: list[spb.RewardEntry]
) -> tuple[list[spb.RewardAck], list[spb.SubmitRewardsResponse]]:
    """Sends the requests on one stream, half-closes, and reads everything back."""

    async def produce() -> AsyncIterator[spb.SubmitRewardsRequest]:
        for i, entries in enumerate(requests):
            yield spb.SubmitRewardsRequest(entries=entries, sequence=i + 1)

    responses = [r async for r in h.sessions.SubmitRewards(produce())]
    return [r.ack for r in responses if r.HasField("ack")], responses


async def two_groups(h: Harness) -> tuple[list[str], list[str]]:
    names = []
    for gid in ("same", "mixed"):
        reply = await h.sessions.StartGroup(
            spb.StartGroupRequest(task_id="t", group_size=2, group_id=gid)
        )
        names.append([m.name for m in reply.group.members])
    return names[0], names[1]


async def test_degenerate_follows_the_filter_metric_not_the_reward(harness: Harness) -> None:
    await register(harness, 2)
    same, mixed = await two_groups(harness)
    # Shaped rewards differ but both passed: degenerate. Rewards equal, outcomes differ: not.
    await submit(
        harness,
        [entry(same[0], 0.3, 1.0), entry(same[1], 0.8, 1.0)],
        [entry(mixed[0], 0.5, 1.0), entry(mixed[1], 0.5, 0.0)],
    )
    harness.reduce()
    results = {g.group_id: g for g in await read_feed(harness, 0, 2)}
    assert results["same"].degenerate and list(results["same"].filter_metrics) == [1.0, 1.0]
    assert any(a != 0.0 for a in results["same"].advantages)
    assert not results["mixed"].degenerate
    assert list(results["mixed"].filter_metrics) == [1.0, 0.0]
    assert harness.server.router.snapshot().groups_degenerate == 1
    session = (await harness.sessions.GetSession(spb.GetSessionRequest(session=same[0]))).session
    assert session.filter_metric == 1.0


async def test_without_metrics_degenerate_is_from_rewards(harness: Harness) -> None:
    await register(harness, 2)
    same, _ = await two_groups(harness)
    await submit(harness, [entry(same[0], 0.3, 1.0), entry(same[1], 0.8, None)])
    harness.reduce()
    (result,) = await read_feed(harness, 0, 1)
    assert not result.degenerate and not result.filter_metrics


async def test_bad_metrics_get_their_own_status(harness: Harness) -> None:
    await register(harness, 2)
    same, _ = await two_groups(harness)
    acks, _ = await submit(
        harness,
        [entry(same[0], 1.0, math.nan)],
        [entry(same[0], 1.0, 1.0)],
        [entry(same[0], 1.0, 0.0), entry(same[0], 1.0, 1.0)],
    )
    statuses = [[r.status for r in a.results] for a in acks]
    assert statuses == [
        [spb.REWARD_STATUS_NOT_FINITE],
        [spb.REWARD_STATUS_ACCEPTED],
        [spb.REWARD_STATUS_CONFLICT, spb.REWARD_STATUS_DUPLICATE],
    ]


async def test_the_feed_skips_degenerate_groups_on_request_and_counts_them(
    harness: Harness,
) -> None:
    await register(harness, 2)
    same, mixed = await two_groups(harness)
    await submit(
        harness,
        [entry(same[0], 0.3, 1.0), entry(same[1], 0.8, 1.0)],
        [entry(mixed[0], 0.5, 1.0), entry(mixed[1], 0.5, 0.0)],
    )
    harness.reduce()
    await read_feed(harness, 0, 2)  # both published
    call = harness.sessions.SubscribeGroups(spb.SubscribeGroupsRequest(skip_degenerate=True))
    kept: list[str] = []
    skipped = 0
    async for message in call:
        kept += [g.group_id for g in message.groups]
        skipped += message.skipped_degenerate
        if message.last_cursor == 2:
            break
    call.cancel()
    assert kept == ["mixed"] and skipped == 1


async def test_filter_metrics_survive_a_restart(tmp_path: Path) -> None:
    h = await start_durable(tmp_path, ManualClock())
    try:
        await register(h, 2)
        same, mixed = await two_groups(h)
        await submit(h, [entry(same[0], 0.3, 1.0), entry(same[1], 0.8, 1.0)])
        await submit(h, [entry(mixed[0], 0.5, 1.0)])  # open group, metric in a session row
        h.reduce()
        await read_feed(h, 0, 1)
        h = await restart(h, tmp_path)
        (result,) = await read_feed(h, 0, 1)
        assert result.degenerate and list(result.filter_metrics) == [1.0, 1.0]
        session = (await h.sessions.GetSession(spb.GetSessionRequest(session=mixed[0]))).session
        assert session.filter_metric == 1.0
    finally:
        await stop_harness(h)
