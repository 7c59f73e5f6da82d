"""The reward stream: many concurrent submitters, one SubmitRewards stream, batched.

A trainer runs hundreds of rollouts at once, and each finishes with one reward. Sending each
reward as its own request costs one message and one ack per rollout; this helper instead puts
the entries that arrive within ``max_delay`` seconds (at most ``max_batch`` of them) into one
``SubmitRewardsRequest``, gives it a fresh ``sequence``, and resolves each submitter's future
from the matching ack (``results[i]`` answers ``entries[i]``).

Nothing is dropped silently: when the stream fails, every entry not yet acknowledged fails
with the mapped error (``StreamClosedError`` when the stream simply ended), later submits
raise it too, and ``results()`` raises it after the last result it delivered.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Self

import grpc

from sessionrouter.client import _convert
from sessionrouter.client._errors import (
    InternalError,
    SessionRouterError,
    StreamClosedError,
    map_rpc_errors,
)
from sessionrouter.client.types import GroupResult, RewardResult
from sessionrouter.v1 import resources_pb2
from sessionrouter.v1 import session_service_pb2 as pb

__all__ = ["RewardStream"]

RewardCall = grpc.aio.StreamStreamCall[pb.SubmitRewardsRequest, pb.SubmitRewardsResponse]

MAX_ENTRIES_PER_REQUEST = 4096
"""The contract's limit on entries in one SubmitRewardsRequest."""


@dataclass(slots=True)
class _Pending:
    entry: pb.RewardEntry
    future: asyncio.Future[RewardResult]


class _End:
    """Marks the end of the results queue."""


