"""The one table from core errors to gRPC status codes, with rich error details.

Every RouterError becomes a ``google.rpc.Status`` carrying an ``ErrorInfo`` (reason, domain,
metadata with the numbers), a ``BadRequest`` when fields are named, and a ``RetryInfo`` for
Unavailable; grpcio-status puts it in the ``grpc-status-details-bin`` trailer that clients in
every language know how to read.
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from sessionrouter.server.core import errors

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
                reason=error.reason, domain=errors.DOMAIN, metadata=error.metadata
            )
        )
    ]
    if error.field_violations:
        details.append(
            _pack(
                error_details_pb2.BadRequest(
                    field_violations=[
                        error_details_pb2.BadRequest.FieldViolation(field=f, description=d)
                        for f, d in error.field_violations
                    ]
                )
            )
        )
    if isinstance(error, errors.Unavailable):
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(error.retry_after_s * 1e9))
        details.append(_pack(error_details_pb2.RetryInfo(retry_delay=delay)))
    status = status_pb2.Status(code=code, message=error.message, details=details)
    converted: grpc.Status = rpc_status.to_status(status)
    return converted
