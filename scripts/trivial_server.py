"""A do-nothing server with sessionrouter's contract: the baseline of the ghz load tests.

It implements both services with the real message shapes and no work: StartSession answers a
fixed session (echoing the caller's ids), StartGroup a group of `group_size` such sessions,
SubmitRewards one ack of ACCEPTED per entry (and never a group result), the worker RPCs echo
a healthy worker. No state, no placement, no reducer. What ghz measures against it is the cost
of grpc.aio, protobuf and the Python event loop alone, so the real server's throughput divided
by this one's is the share of that ceiling the router keeps.

Usage: python scripts/trivial_server.py --listen 127.0.0.1:0 --port-file PATH
The bound port is written to PATH (atomically) once the server is serving; SIGTERM or SIGINT
stops it. Server reflection is on, so that grpcurl and ghz can find the methods.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from google.protobuf.duration_pb2 import Duration
from grpc_reflection.v1alpha import reflection

from sessionrouter.v1 import (
    resources_pb2,
    session_service_pb2,
    session_service_pb2_grpc,
    worker_service_pb2,
    worker_service_pb2_grpc,
)

if TYPE_CHECKING:
    from typing import TypeAlias

    _Context: TypeAlias = grpc.aio.ServicerContext[object, object]

_DEFAULT_GROUP = "trivial"
_ACCEPTED = session_service_pb2.RewardResult(status=session_service_pb2.REWARD_STATUS_ACCEPTED)


def _session(group_id: str, index: int, task_id: str, request_id: str) -> resources_pb2.Session:
    return resources_pb2.Session(
        name=f"groups/{group_id}/sessions/{index}",
        group_id=group_id,
        index=index,
        task_id=task_id,
        worker_id="w0",
        worker_address="127.0.0.1:30000",
        state=resources_pb2.SESSION_STATE_OPEN,
        request_id=request_id,
    )


def _worker(worker_id: str, address: str = "", capacity: int = 1) -> resources_pb2.Worker:
    return resources_pb2.Worker(
        worker_id=worker_id,
        address=address,
        capacity=max(capacity, 1),
        health=resources_pb2.WORKER_HEALTH_HEALTHY,
    )


class TrivialSessionService(session_service_pb2_grpc.SessionServiceServicer):
    """SessionService answering fixed replies."""

    async def StartSession(
        self, request: session_service_pb2.StartSessionRequest, context: _Context
    ) -> session_service_pb2.StartSessionResponse:
        group_id = request.group_id if request.HasField("group_id") else _DEFAULT_GROUP
        return session_service_pb2.StartSessionResponse(
            session=_session(group_id, 0, request.task_id, request.request_id),
            group_size=max(request.group_size, 1),
        )

    async def StartGroup(
        self, request: session_service_pb2.StartGroupRequest, context: _Context
    ) -> session_service_pb2.StartGroupResponse:
        group_id = request.group_id if request.HasField("group_id") else _DEFAULT_GROUP
        size = max(request.group_size, 1)
        return session_service_pb2.StartGroupResponse(
            group=resources_pb2.Group(
                group_id=group_id,
                name=f"groups/{group_id}",
                task_id=request.task_id,
                group_size=size,
                state=resources_pb2.GROUP_STATE_OPEN,
                members=[
                    _session(group_id, i, request.task_id, request.request_id) for i in range(size)
                ],
            )
        )

    async def AbortSession(
        self, request: session_service_pb2.AbortSessionRequest, context: _Context
    ) -> session_service_pb2.AbortSessionResponse:
        session = _session(_DEFAULT_GROUP, 0, "", "")
        session.name = request.session
        session.state = resources_pb2.SESSION_STATE_ABORTED
        return session_service_pb2.AbortSessionResponse(session=session)

    async def GetSession(
        self, request: session_service_pb2.GetSessionRequest, context: _Context
    ) -> session_service_pb2.GetSessionResponse:
        session = _session(_DEFAULT_GROUP, 0, "", "")
        session.name = request.session
        return session_service_pb2.GetSessionResponse(session=session)

    async def GetGroup(
        self, request: session_service_pb2.GetGroupRequest, context: _Context
    ) -> session_service_pb2.GetGroupResponse:
        return session_service_pb2.GetGroupResponse(
            group=resources_pb2.Group(group_id=request.group_id, name=f"groups/{request.group_id}")
        )

    async def ListGroups(
        self, request: session_service_pb2.ListGroupsRequest, context: _Context
    ) -> session_service_pb2.ListGroupsResponse:
        return session_service_pb2.ListGroupsResponse()

    async def SubmitRewards(
        self,
        request_iterator: AsyncIterator[session_service_pb2.SubmitRewardsRequest],
        context: _Context,
    ) -> AsyncIterator[session_service_pb2.SubmitRewardsResponse]:
        accepted = session_service_pb2.RewardResult(
            status=session_service_pb2.REWARD_STATUS_ACCEPTED
        )
        async for request in request_iterator:
            yield session_service_pb2.SubmitRewardsResponse(
                ack=session_service_pb2.RewardAck(
                    sequence=request.sequence, results=[accepted] * len(request.entries)
                )
            )

    async def SubscribeGroups(
        self,
        request: session_service_pb2.SubscribeGroupsRequest,
        context: _Context,
    ) -> AsyncIterator[session_service_pb2.SubscribeGroupsResponse]:
        # No group ever finalizes here: hold the stream open until the client leaves.
        await asyncio.Event().wait()
        yield session_service_pb2.SubscribeGroupsResponse()

    async def SetTrainerState(
        self, request: session_service_pb2.SetTrainerStateRequest, context: _Context
    ) -> session_service_pb2.SetTrainerStateResponse:
        state = session_service_pb2.SetTrainerStateResponse()
        state.state.version = request.version
        return state

    async def GetTrainerState(
        self, request: session_service_pb2.GetTrainerStateRequest, context: _Context
    ) -> session_service_pb2.GetTrainerStateResponse:
        return session_service_pb2.GetTrainerStateResponse()


class TrivialWorkerService(worker_service_pb2_grpc.WorkerServiceServicer):
    """WorkerService echoing a healthy worker."""

    async def RegisterWorker(
        self, request: worker_service_pb2.RegisterWorkerRequest, context: _Context
    ) -> worker_service_pb2.RegisterWorkerResponse:
        return worker_service_pb2.RegisterWorkerResponse(
            worker=_worker(request.worker_id, request.address, request.capacity),
            heartbeat_timeout=Duration(seconds=30),
        )

    async def Heartbeat(
        self, request: worker_service_pb2.HeartbeatRequest, context: _Context
    ) -> worker_service_pb2.HeartbeatResponse:
        return worker_service_pb2.HeartbeatResponse(worker=_worker(request.worker_id))

    async def DrainWorker(
        self, request: worker_service_pb2.DrainWorkerRequest, context: _Context
    ) -> worker_service_pb2.DrainWorkerResponse:
        worker = _worker(request.worker_id)
        worker.draining = not request.resume
        return worker_service_pb2.DrainWorkerResponse(worker=worker)

    async def DeregisterWorker(
        self,
        request: worker_service_pb2.DeregisterWorkerRequest,
        context: _Context,
    ) -> worker_service_pb2.DeregisterWorkerResponse:
        return worker_service_pb2.DeregisterWorkerResponse(worker=_worker(request.worker_id))

    async def GetWorker(
        self, request: worker_service_pb2.GetWorkerRequest, context: _Context
    ) -> worker_service_pb2.GetWorkerResponse:
        return worker_service_pb2.GetWorkerResponse(worker=_worker(request.worker_id))

    async def ListWorkers(
        self, request: worker_service_pb2.ListWorkersRequest, context: _Context
    ) -> worker_service_pb2.ListWorkersResponse:
        return worker_service_pb2.ListWorkersResponse()

    async def BeginWeightUpdate(
        self, request: worker_service_pb2.BeginWeightUpdateRequest, context: _Context
    ) -> worker_service_pb2.BeginWeightUpdateResponse:
        return worker_service_pb2.BeginWeightUpdateResponse()

    async def CompleteWeightUpdate(
        self, request: worker_service_pb2.CompleteWeightUpdateRequest, context: _Context
    ) -> worker_service_pb2.CompleteWeightUpdateResponse:
        worker = _worker(request.worker_id)
        worker.policy_version = request.version
        return worker_service_pb2.CompleteWeightUpdateResponse(worker=worker, update_finished=True)


def _write_port_file(path: Path, port: int) -> None:
    """Writes the port so that a reader never sees a partial file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{port}\n")
    tmp.replace(path)


async def serve(listen: str, port_file: Path | None) -> None:
    server = grpc.aio.server()
    session_service_pb2_grpc.add_SessionServiceServicer_to_server(TrivialSessionService(), server)
    worker_service_pb2_grpc.add_WorkerServiceServicer_to_server(TrivialWorkerService(), server)
    services = (
        session_service_pb2.DESCRIPTOR.services_by_name["SessionService"].full_name,
        worker_service_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(services, server)
    port = server.add_insecure_port(listen)
    if port == 0:
        raise SystemExit(f"trivial_server: cannot listen on {listen}")
    await server.start()
    if port_file is not None:
        _write_port_file(port_file, port)
    print(f"trivial_server: serving on port {port}", file=sys.stderr, flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=1.0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT; port 0 picks one")
    parser.add_argument("--port-file", type=Path, help="write the bound port here once serving")
    args = parser.parse_args(argv)
    asyncio.run(serve(args.listen, args.port_file))


if __name__ == "__main__":
    main()
