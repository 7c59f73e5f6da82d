"""SessionService of a shard: the merged feed (``merged_feed``), and SetTrainerState
written to the fleet's shared entry (``admission``) instead of to this shard alone."""

from __future__ import annotations

from sessionrouter.server.core.router import SessionRouter
from sessionrouter.server.core.staleness import TrainerStateChange
from sessionrouter.server.core.streams import Commit, no_journal
from sessionrouter.server.shards.admission import FleetAdmission
from sessionrouter.server.shards.link import NatsLink
from sessionrouter.server.shards.merged_feed import ShardedSessionServicer
from sessionrouter.server.status import Refusals


class FleetSessionServicer(ShardedSessionServicer):
    """SessionService of a shard whose trainer state is the fleet's."""

    def __init__(
        self,
        router: SessionRouter,
        link: NatsLink,
        fleet: FleetAdmission,
        commit: Commit = no_journal,
        refusals: Refusals | None = None,
    ) -> None:
        super().__init__(router, link, commit, refusals)
        self._fleet = fleet

    async def _set_trainer_state(self, change: TrainerStateChange) -> None:
        await self._fleet.set_state(change)
