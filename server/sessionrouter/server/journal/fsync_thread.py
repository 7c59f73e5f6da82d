"""One thread that fsyncs the journal's WAL for the event loop.

The loop writes each batch into the WAL itself (an INSERT that only reaches the page cache,
tens of microseconds) and asks this thread for the fsync. The thread runs one line of Python
per request on each side of ``os.fdatasync`` (which releases the GIL), so it waits for the
GIL twice per batch at most, where a thread that also ran the INSERT and its bookkeeping
waited for it at every step.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable


class FsyncThread:
    """Runs ``sync`` (blocking, GIL-free) on its own thread; ``request()`` returns a future
    of the running loop that resolves when a ``sync`` started after the request returns,
    or fails with what it raised. Requests are served in order, one ``sync`` each."""

    def __init__(self, sync: Callable[[], None], loop: asyncio.AbstractEventLoop) -> None:
        self._sync = sync
        self._loop = loop
        self._requests: queue.SimpleQueue[asyncio.Future[None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="journal-fsync", daemon=True)
        self._thread.start()

    def request(self) -> asyncio.Future[None]:
        done = self._loop.create_future()
        self._requests.put(done)
        return done

    async def stop(self) -> None:
        """Serves what was requested, then ends the thread."""
        self._requests.put(None)
        await asyncio.to_thread(self._thread.join)

    def _run(self) -> None:
        while (done := self._requests.get()) is not None:
            error: BaseException | None = None
            try:
                self._sync()
            except BaseException as exc:  # every failure must reach the waiter
                error = exc
            try:
                self._loop.call_soon_threadsafe(_settle, done, error)
            except RuntimeError:  # the loop is closed: nobody waits any more
                return


def _settle(done: asyncio.Future[None], error: BaseException | None) -> None:
    if done.done():
        return
    if error is None:
        done.set_result(None)
    else:
        done.set_exception(error)
