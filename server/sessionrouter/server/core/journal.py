"""The durable journal: router state in SQLite (WAL mode), written with group commit.

Why SQLite: it is in the standard library, needs no server, survives ``kill -9`` by design
(its WAL is replayed on the next open) and lets an operator inspect the state with the
``sqlite3`` shell. One file, ``journal.db``, lives in the state directory, next to a ``LOCK``
file that one router at a time holds (two routers writing one journal would hand out the same
cursors).

What is stored: the *current* state the events produce, one row per worker, group, session
and request id, plus a short log of the latest batches. Recovery reads the rows back (its cost
follows the retained state, not the history), and compaction is a ``DELETE`` of the finalized
groups that fell out of the retention window. Schema (version ``SCHEMA_VERSION``)::

    meta(key, value)            schema_version, created, last_cursor, next_seq,
                                compacted_cursor, events
    workers(worker_id PK, address, capacity, labels JSON, draining, seen_wall)
    groups(seq PK, group_id, task_id, size, estimator, eps, ddof, batch_std, deadline_s,
           min_members, create_time, deadline_wall, state, cursor,
           outcome, counted, excluded, rewards, advantages, mean, std, degenerate,
           finalize_time)      cursor > 0 exactly when finalized or dropped, and then the
                               result columns are set: counted/excluded are member indices
                               (uint16 little-endian), rewards/advantages float64 (little-
                               endian): exact, and read back without parsing. For such a
                               group the result is authoritative for its members' rewards.
    sessions((group_seq, idx) PK, worker_id, worker_address, request_id, metadata JSON,
             create_time, shared_worker, state, worker_lost, reward)
    requests(request_id PK, group_seq, idx, fingerprint JSON)
    log(id PK, events)          batches not yet folded into the tables above (pickled
                                tuples of plain values, read back without executing code)

Times are Unix seconds (REAL); ``deadline_wall`` is stored rather than a monotonic deadline so
that deadlines keep counting while the router is down.

Group commit: the event loop only appends events to a list (``append``, about 0.1 us). A
caller that must not reply before its changes are durable awaits ``commit()``. One writer
thread writes one batch at a time; everything appended while it writes forms the next batch,
so N concurrent callers share one fsync instead of paying N.

Why a log in front of the tables: each SQLite statement releases the GIL and must take it
back, and with the event loop busy on the other thread every take-back can wait for the
interpreter's switch interval; the loop stalls at every hand-over. Measured here: 4096
single-row UPDATEs took 72 ms with an idle loop and 17 s with a busy one; one transaction of
a handful of multi-row statements per batch still left reward throughput at about 0.63 of
the in-memory router, against 0.7 to 0.8 with the log below. So a batch is made
durable by ONE autocommit ``INSERT`` of the pickled batch into ``log`` (one step, fsync
included, GIL released throughout), and the writer *folds* the log into the tables every
``FOLD_EVENTS`` events (or when idle), in one transaction that also deletes the folded
rows: few statements per thousands of events, and rewards of groups finalized within the
same fold are never written row by row (their result holds them). Opening a journal folds
what a crash left in ``log`` before anything else.

Durability (``sync``):

- ``full`` (default): ``PRAGMA synchronous=FULL``: the WAL is fsync'd at every commit, that
  is once per batch. An acknowledged change survives ``kill -9``, an OS crash and a power
  loss. Measured here the fsync adds 0.2 to 0.4 ms of latency per batch and no measurable
  throughput cost (rewards/s with ``full`` and ``normal`` within 1%, 80.1k against 79.6k):
  group commit amortises it, so the stronger promise is the default.
- ``normal``: ``PRAGMA synchronous=NORMAL`` (WAL): commits reach the OS page cache but are
  fsync'd only at checkpoints. An acknowledged change survives ``kill -9`` of the router (the
  kernel still writes the file), but an OS crash or power loss can lose the last
  acknowledged transactions (never corrupt the file). Only for rewards that can be
  regenerated.

Compaction: groups finalized more than ``keep_finished`` cursors ago (the larger of the feed
retention and the finished-group retention, so a compacted group is one neither a resuming
subscriber nor GetGroup could reach any more) are deleted, ``compact_step`` groups or more at a
time, by the writer thread after a fold. Freed pages are reused by later writes, so the
file stops growing once the retention window is full.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import enum
import fcntl
import gc
import io
import itertools
import json
import logging
import os
import pickle
import queue
import sqlite3
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from sessionrouter.server.core.errors import Unavailable
from sessionrouter.server.core.estimators import EstimatorParams
from sessionrouter.server.core.events import (
    Event,
    GroupCreated,
    GroupFinalized,
    GroupRow,
    RecoveredState,
    RequestSaved,
    RewardSaved,
    SessionAborted,
    SessionLost,
    SessionStarted,
    WorkerRemoved,
    WorkerSaved,
)
from sessionrouter.server.core.feed import GroupOutcome, GroupResult
from sessionrouter.server.core.groups import SessionRecord, SessionState
from sessionrouter.server.core.validation import session_name

log = logging.getLogger("sessionrouter.journal")

SCHEMA_VERSION = 1
"""Bumped on any change of the tables or of what a column means. A journal with another
version is refused at start-up, never silently reset or reinterpreted."""
APPLICATION_ID = 0x53524A31
"""``PRAGMA application_id`` of a journal ("SRJ1"): tells our file from any other SQLite file."""
JOURNAL_FILE = "journal.db"
LOCK_FILE = "LOCK"
DEFAULT_KEEP_FINISHED = 100_000
WAL_SIZE_LIMIT = 16 * 1024 * 1024
DEFAULT_COMPACT_STEP = 1024
"""Least number of groups a compaction deletes: big enough that its fixed cost is amortised,
small enough (about 10k rows for groups of 8) that the batch waiting behind it waits a few ms."""

_SCHEMA = (
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value) WITHOUT ROWID",
    "CREATE TABLE workers (worker_id TEXT PRIMARY KEY, address TEXT NOT NULL,"
    " capacity INTEGER NOT NULL, labels TEXT NOT NULL, draining INTEGER NOT NULL,"
    " seen_wall REAL NOT NULL) WITHOUT ROWID",
    "CREATE TABLE groups (seq INTEGER PRIMARY KEY, group_id TEXT NOT NULL,"
    " task_id TEXT NOT NULL, size INTEGER NOT NULL, estimator TEXT NOT NULL,"
    " eps REAL NOT NULL, ddof INTEGER NOT NULL, batch_std INTEGER NOT NULL,"
    " deadline_s REAL NOT NULL, min_members INTEGER NOT NULL, create_time REAL NOT NULL,"
    " deadline_wall REAL NOT NULL, state TEXT NOT NULL, cursor INTEGER NOT NULL,"
    " outcome TEXT, counted BLOB, excluded BLOB, rewards BLOB, advantages BLOB, mean REAL,"
    " std REAL, degenerate INTEGER, finalize_time REAL)",
    "CREATE INDEX groups_by_cursor ON groups (cursor) WHERE cursor > 0",
    "CREATE TABLE sessions (group_seq INTEGER NOT NULL, idx INTEGER NOT NULL,"
    " worker_id TEXT NOT NULL, worker_address TEXT NOT NULL, request_id TEXT NOT NULL,"
    " metadata TEXT NOT NULL, create_time REAL NOT NULL, shared_worker INTEGER NOT NULL,"
    " state TEXT NOT NULL, worker_lost INTEGER NOT NULL, reward REAL,"
    " PRIMARY KEY (group_seq, idx)) WITHOUT ROWID",
    "CREATE TABLE requests (request_id TEXT PRIMARY KEY, group_seq INTEGER NOT NULL,"
    " idx INTEGER, fingerprint TEXT NOT NULL) WITHOUT ROWID",
    "CREATE TABLE log (id INTEGER PRIMARY KEY, events BLOB NOT NULL)",
    "CREATE INDEX requests_by_group ON requests (group_seq)",
)
_META_KEYS = ("schema_version", "created", "last_cursor", "next_seq", "compacted_cursor", "events")
_GROUP_STATES = frozenset({"open", "finalized", "dropped"})
_SESSION_STATES = {state.value: state for state in SessionState}
_INDICES = np.dtype("<u2")
_FLOATS = np.dtype("<f8")
FOLD_EVENTS = 16_384
"""Logged events that trigger a fold into the tables: large enough that the statements of a
fold are amortised over many batches, small enough that a fold (about 20 ms) does not hold
the next batch up for long, and that opening after a crash folds little."""
FOLD_IDLE_S = 0.05
"""A writer with nothing to write for this long folds what the log holds."""

_encode = json.JSONEncoder(separators=(",", ":"), check_circular=False).encode
_GROUP_COLUMNS = (
    "seq, group_id, task_id, size, estimator, eps, ddof, batch_std, deadline_s, min_members,"
    " create_time, deadline_wall, state, cursor, outcome, counted, excluded, rewards,"
    " advantages, mean, std, degenerate, finalize_time"
)


class SyncMode(enum.Enum):
    """How hard a commit pushes to disk; see the module docstring for what survives what."""

    FULL = "full"
    NORMAL = "normal"


class JournalError(Exception):
    """The journal cannot be used: the message names the file and what is wrong with it.

    Raised at start-up for a file that is not SQLite, not ours, of another schema version,
    unreadable, or locked by another router. The router refuses to start rather than reset
    the file, because the file may hold rewards that cannot be produced again."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"journal {path}: {problem}")
        self.path = path
        self.problem = problem


