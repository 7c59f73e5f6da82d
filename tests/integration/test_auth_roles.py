"""Roles through a real router: each credential against each RPC of both services.

The router runs with a token file of every role (two rollout tokens, for rotation) and a
worker token bound to ``w-own-*``. Every call gets exactly what ``roles.ACCESS`` says:
UNAUTHENTICATED without a known token, PERMISSION_DENIED with ErrorInfo naming the role held
and the roles allowed when the role may not call it, and a normal reply when it may.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import cast

import grpc
import pytest
from google.protobuf.message import Message
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from sessionrouter.client import PermissionDeniedError, SessionRouterClient
from sessionrouter.server.app import WorkerSpec
from sessionrouter.server.credentials import Role, TokenTable
from sessionrouter.server.roles import ACCESS
from sessionrouter.v1 import session_service_pb2 as spb
from sessionrouter.v1 import session_service_pb2_grpc as spb_grpc
from sessionrouter.v1 import worker_service_pb2 as wpb
from sessionrouter.v1 import worker_service_pb2_grpc as wpb_grpc
from tests.interop._server import running_server
from tests.support import Harness, details_of, start_harness, stop_harness

TOKEN_FILE = """\
# role:token[:worker-id-globs]
admin:admin-0f3c
rollout:rollout-a-71d2
rollout:rollout-b-9e44
trainer:trainer-5b10
worker:worker-c2aa:w-own-*
"""
CALLERS: dict[str, tuple[str | None, Role | None]] = {
    "no-token": (None, None),
    "unknown-token": ("guessed-token", None),
    "worker": ("worker-c2aa", Role.WORKER),
    "rollout": ("rollout-a-71d2", Role.ROLLOUT),
    "rollout-rotated": ("rollout-b-9e44", Role.ROLLOUT),
    "trainer": ("trainer-5b10", Role.TRAINER),
    "admin": ("admin-0f3c", Role.ADMIN),
}
ADMIN = (("authorization", "Bearer admin-0f3c"),)
WORKERS = (
    WorkerSpec("w-own-1", "10.0.0.1:1", 8),
    WorkerSpec("w-own-2", "10.0.0.2:1", 8),
    WorkerSpec("w-other", "10.0.0.3:1", 8),
)

Metadata = tuple[tuple[str, str], ...]


@pytest.fixture
async def router() -> AsyncIterator[Harness]:
    h = await start_harness(tokens=TokenTable.parse(TOKEN_FILE), workers=WORKERS)
    try:
        yield h
    finally:
        await stop_harness(h)


async def _finished_group(h: Harness) -> spb.StartGroupResponse:
    """A group of two with both rewards in, reduced: the feed holds one group."""
    started = await h.sessions.StartGroup(
        spb.StartGroupRequest(task_id="t", group_size=2, request_id="setup"), metadata=ADMIN
    )
    call = h.sessions.SubmitRewards(metadata=ADMIN)
    await call.write(
        spb.SubmitRewardsRequest(
            sequence=1,
            entries=[
                spb.RewardEntry(session=m.name, reward=i)
                for i, m in enumerate(started.group.members)
            ],
        )
    )
    await call.read()
    await call.done_writing()
    while await call.read() is not grpc.aio.EOF:
        pass
    h.reduce()
    return started


async def _open_session(h: Harness) -> spb.StartSessionResponse:
    reply: spb.StartSessionResponse = await h.sessions.StartSession(
        spb.StartSessionRequest(task_id="t", group_size=2), metadata=ADMIN
    )
    return reply


Call = Callable[[Harness, Metadata], Awaitable[object]]


def _unary(service: str, name: str, request: Callable[[Harness], Awaitable[Message]]) -> Call:
    async def call(h: Harness, md: Metadata) -> object:
        stub: object = h.sessions if service == "session" else h.workers
        return await getattr(stub, name)(await request(h), metadata=md, timeout=5)

    return call


def _write_lost_the_race(error: grpc.aio.AioRpcError) -> bool:
    """grpcio's asyncio client reports INTERNAL (``Failed "execute_batch"``) instead of the
    server's status when its write reaches a stream the server has just ended, here by
    refusing the caller (grpc/grpc#36066): the server's answer is lost to the client."""
    said = f"{error.details()} {error.debug_error_string()}"
    return error.code() == grpc.StatusCode.INTERNAL and "execute_batch" in said


async def _submit_rewards(h: Harness, md: Metadata) -> object:
    session = (await _open_session(h)).session.name
    request = spb.SubmitRewardsRequest(
        sequence=1, entries=[spb.RewardEntry(session=session, reward=1)]
    )
    for _ in range(20):  # a lost race is rare: the server's status comes on a next try
        call = h.sessions.SubmitRewards(metadata=md, timeout=5)
        try:
            await call.write(request)
            await call.done_writing()
        except grpc.aio.AioRpcError as error:
            if _write_lost_the_race(error):
                continue
            raise
        responses = []
        while (response := await call.read()) is not grpc.aio.EOF:
            responses.append(response)
        return responses
    raise AssertionError("every write lost the race with the server's status")


async def _subscribe(h: Harness, md: Metadata) -> object:
    await _finished_group(h)
    call = h.sessions.SubscribeGroups(spb.SubscribeGroupsRequest(after_cursor=0), metadata=md)
    try:
        return await asyncio.wait_for(call.read(), 5)
    finally:
        call.cancel()


async def _complete_update_request(h: Harness) -> Message:
    """An admin begins an update of w-own-1 to its next version, so that the call under test
    completes it (a refused caller leaves it updating: the next caller completes that one)."""
    worker = h.server.router.get_worker("w-own-1")
    version = worker.updating_to or worker.policy_version + 1
    await h.workers.BeginWeightUpdate(
        wpb.BeginWeightUpdateRequest(version=version, worker_ids=["w-own-1"]), metadata=ADMIN
    )
    return wpb.CompleteWeightUpdateRequest(worker_id="w-own-1", version=version)


async def _req(message: Message) -> Message:
    return message


def _const(message: Message) -> Callable[[Harness], Awaitable[Message]]:
    return lambda h: _req(message)


async def _abort_request(h: Harness) -> Message:
    return spb.AbortSessionRequest(session=(await _open_session(h)).session.name)


async def _get_session_request(h: Harness) -> Message:
    return spb.GetSessionRequest(session=(await _open_session(h)).session.name)


async def _get_group_request(h: Harness) -> Message:
    return spb.GetGroupRequest(group_id=(await _open_session(h)).session.group_id)


_S = "/sessionrouter.v1.SessionService/"
_W = "/sessionrouter.v1.WorkerService/"
CALLS: dict[str, Call] = {
    _W + "RegisterWorker": _unary(
        "worker",
        "RegisterWorker",
        _const(wpb.RegisterWorkerRequest(worker_id="w-own-1", address="10.0.0.1:1", capacity=8)),
    ),
    _W + "Heartbeat": _unary(
        "worker", "Heartbeat", _const(wpb.HeartbeatRequest(worker_id="w-own-1"))
    ),
    _W + "DrainWorker": _unary(
        "worker", "DrainWorker", _const(wpb.DrainWorkerRequest(worker_id="w-own-1", resume=True))
    ),
    _W + "DeregisterWorker": _unary(
        "worker", "DeregisterWorker", _const(wpb.DeregisterWorkerRequest(worker_id="w-own-2"))
    ),
    _W + "GetWorker": _unary(
        "worker", "GetWorker", _const(wpb.GetWorkerRequest(worker_id="w-own-1"))
    ),
    _W + "ListWorkers": _unary("worker", "ListWorkers", _const(wpb.ListWorkersRequest())),
    _W + "BeginWeightUpdate": _unary(
        "worker",
        "BeginWeightUpdate",
        _const(wpb.BeginWeightUpdateRequest(version=1, worker_ids=["w-own-2"])),
    ),
    _W + "CompleteWeightUpdate": _unary("worker", "CompleteWeightUpdate", _complete_update_request),
    _S + "StartSession": _unary(
        "session", "StartSession", _const(spb.StartSessionRequest(task_id="t", request_id="r1"))
    ),
    _S + "StartGroup": _unary(
        "session",
        "StartGroup",
        _const(spb.StartGroupRequest(task_id="t", group_size=2, request_id="g1")),
    ),
    _S + "AbortSession": _unary("session", "AbortSession", _abort_request),
    _S + "GetSession": _unary("session", "GetSession", _get_session_request),
    _S + "GetGroup": _unary("session", "GetGroup", _get_group_request),
    _S + "ListGroups": _unary("session", "ListGroups", _const(spb.ListGroupsRequest())),
    _S + "SubmitRewards": _submit_rewards,
    _S + "SubscribeGroups": _subscribe,
    _S + "SetTrainerState": _unary(
        "session", "SetTrainerState", _const(spb.SetTrainerStateRequest(version=1))
    ),
    _S + "GetTrainerState": _unary(
        "session", "GetTrainerState", _const(spb.GetTrainerStateRequest())
    ),
}


def test_the_matrix_calls_every_rpc_of_the_table() -> None:
    assert set(CALLS) == set(ACCESS)


@pytest.mark.parametrize("method", sorted(ACCESS), ids=lambda m: m.rsplit("/", 1)[1])
async def test_each_credential_gets_what_the_table_says(router: Harness, method: str) -> None:
    allowed = ACCESS[method].roles
    for caller, (token, role) in CALLERS.items():
        md: Metadata = (("authorization", f"Bearer {token}"),) if token else ()
        try:
            await CALLS[method](router, md)
        except grpc.aio.AioRpcError as error:
            got = details_of(error)
            if role is None:
                assert got.code == grpc.StatusCode.UNAUTHENTICATED, (caller, got)
                assert got.reason == ("MISSING_TOKEN" if token is None else "UNKNOWN_TOKEN")
            else:
                assert role not in allowed, (caller, got)
                assert got.code == grpc.StatusCode.PERMISSION_DENIED, (caller, got)
                assert got.reason == "ROLE_NOT_ALLOWED"
                assert got.metadata == {
                    "role": role.value,
                    "allowed_roles": ",".join(sorted(r.value for r in allowed)),
                    "method": method,
                }
        else:
            assert role is not None and role in allowed, f"{caller} was served {method}"


async def test_a_worker_token_acts_only_on_the_worker_ids_it_is_bound_to(
    router: Harness,
) -> None:
    worker = (("authorization", "Bearer worker-c2aa"),)
    drained = await router.workers.DrainWorker(
        wpb.DrainWorkerRequest(worker_id="w-own-1"), metadata=worker
    )
    assert drained.worker.draining
    registered = await router.workers.RegisterWorker(
        wpb.RegisterWorkerRequest(worker_id="w-own-9", address="10.0.0.9:1", capacity=2),
        metadata=worker,
    )
    assert registered.worker.worker_id == "w-own-9"
    refused: list[tuple[str, Message]] = [
        ("DrainWorker", wpb.DrainWorkerRequest(worker_id="w-other")),
        ("Heartbeat", wpb.HeartbeatRequest(worker_id="w-other")),
        ("GetWorker", wpb.GetWorkerRequest(worker_id="w-other")),
        ("CompleteWeightUpdate", wpb.CompleteWeightUpdateRequest(worker_id="w-other")),
        (
            "RegisterWorker",
            wpb.RegisterWorkerRequest(worker_id="w-other", address="6.6.6.6:1", capacity=64),
        ),
        ("RegisterWorker", wpb.RegisterWorkerRequest(worker_id="evil", address="6.6.6.6:1")),
    ]
    for name, request in refused:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await getattr(router.workers, name)(request, metadata=worker)
        got = details_of(info.value)
        assert got.code == grpc.StatusCode.PERMISSION_DENIED, name
        assert got.reason == "WORKER_NOT_BOUND"
        assert got.metadata == {
            "role": "worker",
            "worker_id": getattr(request, "worker_id"),  # noqa: B009
            "method": f"{_W}{name}",
        }
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await router.workers.DeregisterWorker(
            wpb.DeregisterWorkerRequest(worker_id="w-own-1"), metadata=worker
        )
    assert details_of(info.value).reason == "ROLE_NOT_ALLOWED"
    # Nothing changed for the other worker, and no worker appeared at the attacker's address.
    other = router.server.router.get_worker("w-other")
    assert (other.address, other.capacity, other.draining) == ("10.0.0.3:1", 8, False)
    assert router.server.router.find_worker("evil") is None
    # The admin manages every worker.
    admin_drained = await router.workers.DrainWorker(
        wpb.DrainWorkerRequest(worker_id="w-other"), metadata=ADMIN
    )
    assert admin_drained.worker.draining


async def test_a_long_worker_id_is_cut_in_the_refusal(router: Harness) -> None:
    worker = (("authorization", "Bearer worker-c2aa"),)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await router.workers.Heartbeat(wpb.HeartbeatRequest(worker_id="x" * 5000), metadata=worker)
    got = details_of(info.value)
    assert got.code == grpc.StatusCode.PERMISSION_DENIED
    assert got.metadata["worker_id"] == "x" * 128


async def test_both_tokens_of_a_rotated_role_work_through_the_client(router: Harness) -> None:
    for token in ("rollout-a-71d2", "rollout-b-9e44"):
        async with SessionRouterClient.connect(router.address, token=token) as client:
            started = await client.start_session("t", request_id=f"rotation-{token}")
            assert started.session.worker_id.startswith("w-")
            with pytest.raises(PermissionDeniedError) as info:
                await client.drain_worker("w-other")
            assert info.value.reason == "ROLE_NOT_ALLOWED"
            assert info.value.metadata["role"] == "rollout"


async def test_health_and_reflection_need_no_token(router: Harness) -> None:
    health = health_pb2_grpc.HealthStub(router.channel)
    reply = await health.Check(health_pb2.HealthCheckRequest())
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(router.channel)
    call = stub.ServerReflectionInfo()
    await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
    response = await call.read()
    await call.done_writing()
    assert "sessionrouter.v1.SessionService" in {
        s.name for s in response.list_services_response.service
    }


async def test_a_bearer_header_without_a_token_is_unauthenticated(router: Harness) -> None:
    for value in ("Bearer ", "Basic YWRtaW46eA==", "admin-0f3c"):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await router.workers.ListWorkers(
                wpb.ListWorkersRequest(), metadata=(("authorization", value),)
            )
        assert details_of(info.value).reason == "MISSING_TOKEN", value
    stub = spb_grpc.SessionServiceStub(router.channel)
    reply = await stub.ListGroups(
        spb.ListGroupsRequest(), metadata=(("authorization", "bearer admin-0f3c"),)
    )
    assert reply is not None
    workers = wpb_grpc.WorkerServiceStub(router.channel)
    assert (await workers.ListWorkers(wpb.ListWorkersRequest(), metadata=ADMIN)).workers


def _reason(error: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    """Code and ErrorInfo reason of a failed call of a sync channel (also a grpc.Call)."""
    call = cast(grpc.Call, error)
    status = rpc_status.from_call(call)
    assert status is not None
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    return call.code(), info.reason


def test_the_serve_command_reads_the_roles_of_a_token_file(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKEN_FILE)
    with (
        running_server("real", extra_args=["--token-file", str(tokens)]) as address,
        grpc.insecure_channel(address) as channel,
    ):
        workers = wpb_grpc.WorkerServiceStub(channel)
        as_worker = (("authorization", "Bearer worker-c2aa"),)
        workers.RegisterWorker(
            wpb.RegisterWorkerRequest(worker_id="w-own-1", address="10.0.0.1:1", capacity=1),
            metadata=as_worker,
            timeout=10,
        )
        with pytest.raises(grpc.RpcError) as info:
            workers.DrainWorker(
                wpb.DrainWorkerRequest(worker_id="w-other"), metadata=as_worker, timeout=10
            )
        assert _reason(info.value) == (grpc.StatusCode.PERMISSION_DENIED, "WORKER_NOT_BOUND")
        as_rollout = (("authorization", "Bearer rollout-b-9e44"),)
        with pytest.raises(grpc.RpcError) as info:
            workers.ListWorkers(wpb.ListWorkersRequest(), metadata=as_rollout, timeout=10)
        assert _reason(info.value) == (grpc.StatusCode.PERMISSION_DENIED, "ROLE_NOT_ALLOWED")
        listed = workers.ListWorkers(wpb.ListWorkersRequest(), metadata=ADMIN, timeout=10)
        assert [w.worker_id for w in listed.workers] == ["w-own-1"]
