"""The journal's on-disk format: read this file before changing the schema.

One SQLite file, ``journal.db``, in the state directory, next to a ``LOCK`` file that one
router at a time holds. Each table is one named column list (``Table``); the DDL, the widths
of the bulk statements and the positions the fold writes into are all derived from it, so a
column is added in one place. Any change of a table, of a column's meaning or of the ``log``
row format (``logrows``) bumps ``SCHEMA_VERSION``: a journal of another version is refused at
start-up, never silently reset or reinterpreted.

Tables (version 3)::

    meta(key, value)            schema_version, created, last_cursor, next_seq,
                                compacted_cursor, events, journal_id (since 3)
    workers                     one row per registered worker
    groups                      one row per group; ``cursor > 0`` exactly when finalized or
                                dropped, and then the result columns are set: counted and
                                excluded are member indices (uint16 little-endian), rewards
                                and advantages float64 (little-endian), exact and read back
                                without parsing. For such a group the result is
                                authoritative for its members' rewards.
    sessions                    one row per member, keyed by (group_seq, idx)
    requests                    one row per request id, with what it started
    log(id, events)             batches not folded into the tables yet (see ``logrows``)

Times are Unix seconds (REAL); ``deadline_wall`` is stored rather than a monotonic deadline so
that deadlines keep counting while the router is down. Maps (labels, metadata) and request
fingerprints are compact JSON.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEMA_VERSION = 3
"""Bumped on any change of the tables, of what a column means, or of the log-row format.

