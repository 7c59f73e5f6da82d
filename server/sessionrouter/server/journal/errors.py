"""The journal's one error type, apart so that every journal module can raise it."""

from __future__ import annotations

from pathlib import Path


class JournalError(Exception):
    """The journal cannot be used: the message names the file and what is wrong with it.

    Raised at start-up for a file that is not SQLite, not ours, of another schema version,
    unreadable, or locked by another router. The router refuses to start rather than reset
    the file, because the file may hold rewards that cannot be produced again."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"journal {path}: {problem}")
        self.path = path
        self.problem = problem


class JournalDamagedError(JournalError):
    """The journal is empty, of another identity, or behind what it had committed (see
    ``journal.integrity``): starting fresh moves its files aside."""
