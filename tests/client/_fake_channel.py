"""grpcio-testing's fake channel, made usable by an asyncio client.

``grpc_testing.channel`` is a *synchronous* ``grpc.Channel`` double: the system under test
invokes RPCs on it, and the test "plays server" with ``take_unary_unary(...)`` and friends,
deciding each response, status code and trailing metadata. Our client speaks ``grpc.aio``, so
``FakeAioChannel`` bridges the two: it offers the part of ``grpc.aio.Channel`` the client uses
(``unary_unary``, ``unary_stream``, ``stream_stream``, ``close``), runs each blocking fake call
in a worker thread, and turns the fake's sync errors into real ``grpc.aio.AioRpcError``s.
The generated stubs and every line of the client run unchanged on top of it.

What the fake does not do, and how this bridge makes up for it:

- It drops the ``timeout`` argument. The bridge records each call's timeout in ``timeouts``
  (so tests can check the deadline the client asked for), and enforces it as the aio runtime
  does: when it passes, the fake RPC is cancelled and ``DEADLINE_EXCEEDED`` is raised.
- It passes messages as objects, without serializing them. Conversion tests serialize
  explicitly.
- A cancelled aio call raises ``asyncio.CancelledError`` on read; the bridge does the same.

Blocking calls run on the bridge's own thread pool, so that a test with several calls in
flight cannot starve the event loop's default executor.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import queue
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
import grpc_testing
from google.protobuf import descriptor, message
from google.rpc import status_pb2
from grpc_status import rpc_status

from sessionrouter.v1 import session_service_pb2, worker_service_pb2

T = TypeVar("T")

SESSION_SERVICE = session_service_pb2.DESCRIPTOR.services_by_name["SessionService"]
WORKER_SERVICE = worker_service_pb2.DESCRIPTOR.services_by_name["WorkerService"]

Metadata = dict[str, str | bytes]


def method(name: str) -> descriptor.MethodDescriptor:
    """The descriptor of an RPC of either service, by its proto name (``StartSession``)."""
    for service in (SESSION_SERVICE, WORKER_SERVICE):
        if name in service.methods_by_name:
            return service.methods_by_name[name]
    raise KeyError(name)


def status_trailer(
    code: grpc.StatusCode, message_text: str, *details: message.Message
) -> tuple[tuple[str, str | bytes], ...]:
    """Trailing metadata carrying a ``google.rpc.Status`` with ``details``, as the router sends.

    Built the way a grpcio-status server does it (``rpc_status.to_status``), so the client
    decodes exactly what it would get off the wire.
    """
    status = status_pb2.Status(code=code.value[0], message=message_text)
    for detail in details:
        status.details.add().Pack(detail)
    return tuple(rpc_status.to_status(status).trailing_metadata)


def _aio_error(error: grpc.RpcError) -> grpc.aio.AioRpcError:
    """The AioRpcError a real aio channel would raise for the same status."""
    # The fake returns (key, value) tuples, which the sync stubs type as ``_Metadatum``.
    trailing: Any = error.trailing_metadata() or ()
    return grpc.aio.AioRpcError(
        error.code(),
        grpc.aio.Metadata(),
        grpc.aio.Metadata.from_tuple(trailing),
        error.details(),
    )


_END = object()


def _next_or_eof(responses: Iterator[Any]) -> Any:
    try:
        return next(responses)
    except StopIteration:
        return grpc.aio.EOF


class FakeAioChannel:
    """A ``grpc.aio.Channel`` stand-in over ``grpc_testing.channel``; see the module docstring."""

    def __init__(self) -> None:
        self.sync: Any = grpc_testing.channel(
            [SESSION_SERVICE, WORKER_SERVICE], grpc_testing.strict_real_time()
        )
        self.timeouts: defaultdict[str, list[float | None]] = defaultdict(list)
        self.closed = False

    async def in_thread(self, fn: Callable[[], T]) -> T:
        """Runs a blocking call of the fake (client or server side) off the event loop.

        Each call gets its own daemon thread: a fake call that never returns (a test that
        went wrong) then fails that test by its timeout instead of keeping the interpreter
        from exiting, as a ThreadPoolExecutor's joined workers would."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()

        def settle(outcome: Callable[[], None]) -> None:
            if not done.done():
                outcome()

        def hand_back(outcome: Callable[[], None]) -> None:
            # A call that outlived its test finds the loop closed: nobody waits for it.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(settle, outcome)

        def run() -> None:
            try:
                value = fn()
            except BaseException as exc:  # handed to the awaiting coroutine
                error = exc
                hand_back(lambda: done.set_exception(error))
            else:
                hand_back(lambda: done.set_result(value))

        threading.Thread(target=run, name="fake-grpc", daemon=True).start()
        return await done

    # The grpc.aio.Channel surface the client uses.

    def unary_unary(self, method: str, *args: object, **kwargs: object) -> _UnaryUnary:
        return _UnaryUnary(self, method)

    def unary_stream(self, method: str, *args: object, **kwargs: object) -> _UnaryStream:
        return _UnaryStream(self, method)

    def stream_stream(self, method: str, *args: object, **kwargs: object) -> _StreamStream:
        return _StreamStream(self, method)

    def stream_unary(self, method: str, *args: object, **kwargs: object) -> object:
        return object()  # the services have no client-streaming RPC

    async def close(self, grace: float | None = None) -> None:
        self.closed = True

    def shutdown(self) -> None:
        """Nothing to stop: blocking calls run on daemon threads (see ``in_thread``)."""

    # The server side, for tests.

    async def take_unary(self, name: str) -> tuple[Metadata, Any, Any]:
        """Waits for the client to call unary RPC ``name``: (metadata, request, rpc)."""
        md, request, rpc = await self.in_thread(lambda: self.sync.take_unary_unary(method(name)))
        return dict(md), request, rpc

    async def take_unary_stream(self, name: str) -> tuple[Metadata, Any, Any]:
        md, request, rpc = await self.in_thread(lambda: self.sync.take_unary_stream(method(name)))
        return dict(md), request, rpc

    async def take_stream_stream(self, name: str) -> tuple[Metadata, Any]:
        md, rpc = await self.in_thread(lambda: self.sync.take_stream_stream(method(name)))
        return dict(md), rpc

    async def reply(
        self,
        name: str,
        response: message.Message | None = None,
        *,
        code: grpc.StatusCode = grpc.StatusCode.OK,
        details: str = "",
        trailing: tuple[tuple[str, str | bytes], ...] = (),
    ) -> tuple[Metadata, Any]:
        """Takes the next call of unary ``name`` and ends it; returns (metadata, request)."""
        md, request, rpc = await self.take_unary(name)
        rpc.terminate(response, trailing, code, details)
        return md, request