Version 2 added ``groups.placement`` (the group's placement policy),
``sessions.filter_metric`` and ``groups.filter_metrics`` (the metric given beside a reward,
and a result's metrics), the ``FilterMetricSaved`` log event, ``sessions.replaces`` and
``groups.replaced`` (replacement members and the members they replaced). A version 1 journal is
refused at start-up with a message naming its file: it holds no placement policies, and its
groups are better finished by the router version that wrote it than guessed.

Version 3 added ``journal_id`` to ``meta`` (the id ``IDENTITY`` names too, see
``integrity``). A version 2 journal is upgraded in place at start-up by giving it one (nothing
else changed); version 1 is still refused."""
APPLICATION_ID = 0x53524A31
"""``PRAGMA application_id`` of a journal ("SRJ1"): tells our file from any other SQLite file."""
JOURNAL_FILE = "journal.db"
LOCK_FILE = "LOCK"


@dataclass(frozen=True, slots=True)
class Column:
    name: str
    sql_type: str = ""
    """SQLite type with its constraints, as it appears in the DDL."""


@dataclass(frozen=True, slots=True)
class Table:
    """One table: its columns in storage order, and its primary key."""

    name: str
    columns: tuple[Column, ...]
    key: tuple[str, ...]
    without_rowid: bool = True

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    @property
    def width(self) -> int:
        return len(self.columns)

    def pos(self, name: str) -> int:
        """Index of a column in a row of this table (``KeyError`` for an unknown name)."""
        try:
            return self.names.index(name)
        except ValueError:
            raise KeyError(f"table {self.name} has no column {name!r}") from None

    def select(self) -> str:
        """The column list, in storage order, for a SELECT."""
        return ", ".join(self.names)

    def ddl(self) -> str:
        body = [f"{c.name} {c.sql_type}".rstrip() for c in self.columns]
        if len(self.key) > 1 or self.without_rowid:
            # A single INTEGER PRIMARY KEY is declared on its column (it is the rowid).
            body.append(f"PRIMARY KEY ({', '.join(self.key)})")
        suffix = " WITHOUT ROWID" if self.without_rowid else ""
        return f"CREATE TABLE {self.name} ({', '.join(body)}){suffix}"


def _columns(*specs: str) -> tuple[Column, ...]:
    return tuple(Column(*spec.split(" ", 1)) for spec in specs)


META = Table("meta", _columns("key TEXT", "value"), key=("key",))
META_KEYS = ("schema_version", "created", "last_cursor", "next_seq", "compacted_cursor", "events")

WORKERS = Table(
    "workers",
    _columns(
        "worker_id TEXT",
        "address TEXT NOT NULL",
        "capacity INTEGER NOT NULL",
        "labels TEXT NOT NULL",  # JSON object
        "draining INTEGER NOT NULL",
        "seen_wall REAL NOT NULL",
    ),
    key=("worker_id",),
)

GROUP_CREATED_COLUMNS = (
    "seq",
    "group_id",
    "task_id",
    "size",
    "estimator",
    "eps",
    "ddof",
    "batch_std",
    "deadline_s",
    "min_members",
    "create_time",
    "deadline_wall",
    "placement",
)
"""The leading columns of ``groups``: the fields of ``core.events.GroupCreated``, in order
(a unit test holds the two together)."""
GROUP_RESULT_COLUMNS = (
    "state",
    "cursor",
    "outcome",
    "counted",
    "excluded",
    "rewards",
    "advantages",
    "mean",
    "std",
    "degenerate",
    "finalize_time",
    "filter_metrics",
    "replaced",
)
"""The trailing columns of ``groups``: what a finalization sets (``state`` and ``cursor`` first)."""

GROUPS = Table(
    "groups",
    _columns(
        "seq INTEGER PRIMARY KEY",
        "group_id TEXT NOT NULL",
        "task_id TEXT NOT NULL",
        "size INTEGER NOT NULL",
        "estimator TEXT NOT NULL",
        "eps REAL NOT NULL",
        "ddof INTEGER NOT NULL",
        "batch_std INTEGER NOT NULL",
        "deadline_s REAL NOT NULL",
        "min_members INTEGER NOT NULL",
        "create_time REAL NOT NULL",
        "deadline_wall REAL NOT NULL",
        "placement TEXT NOT NULL",  # JSON of the placement policy; "" for the default
        "state TEXT NOT NULL",  # open, finalized or dropped
        "cursor INTEGER NOT NULL",  # 0 while open
        "outcome TEXT",
        "counted BLOB",  # uint16 little-endian member indices
        "excluded BLOB",  # uint16 little-endian member indices
        "rewards BLOB",  # float64 little-endian
        "advantages BLOB",  # float64 little-endian
        "mean REAL",
        "std REAL",
        "degenerate INTEGER",
        "finalize_time REAL",
        "filter_metrics BLOB",  # float64 little-endian, aligned with counted; empty if none
        "replaced BLOB",  # uint16 little-endian member indices
    ),
    key=("seq",),
    without_rowid=False,
)

SESSIONS = Table(
    "sessions",
    _columns(
        "group_seq INTEGER NOT NULL",
        "idx INTEGER NOT NULL",
        "worker_id TEXT NOT NULL",
        "worker_address TEXT NOT NULL",
        "request_id TEXT NOT NULL",
        "metadata TEXT NOT NULL",  # JSON object
        "create_time REAL NOT NULL",
        "shared_worker INTEGER NOT NULL",
        "state TEXT NOT NULL",  # a SessionState value
        "worker_lost INTEGER NOT NULL",
        "reward REAL",
        "filter_metric REAL",
        "replaces INTEGER NOT NULL",  # index of the member this one replaces, or -1
    ),
    key=("group_seq", "idx"),
)

REQUESTS = Table(
    "requests",
    _columns(
        "request_id TEXT",
        "group_seq INTEGER NOT NULL",
        "idx INTEGER",  # None for StartGroup
        "fingerprint TEXT NOT NULL",  # JSON array
    ),
    key=("request_id",),
)

LOG = Table(
    "log",
    _columns("id INTEGER PRIMARY KEY", "events BLOB NOT NULL"),
    key=("id",),
    without_rowid=False,
)

TABLES = (META, WORKERS, GROUPS, SESSIONS, REQUESTS, LOG)

INDEXES = (
    "CREATE INDEX groups_by_cursor ON groups (cursor) WHERE cursor > 0",
    "CREATE INDEX requests_by_group ON requests (group_seq)",
)

GROUP_STATES = frozenset({"open", "finalized", "dropped"})
SESSION_STATE = SESSIONS.pos("state")
SESSION_WORKER_LOST = SESSIONS.pos("worker_lost")
SESSION_REWARD = SESSIONS.pos("reward")
SESSION_FILTER_METRIC = SESSIONS.pos("filter_metric")
GROUP_RESULT_START = GROUPS.pos(GROUP_RESULT_COLUMNS[0])
GROUP_CURSOR = GROUPS.pos("cursor")

if GROUPS.names != GROUP_CREATED_COLUMNS + GROUP_RESULT_COLUMNS:  # pragma: no cover
    raise AssertionError("groups columns must be the created columns, then the result columns")


def ddl() -> tuple[str, ...]:
    """The statements that create an empty journal of this version."""
    return (*(t.ddl() for t in TABLES), *INDEXES)
