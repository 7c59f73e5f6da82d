"""SessionService of a shard: the merged feed (``merged_feed``), and SetTrainerState
written to the fleet's shared entry (``admission``) instead of to this shard alone."""

from __future__ import annotations

import grpc

from sessionrouter.server import convert
from sessionrouter.server.core.errors import RouterError
from sessionrouter.server.core.router import SessionRouter
from sessionrouter.server.core.streams import Commit, no_journal
from sessionrouter.server.shards.admission import FleetAdmission
from sessionrouter.server.shards.link import NatsLink
from sessionrouter.server.shards.merged_feed import ShardedSessionServicer
from sessionrouter.server.status import Refusals
from sessionrouter.v1 import session_service_pb2 as spb

Context = grpc.aio.ServicerContext[object, object]


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

    async def SetTrainerState(
        self, request: spb.SetTrainerStateRequest, context: Context
    ) -> spb.SetTrainerStateResponse:
        try:
            await self._fleet.set_state(
                request.version,
                convert.policy_from_proto(request),
                clear_policy=request.clear_policy,
                reset_counters=request.reset_counters,
                refuse_mixed_versions=request.refuse_mixed_versions
                if request.HasField("refuse_mixed_versions")
                else None,
            )
        except RouterError as error:
            await self._abort(context, error)
        reply = spb.SetTrainerStateResponse(state=convert.trainer_state_to_proto(self._router))
        await self._durable(context)
        return reply
