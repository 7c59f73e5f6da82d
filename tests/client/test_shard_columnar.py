"""``ShardedRewardStream.submit_arrays``: the split by shard and the merge back, exactly.

Each shard's stream is a recording stand-in that answers its part with statuses derived from
the rewards it got, so the test sees which entries went where, in which order, and that the
packed statuses, ``detail_entries`` and ``details`` come back in the caller's order. (The same
calls against real shards are in ``tests/shards/test_columnar_shards.py``.)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Sequence
from types import TracebackType
from typing import Self, cast

import numpy as np
import numpy.typing as npt
import pytest

from sessionrouter.client import RewardStatus, RewardStream
from sessionrouter.client._shard_rewards import ShardedRewardStream, shards_of_entries
from sessionrouter.client._shards import ShardRouting, ShardStubs
from sessionrouter.client.shardmap import shard_of
from sessionrouter.client.types import GroupResult, ResultBatch, RewardAckBatch, RewardResult

from ._fake_channel import FakeAioChannel

N = 3


def handle(shard: int, seq: int, index: int) -> int:
    """A sharded router's handle (see the proto's ``Session.handle``)."""
    return (shard << 48) | (seq << 16) | index


class RecordingStream:
    """A shard's stream that records each ``submit_arrays`` part and answers it: NOT_FINITE
    for a negative reward (with a detail naming it), else ACCEPTED."""

    def __init__(self, shard: int) -> None:
        self.shard = shard
        self.parts: list[tuple[list[int], list[float], list[str] | None]] = []

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None

    def open(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def submit(self, session: str, reward: float, **_: object) -> RewardResult:
        raise AssertionError("not used")

    async def submit_many(self, rewards: Iterable[object]) -> list[RewardResult]:
        raise AssertionError("not used")

    async def submit_arrays(
        self,
        handles: npt.ArrayLike | None,
        rewards: npt.ArrayLike,
        *,
        sessions: Sequence[str] | None = None,
        **_: object,
    ) -> RewardAckBatch:
        values = np.asarray(rewards, dtype=np.float64)
        got = [] if handles is None else np.asarray(handles, dtype=np.uint64).tolist()
        self.parts.append((got, values.tolist(), None if sessions is None else list(sessions)))
        await asyncio.sleep(0.001 * (N - self.shard))  # answer out of shard order
        bad = np.flatnonzero(values < 0)
        statuses = np.full(len(values), RewardStatus.ACCEPTED.value, dtype=np.uint8)
        statuses[bad] = RewardStatus.NOT_FINITE.value
        return RewardAckBatch(
            statuses=statuses,
            detail_entries=bad.astype(np.int64),
            details=tuple(f"shard {self.shard}: {values[i]}" for i in bad.tolist()),
        )

    def watch_group(self, group_id: str) -> asyncio.Future[GroupResult]:
        raise AssertionError("not used")

    async def results(self) -> AsyncIterator[GroupResult]:
        return
        yield

    async def result_batches(self) -> AsyncIterator[ResultBatch]:
        return
        yield


@pytest.fixture
def routing() -> ShardRouting:
    return ShardRouting([ShardStubs.over(cast("object", FakeAioChannel())) for _ in range(N)])  # type: ignore[arg-type]


def owned(shard: int) -> str:
    k = 0
    while shard_of(f"g{k}", N) != shard:
        k += 1
    return f"g{k}"


async def test_arrays_are_split_by_the_handles_shard_and_merged_in_order(
    routing: ShardRouting,
) -> None:
    streams = {i: RecordingStream(i) for i in range(N)}
    sharded = ShardedRewardStream(
        routing, lambda shard, group: cast(RewardStream, streams[shard]), keep_results=False
    )
    handles = [handle(2, 9, 0), handle(0, 4, 1), handle(1, 5, 0), handle(0, 4, 0), handle(7, 1, 0)]
    rewards = [2.0, -0.5, 1.0, 0.0, -1.0]
    async with sharded:
        ack = await sharded.submit_arrays(np.array(handles, dtype=np.uint64), rewards)
    # Shard 7 of 3 does not exist: that entry goes to shard 0, which refuses it as any would.
    assert streams[0].parts == [([handles[1], handles[3], handles[4]], [-0.5, 0.0, -1.0], None)]
    assert streams[1].parts == [([handles[2]], [1.0], None)]
    assert streams[2].parts == [([handles[0]], [2.0], None)]
    accepted, refused = RewardStatus.ACCEPTED.value, RewardStatus.NOT_FINITE.value
    assert ack.statuses.tolist() == [accepted, refused, accepted, accepted, refused]
    assert ack.detail_entries.tolist() == [1, 4]
    assert ack.details == ("shard 0: -0.5", "shard 0: -1.0")


async def test_entries_by_name_go_by_their_group(routing: ShardRouting) -> None:
    streams = {i: RecordingStream(i) for i in range(N)}
    sharded = ShardedRewardStream(
        routing, lambda shard, group: cast(RewardStream, streams[shard]), keep_results=False
    )
    names = [f"groups/{owned(s)}/sessions/0" for s in (1, 2, 1)] + ["not-a-session-name"]
    async with sharded:
        ack = await sharded.submit_arrays(None, [1.0, 2.0, -3.0, 4.0], sessions=names)
    assert streams[1].parts == [([], [1.0, -3.0], [names[0], names[2]])]
    assert streams[2].parts == [([], [2.0], [names[1]])]
    assert streams[0].parts == [([], [4.0], [names[3]])]  # malformed: shard 0 refuses it
    assert ack.detail_entries.tolist() == [2]


def test_a_handle_goes_by_its_shard_bits_and_a_zero_handle_by_its_name(
    routing: ShardRouting,
) -> None:
    handles = np.array([handle(1, 3, 0), 0, handle(2, 1, 5)], dtype=np.uint64)
    names = ["", f"groups/{owned(2)}/sessions/1", ""]
    assert shards_of_entries(routing, handles, names, 3).tolist() == [1, 2, 2]


async def test_arrays_of_unequal_lengths_are_refused_before_anything_is_sent(
    routing: ShardRouting,
) -> None:
    streams = {i: RecordingStream(i) for i in range(N)}
    sharded = ShardedRewardStream(
        routing, lambda shard, group: cast(RewardStream, streams[shard]), keep_results=False
    )
    async with sharded:
        with pytest.raises(ValueError, match="one value per reward"):
            await sharded.submit_arrays(
                np.array([handle(0, 1, 0)], dtype=np.uint64),
                [1.0, 2.0],
                filter_metrics=[0.5, 0.5],
            )
        with pytest.raises(RuntimeError, match="without columnar_results"):
            async for _ in sharded.result_batches():
                pass
    assert all(not s.parts for s in streams.values())


def test_both_streams_implement_the_protocol(routing: ShardRouting) -> None:
    sharded = ShardedRewardStream(
        routing, lambda shard, group: cast(RewardStream, RecordingStream(shard)), keep_results=True
    )
    assert isinstance(sharded, RewardStream)
