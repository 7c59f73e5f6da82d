"""``subscribe_groups`` over the fake channel: resuming, reconnecting, giving up, errors.

The test plays the router's side of SubscribeGroups with grpcio-testing's unary-stream fixture
through ``FakeAioChannel``; see ``test_client_unary`` for how the sync fake drives the client.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from google.rpc import error_details_pb2

from sessionrouter.client import (
    GroupResult,
    InternalError,
    OutOfRangeError,
    SessionRouterClient,
    SessionRouterError,
    UnavailableError,
)
from sessionrouter.client._feed import AFTER_CURSOR_HEADER
from sessionrouter.v1 import resources_pb2 as rpb
from sessionrouter.v1 import session_service_pb2 as spb

from ._fake_channel import FakeAioChannel, status_trailer

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


def groups(*cursors: int) -> spb.SubscribeGroupsResponse:
    return spb.SubscribeGroupsResponse(
        groups=[rpb.GroupResult(cursor=c, group_id=f"g{c}") for c in cursors]
    )


async def take(
    fake: FakeAioChannel, after: int | None = None
) -> tuple[spb.SubscribeGroupsRequest, object]:
    """The next SubscribeGroups call; its headers name ``after`` as the router does (no
    headers value at all, as an older router, when ``after`` is None)."""
    _, request, rpc = await fake.take_unary_stream("SubscribeGroups")
    header = () if after is None else ((AFTER_CURSOR_HEADER, str(after)),)
    rpc.send_initial_metadata(header)
    return request, rpc


def shutting_down(cursor: int, delay_s: float) -> tuple[tuple[str, str | bytes], ...]:
    """The trailer of a feed stream the router ended because it drains."""
    info = error_details_pb2.ErrorInfo(
        reason="SHUTTING_DOWN", domain="sessionrouter.dev", metadata={"cursor": str(cursor)}
    )
    retry = error_details_pb2.RetryInfo()
    retry.retry_delay.FromNanoseconds(int(delay_s * 1e9))
    return status_trailer(UNAVAILABLE, "shutting down", info, retry)


class Retries:
    """Records what ``on_retry`` was told."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, grpc.StatusCode | None, float, int]] = []

    def __call__(self, failures: int, error: SessionRouterError, delay: float, cursor: int) -> None:
        self.calls.append((failures, error.code, delay, cursor))


class Trainer:
    """Consumes a subscription; lets the router side wait until messages were read.

    grpcio-testing's fake drops responses not yet read when the RPC is terminated (a real
    channel delivers them before the status), so the router side waits for the reads before
    ending a stream.
    """

    def __init__(self, client: SessionRouterClient) -> None:
        self.client = client
        self.results: list[GroupResult] = []
        self._read = asyncio.Condition()

    async def first(self, n: int, **kwargs: object) -> list[GroupResult]:
        """The first ``n`` results of a subscription, which is then closed."""
        feed = self.client.subscribe_groups(**kwargs)  # type: ignore[arg-type]
        async with contextlib.aclosing(feed):
            async for result in feed:
                async with self._read:
                    self.results.append(result)
                    self._read.notify_all()
                if len(self.results) == n:
                    break
        return self.results

    async def has_read(self, n: int) -> None:
        async with self._read:
            await self._read.wait_for(lambda: len(self.results) >= n)


async def test_resumes_after_the_last_delivered_cursor(
    fake: FakeAioChannel, client: SessionRouterClient
) -> None:
    trainer = Trainer(client)

    async def router() -> list[spb.SubscribeGroupsRequest]:
        one, rpc = await take(fake, 5)
        rpc.send_response(groups(6, 7))  # type: ignore[attr-defined]
        await trainer.has_read(2)
        rpc.terminate((), UNAVAILABLE, "router restarting")  # type: ignore[attr-defined]
        two, rpc = await take(fake, 7)
        rpc.send_response(groups(7, 8))  # type: ignore[attr-defined]  # 7 again: not twice
        await fake.in_thread(rpc.cancelled)  # type: ignore[attr-defined]
        return [one, two]

    results, requests = await asyncio.gather(trainer.first(3, after_cursor=5), router())
    assert [r.cursor for r in results] == [6, 7, 8]
    assert [(r.after_cursor, r.from_latest) for r in requests] == [(5, False), (7, False)]
    assert requests[0] == spb.SubscribeGroupsRequest(after_cursor=5)


async def test_a_stream_the_router_ends_is_resumed_too(
    fake: FakeAioChannel, client: SessionRouterClient
) -> None:
    trainer = Trainer(client)

    async def router() -> int:
        _, rpc = await take(fake, 0)
        rpc.send_response(groups(1))  # type: ignore[attr-defined]
        await trainer.has_read(1)
        rpc.terminate((), grpc.StatusCode.OK, "")  # type: ignore[attr-defined]
        request, rpc = await take(fake, 1)
        rpc.send_response(groups(2))  # type: ignore[attr-defined]
        await fake.in_thread(rpc.cancelled)  # type: ignore[attr-defined]
        return request.after_cursor

    results, resumed_from = await asyncio.gather(trainer.first(2), router())
    assert [r.group_id for r in results] == ["g1", "g2"]
    assert resumed_from == 1


