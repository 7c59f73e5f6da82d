"""Group commit: the event loop appends, one writer thread makes batches durable.

The event loop only appends events to a list (``append``, about 0.1 us). A caller that must
not reply before its changes are durable awaits ``commit()``. One writer thread writes one
batch at a time; everything appended while it writes forms the next batch, so N concurrent
callers share one fsync instead of paying N. An idle writer gets the batch at the next turn
of the loop, so the calls the loop runs in one turn share a batch too.

A batch is made durable by ONE autocommit ``INSERT`` of the encoded batch into ``log`` (one
step, fsync included, GIL released throughout), and the writer folds the log into the
tables every ``FOLD_EVENTS`` events (or when idle), in one transaction that also deletes the
folded rows (see the package docstring for why). Opening a journal folds what a crash left
in ``log`` before anything else.

The thread runs as little Python per batch as it can: the loop encodes the batch when it
hands it over and does the bookkeeping (COMMITTED, counters, metrics) when the thread reports
it durable. Each time the thread needs the GIL back while the loop is busy, it waits up to
the interpreter's switch interval (5 ms); so per batch it takes the GIL only to wake up, to
come back from the INSERT and to report. Measured under StartSession load (ghz, 64 in
flight): encoding, the COMMITTED write and the metrics on the thread made every call cost
the router 35-40% more CPU than without a journal; done on the loop, about 8% more.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable, Generator, Sequence
from pathlib import Path
from typing import Any

from sessionrouter.server.core.errors import Unavailable
from sessionrouter.server.core.events import Event, GroupFinalized, RecoveredState, RewardSaved
from sessionrouter.server.journal.errors import JournalError
from sessionrouter.server.journal.fold import Rewards, fold
from sessionrouter.server.journal.logrows import Batch, Finalized, LoggedEvent
from sessionrouter.server.journal.tables import JournalTables, SyncMode

log = logging.getLogger("sessionrouter.journal")

DEFAULT_KEEP_FINISHED = 100_000
DEFAULT_COMPACT_STEP = 1024
"""Least number of groups a compaction deletes: big enough that its fixed cost is amortised,
small enough (about 10k rows for groups of 8) that the batch waiting behind it waits a few ms."""
FOLD_EVENTS = 16_384
"""Logged events that trigger a fold into the tables: large enough that the statements of a
fold are amortised over many batches, small enough that a fold (about 20 ms) does not hold
the next batch up for long, and that opening after a crash folds little."""
FOLD_IDLE_S = 0.05
"""A writer with nothing to write for this long folds what the log holds."""
DISK_FULL_RETRY_S = 0.5
"""How often a writer whose disk is full tries the same batch again."""


def is_disk_full(error: BaseException) -> bool:
    """SQLite's SQLITE_FULL ("database or disk is full"), or ENOSPC/EDQUOT from the OS: a
    condition that passes when space is freed, unlike a damaged or vanished file."""
    if isinstance(error, sqlite3.Error):
        return getattr(error, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL
    return isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)


OpenTables = Callable[[Path, SyncMode], JournalTables]
"""Opens the tables of a state directory: ``JournalTables`` itself, or in tests a subclass
whose writes fail."""


class _Durable:
    """Awaitable for one journal batch. Shielded: a caller that is cancelled while waiting
    (its client went away) must not cancel the batch every other caller waits for."""

    __slots__ = ("_batch",)

    def __init__(self, batch: asyncio.Future[None]) -> None:
        self._batch = batch

    def __await__(self) -> Generator[Any, None, None]:
        return asyncio.shield(self._batch).__await__()


class SqliteJournal:
    """The journal of one state directory: a ``JournalSink`` with group commit.

    Life cycle: construct (opens, checks or creates the file, takes the lock, folds what a
    crash left in the log), ``load()`` the state (start-up only), ``start()`` the writer
    thread on the running loop, then ``append`` and ``commit`` from the loop; ``close()``
    flushes and releases everything. ``write_pending()`` applies what was appended
    synchronously, for tools and tests that run no writer.
    """

    def __init__(
        self,
        state_dir: Path | str,
        *,
        sync: SyncMode = SyncMode.FULL,
        keep_finished: int = DEFAULT_KEEP_FINISHED,
        compact_step: int = DEFAULT_COMPACT_STEP,
        fold_events: int = FOLD_EVENTS,
        open_tables: OpenTables = JournalTables,
    ) -> None:
        if keep_finished < 1 or compact_step < 1 or fold_events < 1:
            raise ValueError("keep_finished, compact_step and fold_events must be at least 1")
        self.sync = sync
        self.keep_finished = keep_finished
        self.compact_step = compact_step
        self.fold_events = fold_events
        """Logged events that trigger a fold (``FOLD_EVENTS``; tests fold more often)."""
        self.on_failure: list[Callable[[BaseException], None]] = []
        """Called on the loop, once, when a batch cannot be written."""
        self.on_disk_full: list[Callable[[bool], None]] = []
        """Called on the loop with True when writes start failing for lack of space (they
        are retried, nothing is acknowledged meanwhile) and with False once one succeeds."""
        self.disk_full = False
        self.batches = 0
        """Batches (transactions) written by this process; for tests and benchmarks."""
        self.on_commit: Callable[[float, int, int], None] | None = None
        """Called on the loop after each batch is durable, with the seconds the write (and
        its fsync) took, its events and its encoded bytes (metrics)."""
        self._closed = False
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        """Set by close(): a writer waiting for disk space gives up."""
        self._full_reported = False
        """Writer thread: the current lack of space was reported."""
        self._tables = open_tables(Path(state_dir), sync)
        self.state_dir = self._tables.state_dir
        self.path = self._tables.path
        self._unfolded = Batch()
        """What the ``log`` rows not folded yet hold (writer thread only)."""
        self._last_log_id = 0
        self._fold_log_left_by_a_crash()
        try:
            self._tables.check_committed()
        except JournalError:
            self.close_now()
            raise
        self._durable_events = self._tables.events
        """Events durable so far, folded or in the log (only the writer changes it)."""
        # Loop side.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending = Batch()
        self._next: asyncio.Future[None] | None = None
        self._inflight: asyncio.Future[None] | None = None
        self._done: asyncio.Future[None] | None = None
        self._error: Unavailable | None = None
        self._queue: queue.SimpleQueue[tuple[Batch, bytes, asyncio.Future[None]] | None] = (
            queue.SimpleQueue()
        )

    # -- start-up ----------------------------------------------------------------------------

    def check(self) -> None:
        """SQLite's quick_check over the whole file; JournalError naming the damage."""
        self._tables.check()

    def load(self) -> RecoveredState:
        """Reads everything back, validated. JournalError when a row cannot be understood."""
        return self._tables.load()

    def _fold_log_left_by_a_crash(self) -> None:
        try:
            logged, last_id = self._tables.read_log()
        except JournalError:
            self.close_now()
            raise
        if last_id:
            try:
                self.write(logged.events, logged.rewards(), fold_log_upto=last_id)
            except sqlite3.DatabaseError as exc:
                self.close_now()
                raise JournalError(self.path, f"its log cannot be folded ({exc})") from None
            log.info(
                "journal log folded",
                extra={"event": "journal_log_folded", "events": len(logged)},
            )

    # -- the event loop side -----------------------------------------------------------------

    def start(self) -> None:
        """Starts the writer thread, bound to the running loop."""
        if self._thread is not None:
            raise RuntimeError("journal already started")
        self._loop = asyncio.get_running_loop()
        self._done = self._loop.create_future()
        self._done.set_result(None)
        self._thread = threading.Thread(target=self._run_writer, name="journal", daemon=True)
        self._thread.start()

    def append(self, event: Event) -> None:
        if type(event) is RewardSaved:
            self.reward(event.group_seq, event.idx, event.reward)
        else:
            self._pending.events.append(event)

    def reward(self, group_seq: int, idx: int, value: float) -> None:
        pending = self._pending
        pending.seqs.append(group_seq)
        pending.idxs.append(idx)
        pending.values.append(value)

    def commit(self) -> Awaitable[None]:
        """Resolves once everything appended so far is durable; raises Unavailable once the
        journal has failed (the router then stops: it can no longer promise anything).

        An idle writer is handed the batch at the next turn of the loop, not at once: the
        other calls the loop runs in this turn join it and share its write."""
        if self._error is not None:
            raise self._error
        if self._pending:
            if self._next is None:
                assert self._loop is not None, "journal not started"
                self._next = self._loop.create_future()
                if self._inflight is None:
                    self._loop.call_soon(self._dispatch_if_idle)
            return _Durable(self._next)
        if self._inflight is not None:
            return _Durable(self._inflight)
        assert self._done is not None, "journal not started"
        return self._done

    def kick(self) -> None:
        """Starts writing what was appended without anyone committing (worker-lost marks
        from the expiry tick), if the writer is idle."""
        if self._thread is not None:
            self._dispatch_if_idle()

    @property
    def failed(self) -> bool:
        return self._error is not None

    @property
    def events(self) -> int:
        """Events made durable over the journal's life: folded (counted in ``meta``, which
        compaction keeps) or still in the log."""
        return self._durable_events

    def _dispatch_if_idle(self) -> None:
        if self._pending and self._inflight is None and self._error is None:
            self._dispatch()

    def _dispatch(self) -> None:
        """Hands the pending batch to the writer thread, encoded: all the Python work of a
        batch is done here, so the thread only runs the INSERT (without the GIL) and
        reports back."""
        assert self._loop is not None
        events, self._pending = self._pending, Batch()
        batch = self._next if self._next is not None else self._loop.create_future()
        self._next = None
        self._inflight = batch
        events.events = [
            Finalized.of(e) if isinstance(e, GroupFinalized) else e for e in events.events
        ]
        self._queue.put((events, events.encode(), batch))

    def _written(
        self,
        batch: asyncio.Future[None] | None,
        error: BaseException | None,
        seconds: float = 0.0,
        events: int = 0,
        size: int = 0,
    ) -> None:
        """On the loop, from the writer thread: ``batch`` (``events`` events, ``size``
        encoded bytes) is in the log after ``seconds``, or ``error`` stopped the writer. The
        bookkeeping of a durable batch (COMMITTED, counters, metrics) is done here rather
        than on the thread, which would wait for the GIL for each of them."""
        if batch is not None:
            self._inflight = None
        if error is None:
            assert batch is not None
            self._durable_events += events
            try:
                self._tables.files.record(self._durable_events)
            except OSError as exc:
                error = exc
            else:
                self.batches += 1
                if self.on_commit is not None:
                    self.on_commit(seconds, events, size)
                batch.set_result(None)
                if self._pending:
                    self._dispatch()
                return
        if self._error is not None:
            return
        self._error = Unavailable(
            "JOURNAL_FAILED",
            f"the journal {self.path} cannot be written ({error}); the router stops",
            retry_after_s=1.0,
        )
        log.critical(
            "journal write failed",
            extra={"event": "journal_failed", "path": str(self.path), "error": repr(error)},
        )
        for future in (batch, self._inflight, self._next):
            if future is not None and not future.done():
                future.set_exception(self._error)
                future.exception()  # retrieved: waiters re-raise it, nobody else must log it
        self._next = None
        self._pending = Batch()
        for callback in self.on_failure:
            callback(error)

    async def close(self) -> None:
        """Writes what is pending, stops the writer and closes the file. Safe to call twice."""
        if self._closed:
            return
        if self._thread is not None:
            if self._error is None and not self.disk_full:
                with contextlib.suppress(Unavailable):
                    self.kick()
                    await self.commit()
            self._stopping.set()
            self._queue.put(None)
            await asyncio.to_thread(self._thread.join)
        self.close_now()

    def close_now(self) -> None:
        """Closes the file without writing anything pending (start-up errors, tests)."""
        if self._closed:
            return
        self._closed = True
        self._tables.close()

    # -- the writer thread -------------------------------------------------------------------

    def _run_writer(self) -> None:
        while True:
            idle = False
            try:
                item = self._queue.get(timeout=FOLD_IDLE_S if self._unfolded else None)
            except queue.Empty:
                item, idle = None, True
            if item is None and not idle:
                break
            if item is not None:
                events, row, batch = item
                error: BaseException | None = None
                started = time.perf_counter()
                while True:
                    try:
                        self._last_log_id = self._tables.append_log(row) or self._last_log_id
                    except BaseException as exc:  # every failure must reach the waiters
                        if is_disk_full(exc) and self._wait_for_space(exc):
                            continue
                        error = exc
                    break
                seconds = time.perf_counter() - started
                self._space_back()
                if error is None:
                    self._unfolded.extend(events)
                if not self._notify(batch, error, seconds, len(events), len(row)):
                    return
                if error is not None:
                    return
            if len(self._unfolded) >= self.fold_events or (idle and self._unfolded):
                try:
                    self._fold(carry=not idle)
                except BaseException as exc:  # the batches are safe in the log
                    if is_disk_full(exc) and self._wait_for_space(exc):
                        continue  # folded again later; the log still holds every batch
                    self._notify(None, exc)
                    return
        with contextlib.suppress(BaseException):  # a clean stop leaves an empty log
            self._fold(carry=False)

    def _wait_for_space(self, error: BaseException) -> bool:
        """After a write failed for lack of space: says so once, waits, and returns True to
        try again (False when the loop is gone or the journal is closing)."""
        if not self._full_reported:
            self._full_reported = True
            log.error(
                "disk full: the journal %s cannot be written (%s); nothing is acknowledged"
                " until it can, retrying every %.1f s",
                self.path,
                error,
                DISK_FULL_RETRY_S,
                extra={"event": "journal_disk_full", "path": str(self.path)},
            )
            assert self._loop is not None
            try:
                self._loop.call_soon_threadsafe(self._set_disk_full, True)
            except RuntimeError:
                return False
        time.sleep(DISK_FULL_RETRY_S)
        return not self._stopping.is_set()

    def _space_back(self) -> None:
        if self._full_reported:
            self._full_reported = False
            log.warning(
                "journal writable again",
                extra={"event": "journal_disk_writable", "path": str(self.path)},
            )
            assert self._loop is not None
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._set_disk_full, False)

    def _set_disk_full(self, full: bool) -> None:
        self.disk_full = full
        for callback in self.on_disk_full:
            callback(full)

    def _notify(
        self,
        batch: asyncio.Future[None] | None,
        error: BaseException | None,
        seconds: float = 0.0,
        events: int = 0,
        size: int = 0,
    ) -> bool:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._written, batch, error, seconds, events, size)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            return False
        return True

    def _fold(self, carry: bool) -> None:
        """Folds the log into the tables; under load (``carry``) the rewards of groups still
        open are carried over to the next fold (see ``fold``), when idle or stopping not."""
        if self._unfolded:
            folded, self._unfolded = self._unfolded, Batch()
            try:
                self._unfolded = self.write(
                    folded.events,
                    folded.rewards(),
                    fold_log_upto=self._last_log_id,
                    carried_before=folded.carried,
                    carry=carry,
                )
            except BaseException:
                self._unfolded = folded  # rolled back: still in the log, folded later
                raise
        self._compact_if_due()

    def log_pending(self) -> None:
        """Makes what was appended durable as the writer thread does, as one ``log`` row,
        without folding it: for tests of what a crash leaves behind."""
        if self._thread is not None:
            raise RuntimeError("the writer thread owns the journal")
        pending, self._pending = self._pending, Batch()
        pending.events = [
            Finalized.of(e) if isinstance(e, GroupFinalized) else e for e in pending.events
        ]
        self._last_log_id = self._tables.append_log(pending.encode()) or self._last_log_id
        self._unfolded.extend(pending)
        self._durable_events += len(pending)
        self._tables.files.record(self._durable_events)
        self.batches += 1

    def write_pending(self) -> None:
        """Writes what was appended, synchronously on the calling thread, and compacts if
        due: for tools and tests that run no writer thread (never while one runs)."""
        if self._thread is not None:
            raise RuntimeError("the writer thread owns the journal")
        pending, self._pending = self._pending, Batch()
        self.write(pending.events, pending.rewards())
        self._durable_events += len(pending)
        self._tables.files.record(self._durable_events)
        self.batches += 1
        self._compact_if_due()

    def _compact_if_due(self) -> None:
        tables = self._tables
        if tables.last_cursor - tables.compacted_cursor >= self.keep_finished + self.compact_step:
            tables.compact(tables.last_cursor - self.keep_finished)

    def write(
        self,
        events: Sequence[LoggedEvent],
        rewards: Rewards = ([], [], []),
        fold_log_upto: int = 0,
        carried_before: int = 0,
        carry: bool = False,
    ) -> Batch:
        """Folds events and rewards (see ``fold``) and applies them to the tables in one
        transaction, deleting the ``log`` rows up to ``fold_log_upto``; returns the rewards
        carried over to the next fold (already logged again)."""
        tables = self._tables
        changes = fold(
            events,
            rewards,
            last_cursor=tables.last_cursor,
            next_seq=tables.next_seq,
            carried_before=carried_before,
            carry=carry,
        )
        carried_id = tables.apply(changes, fold_log_upto)
        if carried_id:
            self._last_log_id = carried_id
        return changes.carried

    def compact(self, upto_cursor: int) -> int:
        """Deletes the groups finalized at or before ``upto_cursor`` (see the tables)."""
        return self._tables.compact(upto_cursor)

    def checkpoint(self) -> None:
        self._tables.checkpoint()

    def size_bytes(self) -> int:
        """Bytes on disk: the database file plus its WAL."""
        return self._tables.size_bytes()