class RewardStream:
    """One open SubmitRewards stream shared by concurrent submitters.

    Use it as an async context manager (``client.reward_stream()`` builds one). Leaving the
    block normally flushes every queued entry, waits for their acks and for the router to end
    the stream (so that group results sent after the last ack still arrive), at most
    ``close_timeout`` seconds. Leaving it with an exception cancels the stream; the entries
    still unacknowledged then fail with ``StreamClosedError``.
    """

    def __init__(
        self,
        open_call: Callable[[], RewardCall],
        *,
        max_batch: int = 256,
        max_delay: float = 0.005,
        keep_results: bool = True,
        close_timeout: float | None = 10.0,
    ) -> None:
        """
        Args:
            open_call: starts the SubmitRewards call (the client passes its stub and metadata).
            max_batch: most entries per request, 1 to 4096.
            max_delay: seconds an entry may wait for company before its request is sent; the
                window opens when the first entry of a batch arrives. 0 sends what is queued.
            keep_results: queue the group results that arrive, for ``results()``. Turn off
                when nobody reads them (they are on the feed too), or they pile up in memory.
            close_timeout: seconds a normal close waits for acks and the end of the stream.
        """
        if not 1 <= max_batch <= MAX_ENTRIES_PER_REQUEST:
            raise ValueError(f"max_batch must be 1 to {MAX_ENTRIES_PER_REQUEST}, got {max_batch}")
        if max_delay < 0:
            raise ValueError(f"max_delay must be non-negative, got {max_delay}")
        self._open_call = open_call
        self._max_batch = max_batch
        self._max_delay = max_delay
        self._keep_results = keep_results
        self._close_timeout = close_timeout
        self._call: RewardCall | None = None
        self._queued: list[_Pending] = []
        self._inflight: dict[int, list[_Pending]] = {}
        self._sequence = itertools.count(1)
        self._has_work = asyncio.Event()
        self._batch_full = asyncio.Event()
        self._closing = False
        self._failure: SessionRouterError | None = None
        self._closed_by_us = False
        self._results: asyncio.Queue[GroupResult | _End] = asyncio.Queue()
        self._group_watchers: dict[str, list[asyncio.Future[GroupResult]]] = {}
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Self:
        self._call = self._open_call()
        self._tasks = [
            asyncio.create_task(self._send_loop(), name="sessionrouter-reward-send"),
            asyncio.create_task(self._read_loop(), name="sessionrouter-reward-read"),
        ]
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            await self.close()
        else:
            self._abort(StreamClosedError("the reward stream was closed by an exception"))
            await self._join()

    async def close(self) -> None:
        """Flushes queued entries, waits for their acks and the end of the stream."""
        self._closing = True
        self._has_work.set()
        self._batch_full.set()
        try:
            async with asyncio.timeout(self._close_timeout):
                await asyncio.gather(*self._tasks, return_exceptions=True)
        except TimeoutError:
            self._abort(
                StreamClosedError(f"the router did not end the stream in {self._close_timeout}s")
            )
        await self._join()

    async def submit(self, session: str, reward: float) -> RewardResult:
        """Submits one reward and returns what the router did with it.

        ``RewardResult.ok`` is true for ACCEPTED and DUPLICATE. Raises the stream's error if
        the stream died before this entry was acknowledged.
        """
        return await self._enqueue(_convert.reward_entry_to_proto(session, reward))

    async def submit_many(self, rewards: Iterable[tuple[str, float]]) -> list[RewardResult]:
        """Submits several rewards at once; ``result[i]`` answers ``rewards[i]``."""
        futures = [self._enqueue_nowait(_convert.reward_entry_to_proto(s, r)) for s, r in rewards]
        outcomes = await asyncio.gather(*futures, return_exceptions=True)
        results: list[RewardResult] = []
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
            results.append(outcome)
        return results

    def watch_group(self, group_id: str) -> asyncio.Future[GroupResult]:
        """A future for the result of ``group_id``, if it arrives on this stream.

        Register before submitting the reward that completes the group: results are not kept
        for late watchers. It fails with the stream's error if the stream ends first.
        """
        future: asyncio.Future[GroupResult] = asyncio.get_running_loop().create_future()
        if self._failure is not None:
            future.set_exception(self._failure)
            return future
        watchers = self._group_watchers.setdefault(group_id, [])
        watchers.append(future)

        def forget(done: asyncio.Future[GroupResult]) -> None:
            # A watcher the caller cancels (it got the result elsewhere) must not pile up.
            if done in watchers:
                watchers.remove(done)
            if not watchers and self._group_watchers.get(group_id) is watchers:
                del self._group_watchers[group_id]

        future.add_done_callback(forget)
        return future

    async def results(self) -> AsyncIterator[GroupResult]:
        """The group results that arrive on this stream, until it ends.

        Requires ``keep_results=True``. Raises the stream's error at the end if the stream
        failed rather than closed. Meant for one consumer.
        """
        if not self._keep_results:
            raise RuntimeError("this RewardStream was opened with keep_results=False")
        while True:
            item = await self._results.get()
            if isinstance(item, _End):
                self._results.put_nowait(item)  # later calls end too
                if self._failure is not None and not self._closed_by_us:
                    raise self._failure
                return
            yield item

    # Internals ------------------------------------------------------------------------------

    def _enqueue_nowait(self, entry: pb.RewardEntry) -> asyncio.Future[RewardResult]:
        if self._call is None:
            raise RuntimeError("use the RewardStream inside `async with`")
        if self._failure is not None and not self._closed_by_us:
            raise self._failure
        if self._closing:
            raise StreamClosedError("the reward stream is closed or closing")
        future: asyncio.Future[RewardResult] = asyncio.get_running_loop().create_future()
        self._queued.append(_Pending(entry, future))
        self._has_work.set()
        if len(self._queued) >= self._max_batch:
            self._batch_full.set()
        return future

    async def _enqueue(self, entry: pb.RewardEntry) -> RewardResult:
        return await self._enqueue_nowait(entry)

    async def _send_loop(self) -> None:
        assert self._call is not None
        backlog = False
        try:
            while True:
                await self._has_work.wait()
                if not self._queued:
                    if self._closing:
                        break
                    self._has_work.clear()
                    continue
                if not backlog and len(self._queued) < self._max_batch and not self._closing:
                    # Let concurrent submitters join this batch for up to max_delay.
                    self._batch_full.clear()
                    try:
                        async with asyncio.timeout(self._max_delay):
                            await self._batch_full.wait()
                    except TimeoutError:
                        pass
                batch = self._queued[: self._max_batch]
                del self._queued[: self._max_batch]
                # Entries left over already waited a window: the next batch goes at once.
                backlog = bool(self._queued)
                if not self._queued and not self._closing:
                    self._has_work.clear()
                live = [p for p in batch if not p.future.done()]  # skip cancelled submitters
                if not live:
                    continue
                sequence = next(self._sequence)
                self._inflight[sequence] = live
                request = pb.SubmitRewardsRequest(
                    entries=[p.entry for p in live], sequence=sequence
                )
                with map_rpc_errors():
                    await self._call.write(request)
            with map_rpc_errors():
                await self._call.done_writing()
        except SessionRouterError as error:
            self._abort(error)
        except (asyncio.InvalidStateError, grpc.aio.UsageError) as error:
            # Writing to a call that already ended: the read loop holds the real reason.
            self._abort(StreamClosedError(f"the reward stream ended while sending: {error}"))
        except Exception as error:
            self._abort(_unexpected(error))

    async def _read_loop(self) -> None:
        assert self._call is not None
        try:
            with map_rpc_errors():
                while True:
                    message = await self._call.read()
                    if not isinstance(message, pb.SubmitRewardsResponse):
                        break  # grpc.aio.EOF: the router ended the stream normally
                    # A message may carry an ack, group results, or both; the ack of the
                    # request that finalized a group never comes after that group's result.
                    if message.HasField("ack"):
                        self._on_ack(message.ack)
                    for group_result in message.group_results:
                        self._on_group_result(group_result)
            self._abort(
                StreamClosedError("the router ended the reward stream before acknowledging")
            )
        except SessionRouterError as error:
            self._abort(error)
        except Exception as error:
            self._abort(_unexpected(error))
        finally:
            self._results.put_nowait(_End())

    def _on_ack(self, ack: pb.RewardAck) -> None:
        pending = self._inflight.pop(ack.sequence, None)
        if pending is None:
            raise InternalError(f"ack for unknown sequence {ack.sequence}")
        if len(ack.results) != len(pending):
            error = InternalError(
                f"ack {ack.sequence} has {len(ack.results)} results for {len(pending)} entries"
            )
            for p in pending:
                if not p.future.done():
                    p.future.set_exception(error)
            raise error
        for p, result in zip(pending, ack.results, strict=True):
            if not p.future.done():
                p.future.set_result(_convert.reward_result_from_proto(result))

    def _on_group_result(self, message: resources_pb2.GroupResult) -> None:
        result = _convert.group_result_from_proto(message)
        for future in self._group_watchers.pop(result.group_id, []):
            if not future.done():
                future.set_result(result)
        if self._keep_results:
            self._results.put_nowait(result)

    def _abort(self, error: SessionRouterError) -> None:
        """Ends the stream: fails everything not yet answered with ``error``. Idempotent."""
        if self._failure is None:
            self._failure = error
            self._closed_by_us = self._closing and isinstance(error, StreamClosedError)
        failure = self._failure
        self._closing = True
        pending = self._queued + [p for batch in self._inflight.values() for p in batch]
        self._queued.clear()
        self._inflight.clear()
        for p in pending:
            if not p.future.done():
                p.future.set_exception(failure)
        for watchers in self._group_watchers.values():
            for future in watchers:
                if not future.done():
                    future.set_exception(failure)
        self._group_watchers.clear()
        if self._call is not None:
            self._call.cancel()
        self._has_work.set()
        self._batch_full.set()

    async def _join(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _unexpected(error: Exception) -> InternalError:
    wrapped = InternalError(f"reward stream failed unexpectedly: {error!r}")
    wrapped.__cause__ = error
    return wrapped
