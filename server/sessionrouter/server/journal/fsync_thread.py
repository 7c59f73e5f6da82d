"""One thread that fsyncs the journal's WAL for the event loop, and checkpoints it.

The loop writes each batch into the WAL itself (an INSERT that only reaches the page cache,
tens of microseconds) and asks this thread for the fsync. The thread runs one line of Python
per request on each side of ``os.fdatasync`` (which releases the GIL), so it waits for the
GIL twice per batch at most, where a thread that also ran the INSERT and its bookkeeping
waited for it at every step.

A request may carry the journal's new count of durable events: the thread rewrites the
COMMITTED file with it (a ``pwrite``, GIL-free) right after the fsync, so the loop does not
make that system call once per batch. A request may also ask for a checkpoint, run after
the fsync and before the answer: the loop
writes nothing while its batch waits for this answer, so the checkpoint copies the whole WAL
and the loop's next INSERT starts the WAL over. SQLite's automatic checkpoint would instead
run on the loop, inside an INSERT. A failed checkpoint does not fail the batch (its commits
are in the fsync'd WAL); it is logged and tried again at the next request that asks.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable

log = logging.getLogger("sessionrouter.journal")


class FsyncThread:
    """Runs ``sync`` (blocking, GIL-free) on its own thread; ``request()`` returns a future
    of the running loop that resolves when a ``sync`` started after the request returns,
    or fails with what it raised. Requests are served in order, one ``sync`` each; a request
    with ``committed`` then runs ``record(committed)`` (a failure fails the request like a
    failed ``sync``), and one with ``checkpoint`` runs ``checkpoint`` too, after its
    ``sync`` and before it resolves."""

    def __init__(
        self,
        sync: Callable[[], None],
        loop: asyncio.AbstractEventLoop,
        checkpoint: Callable[[], int] | None = None,
        record: Callable[[int], None] | None = None,
    ) -> None:
        self._sync = sync
        self._checkpoint = checkpoint
        self._record = record
        self._loop = loop
        self._requests: queue.SimpleQueue[tuple[asyncio.Future[None], bool, int | None] | None] = (
            queue.SimpleQueue()
        )
        self._checkpoint_failed = False
        self.checkpoints = 0
        """Checkpoints that succeeded (tests and benchmarks)."""
        self._thread = threading.Thread(target=self._run, name="journal-fsync", daemon=True)
        self._thread.start()

    def request(
        self, checkpoint: bool = False, committed: int | None = None
    ) -> asyncio.Future[None]:
        done = self._loop.create_future()
        self._requests.put((done, checkpoint, committed))
        return done

    async def stop(self) -> None:
        """Serves what was requested, then ends the thread."""
        self._requests.put(None)
        await asyncio.to_thread(self._thread.join)

    def _run(self) -> None:
        while (request := self._requests.get()) is not None:
            done, checkpoint, committed = request
            error: BaseException | None = None
            try:
                self._sync()
                if committed is not None and self._record is not None:
                    self._record(committed)
            except BaseException as exc:  # every failure must reach the waiter
                error = exc
            if checkpoint and error is None and self._checkpoint is not None:
                self._run_checkpoint(self._checkpoint)
            try:
                self._loop.call_soon_threadsafe(settle, done, error)
            except RuntimeError:  # the loop is closed: nobody waits any more
                return

    def _run_checkpoint(self, checkpoint: Callable[[], int]) -> None:
        started = time.perf_counter()
        try:
            frames = checkpoint()
        except Exception as exc:  # the WAL keeps everything: report, retry next time
            if not self._checkpoint_failed:
                self._checkpoint_failed = True
                log.warning(
                    "journal checkpoint failed; the WAL keeps growing until one succeeds",
                    extra={"event": "journal_checkpoint_failed", "error": repr(exc)},
                )
            return
        self.checkpoints += 1
        if self._checkpoint_failed:
            self._checkpoint_failed = False
            log.info(
                "journal checkpoint succeeded again",
                extra={"event": "journal_checkpoint_recovered"},
            )
        log.debug(
            "journal checkpointed",
            extra={
                "event": "journal_checkpointed",
                "frames": frames,
                "ms": round((time.perf_counter() - started) * 1000, 3),
            },
        )


def settle(done: asyncio.Future[None], error: BaseException | None) -> None:
    """Resolves ``done`` with ``error`` (None: success), unless it is done already (its
    waiter left)."""
    if done.done():
        return
    if error is None:
        done.set_result(None)
    else:
        done.set_exception(error)
