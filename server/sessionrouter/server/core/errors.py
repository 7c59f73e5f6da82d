"""Domain errors of the router core.

The core raises these and nothing else for bad or conflicting input; the servicer maps each
class to one gRPC status code in a single table (``sessionrouter.server.status``). Every error
carries a machine-readable ``reason`` (an UPPER_SNAKE string, sent as ``google.rpc.ErrorInfo``)
and ``metadata`` with the numbers involved, so that a client in any language can branch on the
case without parsing the message.

    RouterError
    ├── InvalidArgument       malformed or conflicting input (field_violations name the fields)
    ├── NotFound              unknown worker, session or group
    ├── AlreadyExists         an id already taken by something else
    ├── FailedPrecondition    valid input that the current state refuses (group full, closed)
    ├── ResourceExhausted     a limit (open groups, workers, reply bytes; details say which),
    │                         strict placement cannot give distinct workers, or the
    │                         staleness limit (retry_after_s)
    ├── Unavailable           no eligible worker at all, or shutting down (retry_after_s)
    └── OutOfRange            a feed cursor older than what is retained
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

DOMAIN = "sessionrouter.dev"
"""The ``ErrorInfo.domain`` of every error this service raises."""


class RouterError(Exception):
    """Base of every error the core raises on purpose."""

    def __init__(
        self,
        reason: str,
        message: str,
        *,
        metadata: Mapping[str, object] | None = None,
        field_violations: Sequence[tuple[str, str]] = (),
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.metadata: dict[str, str] = {k: str(v) for k, v in (metadata or {}).items()}
        self.field_violations: tuple[tuple[str, str], ...] = tuple(field_violations)


class InvalidArgument(RouterError):
    """The request is malformed, or contradicts what the router already holds."""


class NotFound(RouterError):
    """The named worker, session or group does not exist (or is no longer retained)."""


class AlreadyExists(RouterError):
    """The id is taken by something that is not this request."""


class FailedPrecondition(RouterError):
    """The request is valid but the current state refuses it."""


class ResourceExhausted(RouterError):
    """A limit is reached (the metadata names it and its value); strict placement has fewer
    eligible workers than the group needs; or the staleness limit, which a retry after
    ``retry_after_s`` (set then) may pass."""

    def __init__(
        self,
        reason: str,
        message: str,
        *,
        metadata: Mapping[str, object] | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(reason, message, metadata=metadata)
        self.retry_after_s = retry_after_s


class Unavailable(RouterError):
    """Nothing can serve the request now; a retry after ``retry_after_s`` may succeed."""

    def __init__(
        self,
        reason: str,
        message: str,
        *,
        retry_after_s: float = 1.0,
        metadata: Mapping[str, object] | None = None,
    ) -> None:
        super().__init__(reason, message, metadata=metadata)
        self.retry_after_s = retry_after_s


class OutOfRange(RouterError):
    """A feed cursor older than the oldest retained group."""
