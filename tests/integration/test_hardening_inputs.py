"""Bad input, each case through a real router: the status it gets, and that nothing changed.

Echoed values are cut so the trailers fit a default client; page tokens are validated;
payloads that are not the message (or hold invalid UTF-8) are INVALID_ARGUMENT, not UNKNOWN;
rewards whose group statistics could overflow are refused and never reach the feed.
"""

from __future__ import annotations

import base64
import math
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from sessionrouter.server.app import WorkerSpec
from sessionrouter.server.core.validation import MAX_REWARD_MAGNITUDE
from sessionrouter.v1 import resources_pb2 as pb
from sessionrouter.v1 import session_service_pb2 as spb
from sessionrouter.v1 import worker_service_pb2 as wpb
from tests.support import Harness, details_of, read_feed, start_harness, stop_harness

TRAILER_LIMIT = 8192
"""Default soft limit of a gRPC client on received metadata, bytes."""


@pytest.fixture
async def h() -> AsyncIterator[Harness]:
    harness = await start_harness(
        workers=tuple(WorkerSpec(f"w{i}", f"10.0.0.{i}:1", 64) for i in range(4))
    )
    try:
        yield harness
    finally:
        await stop_harness(harness)


def _trailer_bytes(error: grpc.aio.AioRpcError) -> int:
    metadata = error.trailing_metadata() or ()
    size = sum(len(k) + len(v) for k, v in metadata)
    return size + len((error.details() or "").encode())


async def _group_count(h: Harness) -> int:
    reply = await h.sessions.ListGroups(spb.ListGroupsRequest(page_size=1000))
    return len(reply.groups)