async def test_from_latest_resumes_from_the_cursor_the_router_named(
    fake: FakeAioChannel, client: SessionRouterClient
) -> None:
    """The first stream, from latest, starts after cursor 40 and is lost before any group:
    the reconnect asks for the groups after 40, so 41 (finalized meanwhile) is not skipped."""
    trainer = Trainer(client)

    async def router() -> list[spb.SubscribeGroupsRequest]:
        one, rpc = await take(fake, 40)
        rpc.terminate((), UNAVAILABLE, "restart")  # type: ignore[attr-defined]
        two, rpc = await take(fake, 40)
        rpc.send_response(groups(41))  # type: ignore[attr-defined]
        await trainer.has_read(1)
        rpc.terminate((), UNAVAILABLE, "restart")  # type: ignore[attr-defined]
        three, rpc = await take(fake, 41)
        rpc.send_response(groups(42))  # type: ignore[attr-defined]
        await fake.in_thread(rpc.cancelled)  # type: ignore[attr-defined]
        return [one, two, three]

    results, requests = await asyncio.gather(trainer.first(2, from_latest=True), router())
    assert [r.cursor for r in results] == [41, 42]
    assert [(r.after_cursor, r.from_latest) for r in requests] == [
        (0, True),
        (40, False),
        (41, False),
    ]


async def test_from_latest_without_the_header_holds_until_the_first_group(
    fake: FakeAioChannel, client: SessionRouterClient
) -> None:
    """An older router names no cursor: "from latest" is all the client can ask again."""
    trainer = Trainer(client)

    async def router() -> list[spb.SubscribeGroupsRequest]:
        one, rpc = await take(fake)
        rpc.terminate((), UNAVAILABLE, "blip")  # type: ignore[attr-defined]
        two, rpc = await take(fake)
        rpc.send_response(groups(40))  # type: ignore[attr-defined]
        await trainer.has_read(1)
        rpc.terminate((), UNAVAILABLE, "blip")  # type: ignore[attr-defined]
        three, rpc = await take(fake)
        rpc.send_response(groups(41))  # type: ignore[attr-defined]
        await fake.in_thread(rpc.cancelled)  # type: ignore[attr-defined]
        return [one, two, three]

    _, requests = await asyncio.gather(trainer.first(2, from_latest=True), router())
    assert [(r.after_cursor, r.from_latest) for r in requests] == [
        (0, True),
        (0, True),
        (40, False),
    ]


async def test_a_proxy_reset_is_a_reconnect_but_the_routers_internal_is_raised(
    fake: FakeAioChannel, client: SessionRouterClient
) -> None:
    """INTERNAL without details is what nginx's RST_STREAM looks like; one with an ErrorInfo
    is the router's own answer."""
    info = error_details_pb2.ErrorInfo(reason="BUG", domain="sessionrouter.dev")
    internal = grpc.StatusCode.INTERNAL

    async def router() -> None:
        _, rpc = await take(fake, 3)
        rpc.terminate((), internal, "Received RST_STREAM with error code 2")  # type: ignore[attr-defined]
        _, rpc = await take(fake, 3)
        rpc.terminate(status_trailer(internal, "broken", info), internal, "broken")  # type: ignore[attr-defined]

    retries = Retries()
    feed = client.subscribe_groups(after_cursor=3, on_retry=retries)
    with pytest.raises(InternalError, match="broken"):
        await asyncio.gather(anext(feed), router())
    await feed.aclose()
    assert [(n, code, cursor) for n, code, _, cursor in retries.calls] == [(1, internal, 3)]


async def test_a_drained_stream_reconnects_after_the_retry_delay(
    fake: FakeAioChannel, client: SessionRouterClient
) -> None:
    trainer = Trainer(client)

    async def router() -> spb.SubscribeGroupsRequest:
        _, rpc = await take(fake, 0)
        rpc.send_response(groups(1))  # type: ignore[attr-defined]
        await trainer.has_read(1)
        rpc.terminate(shutting_down(1, 0.05), UNAVAILABLE, "shutting down")  # type: ignore[attr-defined]
        request, rpc = await take(fake, 1)
        rpc.send_response(groups(2))  # type: ignore[attr-defined]
        await fake.in_thread(rpc.cancelled)  # type: ignore[attr-defined]
        return request

    retries = Retries()
    results, request = await asyncio.gather(trainer.first(2, on_retry=retries), router())
    assert [r.cursor for r in results] == [1, 2]
    assert request.after_cursor == 1
    ((failures, code, delay, cursor),) = retries.calls
    assert (failures, code, cursor) == (1, UNAVAILABLE, 1)
    assert 0.05 <= delay <= 0.05 * 1.2 + 1e-9  # RetryInfo, plus at most 20% jitter


