"""Which router a call goes to: one unsharded router, N shards dialled directly, or a proxy.

A sharded deployment is N fixed routers; shard ``i`` owns the groups with
``shard_of(group_id, N) == i`` (``shardmap``) and refuses the others (FAILED_PRECONDITION,
reason ``WRONG_SHARD``, with the owner in the metadata). The client computes the owner itself,
so a correct client never hears that refusal; it follows one once (a client whose shard list
disagrees with the routers') and raises the second.

Three layouts, one ``ShardRouting``:

- one router, unsharded: every call on its one channel, no routing header (as before shards);
- N shards, one channel each, in shard order: a call naming a group goes to its owner's
  channel; a call naming none (register a worker, start a session without a group id) goes to
  the next shard round-robin, since the worker pool and the feed are shared by all shards;
- one proxy (nginx ``hash $http_x_group_id``) in front of N shards: one channel, and the
  ``x-group-id`` header on every call picks the shard. A call that must reach one particular
  shard but names no group (a page of ``ListGroups``, one reward stream per shard, the feed's
  failover) carries a *routing key*: a fixed string that maps to that shard.

Sharded calls carry ``x-group-id`` in the direct layout too, so a shard can check the header
against the group of the request in both layouts.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from sessionrouter.client._errors import SessionRouterError
from sessionrouter.client.shardmap import shard_of
from sessionrouter.v1 import session_service_pb2_grpc, worker_service_pb2_grpc

__all__ = [
    "GROUP_HEADER",
    "WRONG_SHARD",
    "Route",
    "ShardRouting",
    "ShardStubs",
    "group_of_session",
    "routing_key",
]

_log = logging.getLogger("sessionrouter.client.shards")

GROUP_HEADER = "x-group-id"
"""Request header naming the group a call is about; what a proxy's shard map hashes."""

WRONG_SHARD = "WRONG_SHARD"
"""ErrorInfo reason of a shard refusing a group it does not own."""


def group_of_session(name: str) -> str | None:
    """The group of a session name ``groups/{group_id}/sessions/{index}``; None if malformed."""
    parts = name.split("/")
    if len(parts) == 4 and parts[0] == "groups" and parts[2] == "sessions" and parts[1]:
        return parts[1]
    return None


def routing_key(shard: int, shard_count: int) -> str:
    """A fixed string that ``shard_of`` maps to ``shard``: the header that reaches that shard
    through a proxy when the call names no group. The first of ``shard-{i}-{k}``, k = 0, 1...
    that maps there (a few tries on average: the map is uniform)."""
    for k in itertools.count():
        key = f"shard-{shard}-{k}"
        if shard_of(key, shard_count) == shard:
            return key
    raise AssertionError("unreachable")  # pragma: no cover


@dataclass(frozen=True, slots=True)
class ShardStubs:
    """The two service stubs over one channel, and the address it dials ('' if unknown)."""

    address: str
    channel: grpc.aio.Channel
    sessions: session_service_pb2_grpc.SessionServiceAsyncStub
    workers: worker_service_pb2_grpc.WorkerServiceAsyncStub

    @classmethod
    def over(cls, channel: grpc.aio.Channel, address: str = "") -> ShardStubs:
        return cls(
            address,
            channel,
            session_service_pb2_grpc.SessionServiceStub(channel),
            worker_service_pb2_grpc.WorkerServiceStub(channel),
        )


@dataclass(frozen=True, slots=True)
class Route:
    """Where one call goes: the stubs, the headers to add, and the shard index (-1 for an
    owner reached by address only)."""

    shard: int
    stubs: ShardStubs
    headers: tuple[tuple[str, str], ...]


