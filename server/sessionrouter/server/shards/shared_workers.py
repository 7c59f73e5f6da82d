"""The worker directory of a shard (``worker_directory.WorkerDirectory``): the pool every
shard shares (``pool``), with weight updates that reach every shard (``fleet_updates``).

Writes go to the pool bucket first and are applied to this shard's table at once (the watch
applies them again, idempotently, as it does on every other shard); reads answer from the
whole pool, with this shard's share and open sessions and the load summed over shards.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sessionrouter.server import convert
from sessionrouter.server.core.workers import page_of_ids
from sessionrouter.server.shards.fleet_updates import FleetUpdates
from sessionrouter.server.shards.pool import PoolMirror, WorkerEntry, share
from sessionrouter.v1 import resources_pb2 as pb


class SharedWorkers:
    """WorkerService's calls over the shared pool."""

    def __init__(self, pool: PoolMirror, updates: FleetUpdates) -> None:
        self._pool = pool
        self._router = pool.router
        self._updates = updates

    def describe(self, entry: WorkerEntry) -> pb.Worker:
        """The pool's record with this shard's share and the load summed over shards."""
        local = self._router.find_worker(entry.worker_id)
        if local is not None:
            msg = convert.worker_to_proto(local)
        else:  # no share of it on this shard: described from the pool's record
            alive = self._pool.healthy(entry)
            msg = pb.Worker(
                worker_id=entry.worker_id,
                address=entry.address,
                policy_version=entry.policy_version,
                labels=entry.labels,
                health=pb.WORKER_HEALTH_HEALTHY if alive else pb.WORKER_HEALTH_UNHEALTHY,
                draining=entry.draining,
                updating_to_version=entry.updating_to,
            )
        msg.capacity = entry.capacity
        # The pool's last heartbeat, whichever shard received it.
        msg.last_heartbeat_time.CopyFrom(convert.timestamp(entry.heartbeat))
        msg.shard_capacity = share(entry.worker_id, entry.capacity, self._pool.shard)
        msg.cluster_open_sessions = self._pool.cluster_open(entry.worker_id)
        return msg

    async def register(
        self,
        worker_id: str,
        address: str,
        capacity: int,
        labels: Mapping[str, str],
        policy_version: int,
    ) -> pb.Worker:
        entry = await self._pool.register(worker_id, address, capacity, labels, policy_version)
        return self.describe(entry)

    async def heartbeat(self, worker_id: str, policy_version: int) -> pb.Worker:
        return self.describe(await self._pool.heartbeat(worker_id, policy_version))

    async def drain(self, worker_id: str, resume: bool) -> pb.Worker:
        return self.describe(await self._pool.drain(worker_id, resume))

    async def deregister(self, worker_id: str) -> tuple[pb.Worker, int]:
        entry, lost, local = await self._pool.deregister(worker_id)
        worker = convert.worker_to_proto(local) if local is not None else self.describe(entry)
        worker.capacity = entry.capacity
        return worker, lost

    def get(self, worker_id: str) -> pb.Worker:
        return self.describe(self._pool.get(worker_id))

    def page(self, limit: int, after: str) -> tuple[list[pb.Worker], str]:
        chosen, last = page_of_ids(self._pool.entries, limit, after)
        return [self.describe(self._pool.entries[w]) for w in chosen], last

    async def begin_update(
        self, version: int, worker_ids: Sequence[str], interrupt: bool
    ) -> tuple[list[pb.Worker], int]:
        entries, interrupted = await self._updates.begin(version, worker_ids, interrupt)
        return [self.describe(e) for e in entries], interrupted

    async def complete_update(self, worker_id: str, version: int) -> tuple[pb.Worker, bool]:
        entry, finished = await self._updates.complete(worker_id, version)
        return self.describe(entry), finished
