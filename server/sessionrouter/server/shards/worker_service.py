"""WorkerService of a sharded router: the same RPCs, over the shared pool (``pool``).

Writes go to the pool bucket first and are applied to this shard's table at once (the watch
applies them again, idempotently, as it does on every other shard); reads answer from the
whole pool, with this shard's share and open sessions and the load summed over shards.
"""

from __future__ import annotations

import time

import grpc

from sessionrouter.server import convert, paging
from sessionrouter.server.core.errors import RouterError
from sessionrouter.server.core.router import SessionRouter
from sessionrouter.server.core.streams import Commit, no_journal
from sessionrouter.server.servicer import WorkerServicer
from sessionrouter.server.shards.pool import PoolMirror, WorkerEntry, share
from sessionrouter.server.status import Refusals
from sessionrouter.v1 import resources_pb2 as pb
from sessionrouter.v1 import worker_service_pb2 as wpb

Context = grpc.aio.ServicerContext[object, object]


class ShardedWorkerServicer(WorkerServicer):
    """WorkerService over the pool every shard shares."""

    def __init__(
        self,
        router: SessionRouter,
        pool: PoolMirror,
        commit: Commit = no_journal,
        refusals: Refusals | None = None,
    ) -> None:
        super().__init__(router, commit, refusals)
        self._pool = pool

    def _worker(self, entry: WorkerEntry) -> pb.Worker:
        local = self._router.find_worker(entry.worker_id)
        if local is not None:
            msg = convert.worker_to_proto(local)
        else:  # no share of it on this shard: described from the pool's record
            alive = time.time() - entry.heartbeat <= self._router.settings.heartbeat_timeout_s
            msg = pb.Worker(
                worker_id=entry.worker_id,
                address=entry.address,
                policy_version=entry.policy_version,
                labels=entry.labels,
                health=pb.WORKER_HEALTH_HEALTHY if alive else pb.WORKER_HEALTH_UNHEALTHY,
                draining=entry.draining,
                last_heartbeat_time=convert.timestamp(entry.heartbeat),
            )
        msg.capacity = entry.capacity
        # The pool's last heartbeat, whichever shard received it.
        msg.last_heartbeat_time.CopyFrom(convert.timestamp(entry.heartbeat))
        msg.shard_capacity = share(entry.worker_id, entry.capacity, self._pool.shard)
        msg.cluster_open_sessions = self._pool.cluster_open(entry.worker_id)
        return msg

    async def RegisterWorker(
        self, request: wpb.RegisterWorkerRequest, context: Context
    ) -> wpb.RegisterWorkerResponse:
        try:
            entry = await self._pool.register(
                request.worker_id,
                request.address,
                request.capacity,
                dict(request.labels),
                request.policy_version,
            )
        except RouterError as error:
            await self._abort(context, error)
        reply = wpb.RegisterWorkerResponse(
            worker=self._worker(entry),
            heartbeat_timeout=convert.duration(self._router.settings.heartbeat_timeout_s),
        )
        await self._durable(context)
        return reply

    async def Heartbeat(
        self, request: wpb.HeartbeatRequest, context: Context
    ) -> wpb.HeartbeatResponse:
        try:
            entry = await self._pool.heartbeat(request.worker_id, request.policy_version)
        except RouterError as error:
            await self._abort(context, error)
        reply = wpb.HeartbeatResponse(worker=self._worker(entry))
        if request.policy_version:
            await self._durable(context)  # a new version is journaled
        return reply

    async def DrainWorker(
        self, request: wpb.DrainWorkerRequest, context: Context
    ) -> wpb.DrainWorkerResponse:
        try:
            entry = await self._pool.drain(request.worker_id, request.resume)
        except RouterError as error:
            await self._abort(context, error)
        reply = wpb.DrainWorkerResponse(worker=self._worker(entry))
        await self._durable(context)
        return reply

    async def DeregisterWorker(
        self, request: wpb.DeregisterWorkerRequest, context: Context
    ) -> wpb.DeregisterWorkerResponse:
        try:
            entry, lost, local = await self._pool.deregister(request.worker_id)
        except RouterError as error:
            await self._abort(context, error)
        worker = convert.worker_to_proto(local) if local is not None else self._worker(entry)
        worker.capacity = entry.capacity
        reply = wpb.DeregisterWorkerResponse(worker=worker, lost_sessions=lost)
        await self._durable(context)
        return reply

    async def GetWorker(
        self, request: wpb.GetWorkerRequest, context: Context
    ) -> wpb.GetWorkerResponse:
        try:
            entry = self._pool.get(request.worker_id)
        except RouterError as error:
            await self._abort(context, error)
        return wpb.GetWorkerResponse(worker=self._worker(entry))

    async def ListWorkers(
        self, request: wpb.ListWorkersRequest, context: Context
    ) -> wpb.ListWorkersResponse:
        try:
            after = paging.decode_id("workers", request.page_token)
        except RouterError as error:
            await self._abort(context, error)
        size = paging.page_size(request.page_size)
        ids = sorted(w for w in self._pool.entries if w > after)
        chosen = ids[:size]
        last = chosen[-1] if len(ids) > size and chosen else ""
        return wpb.ListWorkersResponse(
            workers=[self._worker(self._pool.entries[w]) for w in chosen],
            next_page_token=paging.encode("workers", last),
        )
