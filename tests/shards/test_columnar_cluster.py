"""The columnar form when a shard process dies: 3 journaled shard processes and NATS.

kill -9 of one shard: the handles of its sessions are UNAVAILABLE to the sharded client's
``submit_arrays`` (the arrays' other shards are served as usual), and the other shards never
serve them (WRONG_SHARD, the session untouched). Once the shard is back on its journal, the
same handles resolve to the same sessions, what was acknowledged before the kill is still
there (DUPLICATE), and the merged feed in columnar form has every group once, gapless.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from sessionrouter.client import (
    GroupResult,
    RetryPolicy,
    RewardStatus,
    SessionRouterClient,
    SessionState,
    UnavailableError,
)
from sessionrouter.client.shardmap import shard_of_handle
from sessionrouter.v1 import session_service_pb2 as spb
from sessionrouter.v1 import session_service_pb2_grpc as spb_grpc
from tests.shards.support import owned_group

from ._cluster import Cluster

N = 3
ONE_TRY = RetryPolicy(max_attempts=1)
PATIENT = RetryPolicy(max_attempts=1_000_000, initial_backoff=0.05, max_backoff=1.0)
"""Retries until the restarted shard answers, at most 1 s apart (the test's timeout bounds it):
20 attempts were about 5 s of waits, which a restart on a loaded machine can outlast."""
STATIC_WORKERS = tuple(f"--worker=w{i}=10.0.0.{i}:1,100000" for i in range(4))

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("columnar"), N, *STATIC_WORKERS)
    try:
        c.start()
        yield c
    finally:
        c.stop()
        print(c.logs())


async def test_kill9_makes_a_shards_handles_unavailable_never_served_elsewhere(
    cluster: Cluster,
) -> None:
    run = uuid.uuid4().hex[:6]
    down = 2
    async with SessionRouterClient.connect(
        cluster.addresses, retry_policy=ONE_TRY, default_timeout=10.0
    ) as client:
        groups = [
            await client.start_group("t", 2, group_id=owned_group(shard, N, f"c-{run}-{k}"))
            for k in range(2)
            for shard in range(N)
        ]
        first = np.array([g.sessions[0].handle for g in groups], dtype=np.uint64)
        second = np.array([g.sessions[1].handle for g in groups], dtype=np.uint64)
        assert [shard_of_handle(int(h)) for h in first] == [0, 1, 2] * 2
        async with client.reward_stream() as stream:
            ack = await stream.submit_arrays(first, np.ones(len(first)))
        assert ack.statuses.tolist() == [RewardStatus.ACCEPTED.value] * len(first)

        cluster.shards[down].kill9()
        with pytest.raises(UnavailableError):
            async with client.reward_stream(reconnect=False) as stream:
                await stream.submit_arrays(second, np.zeros(len(second)))
        # The other shards' entries were served; the dead shard's went nowhere else.
        for g in groups:
            if shard_of_handle(g.sessions[1].handle) != down:
                state = (await client.get_session(g.sessions[1].name)).state
                assert state is SessionState.REWARDED
        theirs = [int(h) for h in second if shard_of_handle(int(h)) == down]
        for alive in (0, 1):
            channel = client._routing.shard(alive).stubs.channel
            call = spb_grpc.SessionServiceStub(channel).SubmitRewards()
            await call.write(
                spb.SubmitRewardsRequest(
                    sequence=1, columns=spb.RewardColumns(handles=theirs, rewards=[0.0, 0.0])
                )
            )
            response = await asyncio.wait_for(call.read(), 5)
            assert isinstance(response, spb.SubmitRewardsResponse)
            assert list(response.ack.statuses) == [spb.REWARD_STATUS_WRONG_SHARD] * 2
            call.cancel()

    # Back on its journal: the same handles are the same sessions.
    cluster.shards[down].start()
    async with SessionRouterClient.connect(
        cluster.addresses, retry_policy=PATIENT, default_timeout=None
    ) as client:
        async with client.reward_stream() as stream:
            again = await stream.submit_arrays(
                np.concatenate([first, second]), np.concatenate([np.ones(6), np.zeros(6)])
            )
        expected = [RewardStatus.DUPLICATE.value] * 6 + [
            (
                RewardStatus.ACCEPTED if shard_of_handle(int(h)) == down else RewardStatus.DUPLICATE
            ).value
            for h in second
        ]
        assert again.statuses.tolist() == expected

        want = {g.group_id for g in groups}
        seen: list[GroupResult] = []
        feed = client.subscribe_result_batches()
        async with asyncio.timeout(60), contextlib.aclosing(feed):
            async for batch in feed:
                seen.extend(batch.groups)
                if want <= {g.group_id for g in seen}:
                    break
    cursors = [g.cursor for g in seen]
    assert cursors == list(range(1, len(cursors) + 1))
    assert sorted(g.group_id for g in seen) == sorted(want)
    assert all(g.rewards == (1.0, 0.0) for g in seen)
