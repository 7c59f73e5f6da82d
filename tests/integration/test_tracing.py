"""Tracing: a span per RPC with the group id and session name, exported where configured."""

from __future__ import annotations

import time

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from sessionrouter.server.app import RouterServer, ServerConfig, WorkerSpec
from sessionrouter.server.tracing import GROUP_ATTRIBUTE, SESSION_ATTRIBUTE, STATUS_CODE_ATTRIBUTE
from sessionrouter.v1 import session_service_pb2 as spb
from sessionrouter.v1 import session_service_pb2_grpc as spb_grpc


async def _served(config: ServerConfig, exporter: InMemorySpanExporter | None) -> RouterServer:
    server = RouterServer(config, span_exporter=exporter)
    await server.start()
    return server


async def test_each_rpc_is_a_span_naming_its_group_and_session() -> None:
    exporter = InMemorySpanExporter()
    config = ServerConfig(listen="127.0.0.1:0", workers=(WorkerSpec("w", "a:1", 4),), tracing=True)
    server = await _served(config, exporter)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = spb_grpc.SessionServiceStub(channel)
            started = await stub.StartSession(
                spb.StartSessionRequest(task_id="t", group_id="g1", group_size=2)
            )
            await stub.GetSession(spb.GetSessionRequest(session=started.session.name))
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.StartSession(
                    spb.StartSessionRequest(task_id="other", group_id="g1", group_size=2)
                )
    finally:
        await server.stop(grace_s=0.5)  # flushes the span processor
    spans = {(s.name, i): s for i, s in enumerate(exporter.get_finished_spans())}
    names = [name for name, _ in spans]
    assert names == [
        "/sessionrouter.v1.SessionService/StartSession",
        "/sessionrouter.v1.SessionService/GetSession",
        "/sessionrouter.v1.SessionService/StartSession",
    ]
    start, get, refused = spans.values()
    assert start.kind is SpanKind.SERVER
    assert start.attributes is not None and get.attributes is not None
    assert start.attributes[GROUP_ATTRIBUTE] == "g1"
    assert start.attributes[SESSION_ATTRIBUTE] == "groups/g1/sessions/0"
    assert get.attributes[SESSION_ATTRIBUTE] == "groups/g1/sessions/0"
    assert get.attributes[GROUP_ATTRIBUTE] == "g1"
    assert refused.attributes is not None and refused.attributes[GROUP_ATTRIBUTE] == "g1"
    assert refused.attributes[STATUS_CODE_ATTRIBUTE] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert refused.status.is_unset  # a client fault, as OpenTelemetry's convention has it


async def test_the_otlp_exporter_starts_without_a_collector(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Port 1 on loopback has no collector: serving works, the spans are lost, and stopping
    waits no longer than the exporter's timeout (OpenTelemetry's own variable, 1 s here)."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1")
    config = ServerConfig(listen="127.0.0.1:0", tracing=True, otlp_endpoint="http://127.0.0.1:1")
    server = await _served(config, None)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = spb_grpc.SessionServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.StartSession(spb.StartSessionRequest(task_id="t"))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # no worker
    finally:
        stopping = time.monotonic()
        await server.stop(grace_s=0.5)
    assert time.monotonic() - stopping < 10