class ShardRouting:
    """Maps groups to routes for one of the three layouts (see the module docstring).

    Args:
        shards: one ``ShardStubs`` per shard, in shard order; exactly one for an unsharded
            router or a proxy.
        shard_count: N behind a proxy (``shards`` then holds the proxy alone); None otherwise.
        open_stubs: opens stubs to an address outside ``shards`` (an owner named by a
            ``WRONG_SHARD`` refusal); None to follow such refusals only to known shards.
    """

    def __init__(
        self,
        shards: Sequence[ShardStubs],
        *,
        shard_count: int | None = None,
        open_stubs: Callable[[str], ShardStubs] | None = None,
    ) -> None:
        if not shards:
            raise ValueError("at least one router address is needed")
        if shard_count is not None and len(shards) != 1:
            raise ValueError("shard_count is for one proxy address; a shard list gives N itself")
        self.shards = tuple(shards)
        self.via_proxy = shard_count is not None
        self.count = shard_count if shard_count is not None else len(self.shards)
        shard_of("", self.count)  # validates the count
        self.sharded = self.count > 1 or self.via_proxy
        self._open_stubs = open_stubs
        self._extra: dict[str, ShardStubs] = {}
        self._next = itertools.count()
        self._keys = (
            [routing_key(i, self.count) for i in range(self.count)] if self.via_proxy else []
        )

    def shard_of(self, group_id: str) -> int:
        return shard_of(group_id, self.count) if self.count > 1 else 0

    def for_group(self, group_id: str) -> Route:
        """The owner of ``group_id``."""
        shard = self.shard_of(group_id)
        return Route(shard, self._stubs(shard), self._header(group_id))

    def for_session(self, session: str) -> Route:
        """The owner of the session's group; any shard for a malformed name (which every
        shard refuses alike)."""
        group = group_of_session(session)
        return self.any() if group is None else self.for_group(group)

    def shard(self, shard: int) -> Route:
        """Shard ``shard`` itself, for a call that names no group (a routing key behind a
        proxy)."""
        headers = ((GROUP_HEADER, self._keys[shard]),) if self.via_proxy else ()
        return Route(shard, self._stubs(shard), headers)

    def any(self) -> Route:
        """The next shard, round-robin: for calls any shard serves alike. Behind a proxy the
        call carries no header and the proxy picks (nginx round-robins an empty key)."""
        if self.via_proxy:
            return Route(-1, self.shards[0], ())
        return self.shard(next(self._next) % self.count)

    def owner_of(self, error: SessionRouterError, tried: Route) -> Route | None:
        """Where a ``WRONG_SHARD`` refusal says the group lives; None when ``error`` is not
        one, names no reachable owner, or names the shard just tried."""
        if error.reason != WRONG_SHARD:
            return None
        metadata = error.metadata
        address = metadata.get("owner_address", "")
        count = metadata.get("shard_count", "")
        owner = metadata.get("owner_shard", "")
        if count.isdigit() and int(count) != self.count:
            _log.warning(
                "the routers run %s shards, this client was given %d: fix the client's shard"
                " list (following the refusal to %s)",
                count,
                self.count,
                address or f"shard {owner}",
            )
        route: Route | None = None
        for i, stubs in enumerate(self.shards):
            if address and stubs.address == address and not self.via_proxy:
                route = Route(i, stubs, tried.headers)
        if route is None and address and self._open_stubs is not None:
            opened = self._extra.get(address)
            if opened is None:
                opened = self._extra[address] = self._open_stubs(address)
            route = Route(-1, opened, tried.headers)
        if (
            route is None
            and owner.isdigit()
            and count.isdigit()
            and int(count) == self.count
            and int(owner) < self.count
            and not self.via_proxy
        ):
            route = Route(int(owner), self._stubs(int(owner)), tried.headers)
        if route is None or route.stubs is tried.stubs:
            return None
        return route

    async def close_extra(self) -> None:
        """Closes the channels opened to follow refusals."""
        for stubs in self._extra.values():
            await stubs.channel.close()
        self._extra.clear()

    def _stubs(self, shard: int) -> ShardStubs:
        return self.shards[0] if self.via_proxy else self.shards[shard]

    def _header(self, group_id: str) -> tuple[tuple[str, str], ...]:
        # gRPC header values are printable ASCII; every valid group id is. An id that is not
        # goes without the header and gets the router's INVALID_ARGUMENT.
        if self.sharded and group_id.isascii() and group_id.isprintable():
            return ((GROUP_HEADER, group_id),)
        return ()