async def test_out_of_range_is_raised_with_the_oldest_cursor(
    fake: FakeAioChannel, client: SessionRouterClient
) -> None:
    code = grpc.StatusCode.OUT_OF_RANGE
    info = error_details_pb2.ErrorInfo(reason="CURSOR_EXPIRED", metadata={"oldest_cursor": "100"})

    async def router() -> None:
        _, _, rpc = await fake.take_unary_stream("SubscribeGroups")
        rpc.terminate(status_trailer(code, "cursor 3 expired", info), code, "cursor 3 expired")

    with pytest.raises(OutOfRangeError) as caught:
        await asyncio.gather(Trainer(client).first(1, after_cursor=3), router())
    assert caught.value.metadata == {"oldest_cursor": "100"}


async def test_never_gives_up_by_default(fake: FakeAioChannel, client: SessionRouterClient) -> None:
    """Far more failed connections than the retry policy's max_attempts (3 here)."""
    failures = 12

    async def router() -> None:
        for _ in range(failures):
            _, _, rpc = await fake.take_unary_stream("SubscribeGroups")
            rpc.terminate((), UNAVAILABLE, "connection refused")
        _, rpc = await take(fake, 0)
        rpc.send_response(groups(1))  # type: ignore[attr-defined]
        await fake.in_thread(rpc.cancelled)  # type: ignore[attr-defined]

    retries = Retries()
    results, _ = await asyncio.gather(Trainer(client).first(1, on_retry=retries), router())
    assert [r.cursor for r in results] == [1]
    assert [n for n, *_ in retries.calls] == list(range(1, failures + 1))


async def test_gives_up_after_consecutive_failed_connections(
    fake: FakeAioChannel, client: SessionRouterClient
) -> None:
    """``max_failed_connections`` counts failures in a row: a connection whose headers
    arrived (the router answered) starts the count again. No clock is involved."""

    async def router() -> None:
        for answered in (False, True, False):
            if answered:
                _, rpc = await take(fake, 0)
            else:
                _, _, rpc = await fake.take_unary_stream("SubscribeGroups")
            rpc.terminate((), UNAVAILABLE, "down")  # type: ignore[attr-defined]

    retries = Retries()
    trainer = Trainer(client)
    with pytest.raises(UnavailableError, match="down") as caught:
        await asyncio.gather(trainer.first(1, max_failed_connections=2, on_retry=retries), router())
    # Failure 1, then an answered connection lost (1 again), then 2 in a row: given up.
    assert [n for n, *_ in retries.calls] == [1, 1]
    assert any("2 failed connection" in note for note in caught.value.__notes__)


async def test_skip_degenerate_is_asked_for_counted_and_resumed_past(
    fake: FakeAioChannel, client: SessionRouterClient
) -> None:
    trainer = Trainer(client)
    skipped: list[tuple[int, int]] = []
    both_skips = asyncio.Event()

    def on_skipped(count: int, last_cursor: int) -> None:
        skipped.append((count, last_cursor))
        if len(skipped) == 2:
            both_skips.set()

    async def router() -> list[spb.SubscribeGroupsRequest]:
        one, rpc = await take(fake, 0)
        send = rpc.send_response  # type: ignore[attr-defined]
        send(
            spb.SubscribeGroupsResponse(
                groups=groups(2).groups, skipped_degenerate=1, last_cursor=2
            )
        )
        await trainer.has_read(1)
        # Only skipped, by both filters: on_skipped hears them together.
        send(spb.SubscribeGroupsResponse(skipped_degenerate=1, skipped_groups=2, last_cursor=6))
        async with asyncio.timeout(5):  # read before the end, as on a real channel
            await both_skips.wait()
        rpc.terminate((), UNAVAILABLE, "router restarting")  # type: ignore[attr-defined]
        two, rpc = await take(fake, 6)
        rpc.send_response(spb.SubscribeGroupsResponse(groups=groups(7).groups, last_cursor=7))  # type: ignore[attr-defined]
        await fake.in_thread(rpc.cancelled)  # type: ignore[attr-defined]
        return [one, two]

    results, requests = await asyncio.gather(
        trainer.first(2, skip_degenerate=True, min_version=5, on_skipped=on_skipped),
        router(),
    )
    assert [r.cursor for r in results] == [2, 7]
    assert skipped == [(1, 2), (3, 6)]
    # The reconnect resumes after the skipped groups, and still asks to skip.
    assert [(r.after_cursor, r.skip_degenerate, r.min_version) for r in requests] == [
        (0, True, 5),
        (6, True, 5),
    ]
