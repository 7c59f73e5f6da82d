"""Fuzz every RPC of both services against a live router process.

Hypothesis builds requests from the message descriptors (any field set or not, ids picked
from the ones the router knows or made up, strings up to 100 KB, any integer of the field's
width, NaN and infinities, unknown enum values), plus payloads that are not the message at
all (random bytes, a string field holding invalid UTF-8). A default client (4 MiB receive
limit, 8 KiB-ish metadata) calls the router, and the test fails on:

- UNKNOWN or INTERNAL: an exception escaped a handler, or a reply could not be built;
- RESOURCE_EXHAUSTED not raised by the router itself (no ``ErrorInfo`` of its domain): the
  client's own transport refused a reply or trailer too large for it;
- DEADLINE_EXCEEDED on anything but the subscription (which waits for groups on purpose):
  a call that hung.

The router is a real ``sessionrouter serve`` with a journal, so what the fuzzer sends also
goes through the journal's encoding. Derandomized: a failure replays.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessionrouter.v1 import session_service_pb2, worker_service_pb2
from tests.router_process import RouterProcess

pytestmark = [
    pytest.mark.slow,
    # A failing example may hold a 100 KB string: Hypothesis warns that its repr is large.
    pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisWarning"),
]

EXAMPLES = 200
"""Examples per RPC."""
DOMAIN = "sessionrouter.dev"
WORKERS = [f"w{i}" for i in range(4)]
KNOWN_STRINGS = [
    *WORKERS,
    "t",
    "g0",
    "g1",
    "groups/g0/sessions/0",
    "groups/g0/sessions/3",
    "groups/g1/sessions/1",
    "grpo",
    "rloo",
    "dr_grpo",
    "10.0.0.9:1",
    "",
]
INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


def _ints(low: int, high: int) -> st.SearchStrategy[int]:
    """Small values most of the time (they reach deeper code), the extremes sometimes."""
    return st.one_of(
        st.integers(max(low, -3), min(high, 1100)),
        st.sampled_from([low, high, 0]),
        st.integers(low, high),
    )


def _long_text() -> st.SearchStrategy[str]:
    return st.builds(
        lambda c, n: c * n,
        st.sampled_from(["a", "é", "/", " ", "\U0001f600"]),
        st.integers(0, 100_000),
    )


TEXT = st.one_of(st.sampled_from(KNOWN_STRINGS), st.text(max_size=40), _long_text())


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    t = field.type
    if t == FieldDescriptor.TYPE_STRING:
        return TEXT
    if t == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.one_of(
            st.floats(width=64 if t == FieldDescriptor.TYPE_DOUBLE else 32),
            st.sampled_from([1e308, -1.5e308, 1e100, 0.5, -0.0]),
        )
    if t == FieldDescriptor.TYPE_ENUM:
        return st.integers(-2, 12)
    low, high = INT_RANGES[t]
    return _ints(low, high)


def messages(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Any]:
    """Instances of ``descriptor``'s message with any subset of fields set."""
    cls = message_factory.GetMessageClass(descriptor)
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        sub_type = field.message_type
        if sub_type is not None:
            if sub_type.GetOptions().map_entry:
                key = _scalar(sub_type.fields_by_name["key"])
                value = _scalar(sub_type.fields_by_name["value"])
                fields[field.name] = st.dictionaries(key, value, max_size=40)
                continue
            if depth >= 3:
                continue
            sub = messages(sub_type, depth + 1)
        else:
            sub = _scalar(field)
        if field.is_repeated:
            sub = st.lists(sub, max_size=8)
        fields[field.name] = sub

    @st.composite
    def build(draw: Callable[[st.SearchStrategy[Any]], Any]) -> Any:
        message = cls()
        for name, strategy in fields.items():
            if draw(st.booleans()):
                value = draw(strategy)
                target = getattr(message, name)
                if isinstance(value, dict):
                    target.update(value)
                elif isinstance(value, list):
                    if value and hasattr(value[0], "SerializeToString"):
                        target.extend(value)
                    else:
                        target.extend(value)
                elif hasattr(value, "SerializeToString"):
                    target.CopyFrom(value)
                else:
                    setattr(message, name, value)
        return message

    return build()


