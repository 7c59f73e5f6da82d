"""TLS and mTLS through a real router, with certificates made at test time.

With ``tls_client_ca_file`` the handshake requires a client certificate signed by that CA: a
client without one, or with one from another CA, never reaches an RPC; a client with a valid
certificate is served, and tokens and roles still apply on top.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from sessionrouter.client import SessionRouterClient, UnauthenticatedError
from sessionrouter.server.credentials import TokenTable
from sessionrouter.v1 import worker_service_pb2 as wpb
from sessionrouter.v1 import worker_service_pb2_grpc as wpb_grpc
from tests.support import Harness, start_harness, stop_harness


@dataclass(frozen=True)
class Pem:
    """A certificate and its private key, PEM-encoded."""

    cert: bytes
    key: bytes


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _issue(
    subject: str,
    issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
    *,
    ca: bool = False,
    server: bool = False,
) -> tuple[Pem, x509.Name, ec.EllipticCurvePrivateKey]:
    """A P-256 certificate valid for a day; self-signed when ``issuer`` is None."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(subject)
    issuer_name, issuer_key = issuer if issuer is not None else (name, key)
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        ).add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
    elif not ca:
        builder = builder.add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
    cert = builder.sign(issuer_key, hashes.SHA256())
    pem = Pem(
        cert.public_bytes(serialization.Encoding.PEM),
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )
    return pem, name, key


@dataclass(frozen=True)
class Pki:
    ca: Pem
    server: Pem
    client: Pem
    stranger: Pem
    """A client certificate from another CA."""


@pytest.fixture(scope="module")
def pki() -> Pki:
    ca, ca_name, ca_key = _issue("sessionrouter test CA", None, ca=True)
    server, _, _ = _issue("router", (ca_name, ca_key), server=True)
    client, _, _ = _issue("trainer-1", (ca_name, ca_key))
    _, other_name, other_key = _issue("another CA", None, ca=True)
    stranger, _, _ = _issue("stranger", (other_name, other_key))
    return Pki(ca, server, client, stranger)


async def _mtls_router(tmp_path: Path, pki: Pki, tokens: TokenTable | None = None) -> Harness:
    files = {}
    for name, data in (
        ("server.pem", pki.server.cert),
        ("server.key", pki.server.key),
        ("clients-ca.pem", pki.ca.cert),
    ):
        (tmp_path / name).write_bytes(data)
        files[name] = str(tmp_path / name)
    return await start_harness(
        tls_cert_file=files["server.pem"],
        tls_key_file=files["server.key"],
        tls_client_ca_file=files["clients-ca.pem"],
        tokens=tokens,
    )


def _client(address: str, pki: Pki, token: str | None = None) -> SessionRouterClient:
    """A typed client holding a certificate of the router's client CA."""
    return SessionRouterClient.connect(
        address,
        token=token,
        root_certificates=pki.ca.cert,
        client_certificate_chain=pki.client.cert,
        client_private_key=pki.client.key,
    )


async def _list_workers(address: str, credentials: grpc.ChannelCredentials) -> grpc.StatusCode:
    async with grpc.aio.secure_channel(address, credentials) as channel:
        stub = wpb_grpc.WorkerServiceStub(channel)
        try:
            await stub.RegisterWorker(
                wpb.RegisterWorkerRequest(worker_id="sneaky", address="6.6.6.6:1"), timeout=5
            )
        except grpc.aio.AioRpcError as error:
            return error.code()
        return grpc.StatusCode.OK


async def test_mtls_refuses_a_client_without_a_valid_certificate(tmp_path: Path, pki: Pki) -> None:
    h = await _mtls_router(tmp_path, pki)
    try:
        no_cert = grpc.ssl_channel_credentials(root_certificates=pki.ca.cert)
        assert await _list_workers(h.address, no_cert) == grpc.StatusCode.UNAVAILABLE
        other_ca = grpc.ssl_channel_credentials(pki.ca.cert, pki.stranger.key, pki.stranger.cert)
        assert await _list_workers(h.address, other_ca) == grpc.StatusCode.UNAVAILABLE
        assert h.server.router.find_worker("sneaky") is None
        async with _client(h.address, pki) as client:
            registered = await client.register_worker("w1", "10.0.0.1:1", 2)
            assert registered.worker.worker_id == "w1"
            assert [w.worker_id for w in (await client.list_workers()).items] == ["w1"]
    finally:
        await stop_harness(h)


async def test_mtls_and_tokens_both_apply(tmp_path: Path, pki: Pki) -> None:
    h = await _mtls_router(tmp_path, pki, tokens=TokenTable.parse("admin:a-1\ntrainer:t-1\n"))
    try:
        async with _client(h.address, pki) as client:
            with pytest.raises(UnauthenticatedError):
                await client.list_workers()
        async with _client(h.address, pki, token="t-1") as client:
            assert (await client.list_workers()).items == ()
    finally:
        await stop_harness(h)


def test_pem_options_and_credentials_exclude_each_other(pki: Pki) -> None:
    creds = grpc.ssl_channel_credentials(pki.ca.cert)
    with pytest.raises(ValueError, match="not both"):
        SessionRouterClient.connect("127.0.0.1:1", credentials=creds, root_certificates=b"x")
    with pytest.raises(ValueError, match="private key"):
        SessionRouterClient.connect("127.0.0.1:1", client_certificate_chain=pki.client.cert)