class _UnaryUnary:
    def __init__(self, fake: FakeAioChannel, method: str) -> None:
        self._fake = fake
        self._method = method

    def __call__(
        self,
        request: Any,
        *,
        timeout: float | None = None,
        metadata: Any = None,
        **kwargs: object,
    ) -> Any:
        self._fake.timeouts[self._method].append(timeout)
        return self._invoke(request, timeout, metadata)

    async def _invoke(self, request: Any, deadline: float | None, metadata: Any) -> Any:
        call = self._fake.sync.unary_unary(self._method).future(
            request, timeout=deadline, metadata=metadata
        )
        try:
            async with asyncio.timeout(deadline):
                return await self._fake.in_thread(call.result)
        except TimeoutError:
            # Not call.cancel(): grpc_testing's future holds a lock while result() blocks, and
            # its cancel() waits for that same lock. Cancelling the RPC state directly is what
            # cancel() would do, minus the deadlock.
            call._handler.cancel(grpc.StatusCode.CANCELLED, "Deadline Exceeded")
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                "Deadline Exceeded",
            ) from None
        except asyncio.CancelledError:
            # Cancelling the awaiting task cancels the RPC, as in grpc.aio; it also frees the
            # thread blocked in result().
            call._handler.cancel(grpc.StatusCode.CANCELLED, "Locally cancelled!")
            raise
        except grpc.RpcError as error:
            raise _aio_error(error) from None


class _ReadableCall:
    """Reads a sync response iterator of the fake as an aio call would."""

    def __init__(self, fake: FakeAioChannel, responses: Any) -> None:
        self._fake = fake
        self._responses = responses
        self._cancelled = False

    async def read(self) -> Any:
        if self._cancelled:
            raise asyncio.CancelledError
        try:
            return await self._fake.in_thread(functools.partial(_next_or_eof, self._responses))
        except grpc.RpcError as error:
            if self._cancelled:
                raise asyncio.CancelledError from None
            raise _aio_error(error) from None

    async def initial_metadata(self) -> grpc.aio.Metadata:
        """What the router side sent with ``send_initial_metadata`` (empty if it ended the
        call without), as the aio call's ``initial_metadata()`` does."""
        sent: Any = await self._fake.in_thread(self._responses.initial_metadata)
        return grpc.aio.Metadata.from_tuple(tuple(sent or ()))

    def cancel(self) -> bool:
        if self._cancelled:
            return False
        self._cancelled = True
        self._responses.cancel()
        return True


class _UnaryStream:
    def __init__(self, fake: FakeAioChannel, method: str) -> None:
        self._fake = fake
        self._method = method

    def __call__(
        self, request: Any, *, timeout: float | None = None, metadata: Any = None, **_: object
    ) -> _ReadableCall:
        self._fake.timeouts[self._method].append(timeout)
        responses = self._fake.sync.unary_stream(self._method)(
            request, timeout=timeout, metadata=metadata
        )
        return _ReadableCall(self._fake, responses)


class _StreamStreamCall(_ReadableCall):
    def __init__(self, fake: FakeAioChannel, requests: queue.SimpleQueue[Any], responses: Any):
        super().__init__(fake, responses)
        self._requests = requests
        self._half_closed = False

    async def write(self, request: Any) -> None:
        if self._half_closed or self._cancelled:
            raise asyncio.InvalidStateError("write after done_writing or cancel")
        self._requests.put(request)

    async def done_writing(self) -> None:
        if not self._half_closed:
            self._half_closed = True
            self._requests.put(_END)

    def cancel(self) -> bool:
        self._requests.put(_END)  # lets the fake's request-consuming thread finish
        return super().cancel()


class _StreamStream:
    def __init__(self, fake: FakeAioChannel, method: str) -> None:
        self._fake = fake
        self._method = method

    def __call__(
        self,
        request_iterator: Any = None,
        timeout: float | None = None,
        metadata: Any = None,
        **_: object,
    ) -> _StreamStreamCall:
        self._fake.timeouts[self._method].append(timeout)
        requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        responses = self._fake.sync.stream_stream(self._method)(
            iter(requests.get, _END), timeout=timeout, metadata=metadata
        )
        return _StreamStreamCall(self._fake, requests, responses)
