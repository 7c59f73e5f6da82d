"""What the state directory remembers outside the database, to notice a damaged journal.

SQLite recovers from a crash by itself, but not from losing its own files: ``journal.db``
truncated to 0 bytes opens as a new, empty database, and a deleted ``journal.db-wal`` after
a ``kill -9`` opens on the state of the last checkpoint. Either would start the router as
if nothing, or less, had been acknowledged. So two small files live next to the database:

- ``IDENTITY`` (JSON, written once when the journal is created): the journal's id, also kept
  in the database's ``meta``. A state directory with an IDENTITY but an empty or missing
  database, or a database of another id, is damaged.
- ``COMMITTED``: the number of events made durable so far, rewritten in place by the writer
  after every batch (one ``pwrite`` of 21 bytes, no fsync: it only ever lags the database,
  which is synced first). A database holding fewer events than COMMITTED says lost
  acknowledged changes.

The router refuses to start on a damaged journal, naming the files (``JournalDamagedError``),
unless told to start fresh: then the old files are moved aside, never deleted, and a new
journal begins.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from sessionrouter.server.journal.errors import JournalDamagedError
from sessionrouter.server.journal.schema import JOURNAL_FILE, LOCK_FILE

IDENTITY_FILE = "IDENTITY"
COMMITTED_FILE = "COMMITTED"
FILE_MODE = 0o600
"""State files hold rewards, metadata and worker addresses: owner only."""
DIR_MODE = 0o700
MOVABLE = (
    JOURNAL_FILE,
    f"{JOURNAL_FILE}-wal",
    f"{JOURNAL_FILE}-shm",
    IDENTITY_FILE,
    COMMITTED_FILE,
)
"""What starting fresh moves aside (the LOCK stays: this process holds it)."""
_WIDTH = 20


@dataclass(frozen=True, slots=True)
class Identity:
    journal_id: str
    created: float
    """Unix seconds."""


def new_identity() -> Identity:
    return Identity(uuid.uuid4().hex, time.time())


def create_private(path: Path) -> None:
    """Creates ``path`` (empty) with mode 0600 if it does not exist, so that SQLite, which
    gives its WAL and shared-memory files the mode of the database, creates those 0600 too."""
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE))


def tighten(path: Path) -> None:
    """Removes group and other permissions from a file an older router created 0644."""
    with contextlib.suppress(FileNotFoundError, PermissionError):
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            path.chmod(mode & 0o700)


class StateFiles:
    """IDENTITY and COMMITTED of one state directory (see the module docstring)."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.identity_path = state_dir / IDENTITY_FILE
        self.committed_path = state_dir / COMMITTED_FILE
        self._fd = -1

    def read_identity(self, journal: Path) -> Identity | None:
        try:
            data = json.loads(self.identity_path.read_text())
            return Identity(str(data["journal_id"]), float(data["created"]))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise JournalDamagedError(
                journal, f"{self.identity_path} cannot be read ({exc}); it was not reset"
            ) from None

    def write_identity(self, identity: Identity) -> None:
        """Written once, atomically and synced: a crash leaves the old file or the new."""
        tmp = self.identity_path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
        try:
            body = {"journal_id": identity.journal_id, "created": identity.created}
            os.write(fd, json.dumps(body).encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.identity_path)
        _sync_dir(self.state_dir)

    def read_committed(self, journal: Path) -> int:
        try:
            text = self.committed_path.read_text().strip()
        except FileNotFoundError:
            return 0
        if not text.isascii() or not text.isdigit():
            raise JournalDamagedError(
                journal, f"{self.committed_path} holds {text[:40]!r}, not a count"
            )
        return int(text)

    def record(self, events: int) -> None:
        """Rewrites COMMITTED in place (after each durable batch)."""
        if self._fd < 0:
            self._fd = os.open(self.committed_path, os.O_WRONLY | os.O_CREAT, FILE_MODE)
        os.pwrite(self._fd, f"{events:0{_WIDTH}d}\n".encode(), 0)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def move_aside(state_dir: Path) -> Path:
    """Moves the journal's files into ``state_dir/damaged-<UTC time>/`` and returns it."""
    target = state_dir / time.strftime("damaged-%Y%m%dT%H%M%SZ", time.gmtime())
    suffix = 0
    while target.exists():
        suffix += 1
        target = target.with_name(f"{target.name.split('.')[0]}.{suffix}")
    target.mkdir(mode=DIR_MODE)
    for name in MOVABLE:
        with contextlib.suppress(FileNotFoundError):
            os.replace(state_dir / name, target / name)
    _sync_dir(state_dir)
    return target


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = [
    "COMMITTED_FILE",
    "DIR_MODE",
    "FILE_MODE",
    "IDENTITY_FILE",
    "LOCK_FILE",
    "Identity",
    "JournalDamagedError",
    "StateFiles",
    "create_private",
    "move_aside",
    "new_identity",
    "tighten",
]
