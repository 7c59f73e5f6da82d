"""Rewards for a sharded router: one SubmitRewards stream per shard, one stream to the caller.

A shard records rewards only for the sessions of its own groups (another shard's entry comes
back ``WRONG_SHARD``), so a batch that mixes groups is split by ``shard_of(group)``: each
shard gets its own ``RewardStream`` (batching, acks, reconnects and resends as for one router),
opened on the first entry for that shard, with ``x-group-id`` set to that entry's group (the
header a proxy's shard map hashes; behind a proxy a shard's stream stays on that shard because
every later entry on it maps there too).

What the caller sees is what one ``RewardStream`` promises: ``submit`` answers its entry;
``submit_many`` returns ``results[i]`` for ``rewards[i]``, in the caller's order, whatever the
shards; ``watch_group`` resolves from the stream of the group's shard; ``results()`` merges
the group results of all shards (in arrival order, which across shards is not cursor order;
the feed has that). A shard's stream failing fails its own entries only: the other shards'
entries are answered as usual, and ``results()`` raises the first failure at the end.

An entry answered ``WRONG_SHARD`` (the client's shard list disagrees with the routers') is
resent once to the shard the answer names; what that shard answers is the entry's result.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from types import TracebackType
from typing import Any, NoReturn, Self

from sessionrouter.client._errors import SessionRouterError, StreamClosedError
from sessionrouter.client._rewards import RewardStream
from sessionrouter.client._shards import ShardRouting, group_of_session
from sessionrouter.client.types import GroupResult, RewardResult, RewardStatus

__all__ = ["ShardedRewardStream", "split_by_shard", "wrong_shard_owner"]

_log = logging.getLogger("sessionrouter.client.shards")

RewardEntryTuple = tuple[str, float] | tuple[str, float, float | None]

OpenShardStream = Callable[[int, str | None], RewardStream]
"""``open_stream(shard, group_id)`` builds (unopened) the RewardStream of one shard; the group
is the first one sent on it (its ``x-group-id``), None when the entry's name is malformed."""


def split_by_shard(
    routing: ShardRouting, sessions: Iterable[str]
) -> dict[int, tuple[list[int], str | None]]:
    """Positions of ``sessions`` by owning shard, in order, with the first group of each.

    A malformed session name goes to shard 0, which refuses it as any shard would.
    """
    by_shard: dict[int, tuple[list[int], str | None]] = {}
    for position, session in enumerate(sessions):
        group = group_of_session(session)
        shard = 0 if group is None else routing.shard_of(group)
        if shard not in by_shard:
            by_shard[shard] = ([], group)
        by_shard[shard][0].append(position)
    return by_shard


def wrong_shard_owner(routing: ShardRouting, result: RewardResult, sent_to: int) -> int | None:
    """The shard to resend an entry to: the owner a ``WRONG_SHARD`` result names, when it is
    one of ``routing``'s shards other than ``sent_to``; None otherwise (not followed)."""
    if result.status is not RewardStatus.WRONG_SHARD or result.owner_shard is None:
        return None
    owner = result.owner_shard
    if not 0 <= owner < routing.count or owner == sent_to:
        return None
    _log.warning(
        "shard %d refused a reward of shard %d's group (%s): the client's shard list disagrees"
        " with the routers'; resending it there",
        sent_to,
        owner,
        result.detail,
    )
    return owner


class _End:
    """One shard stream's results are over."""


