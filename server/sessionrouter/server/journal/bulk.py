"""Bulk statements: many rows per ``sqlite3_step``, their widths taken from the schema."""

from __future__ import annotations

import itertools
import sqlite3
from collections.abc import Sequence
from typing import Any

from sessionrouter.server.journal.schema import (
    GROUP_RESULT_COLUMNS,
    GROUPS,
    REQUESTS,
    SESSIONS,
    Table,
)


def marks(n: int) -> str:
    """``?, ?, ...``: n placeholders."""
    return ", ".join("?" * n)


class Bulk:
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
        self._row = f"({marks(columns)})"
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


def _update(table: str, sets: Sequence[str], keys: Sequence[str]) -> str:
    """``UPDATE table SET ... FROM (VALUES ...)``: the VALUES rows hold the set values first,
    then the keys, in the order given (``column1``, ``column2``...)."""
    values = [*sets, *keys]
    assign = ", ".join(f"{name} = v.column{values.index(name) + 1}" for name in sets)
    match = " AND ".join(f"{table}.{name} = v.column{values.index(name) + 1}" for name in keys)
    return f"UPDATE {table} SET {assign} FROM (VALUES {{values}}) AS v WHERE {match}"


def _insert(table: Table, verb: str = "INSERT") -> str:
    """``INSERT INTO table (columns) SELECT * FROM (VALUES ...)``: the columns are named, so
    that a table upgraded by ``ADD COLUMN`` (its new columns last in the file) takes the rows
    as one created with this version's DDL does."""
    return (
        f"{verb} INTO {table.name} ({table.select()})"
        " SELECT * FROM (VALUES {values}) WHERE column1 IS NOT NULL"
    )


def bulk_statements(con: sqlite3.Connection) -> dict[str, Bulk]:
    """The statements ``apply`` runs, keyed by what they apply; widths follow the schema.
    NULL padding rows match nothing (``IS NOT NULL`` for inserts, ``=`` for updates)."""
    member = ("group_seq", "idx")
    result = GROUP_RESULT_COLUMNS
    return {
        "groups": Bulk(con, _insert(GROUPS), GROUPS.width),
        "sessions": Bulk(con, _insert(SESSIONS), SESSIONS.width),
        "requests": Bulk(con, _insert(REQUESTS, "INSERT OR REPLACE"), REQUESTS.width),
        # (group_seq, idx, reward): the key first, as the fold builds them.
        "rewards": Bulk(
            con,
            "UPDATE sessions SET state = 'rewarded', reward = v.column3"
            " FROM (VALUES {values}) AS v"
            " WHERE sessions.group_seq = v.column1 AND sessions.idx = v.column2",
            len(member) + 1,
        ),
        "aborts": Bulk(
            con,
            "UPDATE sessions SET state = 'aborted' FROM (VALUES {values}) AS v"
            " WHERE sessions.group_seq = v.column1 AND sessions.idx = v.column2",
            len(member),
        ),
        "metrics": Bulk(
            con,
            "UPDATE sessions SET filter_metric = v.column3 FROM (VALUES {values}) AS v"
            " WHERE sessions.group_seq = v.column1 AND sessions.idx = v.column2",
            len(member) + 1,
        ),
        "lost": Bulk(
            con,
            "UPDATE sessions SET worker_lost = 1 FROM (VALUES {values}) AS v"
            " WHERE sessions.group_seq = v.column1 AND sessions.idx = v.column2",
            len(member),
        ),
        "finals": Bulk(con, _update("groups", result, ("seq",)), len(result) + 1),
        # (min_version, max_version, group_seq, idx)
        "versions": Bulk(
            con,
            _update("sessions", ("min_version", "max_version"), member),
            len(member) + 2,
        ),
        "interrupted": Bulk(
            con,
            "UPDATE sessions SET interrupted = 1 FROM (VALUES {values}) AS v"
            " WHERE sessions.group_seq = v.column1 AND sessions.idx = v.column2",
            len(member),
        ),
    }
