"""A trainer's feed through restarts and a proxy cut: every group, exactly once.

The router runs as a real process with a journal, behind a real nginx whose read timeout
(2 s) is shorter than the router's keepalive (30 s by default), so an idle feed stream is cut
by the proxy (INTERNAL, RST_STREAM). Two subscribers follow the feed through the proxy with the
typed client, one from ``after_cursor=0`` and one ``from_latest``; the router is restarted
three times on the same port and the feed is left idle past the proxy's timeout once. Each
subscriber must receive every group finalized after its start exactly once, in cursor order.
The producer's rewards go over one reward stream, which reopens itself after each restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import grpc
import pytest

from sessionrouter.client import (
    GroupResult,
    RewardStream,
    SessionRouterClient,
    SessionRouterError,
)
from tests.integration.processes import router_behind_nginx

READ_TIMEOUT_S = 2.0

pytestmark = pytest.mark.slow


class Follower:
    """Consumes one subscription in a task and records what arrived and every retry."""

    def __init__(self, client: SessionRouterClient, **kwargs: object) -> None:
        self.results: list[GroupResult] = []
        self.retries: list[tuple[grpc.StatusCode | None, int]] = []
        self._feed = client.subscribe_groups(on_retry=self._on_retry, **kwargs)  # type: ignore[arg-type]
        self._task = asyncio.create_task(self._run())

    def _on_retry(
        self, failures: int, error: SessionRouterError, delay: float, cursor: int
    ) -> None:
        self.retries.append((error.code, cursor))

    async def _run(self) -> None:
        async for result in self._feed:
            self.results.append(result)

    async def until(self, count: int, within: float = 60) -> None:
        deadline = time.monotonic() + within
        while len(self.results) < count:
            if self._task.done():
                self._task.result()  # raises what ended the feed
            assert time.monotonic() < deadline, f"{len(self.results)} of {count} groups arrived"
            await asyncio.sleep(0.02)

    async def until_retry(self, cursor: int, within: float = 60) -> None:
        """Waits for a retry that resumes after ``cursor``."""
        deadline = time.monotonic() + within
        while not any(c == cursor for _, c in self.retries):
            assert time.monotonic() < deadline, f"no retry after cursor {cursor}: {self.retries}"
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self._feed.aclose()


async def produce(
    client: SessionRouterClient, stream: RewardStream, tag: str, count: int
) -> list[str]:
    """Starts and rewards ``count`` groups of two; returns their ids in finalization order.
    The rewards go over one reward stream that lives through every restart."""
    ids = []
    for i in range(count):
        started = await client.start_group("prompt", 2, group_id=f"{tag}-{i}")
        results = await stream.submit_many(
            [(s.name, float(j)) for j, s in enumerate(started.sessions)]
        )
        assert all(r.ok for r in results)
        ids.append(started.group_id)
    return ids


async def test_feed_survives_three_restarts_and_a_proxy_cut(tmp_path: Path) -> None:
    with router_behind_nginx(tmp_path, READ_TIMEOUT_S) as (router, nginx):
        async with (
            SessionRouterClient.connect(nginx.target) as client,
            client.reward_stream(keep_results=False) as stream,
        ):
            produced = await produce(client, stream, "p0", 2)
            everything = Follower(client, after_cursor=0)
            await everything.until(2)
            latest = Follower(client, from_latest=True)
            await asyncio.sleep(0.5)  # its stream is open: it starts after cursor 2

            router.restart()
            await everything.until_retry(2)
            # The from_latest subscriber resumes after the cursor the router named (2), not
            # "from latest" again: the groups made while it is away cannot be skipped.
            await latest.until_retry(2)
            produced += await produce(client, stream, "p1", 3)
            await everything.until(5)
            await latest.until(3)

            # Idle past nginx's read timeout: the proxy resets both streams (INTERNAL).
            await asyncio.sleep(READ_TIMEOUT_S * 1.75)
            produced += await produce(client, stream, "p2", 2)
            await everything.until(7)
            await latest.until(5)
            for follower in (everything, latest):
                assert grpc.StatusCode.INTERNAL in [code for code, _ in follower.retries]

            for tag in ("p3", "p4"):
                router.restart()
                for follower in (everything, latest):
                    # Each sees this restart (its stream was open), and resumes after it.
                    await follower.until_retry(len(produced))
                produced += await produce(client, stream, tag, 2)
                await everything.until(len(produced))
                await latest.until(len(produced) - 2)
            await asyncio.sleep(0.3)  # nothing more may arrive
            await everything.close()
            await latest.close()

    assert router.starts == 4
    assert [r.cursor for r in everything.results] == list(range(1, 12))
    assert [r.group_id for r in everything.results] == produced
    assert [r.cursor for r in latest.results] == list(range(3, 12))
    assert [r.group_id for r in latest.results] == produced[2:]
    for follower in (everything, latest):
        # Every restart ended the stream with UNAVAILABLE (the drain), after cursors 2, 7, 9.
        drained = {c for code, c in follower.retries if code is grpc.StatusCode.UNAVAILABLE}
        assert {2, 7, 9} <= drained, follower.retries
