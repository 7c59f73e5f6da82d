"""SubmitRewards, the completed-group feed and incomplete groups, against a real server."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Sequence

import grpc
import numpy as np
import pytest
from google.protobuf.duration_pb2 import Duration

from sessionrouter.server.core.router import RouterSettings
from sessionrouter.v1 import resources_pb2 as pb
from sessionrouter.v1 import session_service_pb2 as spb
from sessionrouter.v1 import worker_service_pb2 as wpb
from tests.support import Harness, details_of, read_feed, start_harness, stop_harness

S = spb  # short alias for statuses below


async def make_group(
    h: Harness, group_id: str, size: int, options: pb.GroupOptions | None = None
) -> list[str]:
    reply = await h.sessions.StartGroup(
        spb.StartGroupRequest(
            task_id="prompt", group_id=group_id, group_size=size, group_options=options
        )
    )
    return [m.name for m in reply.group.members]


async def register_pool(h: Harness, n: int = 8) -> None:
    for i in range(n):
        await h.workers.RegisterWorker(
            wpb.RegisterWorkerRequest(worker_id=f"w{i}", address=f"10.0.0.{i}:1", capacity=64)
        )


class RewardClient:
    """One open SubmitRewards stream: send requests; read acks and group results apart.

    Checks on the way the ordering the contract promises: acks in request order, and within
    a message the group results after its ack."""

    def __init__(self, h: Harness) -> None:
        self._out: asyncio.Queue[spb.SubmitRewardsRequest | None] = asyncio.Queue()
        self.call = h.sessions.SubmitRewards(self._requests())
        self._seq = 0
        self._acks: list[spb.RewardAck] = []
        self._results: list[pb.GroupResult] = []
        self.messages = 0

    async def _requests(self) -> AsyncIterator[spb.SubmitRewardsRequest]:
        while (item := await self._out.get()) is not None:
            yield item

    async def send(self, entries: Sequence[tuple[str, float]]) -> int:
        self._seq += 1
        await self._out.put(
            spb.SubmitRewardsRequest(
                entries=[spb.RewardEntry(session=s, reward=r) for s, r in entries],
                sequence=self._seq,
            )
        )
        return self._seq

    def _take(self, response: spb.SubmitRewardsResponse) -> None:
        self.messages += 1
        if response.HasField("ack"):
            expected = self._acks[-1].sequence + 1 if self._acks else 1
            assert response.ack.sequence == expected
            self._acks.append(response.ack)
        self._results += response.group_results

    async def _read_one(self) -> None:
        response = await asyncio.wait_for(self.call.read(), 5)
        assert isinstance(response, spb.SubmitRewardsResponse)
        self._take(response)

    async def ack(self) -> spb.RewardAck:
        """The next ack not yet returned."""
        while not self._acks or self._acks[-1].sequence <= self._acked:
            await self._read_one()
        self._acked += 1
        return next(a for a in self._acks if a.sequence == self._acked)

    _acked = 0

    async def results(self, count: int) -> list[pb.GroupResult]:
        """The next ``count`` group results not yet returned."""
        while len(self._results) < count:
            await self._read_one()
        taken, self._results = self._results[:count], self._results[count:]
        return taken

    async def close(self) -> tuple[int, int]:
        """Half-closes and reads to the end; returns (acks, results) that were still unread."""
        await self._out.put(None)
        while isinstance(
            response := await asyncio.wait_for(self.call.read(), 5), spb.SubmitRewardsResponse
        ):
            self._take(response)
        assert response is grpc.aio.EOF
        return (len(self._acks) - self._acked, len(self._results))


async def test_every_entry_gets_its_own_result_and_bad_ones_change_nothing(
    harness: Harness,
) -> None:
    await register_pool(harness)
    a = await make_group(harness, "a", 3)
    b = await make_group(harness, "b", 2)
    await harness.sessions.AbortSession(spb.AbortSessionRequest(session=b[1]))
    stream = RewardClient(harness)
    seq = await stream.send(
        [
            (a[0], 1.0),
            (a[0], 1.0),  # same reward again
            (a[0], 0.5),  # another reward for a rewarded session
            (a[1], math.nan),
            (a[1], math.inf),
            ("groups/zzz/sessions/0", 1.0),
            ("not a name", 1.0),
            ("groups/a/sessions/7", 1.0),
            (b[1], 1.0),  # aborted
        ]
    )
    ack = await stream.ack()
    assert ack.sequence == seq
    assert [r.status for r in ack.results] == [
        S.REWARD_STATUS_ACCEPTED,
        S.REWARD_STATUS_DUPLICATE,
        S.REWARD_STATUS_CONFLICT,
        S.REWARD_STATUS_NOT_FINITE,
        S.REWARD_STATUS_NOT_FINITE,
        S.REWARD_STATUS_UNKNOWN_SESSION,
        S.REWARD_STATUS_UNKNOWN_SESSION,
        S.REWARD_STATUS_UNKNOWN_SESSION,
        S.REWARD_STATUS_SESSION_ABORTED,
    ]
    assert ack.results[0].detail == "" and all(r.detail for r in ack.results[1:])
    looked_up = await harness.sessions.GetSession(spb.GetSessionRequest(session=a[0]))
    assert looked_up.session.reward == 1.0
    assert (
        await harness.sessions.GetSession(spb.GetSessionRequest(session=a[1]))
    ).session.state == pb.SESSION_STATE_OPEN
    # The stream survived every bad entry and keeps working.
    await stream.send([(a[1], 0.0), (a[2], 0.0)])
    assert [r.status for r in (await stream.ack()).results] == [S.REWARD_STATUS_ACCEPTED] * 2
    (result,) = await stream.results(1)
    assert result.group_id == "a" and result.outcome == pb.GROUP_OUTCOME_COMPLETE
    assert await stream.close() == (0, 0)


async def test_completed_group_comes_back_with_grpo_advantages(harness: Harness) -> None:
    await register_pool(harness)
    names = await make_group(harness, "g", 4)
    stream = RewardClient(harness)
    await stream.send([(names[i], r) for i, r in enumerate([1.0, 0.0, 0.0, 1.0])])
    await stream.ack()
    (result,) = await stream.results(1)
    rewards = np.array([1.0, 0.0, 0.0, 1.0])
    expected = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6)
    assert list(result.sessions) == names
    np.testing.assert_allclose(result.advantages, expected, rtol=0, atol=1e-12)
    assert result.mean == 0.5
    assert result.std == pytest.approx(rewards.std(ddof=1), abs=1e-15)
    assert result.estimator.name == "grpo" and result.estimator.ddof == 1
    assert not result.degenerate and result.cursor == 1
    await stream.close()


async def test_per_group_estimator_and_degenerate_groups(harness: Harness) -> None:
    await register_pool(harness)
    rloo = await make_group(
        harness, "rloo", 3, pb.GroupOptions(estimator=pb.EstimatorConfig(name="rloo"))
    )
    flat = await make_group(harness, "flat", 3)
    one = await make_group(harness, "one", 1)
    stream = RewardClient(harness)
    await stream.send(
        [
            (rloo[0], 1.0),
            (rloo[1], 2.0),
            (rloo[2], 3.0),
            (flat[0], 0.7),
            (flat[1], 0.7),
            (flat[2], 0.7),
            (one[0], 5.0),
        ]
    )
    await stream.ack()
    results = {r.group_id: r for r in await stream.results(3)}
    np.testing.assert_allclose(results["rloo"].advantages, [-1.5, 0.0, 1.5], atol=1e-12)
    assert list(results["flat"].advantages) == [0.0, 0.0, 0.0] and results["flat"].degenerate
    assert list(results["one"].advantages) == [0.0] and results["one"].degenerate
    assert results["one"].std == 0.0
    await stream.close()


async def test_rewards_from_several_streams_complete_a_group_once(harness: Harness) -> None:
    await register_pool(harness)
    names = await make_group(harness, "g", 4)
    first, second = RewardClient(harness), RewardClient(harness)
    await first.send([(names[0], 1.0), (names[1], 2.0)])
    await first.ack()
    await second.send([(names[2], 3.0), (names[3], 4.0)])
    await second.ack()
    (result,) = await second.results(1)  # the stream that completed it gets it
    assert result.group_id == "g"
    assert await first.close() == (0, 0)
    assert await second.close() == (0, 0)


async def test_half_close_right_after_last_reward_still_delivers_the_group(
    harness: Harness,
) -> None:
    await register_pool(harness)
    names = await make_group(harness, "g", 2)
    stream = RewardClient(harness)
    await stream.send([(names[0], 1.0), (names[1], 0.0)])
    assert await stream.close() == (1, 1)


async def test_too_many_entries_in_one_request_ends_the_stream_clearly(harness: Harness) -> None:
    stream = RewardClient(harness)
    await stream.send([("groups/g/sessions/0", 1.0)] * 4097)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stream.ack()
    details = details_of(info.value)
    assert details.code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.reason == "TOO_MANY_ENTRIES"


async def test_subscription_resumes_from_a_cursor_without_loss_or_duplicates(
    harness: Harness,
) -> None:
    await register_pool(harness)
    groups = [await make_group(harness, f"g{i}", 2) for i in range(6)]
    stream = RewardClient(harness)
    for names in groups[:3]:
        await stream.send([(names[0], 1.0), (names[1], 0.0)])
    first = await read_feed(harness, 0, 3)
    assert [g.cursor for g in first] == [1, 2, 3]
    # The trainer disconnects after cursor 2; three more groups finish meanwhile.
    for names in groups[3:]:
        await stream.send([(names[0], 1.0), (names[1], 0.0)])
    resumed = await read_feed(harness, 2, 4)
    assert [g.cursor for g in resumed] == [3, 4, 5, 6]
    assert [g.group_id for g in resumed] == ["g2", "g3", "g4", "g5"]
    await stream.close()


async def test_live_subscriber_receives_groups_as_they_finish(harness: Harness) -> None:
    await register_pool(harness)
    names = await make_group(harness, "live", 2)
    call = harness.sessions.SubscribeGroups(spb.SubscribeGroupsRequest(from_latest=True))
    stream = RewardClient(harness)
    await asyncio.sleep(0.05)
    await stream.send([(names[0], 1.0), (names[1], 0.0)])
    response = await asyncio.wait_for(call.read(), 5)
    assert isinstance(response, spb.SubscribeGroupsResponse)
    assert [g.group_id for g in response.groups] == ["live"]
    call.cancel()
    await stream.close()


async def test_cursor_ahead_of_the_feed_is_out_of_range(harness: Harness) -> None:
    call = harness.sessions.SubscribeGroups(spb.SubscribeGroupsRequest(after_cursor=99))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()
    details = details_of(info.value)
    assert details.code == grpc.StatusCode.OUT_OF_RANGE
    assert details.reason == "CURSOR_AHEAD_OF_FEED"


async def test_expired_cursor_is_out_of_range_with_the_oldest_cursor() -> None:
    h = await start_harness(RouterSettings(feed_retention=8))
    try:
        await register_pool(h)
        stream = RewardClient(h)
        for i in range(20):
            names = await make_group(h, f"g{i}", 1)
            await stream.send([(names[0], 1.0)])
            await stream.ack()
        h.reduce()
        call = h.sessions.SubscribeGroups(spb.SubscribeGroupsRequest(after_cursor=1))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.read()
        details = details_of(info.value)
        assert details.code == grpc.StatusCode.OUT_OF_RANGE
        assert details.reason == "CURSOR_EXPIRED"
        assert int(details.metadata["oldest_cursor"]) > 2
        await stream.close()
    finally:
        await stop_harness(h)


@pytest.fixture
async def silent_pool_harness() -> AsyncIterator[Harness]:
    """A router whose workers stay healthy without heartbeats for an hour: the deadline
    tests let minutes pass, and a group whose open members' workers were all lost would
    finish at once instead of at its deadline."""
    h = await start_harness(RouterSettings(heartbeat_timeout_s=3600.0))
    try:
        yield h
    finally:
        await stop_harness(h)


async def test_deadline_finalizes_partial_group_with_enough_members(
    silent_pool_harness: Harness,
) -> None:
    harness = silent_pool_harness
    await register_pool(harness)
    names = await make_group(harness, "p", 4, pb.GroupOptions(min_members=2))
    stream = RewardClient(harness)
    await stream.send([(names[0], 1.0), (names[1], 0.0), (names[2], 0.5)])
    await stream.ack()
    harness.clock.advance(599)
    assert harness.expire() == 0
    harness.clock.advance(2)
    assert harness.expire() == 1
    harness.reduce()
    (result,) = await read_feed(harness, 0, 1)
    assert result.outcome == pb.GROUP_OUTCOME_PARTIAL
    assert list(result.sessions) == names[:3]
    assert list(result.excluded_sessions) == [names[3]]
    np.testing.assert_allclose(result.advantages, [1.0, -1.0, 0.0], atol=1e-5)
    # A late reward for the excluded member is refused, and its slot was freed.
    await stream.send([(names[3], 1.0)])
    assert (await stream.ack()).results[0].status == S.REWARD_STATUS_GROUP_CLOSED
    workers = (await harness.workers.ListWorkers(wpb.ListWorkersRequest())).workers
    assert sum(w.open_sessions for w in workers) == 0
    group = (await harness.sessions.GetGroup(spb.GetGroupRequest(group_id="p"))).group
    assert group.state == pb.GROUP_STATE_FINALIZED and group.cursor == result.cursor
    await stream.close()


async def test_deadline_drops_group_with_too_few_members(silent_pool_harness: Harness) -> None:
    harness = silent_pool_harness
    await register_pool(harness)
    names = await make_group(
        harness, "d", 4, pb.GroupOptions(min_members=3, deadline=Duration(seconds=30))
    )
    stream = RewardClient(harness)
    await stream.send([(names[0], 1.0)])
    await stream.ack()
    harness.clock.advance(31)
    assert harness.expire() == 1
    harness.reduce()
    (result,) = await read_feed(harness, 0, 1)
    assert result.outcome == pb.GROUP_OUTCOME_DROPPED
    assert list(result.advantages) == []
    assert len(result.excluded_sessions) == 3
    group = (await harness.sessions.GetGroup(spb.GetGroupRequest(group_id="d"))).group
    assert group.state == pb.GROUP_STATE_DROPPED
    await stream.close()


async def test_aborted_members_leave_the_statistics(harness: Harness) -> None:
    await register_pool(harness)
    names = await make_group(harness, "ab", 4, pb.GroupOptions(min_members=2))
    await harness.sessions.AbortSession(spb.AbortSessionRequest(session=names[3]))
    stream = RewardClient(harness)
    await stream.send([(names[0], 3.0), (names[1], 1.0), (names[2], 2.0)])
    await stream.ack()
    (result,) = await stream.results(1)
    assert result.outcome == pb.GROUP_OUTCOME_PARTIAL
    assert list(result.excluded_sessions) == [names[3]]
    assert result.mean == 2.0
    await stream.close()


async def test_group_on_a_lost_worker_can_still_finish(harness: Harness) -> None:
    await register_pool(harness, 2)
    names = await make_group(harness, "lost", 2, pb.GroupOptions(min_members=1))
    member = (await harness.sessions.GetSession(spb.GetSessionRequest(session=names[1]))).session
    await harness.workers.DeregisterWorker(wpb.DeregisterWorkerRequest(worker_id=member.worker_id))
    stream = RewardClient(harness)
    await stream.send([(names[0], 1.0)])
    await stream.ack()
    harness.clock.advance(601)
    harness.expire()
    harness.reduce()
    (result,) = await read_feed(harness, 0, 1)
    assert result.outcome == pb.GROUP_OUTCOME_PARTIAL
    assert list(result.excluded_sessions) == [names[1]]
    assert result.degenerate  # one member: no baseline
    await stream.close()


async def test_groups_finishing_together_are_reduced_in_one_micro_batch() -> None:
    h = await start_harness(RouterSettings(reducer_window_s=0.05))
    try:
        await register_pool(h)
        groups = [await make_group(h, f"g{i}", 2) for i in range(20)]
        stream = RewardClient(h)
        batches_before = h.server.router.finalizer.batches
        await stream.send([(n, float(j)) for names in groups for j, n in enumerate(names)])
        await stream.ack()
        results = await stream.results(20)
        assert [r.cursor for r in results] == list(range(1, 21))
        # One micro-batch, so the twenty results travel in one message after the ack's.
        assert stream.messages <= 2
        assert h.server.router.finalizer.batches - batches_before == 1
        await stream.close()
    finally:
        await stop_harness(h)