class ShardedRewardStream(RewardStream):
    """The ``RewardStream`` interface over one stream per shard; see the module docstring.

    Use it as an async context manager (``client.reward_stream()`` builds it for a sharded
    client). Leaving the block closes every shard's stream (each flushes, waits for its acks
    and its end, at most ``close_timeout`` seconds, concurrently).

    A subclass so that code written against ``RewardStream`` takes it unchanged: it overrides
    every public method and holds no call of its own (the base's state stays unused).
    """

    def __init__(
        self, routing: ShardRouting, open_stream: OpenShardStream, *, keep_results: bool
    ) -> None:
        self._routing = routing
        self._open_stream = open_stream
        self._keep_results = keep_results
        self._streams: dict[int, RewardStream] = {}
        self._forwarders: list[asyncio.Task[None]] = []
        self._merged: asyncio.Queue[GroupResult | _End] = asyncio.Queue()
        self._shard_failures: list[SessionRouterError] = []
        self._entered = False
        self._closed = False

    async def __aenter__(self) -> Self:
        self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            await self.close()
            return
        self._closed = True
        await asyncio.gather(
            *(s.__aexit__(exc_type, exc, tb) for s in self._streams.values()),
            return_exceptions=True,
        )
        await self._join_forwarders()

    def open(self) -> None:
        """Marks the stream usable; each shard's stream opens on its first entry."""
        self._entered = True

    async def close(self) -> None:
        """Closes every shard's stream (flush, acks, end of stream), concurrently."""
        self._closed = True
        await asyncio.gather(*(s.close() for s in self._streams.values()))
        await self._join_forwarders()

    @property
    def shards_open(self) -> tuple[int, ...]:
        """The shards this stream has opened a SubmitRewards stream to, ascending."""
        return tuple(sorted(self._streams))

    async def submit(
        self,
        session: str,
        reward: float,
        *,
        filter_metric: float | None = None,
        min_version: int = 0,
        max_version: int = 0,
    ) -> RewardResult:
        """As ``RewardStream.submit``, on the stream of the session's shard."""
        group = group_of_session(session)
        shard = 0 if group is None else self._routing.shard_of(group)
        versions = {"min_version": min_version, "max_version": max_version}
        result = await self._stream(shard, group).submit(
            session, reward, filter_metric=filter_metric, **versions
        )
        owner = wrong_shard_owner(self._routing, result, shard)
        if owner is None:
            return result
        return await self._stream(owner, group).submit(
            session, reward, filter_metric=filter_metric, **versions
        )

    async def submit_many(self, rewards: Iterable[RewardEntryTuple]) -> list[RewardResult]:
        """As ``RewardStream.submit_many``: ``result[i]`` answers ``rewards[i]``; each shard's
        share goes on its stream at once, the shares concurrently."""
        entries = list(rewards)
        by_shard = split_by_shard(self._routing, (e[0] for e in entries))
        for shard, (_, group) in by_shard.items():
            self._stream(shard, group)
        shares = list(by_shard.items())
        outcomes = await asyncio.gather(
            *(
                self._streams[shard].submit_many(entries[p] for p in positions)
                for shard, (positions, _) in shares
            ),
            return_exceptions=True,
        )
        results: list[RewardResult | None] = [None] * len(entries)
        resend: dict[int, list[int]] = {}
        for (shard, (positions, _)), outcome in zip(shares, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                raise outcome
            for position, result in zip(positions, outcome, strict=True):
                results[position] = result
                owner = wrong_shard_owner(self._routing, result, shard)
                if owner is not None:
                    resend.setdefault(owner, []).append(position)
        for owner, positions in resend.items():
            stream = self._stream(owner, group_of_session(entries[positions[0]][0]))
            again = await stream.submit_many(entries[p] for p in positions)
            for position, result in zip(positions, again, strict=True):
                results[position] = result
        return [r for r in results if r is not None]

    def watch_group(self, group_id: str) -> asyncio.Future[GroupResult]:
        """As ``RewardStream.watch_group``, on the stream of the group's shard (opened now if
        no entry went there yet)."""
        return self._stream(self._routing.shard_of(group_id), group_id).watch_group(group_id)

    async def results(self) -> AsyncIterator[GroupResult]:
        """The group results of every shard's stream, as they arrive, until all have ended
        (after ``close``). Raises the first shard's failure at the end, if one failed."""
        if not self._keep_results:
            raise RuntimeError("this RewardStream was opened with keep_results=False")
        ended = 0
        while True:
            if self._closed and ended >= len(self._forwarders):
                if self._shard_failures:
                    raise self._shard_failures[0]
                return
            item = await self._merged.get()
            if isinstance(item, _End):
                ended += 1
                continue
            yield item

    async def submit_arrays(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Not over shards: a handle is its shard's own numbering, so it names no group to
        route by. Submit by name (``submit_many``), or keep one client per shard for the
        columnar form."""
        raise NotImplementedError(
            "submit_arrays is not available on a sharded client: handles do not name their"
            " group's shard; use submit_many, or one client per shard"
        )

    async def result_batches(self) -> NoReturn:  # type: ignore[override]
        """Not over shards (see ``submit_arrays``); ``results()`` merges every shard's."""
        raise NotImplementedError(
            "result_batches is not available on a sharded client; use results()"
        )

    # Internals ------------------------------------------------------------------------------

    def _stream(self, shard: int, group: str | None) -> RewardStream:
        stream = self._streams.get(shard)
        if stream is not None:
            return stream
        if not self._entered:
            raise RuntimeError("use the RewardStream inside `async with`")
        if self._closed:
            raise StreamClosedError("the reward stream is closed or closing")
        stream = self._streams[shard] = self._open_stream(shard, group)
        stream.open()
        if self._keep_results:
            self._forwarders.append(
                asyncio.create_task(self._forward(stream), name=f"sessionrouter-rewards-{shard}")
            )
        return stream

    async def _forward(self, stream: RewardStream) -> None:
        try:
            async for result in stream.results():
                self._merged.put_nowait(result)
        except SessionRouterError as error:
            self._shard_failures.append(error)
        finally:
            self._merged.put_nowait(_End())

    async def _join_forwarders(self) -> None:
        # Each forwarder ends with its stream; wake a results() that waits with none open.
        if not self._forwarders:
            self._merged.put_nowait(_End())
        await asyncio.gather(*self._forwarders, return_exceptions=True)