async def test_a_5000_character_worker_id_gets_the_routers_answer_with_small_trailers(
    h: Harness,
) -> None:
    """NOT_FOUND (no such worker) from the router, not the client's RESOURCE_EXHAUSTED."""
    for call in (
        h.workers.GetWorker(wpb.GetWorkerRequest(worker_id="x" * 5000)),
        h.workers.Heartbeat(wpb.HeartbeatRequest(worker_id="\U0001f600" * 5000)),
        h.workers.DrainWorker(wpb.DrainWorkerRequest(worker_id="é" * 5000)),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        found = details_of(info.value)
        assert found.code == grpc.StatusCode.NOT_FOUND, found
        assert found.reason == "WORKER_NOT_FOUND"
        assert "more characters" in found.message
        assert _trailer_bytes(info.value) < TRAILER_LIMIT // 2


async def test_a_100_kb_estimator_name_gets_invalid_argument_and_creates_nothing(
    h: Harness,
) -> None:
    request = spb.StartGroupRequest(
        task_id="t",
        group_size=2,
        group_options=pb.GroupOptions(estimator=pb.EstimatorConfig(name="\U0001f600" * 25_000)),
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await h.sessions.StartGroup(request)
    found = details_of(info.value)
    assert found.code == grpc.StatusCode.INVALID_ARGUMENT
    assert found.reason == "INVALID_ESTIMATOR"
    assert "more characters" in found.message
    assert _trailer_bytes(info.value) < TRAILER_LIMIT // 2
    assert await _group_count(h) == 0


def _token(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode()


@pytest.mark.parametrize(
    "token",
    [
        _token("groups:\u0663"),  # an Arabic-Indic digit: str.isdigit() says yes
        _token("groups:" + "9" * 5000),  # beyond int()'s digit limit
        _token("groups:" + "9" * 20),  # beyond 2**63
        _token("groups:007"),
        _token("groups:-1"),
        _token("workers:5"),  # another listing's token
        "not base64 at all!",
        "\u00e9" * 10,
        "A" * 100_000,
    ],
)
async def test_crafted_list_groups_page_tokens_get_invalid_argument(h: Harness, token: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await h.sessions.ListGroups(spb.ListGroupsRequest(page_token=token))
    assert details_of(info.value).code == grpc.StatusCode.INVALID_ARGUMENT
    assert details_of(info.value).reason == "INVALID_PAGE_TOKEN"


@pytest.mark.parametrize(
    "token", [_token("workers:a/b"), _token("workers:" + "w" * 200), _token("groups:w1")]
)
async def test_crafted_list_workers_page_tokens_get_invalid_argument(
    h: Harness, token: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await h.workers.ListWorkers(wpb.ListWorkersRequest(page_token=token))
    assert details_of(info.value).reason == "INVALID_PAGE_TOKEN"


async def test_page_tokens_the_router_hands_out_still_page(h: Harness) -> None:
    for _ in range(3):
        await h.sessions.StartGroup(spb.StartGroupRequest(task_id="t", group_size=1))
    first = await h.sessions.ListGroups(spb.ListGroupsRequest(page_size=2))
    rest = await h.sessions.ListGroups(
        spb.ListGroupsRequest(page_size=2, page_token=first.next_page_token)
    )
    assert len(first.groups) == 2 and len(rest.groups) == 1 and not rest.next_page_token
    workers = await h.workers.ListWorkers(wpb.ListWorkersRequest(page_size=3))
    more = await h.workers.ListWorkers(
        wpb.ListWorkersRequest(page_size=3, page_token=workers.next_page_token)
    )
    assert [w.worker_id for w in more.workers] == ["w3"]


@pytest.mark.parametrize(
    "payload",
    [
        b"\xff\xff\xff\xff",  # not protobuf
        b"\x0a\x02\xc3\x28",  # task_id (field 1) holding invalid UTF-8
        b"\x0a\x05",  # truncated
    ],
)
async def test_payloads_that_do_not_decode_get_invalid_argument_and_create_nothing(
    h: Harness, payload: bytes
) -> None:
    call: Any = h.channel.unary_unary("/sessionrouter.v1.SessionService/StartGroup")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call(payload)
    found = details_of(info.value)
    assert found.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid message" in found.message
    assert found.reason == "UNDECODABLE_PAYLOAD"
    assert found.metadata["payload_bytes"] == str(len(payload))
    # Counted with every other refusal (the sessionrouter_refusals metric reads these).
    assert h.server.refusals.counts[("UNDECODABLE_PAYLOAD", "INVALID_ARGUMENT")] == 1
    assert await _group_count(h) == 0
    register: Any = h.channel.unary_unary("/sessionrouter.v1.WorkerService/RegisterWorker")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await register(payload)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    listed = await h.workers.ListWorkers(wpb.ListWorkersRequest())
    assert len(listed.workers) == 4


async def test_an_undecodable_reward_request_ends_the_stream_after_acking_the_earlier_ones(
    h: Harness,
) -> None:
    started = await h.sessions.StartGroup(spb.StartGroupRequest(task_id="t", group_size=2))
    names = [s.name for s in started.group.members]
    good = spb.SubmitRewardsRequest(
        sequence=1, entries=[spb.RewardEntry(session=names[0], reward=1.0)]
    ).SerializeToString()
    bad_utf8 = b"\x0a\x04\x0a\x02\xc3\x28"  # entries[0].session holding invalid UTF-8
    stream: Any = h.channel.stream_stream(
        "/sessionrouter.v1.SessionService/SubmitRewards",
        response_deserializer=spb.SubmitRewardsResponse.FromString,
    )
    call = stream(iter([good, bad_utf8]))
    replies: list[spb.SubmitRewardsResponse] = []

    async def read_all() -> None:
        async for reply in call:
            replies.append(reply)

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await read_all()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [r.ack.sequence for r in replies] == [1]
    assert replies[0].ack.results[0].status == spb.REWARD_STATUS_ACCEPTED
    session = await h.sessions.GetSession(spb.GetSessionRequest(session=names[0]))
    assert session.session.state == pb.SESSION_STATE_REWARDED
    other = await h.sessions.GetSession(spb.GetSessionRequest(session=names[1]))
    assert other.session.state == pb.SESSION_STATE_OPEN


async def _submit(h: Harness, entries: list[tuple[str, float]]) -> spb.RewardAck:
    call = h.sessions.SubmitRewards()
    await call.write(
        spb.SubmitRewardsRequest(
            sequence=1, entries=[spb.RewardEntry(session=n, reward=r) for n, r in entries]
        )
    )
    reply = await call.read()
    assert isinstance(reply, spb.SubmitRewardsResponse)
    await call.done_writing()
    while await call.read() is not grpc.aio.EOF:
        pass
    return reply.ack


async def test_rewards_whose_statistics_would_overflow_are_refused_and_never_published(
    h: Harness,
) -> None:
    started = await h.sessions.StartGroup(spb.StartGroupRequest(task_id="t", group_size=2))
    names = [s.name for s in started.group.members]
    ack = await _submit(h, [(names[0], 1e308), (names[1], 1.5e308)])
    assert [r.status for r in ack.results] == [spb.REWARD_STATUS_NOT_FINITE] * 2
    assert "magnitude bound" in ack.results[0].detail
    for name in names:
        session = await h.sessions.GetSession(spb.GetSessionRequest(session=name))
        assert session.session.state == pb.SESSION_STATE_OPEN
    # The bound itself is accepted, with opposite signs (the worst case for the std).
    ack = await _submit(h, [(names[0], MAX_REWARD_MAGNITUDE), (names[1], -MAX_REWARD_MAGNITUDE)])
    assert [r.status for r in ack.results] == [spb.REWARD_STATUS_ACCEPTED] * 2
    h.reduce()
    [result] = await read_feed(h, 0, 1)
    numbers = [*result.rewards, *result.advantages, result.mean, result.std]
    assert all(math.isfinite(x) for x in numbers)
    assert result.advantages[0] > 0 > result.advantages[1]
