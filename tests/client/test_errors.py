"""Mapping failed calls to the exception hierarchy, with the router's rich details decoded.

The errors here are genuine ``grpc.aio.AioRpcError``s whose trailing metadata holds a
``google.rpc.Status`` packed by grpcio-status, byte for byte what a router sends.
"""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2

from sessionrouter import client as c
from sessionrouter.client._errors import from_rpc_error, map_rpc_errors

from ._fake_channel import status_trailer


def aio_error(
    code: grpc.StatusCode, message: str, trailer: tuple[tuple[str, str | bytes], ...] = ()
) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailer), message)


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, c.InvalidArgumentError),
        (grpc.StatusCode.NOT_FOUND, c.NotFoundError),
        (grpc.StatusCode.ALREADY_EXISTS, c.AlreadyExistsError),
        (grpc.StatusCode.FAILED_PRECONDITION, c.FailedPreconditionError),
        (grpc.StatusCode.OUT_OF_RANGE, c.OutOfRangeError),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, c.ResourceExhaustedError),
        (grpc.StatusCode.UNAVAILABLE, c.UnavailableError),
        (grpc.StatusCode.DEADLINE_EXCEEDED, c.DeadlineExceededError),
        (grpc.StatusCode.UNAUTHENTICATED, c.UnauthenticatedError),
        (grpc.StatusCode.PERMISSION_DENIED, c.PermissionDeniedError),
        (grpc.StatusCode.UNIMPLEMENTED, c.UnimplementedError),
        (grpc.StatusCode.INTERNAL, c.InternalError),
        (grpc.StatusCode.UNKNOWN, c.InternalError),
        (grpc.StatusCode.DATA_LOSS, c.InternalError),
        (grpc.StatusCode.ABORTED, c.InternalError),
    ],
)
def test_each_code_maps_to_its_class(
    code: grpc.StatusCode, cls: type[c.SessionRouterError]
) -> None:
    error = from_rpc_error(aio_error(code, "boom"))
    assert type(error) is cls
    assert isinstance(error, c.SessionRouterError)
    assert error.code is code
    assert error.message == "boom"
    assert error.reason is None
    assert error.metadata == {}
    assert error.field_violations == []
    assert error.retry_delay is None


def test_error_info_reason_and_metadata() -> None:
    info = error_details_pb2.ErrorInfo(
        reason="GROUP_SIZE_MISMATCH",
        domain="sessionrouter.dev",
        metadata={"group_id": "g1", "expected": "8", "got": "4"},
    )
    message = "group g1 has size 8, not 4"
    code = grpc.StatusCode.INVALID_ARGUMENT
    error = from_rpc_error(aio_error(code, message, status_trailer(code, message, info)))
    assert isinstance(error, c.InvalidArgumentError)
    assert error.reason == "GROUP_SIZE_MISMATCH"
    assert error.domain == "sessionrouter.dev"
    assert error.metadata == {"group_id": "g1", "expected": "8", "got": "4"}
    assert "GROUP_SIZE_MISMATCH" in str(error)
    assert str(error).startswith("INVALID_ARGUMENT: group g1")


def test_bad_request_field_violations() -> None:
    bad = error_details_pb2.BadRequest(
        field_violations=[
            error_details_pb2.BadRequest.FieldViolation(
                field="task_id", description="must be 1 to 128 characters"
            ),
            error_details_pb2.BadRequest.FieldViolation(
                field="metadata", description="at most 32 entries"
            ),
        ]
    )
    info = error_details_pb2.ErrorInfo(reason="INVALID_FIELD")
    code = grpc.StatusCode.INVALID_ARGUMENT
    error = from_rpc_error(aio_error(code, "bad", status_trailer(code, "bad", info, bad)))
    assert error.reason == "INVALID_FIELD"
    assert error.field_violations == [
        ("task_id", "must be 1 to 128 characters"),
        ("metadata", "at most 32 entries"),
    ]


def test_retry_info_delay_in_seconds() -> None:
    retry = error_details_pb2.RetryInfo(
        retry_delay=duration_pb2.Duration(seconds=1, nanos=500_000_000)
    )
    code = grpc.StatusCode.UNAVAILABLE
    error = from_rpc_error(aio_error(code, "no worker", status_trailer(code, "no worker", retry)))
    assert isinstance(error, c.UnavailableError)
    assert error.retry_delay == pytest.approx(1.5)


def test_precondition_failure_violations() -> None:
    failure = error_details_pb2.PreconditionFailure(
        violations=[
            error_details_pb2.PreconditionFailure.Violation(
                type="GROUP_FULL", subject="groups/g1", description="8 of 8 members"
            )
        ]
    )
    code = grpc.StatusCode.FAILED_PRECONDITION
    error = from_rpc_error(aio_error(code, "full", status_trailer(code, "full", failure)))
    assert error.precondition_violations == [("GROUP_FULL", "groups/g1", "8 of 8 members")]


def test_status_that_contradicts_the_call_keeps_code_and_message_only() -> None:
    """A trailer whose code differs from the call's is not trusted (a broken proxy, say)."""
    info = error_details_pb2.ErrorInfo(reason="GROUP_FULL")
    trailer = status_trailer(grpc.StatusCode.NOT_FOUND, "other", info)
    error = from_rpc_error(aio_error(grpc.StatusCode.FAILED_PRECONDITION, "full", trailer))
    assert isinstance(error, c.FailedPreconditionError)
    assert error.message == "full"
    assert error.reason is None


def test_a_bare_rpc_error_is_internal() -> None:
    error = from_rpc_error(grpc.RpcError())
    assert isinstance(error, c.InternalError)
    assert error.code is None


def test_map_rpc_errors_raises_the_typed_error_from_the_original() -> None:
    original = aio_error(grpc.StatusCode.NOT_FOUND, "no group g9")
    with pytest.raises(c.NotFoundError) as caught, map_rpc_errors():
        raise original
    assert caught.value.__cause__ is original


def test_map_rpc_errors_leaves_other_exceptions_alone() -> None:
    with pytest.raises(KeyError), map_rpc_errors():
        raise KeyError("x")


def test_every_class_is_reachable_from_the_base() -> None:
    exported = [getattr(c, n) for n in c.__all__ if n.endswith("Error")]
    assert all(issubclass(cls, c.SessionRouterError) for cls in exported)


def test_errors_survive_pickling_with_their_details() -> None:
    """Trainers on Ray or multiprocessing ship exceptions between processes."""
    import pickle

    info = error_details_pb2.ErrorInfo(reason="GROUP_FULL", metadata={"group_id": "g1"})
    code = grpc.StatusCode.FAILED_PRECONDITION
    error = from_rpc_error(aio_error(code, "full", status_trailer(code, "full", info)))
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is c.FailedPreconditionError
    assert (copy.code, copy.message, copy.reason, copy.metadata) == (
        code,
        "full",
        "GROUP_FULL",
        {"group_id": "g1"},
    )
