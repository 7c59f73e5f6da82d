"""Bearer tokens and the role each one holds, read from a token file.

A token file holds one credential per line (blank lines and ``#`` comments are skipped)::

    # ROLE:TOKEN[:WORKER-ID-GLOBS]
    admin:5b0c6f...
    rollout:8d1e2a...
    rollout:f4a977...            # a second rollout token: both work (rotation)
    trainer:0c33b1...
    worker:a9e0d4...:gpu-node-7-*
    worker:77c2e5...:gpu-a-0,gpu-a-1

Roles are ``worker``, ``rollout``, ``trainer`` and ``admin`` (what each may call is
``sessionrouter.server.roles.ACCESS``). A worker line must end with the worker ids it may act
on: comma-separated ``fnmatch`` globs (worker ids never hold a comma), ``*`` for any worker.
The binding is static, in the file, rather than "the first worker id the token registers",
so it needs no state of its own, survives restarts and cannot be raced by whoever registers
first. Tokens are 1-4096 printable characters without ``:`` or whitespace; a token appears
once in the file (one token, one role).

A file (or ``$SESSIONROUTER_TOKEN``) whose only content is one line that starts with no role
is the single token of earlier versions and is an ``admin`` token, as that token could do
everything. An empty or comment-only file is refused (the router would otherwise start open).

Tokens are kept as SHA-256 digests and a presented token is compared with every one of them
with ``hmac.compare_digest``, without stopping at a match, so the time taken says nothing
about which token, or how much of one, matched.
"""

from __future__ import annotations

import enum
import fnmatch
import hashlib
import hmac
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

TOKEN_MAX_LEN = 4096


class Role(enum.StrEnum):
    """What a credential is for."""

    WORKER = "worker"
    """An inference worker's agent: registers, heartbeats and drains its own worker ids."""
    ROLLOUT = "rollout"
    """A rollout client or reward service: starts, aborts and rewards sessions, reads them."""
    TRAINER = "trainer"
    """A trainer: follows the feed of finished groups and reads sessions, groups, workers."""
    ADMIN = "admin"
    """An operator: the worker pool (drain or deregister any worker) and everything else."""


class CredentialError(ValueError):
    """A token file line that cannot be used: the message names the line."""


@dataclass(frozen=True, slots=True)
class Credential:
    """One token's role, and for a worker token the worker ids it may act on."""

    role: Role
    digest: bytes
    """SHA-256 of the token (32 bytes); the token itself is not kept."""
    worker_globs: tuple[str, ...] = ()
    """``fnmatch`` patterns of the worker ids a worker token may act on (case-sensitive)."""
    line: int = 0
    """Line of the token file it came from (1-based), for messages and logs."""

    def binds(self, worker_id: str) -> bool:
        """Whether this credential may act on ``worker_id`` (any, for the other roles)."""
        if self.role is not Role.WORKER:
            return True
        return any(fnmatch.fnmatchcase(worker_id, glob) for glob in self.worker_globs)


class TokenTable:
    """The credentials the router accepts, looked up by presented token in constant time."""

    def __init__(self, credentials: Sequence[Credential]) -> None:
        if not credentials:
            raise CredentialError("no token given: refusing to start without authentication")
        self._credentials = tuple(credentials)

    @property
    def credentials(self) -> tuple[Credential, ...]:
        return self._credentials

    def roles(self) -> set[Role]:
        return {c.role for c in self._credentials}

    def identify(self, token: bytes) -> Credential | None:
        """The credential of ``token``, or None; every digest is compared, match or not."""
        digest = hashlib.sha256(token).digest()
        found: Credential | None = None
        for credential in self._credentials:
            if hmac.compare_digest(digest, credential.digest):
                found = credential
        return found

    @classmethod
    def parse(cls, text: str) -> TokenTable:
        """Reads a token file's text (format in the module docstring); CredentialError names
        the first bad line, and is raised for a text with no token at all."""
        lines = [
            (number, line.strip())
            for number, line in enumerate(text.splitlines(), start=1)
            if line.strip() and not line.strip().startswith("#")
        ]
        if not lines:
            raise CredentialError("holds no token: refusing to start without authentication")
        if len(lines) == 1 and not _has_role_prefix(lines[0][1]):
            number, token = lines[0]
            return cls([_credential(Role.ADMIN, token, (), number)])
        return cls(_unique(_line_credential(number, line) for number, line in lines))


def _has_role_prefix(line: str) -> bool:
    return any(line.startswith(f"{role.value}:") for role in Role)


def _line_credential(number: int, line: str) -> Credential:
    role_text, _, rest = line.partition(":")
    try:
        role = Role(role_text)
    except ValueError:
        known = ", ".join(r.value for r in Role)
        raise CredentialError(
            f"line {number}: expected ROLE:TOKEN with ROLE one of {known}"
        ) from None
    token, _, globs_text = rest.partition(":")
    if role is Role.WORKER:
        globs = tuple(g.strip() for g in globs_text.split(",") if g.strip())
        if not globs:
            raise CredentialError(
                f"line {number}: a worker token needs the worker ids it may act on:"
                " worker:TOKEN:GLOB[,GLOB...] ('*' for any worker)"
            )
    elif globs_text:
        raise CredentialError(f"line {number}: only worker tokens take worker ids")
    else:
        globs = ()
    return _credential(role, token, globs, number)


def _credential(role: Role, token: str, globs: tuple[str, ...], number: int) -> Credential:
    if not token:
        raise CredentialError(f"line {number}: empty token")
    if len(token) > TOKEN_MAX_LEN or not token.isprintable() or any(c.isspace() for c in token):
        raise CredentialError(
            f"line {number}: a token is 1-{TOKEN_MAX_LEN} printable characters without spaces"
        )
    digest = hashlib.sha256(token.encode()).digest()
    return Credential(role, digest, globs, number)


def _unique(credentials: Iterable[Credential]) -> list[Credential]:
    seen: dict[bytes, int] = {}
    result = []
    for credential in credentials:
        first = seen.setdefault(credential.digest, credential.line)
        if first != credential.line:
            raise CredentialError(
                f"line {credential.line}: the token of line {first} again (one token, one role)"
            )
        result.append(credential)
    return result
