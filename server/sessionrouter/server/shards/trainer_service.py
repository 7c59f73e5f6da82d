"""SessionService of a shard: the merged feed (``merged_feed``), SetTrainerState written to
the fleet's shared entry (``admission``) instead of to this shard alone, and the trainer
state answered for the fleet: counters summed over shards, the weight update and the workers
of the shared pool (``pool``)."""

from __future__ import annotations

from sessionrouter.server import convert
from sessionrouter.server.core.router import SessionRouter
from sessionrouter.server.core.staleness import TrainerStateChange
from sessionrouter.server.core.streams import Commit, no_journal
from sessionrouter.server.shards.admission import FleetAdmission
from sessionrouter.server.shards.link import NatsLink
from sessionrouter.server.shards.merged_feed import ShardedSessionServicer
from sessionrouter.server.shards.pool import PoolMirror
from sessionrouter.server.status import Refusals
from sessionrouter.v1 import resources_pb2 as pb


class FleetSessionServicer(ShardedSessionServicer):
    """SessionService of a shard whose trainer state is the fleet's."""

    def __init__(
        self,
        router: SessionRouter,
        link: NatsLink,
        fleet: FleetAdmission,
        pool: PoolMirror,
        commit: Commit = no_journal,
        refusals: Refusals | None = None,
    ) -> None:
        super().__init__(router, link, commit, refusals)
        self._fleet = fleet
        self._pool = pool

    async def _set_trainer_state(self, change: TrainerStateChange) -> None:
        await self._fleet.set_state(change)

    def _trainer_state(self) -> pb.TrainerState:
        """The fleet's: ``groups_started``/``groups_dropped`` summed over the shards (this
        one live, the others as last published, ``PoolMirror.fleet_counters``), the weight
        update of the fleet's entry, and the pool's workers in an update; the distinct
        worker versions are the pool's too (``PoolMirror.distinct_versions``, through the
        router's ``worker_versions``)."""
        msg = convert.trainer_state_to_proto(self._router)
        msg.groups_started, msg.groups_dropped = self._pool.fleet_counters()
        state = self._fleet.state
        if state is not None:
            msg.weight_update_version = state.update_version
            msg.weight_update_fleet_wide = state.update_fleet_wide
        msg.workers_updating = self._pool.workers_updating()
        return msg