def _dump_map(entries: Any) -> str:
    return _encode(dict(entries)) if entries else "{}"


def _load_map(text: str) -> dict[str, str]:
    if text == "{}":
        return {}
    loaded = json.loads(text)
    if not isinstance(loaded, dict):
        raise ValueError(f"expected a JSON object, got {text[:80]!r}")
    return {str(k): str(v) for k, v in loaded.items()}


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pauses the cyclic garbage collector for an allocation burst (loading and restoring a
    journal builds millions of objects, none of them cyclic garbage): with it running,
    its repeated passes over the growing heap doubled the recovery time."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class _Durable:
    """Awaitable for one journal batch. Shielded: a caller that is cancelled while waiting
    (its client went away) must not cancel the batch every other caller waits for."""

    __slots__ = ("_batch",)

    def __init__(self, batch: asyncio.Future[None]) -> None:
        self._batch = batch

    def __await__(self) -> Generator[Any, None, None]:
        return asyncio.shield(self._batch).__await__()


class SqliteJournal:
    """The journal of one state directory. See the module docstring for the design.

    Life cycle: construct (opens, checks or creates the file, takes the lock), ``load()`` the
    state (start-up only), ``start()`` the writer thread on the running loop, then ``append``
    and ``commit`` from the loop; ``close()`` flushes and releases everything.
    ``write()`` applies a batch synchronously, for tools and tests that run no writer.
    """

    def __init__(
        self,
        state_dir: Path | str,
        *,
        sync: SyncMode = SyncMode.FULL,
        keep_finished: int = DEFAULT_KEEP_FINISHED,
        compact_step: int = DEFAULT_COMPACT_STEP,
    ) -> None:
        if keep_finished < 1 or compact_step < 1:
            raise ValueError("keep_finished and compact_step must be at least 1")
        self.state_dir = Path(state_dir)
        self.path = self.state_dir / JOURNAL_FILE
        self.sync = sync
        self.keep_finished = keep_finished
        self.compact_step = compact_step
        self.on_failure: list[Callable[[BaseException], None]] = []
        """Called on the loop, once, when a batch cannot be written."""
        self.batches = 0
        """Batches (transactions) written by this process; for tests and benchmarks."""
        self._closed = False
        self._lock_fd = -1
        self._lock_fd = self._lock()
        try:
            self._con = self._open()
        except BaseException:
            self._unlock()
            raise
        self._bulk = _bulk_statements(self._con)
        meta = self._meta()
        self._last_cursor = int(meta["last_cursor"])
        self._next_seq = int(meta["next_seq"])
        self._compacted_cursor = int(meta["compacted_cursor"])
        self._events = int(meta["events"])
        self._unfolded = _Batch()
        """What the ``log`` rows not folded yet hold (writer thread only)."""
        self._last_log_id = 0
        self._fold_log_left_by_a_crash()
        self._durable_events = self._events
        """Events durable so far, folded or in the log (only the writer changes it)."""
        # Loop side.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending = _Batch()
        self._next: asyncio.Future[None] | None = None
        self._inflight: asyncio.Future[None] | None = None
        self._done: asyncio.Future[None] | None = None
        self._error: Unavailable | None = None
        self._queue: queue.SimpleQueue[tuple[_Batch, asyncio.Future[None]] | None] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None

    # -- opening -----------------------------------------------------------------------------

    def _lock(self) -> int:
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise JournalError(self.path, f"cannot use state directory: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise JournalError(
                self.path,
                f"in use by another router (process {holder} holds {self.state_dir / LOCK_FILE})",
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    def _unlock(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = -1

    def _open(self) -> sqlite3.Connection:
        try:
            con = sqlite3.connect(
                self.path, isolation_level=None, check_same_thread=False, cached_statements=256
            )
        except sqlite3.Error as exc:
            raise JournalError(self.path, f"cannot be opened ({exc})") from None
        try:
            try:
                app_id = con.execute("PRAGMA application_id").fetchone()[0]
                tables = {
                    r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")
                }
            except sqlite3.DatabaseError as exc:
                raise JournalError(
                    self.path,
                    f"not a readable SQLite database ({exc}); it was not reset. Restore it from"
                    " a backup, or move it away to start with an empty journal",
                ) from None
            if not tables and app_id == 0:
                self._create(con)
            elif app_id != APPLICATION_ID:
                raise JournalError(
                    self.path,
                    f"a SQLite database but not a sessionrouter journal (application_id"
                    f" {app_id:#x}, expected {APPLICATION_ID:#x})",
                )
            else:
                self._check_version(con)
            mode = con.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise JournalError(self.path, f"cannot switch to WAL mode (got {mode!r})")
            con.execute(f"PRAGMA synchronous={self.sync.name}")
            # After a checkpoint the WAL is cut back to this size (bytes), so one huge batch
            # (a first compaction, say) does not leave a huge WAL file behind for good.
            con.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")
        except BaseException:
            con.close()
            raise
        return con

    def _create(self, con: sqlite3.Connection) -> None:
        con.execute("PRAGMA journal_mode=WAL")
        con.execute("BEGIN IMMEDIATE")
        for statement in _SCHEMA:
            con.execute(statement)
        con.executemany(
            "INSERT INTO meta (key, value) VALUES (?, ?)",
            [
                ("schema_version", SCHEMA_VERSION),
                ("created", time.time()),
                ("last_cursor", 0),
                ("next_seq", 1),
                ("compacted_cursor", 0),
                ("events", 0),
            ],
        )
        con.execute(f"PRAGMA application_id={APPLICATION_ID}")
        con.execute("COMMIT")
        log.info("journal created", extra={"event": "journal_created", "path": str(self.path)})

    def _check_version(self, con: sqlite3.Connection) -> None:
        try:
            row = con.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        except sqlite3.DatabaseError as exc:
            raise JournalError(self.path, f"has no readable schema version ({exc})") from None
        if row is None or not isinstance(row[0], int):
            raise JournalError(self.path, f"has no valid schema version (found {row!r})")
        version = row[0]
        if version > SCHEMA_VERSION:
            raise JournalError(
                self.path,
                f"written by a newer sessionrouter (schema version {version}; this one reads"
                f" version {SCHEMA_VERSION}): upgrade the router, it was not reset",
            )
        if version != SCHEMA_VERSION:
            raise JournalError(
                self.path,
                f"schema version {version} is not supported (this router reads version"
                f" {SCHEMA_VERSION}) and was not converted",
            )

    def _meta(self) -> dict[str, Any]:
        try:
            meta = dict(self._con.execute("SELECT key, value FROM meta").fetchall())
        except sqlite3.DatabaseError as exc:
            self.close_now()
            raise JournalError(self.path, f"meta table cannot be read ({exc})") from None
        missing = [k for k in _META_KEYS if not isinstance(meta.get(k), int | float)]
        if missing:
            self.close_now()
            raise JournalError(self.path, f"meta table lacks {missing}")
        return meta

    # -- recovery ----------------------------------------------------------------------------

    def check(self) -> None:
        """``PRAGMA quick_check``: page-level corruption anywhere in the file, including
        indexes that a load would not read. O(file size); JournalError naming the damage."""
        try:
            problems = [r[0] for r in self._con.execute("PRAGMA quick_check(5)")]
        except sqlite3.DatabaseError as exc:
            raise JournalError(self.path, f"is corrupt ({exc})") from None
        if problems != ["ok"]:
            raise JournalError(self.path, f"is corrupt: {'; '.join(problems)}")

    def load(self) -> RecoveredState:
        """Reads everything back, validated. JournalError when a row cannot be understood."""
        try:
            with paused_gc():
                return self._load()
        except JournalError:
            raise
        except (sqlite3.DatabaseError, ValueError, TypeError, KeyError, IndexError) as exc:
            raise JournalError(self.path, f"cannot be read back ({exc})") from None

    def _load(self) -> RecoveredState:
        con = self._con
        workers = [
            WorkerSaved(w, a, int(c), _load_map(labels), bool(d), float(seen))
            for w, a, c, labels, d, seen in con.execute(
                "SELECT worker_id, address, capacity, labels, draining, seen_wall FROM workers"
                " ORDER BY worker_id"
            )
        ]
        groups: dict[int, GroupRow] = {}
        results: dict[int, tuple[GroupRow, tuple[Any, ...]]] = {}
        for row in con.execute(f"SELECT {_GROUP_COLUMNS} FROM groups ORDER BY seq"):
            seq, gid, task, size, name, eps, ddof, batch_std, deadline_s, min_members = row[:10]
            create_time, deadline_wall, state, cursor = row[10:14]
            if state not in _GROUP_STATES or (state == "open") != (cursor == 0):
                raise ValueError(f"group seq {seq}: state {state!r} with cursor {cursor}")
            created = GroupCreated(
                seq,
                gid,
                task,
                size,
                name,
                eps,
                ddof,
                bool(batch_std),
                deadline_s,
                min_members,
                create_time,
                deadline_wall,
            )
            group = GroupRow(created, [], state, None)
            groups[seq] = group
            if cursor:
                results[cursor] = (group, row[14:])
        states = _SESSION_STATES
        current: GroupRow | None = None
        current_seq = 0
        members: list[SessionRecord] = []
        gid = task = ""
        for seq, idx, wid, waddr, rid, meta, created, shared, state, lost, reward in con.execute(
            "SELECT group_seq, idx, worker_id, worker_address, request_id, metadata,"
            " create_time, shared_worker, state, worker_lost, reward FROM sessions"
            " ORDER BY group_seq, idx"
        ):
            if seq != current_seq:
                current, current_seq = groups.get(seq), seq
                if current is None:
                    raise ValueError(f"sessions of group seq {seq}, which does not exist")
                members, gid, task = (
                    current.members,
                    current.created.group_id,
                    current.created.task_id,
                )
            if idx != len(members):
                raise ValueError(f"group seq {seq}: member {idx} out of order")
            members.append(
                SessionRecord(
                    gid,
                    idx,
                    task,
                    wid,
                    waddr,
                    rid,
                    {} if meta == "{}" else _load_map(meta),
                    created,
                    bool(shared),
                    states[state],
                    bool(lost),
                    reward,
                )
            )
        expected = list(range(self._compacted_cursor + 1, self._last_cursor + 1))
        if sorted(results) != expected:
            raise JournalError(
                self.path,
                f"finalized groups have cursors {_span(sorted(results))}, expected a run from"
                f" {self._compacted_cursor + 1} to {self._last_cursor}",
            )
        rewarded = SessionState.REWARDED
        for cursor in expected:
            group, columns = results[cursor]
            group.result, counted = _result_from_columns(cursor, group.created, columns)
            members = group.members
            for i, reward in zip(counted, group.result.rewards.tolist(), strict=True):
                member = members[i]  # the result is authoritative for a finalized group
                member.state, member.reward = rewarded, reward
        requests = [
            RequestSaved(rid, seq, idx, tuple(json.loads(fingerprint)))
            for rid, seq, idx, fingerprint in con.execute(
                "SELECT request_id, group_seq, idx, fingerprint FROM requests"
            )
        ]
        return RecoveredState(
            workers=workers,
            groups=list(groups.values()),
            requests=requests,
            last_cursor=self._last_cursor,
            next_seq=self._next_seq,
            events=self._events,
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
        journal has failed (the router then stops: it can no longer promise anything)."""
        if self._error is not None:
            raise self._error
        if self._pending:
            if self._next is None:
                assert self._loop is not None, "journal not started"
                self._next = self._loop.create_future()
            batch = self._next
            if self._inflight is None:
                self._dispatch()
            return _Durable(batch)
        if self._inflight is not None:
            return _Durable(self._inflight)
        assert self._done is not None, "journal not started"
        return self._done

    def kick(self) -> None:
        """Starts writing what was appended without anyone committing (worker-lost marks
        from the expiry tick), if the writer is idle."""
        if self._pending and self._inflight is None and self._error is None and self._thread:
            self._dispatch()

    @property
    def failed(self) -> bool:
        return self._error is not None

    @property
    def events(self) -> int:
        """Events made durable over the journal's life: folded (counted in ``meta``, which
        compaction keeps) or still in the log."""
        return self._durable_events

    def _dispatch(self) -> None:
        assert self._loop is not None
        events, self._pending = self._pending, _Batch()
        batch = self._next if self._next is not None else self._loop.create_future()
        self._next = None
        self._inflight = batch
        self._queue.put((events, batch))

    def _written(self, batch: asyncio.Future[None] | None, error: BaseException | None) -> None:
        if batch is not None:
            self._inflight = None
        if error is None:
            assert batch is not None
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
        self._pending = _Batch()
        for callback in self.on_failure:
            callback(error)

    async def close(self) -> None:
        """Writes what is pending, stops the writer and closes the file. Safe to call twice."""
        if self._closed:
            return
        if self._thread is not None:
            if self._error is None:
                with contextlib.suppress(Unavailable):
                    self.kick()
                    await self.commit()
            self._queue.put(None)
            await asyncio.to_thread(self._thread.join)
        self.close_now()

    def close_now(self) -> None:
        """Closes the file without writing anything pending (start-up errors, tests)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(sqlite3.Error):
            self._con.close()
        self._unlock()

    # -- the writer thread -------------------------------------------------------------------

    def _fold_log_left_by_a_crash(self) -> None:
        try:
            rows = self._con.execute("SELECT id, events FROM log ORDER BY id").fetchall()
            logged = _Batch()
            for _, data in rows:
                logged.extend(_decode_batch(data))
        except (sqlite3.DatabaseError, pickle.UnpicklingError, ValueError, TypeError) as exc:
            self.close_now()
            raise JournalError(self.path, f"its log cannot be read back ({exc})") from None
        if rows:
            try:
                self.write(logged.events, logged.rewards(), fold_log_upto=rows[-1][0])
            except sqlite3.DatabaseError as exc:
                self.close_now()
                raise JournalError(self.path, f"its log cannot be folded ({exc})") from None
            log.info(
                "journal log folded",
                extra={"event": "journal_log_folded", "batches": len(rows), "events": len(logged)},
            )

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
                events, batch = item
                error: BaseException | None = None
                try:
                    self._log_batch(events)
                except BaseException as exc:  # every failure must reach the waiters
                    error = exc
                if not self._notify(batch, error) or error is not None:
                    return
            if len(self._unfolded) >= FOLD_EVENTS or (idle and self._unfolded):
                try:
                    self._fold(carry=not idle)
                except BaseException as exc:  # the batches are safe in the log; stop anyway
                    self._notify(None, exc)
                    return
        with contextlib.suppress(BaseException):  # a clean stop leaves an empty log
            self._fold(carry=False)

    def _notify(self, batch: asyncio.Future[None] | None, error: BaseException | None) -> bool:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._written, batch, error)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            return False
        return True

    def _log_batch(self, batch: _Batch) -> None:
        """Makes a batch durable with one statement (see the module docstring)."""
        batch.events = [
            _Finalized.of(e) if isinstance(e, GroupFinalized) else e for e in batch.events
        ]
        cursor = self._con.execute("INSERT INTO log (events) VALUES (?)", (batch.encode(),))
        self._last_log_id = cursor.lastrowid or self._last_log_id
        self._unfolded.extend(batch)
        self._durable_events += len(batch)
        self.batches += 1

    def _fold(self, carry: bool) -> None:
        """Folds the log into the tables; under load (``carry``) the rewards of groups still
        open are carried over to the next fold (see ``write``), when idle or stopping not."""
        if self._unfolded:
            folded, self._unfolded = self._unfolded, _Batch()
            self._unfolded = self.write(
                folded.events,
                folded.rewards(),
                fold_log_upto=self._last_log_id,
                carried_before=folded.carried,
                carry=carry,
            )
        self._compact_if_due()

    def log_pending(self) -> None:
        """Makes what was appended durable as the writer thread does, as one ``log`` row,
        without folding it: for tests of what a crash leaves behind."""
        if self._thread is not None:
            raise RuntimeError("the writer thread owns the journal")
        pending, self._pending = self._pending, _Batch()
        self._log_batch(pending)

    def write_pending(self) -> None:
        """Writes what was appended, synchronously on the calling thread, and compacts if
        due: for tools and tests that run no writer thread (never while one runs)."""
        if self._thread is not None:
            raise RuntimeError("the writer thread owns the journal")
        pending, self._pending = self._pending, _Batch()
        self.write(pending.events, pending.rewards())
        self._durable_events += len(pending)
        self.batches += 1
        self._compact_if_due()

    def _compact_if_due(self) -> None:
        if self._last_cursor - self._compacted_cursor >= self.keep_finished + self.compact_step:
            self.compact(self._last_cursor - self.keep_finished)

    def write(
        self,
        events: Sequence[Event | _Finalized],
        rewards: tuple[list[int], list[int], list[float]] = ([], [], []),
        fold_log_upto: int = 0,
        carried_before: int = 0,
        carry: bool = False,
    ) -> _Batch:
        """Applies events, and rewards given as columns (group seqs, member indices,
        values), to the tables in one transaction (all or nothing), deleting the ``log`` rows
        up to ``fold_log_upto`` in the same transaction.

        Events are first folded per row, so a session started and rewarded in the same batch
        is one insert, not an insert and an update; the folding only keeps the last value of
        each column, which is the order the events had. A reward of a group finalized in the
        same call is not written to its session row at all: the result holds it.

        With ``carry`` (a fold by the writer under load), rewards of groups still open are
        not written to their rows yet either: they are carried over, logged again as one
        ``log`` row in the same transaction and returned, because their group is usually
        finalized a moment later (the finalizer trails the rewards by up to a fold's worth
        of events under load) and the next fold then drops them. The first
        ``carried_before`` rewards were carried once already: those go to their rows."""
        new_groups: dict[int, list[Any]] = {}
        finals: dict[int, tuple[Any, ...]] = {}
        new_sessions: dict[tuple[int, int], list[Any]] = {}
        seqs, idxs, values = list(rewards[0]), list(rewards[1]), list(rewards[2])
        aborts: list[tuple[int, int]] = []
        lost: list[tuple[int, int]] = []
        requests: list[tuple[str, int, int | None, str]] = []
        workers: dict[str, WorkerSaved | None] = {}
        last_cursor = self._last_cursor
        next_seq = self._next_seq
        for ev in events:
            if isinstance(ev, RewardSaved):
                seqs.append(ev.group_seq)
                idxs.append(ev.idx)
                values.append(ev.reward)
            elif isinstance(ev, SessionStarted):
                new_sessions[(ev.group_seq, ev.idx)] = [
                    ev.group_seq,
                    ev.idx,
                    ev.worker_id,
                    ev.worker_address,
                    ev.request_id,
                    _dump_map(ev.metadata),
                    ev.create_time,
                    int(ev.shared_worker),
                    "open",
                    0,
                    None,
                ]
            elif isinstance(ev, GroupCreated):
                new_groups[ev.seq] = [*ev, "open", 0, *_NO_RESULT]
                next_seq = max(next_seq, ev.seq + 1)
            elif isinstance(ev, GroupFinalized | _Finalized):
                final = _Finalized.of(ev) if isinstance(ev, GroupFinalized) else ev
                grow = new_groups.get(final.group_seq)
                if grow is None:
                    finals[final.group_seq] = final.columns
                else:
                    grow[12:] = final.columns
                last_cursor = max(last_cursor, final.columns[1])
            elif isinstance(ev, RequestSaved):
                requests.append(
                    (ev.request_id, ev.group_seq, ev.idx, _encode(list(ev.fingerprint)))
                )
            elif isinstance(ev, SessionAborted):
                key = (ev.group_seq, ev.idx)
                row = new_sessions.get(key)
                if row is None:
                    aborts.append(key)
                else:
                    row[8] = "aborted"
            elif isinstance(ev, SessionLost):
                key = (ev.group_seq, ev.idx)
                row = new_sessions.get(key)
                if row is None:
                    lost.append(key)
                else:
                    row[9] = 1
            elif isinstance(ev, WorkerSaved):
                workers[ev.worker_id] = ev
            elif isinstance(ev, WorkerRemoved):
                workers[ev.worker_id] = None
            else:
                raise TypeError(f"not a journal event: {ev!r}")
        updates, carried = _fold_rewards(
            seqs, idxs, values, new_sessions, finals, carried_before if carry else None
        )
        fresh = len(seqs) - carried_before
        con = self._con
        bulk = self._bulk
        con.execute("BEGIN IMMEDIATE")
        try:
            bulk["groups"].run(con, list(new_groups.values()))
            bulk["sessions"].run(con, list(new_sessions.values()))
            bulk["rewards"].run(con, updates)
            bulk["aborts"].run(con, aborts)
            bulk["lost"].run(con, lost)
            bulk["finals"].run(con, [(*columns, seq) for seq, columns in finals.items()])
            bulk["requests"].run(con, requests)
            for worker_id, saved in workers.items():  # rare: one statement each is fine
                if saved is None:
                    con.execute("DELETE FROM workers WHERE worker_id=?", (worker_id,))
                else:
                    con.execute(
                        "INSERT OR REPLACE INTO workers VALUES (?, ?, ?, ?, ?, ?)",
                        (
                            saved.worker_id,
                            saved.address,
                            saved.capacity,
                            _dump_map(saved.labels),
                            int(saved.draining),
                            saved.seen_wall,
                        ),
                    )
            con.execute(
                "UPDATE meta SET value = CASE key WHEN 'events' THEN ? WHEN 'last_cursor' THEN ?"
                " ELSE ? END WHERE key IN ('events', 'last_cursor', 'next_seq')",
                (self._events + len(events) + fresh, last_cursor, next_seq),
            )
            if fold_log_upto:
                con.execute("DELETE FROM log WHERE id <= ?", (fold_log_upto,))
            if carried:
                cursor = con.execute("INSERT INTO log (events) VALUES (?)", (carried.encode(),))
                self._last_log_id = cursor.lastrowid or self._last_log_id
            con.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                con.execute("ROLLBACK")
            raise
        self._events += len(events) + fresh
        self._last_cursor = last_cursor
        self._next_seq = next_seq
        return carried

    def compact(self, upto_cursor: int) -> int:
        """Deletes the groups finalized at or before ``upto_cursor``, with their sessions and
        request ids; returns how many groups went. Runs on the writer thread (or before
        ``start``)."""
        if upto_cursor <= self._compacted_cursor:
            return 0
        started = time.perf_counter()
        con = self._con
        chosen = "SELECT seq FROM groups WHERE cursor > 0 AND cursor <= ?"
        con.execute("BEGIN IMMEDIATE")
        try:
            con.execute(f"DELETE FROM sessions WHERE group_seq IN ({chosen})", (upto_cursor,))
            con.execute(f"DELETE FROM requests WHERE group_seq IN ({chosen})", (upto_cursor,))
            deleted = con.execute(
                "DELETE FROM groups WHERE cursor > 0 AND cursor <= ?", (upto_cursor,)
            ).rowcount
            con.execute("UPDATE meta SET value=? WHERE key='compacted_cursor'", (upto_cursor,))
            con.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                con.execute("ROLLBACK")
            raise
        self._compacted_cursor = upto_cursor
        log.debug(
            "journal compacted",
            extra={
                "event": "journal_compacted",
                "upto_cursor": upto_cursor,
                "groups": deleted,
                "ms": round((time.perf_counter() - started) * 1000, 3),
            },
        )
        return int(deleted)

    def checkpoint(self) -> None:
        """Copies the WAL into the database file and empties it (SQLite does this on its own
        every 1000 pages, and at close); for tools and tests that measure the file."""
        self._con.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def size_bytes(self) -> int:
        """Bytes on disk: the database file plus its WAL."""
        total = 0
        for suffix in ("", "-wal"):
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(f"{self.path}{suffix}").st_size
        return total


class _Bulk:
    """One SQL statement applied to many rows in a few ``sqlite3_step`` calls.

    Why not ``executemany``: Python's sqlite3 releases the GIL around every step, and takes
    it back before the next row. With the event loop busy on the other thread, each
    take-back can wait for the interpreter's switch interval (5 ms): measured here, 4096
    single-row UPDATEs took 72 ms with an idle loop and 17 s with a busy one. So the rows go
    in as a multi-row ``VALUES`` list bound to one statement (up to 256 rows per step; the
    last chunk is padded with NULL rows, to a power of two so that a handful of statement
    texts are prepared and cached), and SQLite does the per-row work without the GIL.
    Values are bound, not formatted: float64 rewards are stored exactly."""

    def __init__(self, con: sqlite3.Connection, template: str, columns: int) -> None:
        limit = con.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)
        self.max_rows = max(1, min(256, limit // columns))
        self._template = template
        self._columns = columns
        self._row = "(" + ", ".join("?" * columns) + ")"
        self._sql: dict[int, str] = {}

    def _statement(self, rows: int) -> str:
        sql = self._sql.get(rows)
        if sql is None:
            sql = self._template.format(values=", ".join([self._row] * rows))
            self._sql[rows] = sql
        return sql

    def run(self, con: sqlite3.Connection, rows: Sequence[Sequence[Any]]) -> None:
        for start in range(0, len(rows), self.max_rows):
            chunk = rows[start : start + self.max_rows]
            size = min(self.max_rows, 1 << (len(chunk) - 1).bit_length())
            params = list(itertools.chain.from_iterable(chunk))
            params.extend([None] * (self._columns * (size - len(chunk))))
            con.execute(self._statement(size), params)


def _bulk_statements(con: sqlite3.Connection) -> dict[str, _Bulk]:
    """The statements ``write`` runs, keyed by what they apply. NULL padding rows match
    nothing (``IS NOT NULL`` for inserts, ``=`` for updates)."""
    insert = "INSERT INTO {table} SELECT * FROM (VALUES {{values}}) WHERE column1 IS NOT NULL"
    update = "UPDATE {table} SET {set} FROM (VALUES {{values}}) AS v WHERE {where}"
    sessions_key = "sessions.group_seq = v.column1 AND sessions.idx = v.column2"
    finals = (
        "state = v.column1, cursor = v.column2, outcome = v.column3, counted = v.column4,"
        " excluded = v.column5, rewards = v.column6, advantages = v.column7, mean = v.column8,"
        " std = v.column9, degenerate = v.column10, finalize_time = v.column11"
    )
    return {
        "groups": _Bulk(con, insert.format(table="groups"), 23),
        "sessions": _Bulk(con, insert.format(table="sessions"), 11),
        "requests": _Bulk(con, "INSERT OR REPLACE" + insert.format(table="requests")[6:], 4),
        "rewards": _Bulk(
            con,
            update.format(
                table="sessions", set="state = 'rewarded', reward = v.column3", where=sessions_key
            ),
            3,
        ),
        "aborts": _Bulk(
            con, update.format(table="sessions", set="state = 'aborted'", where=sessions_key), 2
        ),
        "lost": _Bulk(
            con, update.format(table="sessions", set="worker_lost = 1", where=sessions_key), 2
        ),
        "finals": _Bulk(
            con, update.format(table="groups", set=finals, where="groups.seq = v.column12"), 12
        ),
    }


class _Batch:
    """Events appended between two commits. Rewards, the one event that comes by the tens of
    thousands per second, are kept as three columns instead of one object each: cheaper to
    append on the loop, to pickle, and to fold with NumPy."""

    __slots__ = ("carried", "events", "idxs", "seqs", "values")

    def __init__(self) -> None:
        self.events: list[Event | _Finalized] = []
        self.seqs: list[int] = []
        self.idxs: list[int] = []
        self.values: list[float] = []
        self.carried = 0
        """How many leading rewards were carried over by a fold already."""

    def __len__(self) -> int:
        return len(self.events) + len(self.seqs)

    def __bool__(self) -> bool:
        return bool(self.events) or bool(self.seqs)

    def extend(self, other: _Batch) -> None:
        self.events += other.events
        self.seqs += other.seqs
        self.idxs += other.idxs
        self.values += other.values

    def rewards(self) -> tuple[list[int], list[int], list[float]]:
        return self.seqs, self.idxs, self.values

    def encode(self) -> bytes:
        """The batch as a ``log`` row: pickled plain values (floats exact)."""
        tagged = [(_TAGS[type(e)], *e) for e in self.events]
        return pickle.dumps((tagged, self.seqs, self.idxs, self.values), protocol=5)


def _fold_rewards(
    seqs: list[int],
    idxs: list[int],
    values: list[float],
    new_sessions: dict[tuple[int, int], list[Any]],
    finals: dict[int, tuple[Any, ...]],
    carry_from: int | None,
) -> tuple[list[tuple[int, int, float]], _Batch]:
    """The session UPDATEs a fold needs for these rewards, and the rewards it carries over
    (see ``write``), in O(1) Python per reward that remains: those of groups finalized in
    the same fold are dropped (the result holds them), those of sessions inserted in the
    same fold are written into the new rows."""
    carried = _Batch()
    if not seqs:
        return [], carried
    seq = np.array(seqs, dtype=np.int64)
    idx = np.array(idxs, dtype=np.int64)
    keep = np.ones(len(seq), dtype=bool)
    if finals:
        keep &= ~np.isin(seq, np.fromiter(finals, dtype=np.int64, count=len(finals)))
    if new_sessions:
        keys = seq * _MEMBER_KEY + idx
        new_keys = np.fromiter(
            (s * _MEMBER_KEY + i for s, i in new_sessions), dtype=np.int64, count=len(new_sessions)
        )
        inserted = keep & np.isin(keys, new_keys)
        for j in np.flatnonzero(inserted).tolist():
            row = new_sessions[(seqs[j], idxs[j])]
            row[8], row[10] = "rewarded", values[j]
        keep &= ~inserted
    value = np.array(values, dtype=np.float64)  # exact: these are Python floats
    if carry_from is not None:
        fresh = np.arange(len(seq)) >= carry_from
        carry = keep & fresh
        carried.seqs = seq[carry].tolist()
        carried.idxs = idx[carry].tolist()
        carried.values = value[carry].tolist()
        carried.carried = len(carried.seqs)
        keep &= ~fresh
    updates = zip(seq[keep].tolist(), idx[keep].tolist(), value[keep].tolist(), strict=True)
    return list(updates), carried


_MEMBER_KEY = 1 << 16
"""seq * _MEMBER_KEY + index identifies a member (indices are below MAX_GROUP_SIZE)."""


class _Finalized(NamedTuple):
    """A GroupFinalized reduced to what the tables store: picklable plain values (the
    result's arrays already packed), so that it can be logged and folded later."""

    group_seq: int
    columns: tuple[Any, ...]
    """state, cursor, then the result columns (see ``_result_columns``)."""

    @classmethod
    def of(cls, ev: GroupFinalized) -> _Finalized:
        return cls(ev.group_seq, _result_columns(ev))


_TAG_CLASSES: dict[int, type[Any]] = {
    1: WorkerSaved,
    2: WorkerRemoved,
    3: GroupCreated,
    4: SessionStarted,
    5: RequestSaved,
    6: RewardSaved,
    7: SessionAborted,
    8: SessionLost,
    9: _Finalized,
}
"""Stable numbers of the event kinds in ``log`` (part of the schema: never renumber)."""
_TAGS = {cls: tag for tag, cls in _TAG_CLASSES.items()}


class _PlainUnpickler(pickle.Unpickler):
    """Reads back plain values only: a ``log`` row naming any class or function is refused
    instead of executed."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"log entries hold plain values, not {module}.{name}")


def _decode_batch(data: bytes) -> _Batch:
    tagged, seqs, idxs, values = _PlainUnpickler(io.BytesIO(data)).load()
    if not len(seqs) == len(idxs) == len(values):
        raise ValueError("reward columns of different lengths")
    batch = _Batch()
    batch.events = [_TAG_CLASSES[entry[0]](*entry[1:]) for entry in tagged]
    batch.seqs, batch.idxs, batch.values = list(seqs), list(idxs), [float(v) for v in values]
    return batch


def _span(cursors: list[int]) -> str:
    if not cursors:
        return "none"
    return f"{cursors[0]}..{cursors[-1]} ({len(cursors)} of them)"


_NO_RESULT = (None,) * 9
"""The result columns of a group that is still open."""


def _result_columns(ev: GroupFinalized) -> tuple[Any, ...]:
    """state, cursor and the result columns of a finalized group (see the schema)."""
    r = ev.result
    return (
        "dropped" if r.outcome is GroupOutcome.DROPPED else "finalized",
        r.cursor,
        r.outcome.value,
        _indices_bytes(ev.counted),
        _indices_bytes(ev.excluded),
        _floats_bytes(r.rewards),
        _floats_bytes(r.advantages),
        r.mean,
        r.std,
        int(r.degenerate),
        r.finalize_time,
    )


_LITTLE_ENDIAN = sys.byteorder == "little"


def _indices_bytes(indices: tuple[int, ...]) -> bytes:
    if _LITTLE_ENDIAN:
        return array.array("H", indices).tobytes()  # a few times cheaper than NumPy here
    return np.asarray(indices, dtype=_INDICES).tobytes()


def _floats_bytes(values: NDArray[np.float64]) -> bytes:
    if _LITTLE_ENDIAN and values.dtype == np.float64:
        return values.tobytes()
    return np.ascontiguousarray(values, dtype=_FLOATS).tobytes()


def _floats(blob: bytes) -> NDArray[np.float64]:
    """A read-only float64 array over the stored bytes (no copy on a little-endian host)."""
    array = np.frombuffer(blob, dtype=_FLOATS)
    return array if array.dtype == np.float64 else array.astype(np.float64)


def _result_from_columns(
    cursor: int, created: GroupCreated, columns: tuple[Any, ...]
) -> tuple[GroupResult, list[int]]:
    """The result of a finalized group, and the indices of its counted members."""
    outcome, counted, excluded, rewards, advantages, mean, std, degenerate, finalized = columns
    gid = created.group_id
    indices = np.frombuffer(counted, _INDICES).tolist()
    result = GroupResult(
        cursor=cursor,
        group_id=gid,
        task_id=created.task_id,
        outcome=GroupOutcome(outcome),
        group_size=created.size,
        sessions=tuple(session_name(gid, i) for i in indices),
        rewards=_floats(rewards),
        advantages=_floats(advantages),
        mean=float(mean),
        std=float(std),
        estimator=EstimatorParams(created.estimator, created.eps, created.ddof, created.batch_std),
        degenerate=bool(degenerate),
        excluded_sessions=tuple(
            session_name(gid, i) for i in np.frombuffer(excluded, _INDICES).tolist()
        ),
        finalize_time=float(finalized),
    )
    return result, indices
