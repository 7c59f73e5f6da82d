"""The one table from core errors to gRPC status codes, with rich error details.

Every RouterError becomes a ``google.rpc.Status`` carrying an ``ErrorInfo`` (reason, domain,
metadata with the numbers), a ``BadRequest`` when fields are named, and a ``RetryInfo`` for
Unavailable and the staleness limit; grpcio-status puts it in the
``grpc-status-details-bin`` trailer that clients in every language know how to read.
"""

from __future__ import annotations

import logging
from collections import Counter

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from sessionrouter.server.core import errors

log = logging.getLogger("sessionrouter.refusals")

LOGGED_VALUE_MAX = 200
"""Characters of one error metadata value written to a refusal's log line, at most."""
_RESERVED_LOG_KEYS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
    "event",
    "reason",
    "code",
}

STATUS_OF: dict[type[errors.RouterError], int] = {
    errors.InvalidArgument: code_pb2.INVALID_ARGUMENT,
    errors.NotFound: code_pb2.NOT_FOUND,
    errors.AlreadyExists: code_pb2.ALREADY_EXISTS,
    errors.FailedPrecondition: code_pb2.FAILED_PRECONDITION,
    errors.ResourceExhausted: code_pb2.RESOURCE_EXHAUSTED,
    errors.Unavailable: code_pb2.UNAVAILABLE,
    errors.OutOfRange: code_pb2.OUT_OF_RANGE,
}
"""Core error class -> google.rpc.Code. Subclasses map through their nearest listed base."""

MESSAGE_MAX_BYTES = 512
"""Longest status message sent, in UTF-8 bytes; longer ones (an echoed 100 KB estimator name)
are cut. grpc percent-encodes non-ASCII bytes in ``grpc-message`` (3 bytes each), and the
message is sent again inside ``grpc-status-details-bin``."""
DETAIL_MAX_BYTES = 128
"""Longest metadata value, field name or violation description sent, in UTF-8 bytes. With
the message and at most a dozen such strings, the trailers stay under 6 KiB, below the 8 KiB
default header limit of gRPC clients."""


def clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` UTF-8 bytes (never inside a character), saying how much was
    cut. Errors echo what the caller sent, and a trailer over the 8-16 KiB header limits of
    clients would turn the router's answer into the client transport's own
    RESOURCE_EXHAUSTED."""
    data = text.encode("utf-8", "backslashreplace")
    if len(data) <= limit:
        return text
    kept = data[:limit].decode("utf-8", "ignore")
    return f"{kept}...({len(text) - len(kept)} more characters)"


def _pack(message: object) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)  # type: ignore[arg-type]
    return packed


def to_status(error: errors.RouterError) -> grpc.Status:
    """Builds the gRPC status (code, message, rich details) for a core error."""
    code = next((c for cls, c in STATUS_OF.items() if isinstance(error, cls)), code_pb2.INTERNAL)
    details = [
        _pack(
            error_details_pb2.ErrorInfo(
                reason=error.reason,
                domain=errors.DOMAIN,
                metadata={
                    clip(k, DETAIL_MAX_BYTES): clip(v, DETAIL_MAX_BYTES)
                    for k, v in error.metadata.items()
                },
            )
        )
    ]
    if error.field_violations:
        details.append(
            _pack(
                error_details_pb2.BadRequest(
                    field_violations=[
                        error_details_pb2.BadRequest.FieldViolation(
                            field=clip(f, DETAIL_MAX_BYTES), description=clip(d, DETAIL_MAX_BYTES)
                        )
                        for f, d in error.field_violations
                    ]
                )
            )
        )
    retry_after_s = getattr(error, "retry_after_s", None)
    if isinstance(retry_after_s, float | int):
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(retry_after_s * 1e9))
        details.append(_pack(error_details_pb2.RetryInfo(retry_delay=delay)))
    status = status_pb2.Status(
        code=code, message=clip(error.message, MESSAGE_MAX_BYTES), details=details
    )
    converted: grpc.Status = rpc_status.to_status(status)
    return converted


class Refusals:
    """The core errors that became statuses, counted by (reason, code name), and logged.

    Each refusal writes one log line with the error's reason, code and the ids in its
    metadata (group id, expected and given values...), so an operator can find the caller;
    the counts are plain integers that the metrics collector copies (``snapshot``)."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()

    def status_of(self, error: errors.RouterError) -> grpc.Status:
        """The status for ``error``, counted and logged."""
        status = to_status(error)
        code = status.code.name
        self.counts[(error.reason, code)] += 1
        fields = {
            (f"detail_{key}" if key in _RESERVED_LOG_KEYS else key): value[:LOGGED_VALUE_MAX]
            for key, value in error.metadata.items()
        }
        log.info(
            "refused %s",
            error.reason,
            extra={"event": "refused", "reason": error.reason, "code": code, **fields},
        )
        return status

    def snapshot(self) -> dict[tuple[str, str], int]:
        return dict(self.counts)
