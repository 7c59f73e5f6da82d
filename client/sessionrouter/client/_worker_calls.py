"""The WorkerService methods of ``SessionRouterClient``: register, heartbeat, drain,
deregister, look up and list workers, and weight updates (one call on any shard: sharded
routers share the pool, with each worker's update state, through NATS)."""

# `timeout=` on these coroutines is the gRPC deadline, sent to the router and shared by the
# retries of one call; `asyncio.timeout` around the call could not do either (ASYNC109).

from __future__ import annotations

import contextlib
from collections.abc import (
    AsyncIterator,
    Mapping,
    Sequence,
)

from sessionrouter.client import _convert
from sessionrouter.client._unary_calls import UnaryCalls
from sessionrouter.client.types import (
    DeregisterWorkerResult,
    Page,
    RegisterWorkerResult,
    WeightUpdate,
    Worker,
)
from sessionrouter.v1 import worker_service_pb2 as wpb

__all__ = ["WorkerCalls"]


class WorkerCalls(UnaryCalls):
    """See the module docstring."""

    async def register_worker(
        self,
        worker_id: str,
        address: str,
        capacity: int,
        *,
        labels: Mapping[str, str] | None = None,
        policy_version: int = 0,
        timeout: float | None = None,
    ) -> RegisterWorkerResult:
        """Adds a worker, or updates capacity and labels of a registered one (idempotent).
        ``policy_version`` is the weight version it serves (0: unknown)."""
        request = wpb.RegisterWorkerRequest(
            worker_id=worker_id,
            address=address,
            capacity=capacity,
            labels=dict(labels or {}),
            policy_version=policy_version,
        )
        response = await self._unary(lambda s: s.workers.RegisterWorker, request, timeout)
        return _convert.register_worker_result_from_proto(response)

    async def heartbeat(
        self, worker_id: str, *, policy_version: int = 0, timeout: float | None = None
    ) -> Worker:
        """Tells the router the worker is alive; call well within ``heartbeat_timeout``.
        ``policy_version`` reports the weights it serves now (0: unchanged); the target
        version of a weight update in progress puts the worker back into placement."""
        request = wpb.HeartbeatRequest(worker_id=worker_id, policy_version=policy_version)
        response = await self._unary(lambda s: s.workers.Heartbeat, request, timeout)
        return _convert.worker_from_proto(response.worker)

    async def drain_worker(
        self, worker_id: str, *, resume: bool = False, timeout: float | None = None
    ) -> Worker:
        """Stops placing new sessions on the worker (``resume=True`` restarts it)."""
        request = wpb.DrainWorkerRequest(worker_id=worker_id, resume=resume)
        response = await self._unary(lambda s: s.workers.DrainWorker, request, timeout)
        return _convert.worker_from_proto(response.worker)

    async def deregister_worker(
        self, worker_id: str, *, timeout: float | None = None
    ) -> DeregisterWorkerResult:
        """Removes a worker; its open sessions are marked ``worker_lost``."""
        request = wpb.DeregisterWorkerRequest(worker_id=worker_id)
        response = await self._unary(lambda s: s.workers.DeregisterWorker, request, timeout)
        return _convert.deregister_worker_result_from_proto(response)

    async def get_worker(self, worker_id: str, *, timeout: float | None = None) -> Worker:
        request = wpb.GetWorkerRequest(worker_id=worker_id)
        response = await self._unary(lambda s: s.workers.GetWorker, request, timeout)
        return _convert.worker_from_proto(response.worker)

    async def list_workers(
        self, *, page_size: int = 0, page_token: str = "", timeout: float | None = None
    ) -> Page[Worker]:
        """One page of workers ordered by id; ``page_size`` 0 means the server's 100."""
        request = wpb.ListWorkersRequest(page_size=page_size, page_token=page_token)
        response = await self._unary(lambda s: s.workers.ListWorkers, request, timeout)
        return Page(
            items=tuple(_convert.worker_from_proto(w) for w in response.workers),
            next_page_token=response.next_page_token,
        )

    async def iter_workers(
        self, *, page_size: int = 0, timeout: float | None = None
    ) -> AsyncIterator[Worker]:
        """Every worker, fetching pages as needed (``timeout`` applies per page)."""
        token = ""
        while True:
            page = await self.list_workers(page_size=page_size, page_token=token, timeout=timeout)
            for worker in page.items:
                yield worker
            if not page.next_page_token:
                return
            token = page.next_page_token

    async def begin_weight_update(
        self,
        version: int,
        *,
        worker_ids: Sequence[str] = (),
        interrupt_sessions: bool = False,
        timeout: float | None = None,
    ) -> WeightUpdate:
        """Takes the named workers (every worker when none is named) out of placement until
        each serves ``version``. Their open sessions keep running; with
        ``interrupt_sessions`` they are marked interrupted."""
        request = wpb.BeginWeightUpdateRequest(
            version=version, worker_ids=list(worker_ids), interrupt_sessions=interrupt_sessions
        )
        # The shard reached writes the update to the shared pool: every shard applies it.
        response = await self._unary(lambda s: s.workers.BeginWeightUpdate, request, timeout)
        return WeightUpdate(
            version=version,
            workers=tuple(_convert.worker_from_proto(w) for w in response.workers),
            interrupted_sessions=response.interrupted_sessions,
        )

    async def complete_weight_update(
        self, worker_id: str, *, version: int = 0, timeout: float | None = None
    ) -> tuple[Worker, bool]:
        """Puts a worker back with its new version (0: the update's target); returns the
        worker and whether the whole update is over."""
        request = wpb.CompleteWeightUpdateRequest(worker_id=worker_id, version=version)
        response = await self._unary(lambda s: s.workers.CompleteWeightUpdate, request, timeout)
        return _convert.worker_from_proto(response.worker), response.update_finished

    @contextlib.asynccontextmanager
    async def weight_update(
        self,
        version: int,
        *,
        worker_ids: Sequence[str] = (),
        interrupt_sessions: bool = False,
        timeout: float | None = None,
    ) -> AsyncIterator[WeightUpdate]:
        """``async with client.weight_update(8) as update:`` load the weights in the body.

        On entry the selected workers leave placement; on a normal exit every one of them
        still updating is completed at ``version``. When the body raises, the workers stay
        out of placement (they may not serve the new weights; saying they do would stamp
        sessions with a lie): complete them, or let their heartbeats report the version."""
        update = await self.begin_weight_update(
            version, worker_ids=worker_ids, interrupt_sessions=interrupt_sessions, timeout=timeout
        )
        yield update
        for worker in update.workers:
            current = await self.get_worker(worker.worker_id, timeout=timeout)
            if current.updating_to_version == version:
                await self.complete_weight_update(
                    worker.worker_id, version=version, timeout=timeout
                )