def payloads(descriptor: Descriptor) -> st.SearchStrategy[bytes]:
    """Serialized requests, mostly valid ones, some that are not the message at all."""
    return st.one_of(
        messages(descriptor).map(lambda m: m.SerializeToString()),
        messages(descriptor).map(lambda m: m.SerializeToString()),
        messages(descriptor).map(lambda m: m.SerializeToString()),
        st.binary(max_size=64),
        # Field 1 as a length-delimited value of random bytes: invalid UTF-8 where it is a
        # string, a broken submessage where it is a message.
        st.binary(min_size=1, max_size=20).map(lambda b: b"\x0a" + bytes([len(b)]) + b),
    )


def _check(error: grpc.RpcError, method: MethodDescriptor, streaming_wait: bool) -> None:
    code = error.code()
    where = f"{method.containing_service.name}/{method.name}"
    assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), (
        f"{where}: {code.name}: {error.details()}"
    )
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        assert streaming_wait, f"{where} hung: {error.details()}"
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        domains = []
        try:
            status = rpc_status.from_call(error)
        except ValueError:  # the transport's own code, not the one the router sent
            status = None
        for detail in status.details if status is not None else []:
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info):
                domains.append(info.domain)
        assert DOMAIN in domains, f"{where}: the client refused the reply: {error.details()}"


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[grpc.Channel]:
    workdir: Path = tmp_path_factory.mktemp("fuzz")
    workers = [f"--worker={w}=10.0.0.{i}:1,100000" for i, w in enumerate(WORKERS)]
    process = RouterProcess(
        workdir,
        *("--state-dir", str(workdir / "state"), "--journal-sync", "normal"),
        *("--log-level", "error"),
        *workers,
    )
    address = process.start()
    channel = grpc.insecure_channel(address)  # a default client: 4 MiB receive limit
    try:
        yield channel
    finally:
        channel.close()
        code = process.stop()
        assert code == 0, process.tail()


METHODS = [
    *session_service_pb2.DESCRIPTOR.services_by_name["SessionService"].methods,
    *worker_service_pb2.DESCRIPTOR.services_by_name["WorkerService"].methods,
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_no_rpc_answers_unknown_internal_or_an_unreceivable_reply(
    router: grpc.Channel, method: MethodDescriptor
) -> None:
    path = f"/{method.containing_service.full_name}/{method.name}"
    reply_class = message_factory.GetMessageClass(method.output_type)
    requests = payloads(method.input_type)

    def decode(data: bytes) -> Any:
        return reply_class.FromString(data)

    if method.client_streaming:
        call: Any = router.stream_stream(path, response_deserializer=decode)

        @given(st.lists(requests, max_size=4))
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def fuzz_stream(batch: list[bytes]) -> None:
            try:
                for _ in call(iter(batch), timeout=10):
                    pass
            except grpc.RpcError as error:
                _check(error, method, streaming_wait=False)

        fuzz_stream()
    elif method.server_streaming:
        subscribe: Any = router.unary_stream(path, response_deserializer=decode)

        @given(requests)
        @settings(
            max_examples=EXAMPLES // 4,  # each waits out its deadline when it is valid
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def fuzz_subscription(payload: bytes) -> None:
            try:
                for _ in subscribe(payload, timeout=0.2):
                    pass
            except grpc.RpcError as error:
                _check(error, method, streaming_wait=True)

        fuzz_subscription()
    else:
        unary: Any = router.unary_unary(path, response_deserializer=decode)

        @given(requests)
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def fuzz_unary(payload: bytes) -> None:
            try:
                unary(payload, timeout=10)
            except grpc.RpcError as error:
                _check(error, method, streaming_wait=False)

        fuzz_unary()
