"""The roles table covers every RPC, and token files are read (or refused) as documented."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import pytest
from google.protobuf import descriptor

import sessionrouter.v1
from sessionrouter.server import cli
from sessionrouter.server.config import ConfigError, build_config
from sessionrouter.server.credentials import CredentialError, Role, TokenTable
from sessionrouter.server.roles import ACCESS, access_of, is_open

W, R, T, A = Role.WORKER, Role.ROLLOUT, Role.TRAINER, Role.ADMIN


def _services() -> list[descriptor.ServiceDescriptor]:
    """Every service of every generated module of the contract package."""
    found = []
    for info in pkgutil.iter_modules(sessionrouter.v1.__path__):
        if info.name.endswith("_pb2"):
            module = importlib.import_module(f"sessionrouter.v1.{info.name}")
            found += list(module.DESCRIPTOR.services_by_name.values())
    return found


def _rpcs() -> dict[str, descriptor.MethodDescriptor]:
    return {
        f"/{service.full_name}/{method.name}": method
        for service in _services()
        for method in service.methods
    }


def test_every_rpc_of_the_services_has_a_row_and_every_row_an_rpc() -> None:
    rpcs = _rpcs()
    assert len(rpcs) >= 14
    missing = sorted(set(rpcs) - set(ACCESS))
    assert not missing, f"RPCs without roles: add a row to roles.ACCESS for {missing}"
    assert not sorted(set(ACCESS) - set(rpcs)), "rows naming RPCs that do not exist"


def test_the_table_grants_what_the_roles_are_for() -> None:
    """Pinned: changing who may call what is a deliberate change of this list too."""
    granted = {method.rsplit("/", 1)[1]: access.roles for method, access in ACCESS.items()}
    assert granted == {
        "RegisterWorker": {W, A},
        "Heartbeat": {W, A},
        "DrainWorker": {W, A},
        "DeregisterWorker": {A},
        "GetWorker": {W, T, A},
        "ListWorkers": {T, A},
        "StartSession": {R, A},
        "StartGroup": {R, A},
        "AbortSession": {R, A},
        "GetSession": {R, T, A},
        "GetGroup": {R, T, A},
        "ListGroups": {R, T, A},
        "SubmitRewards": {R, A},
        "SubscribeGroups": {T, A},
        "SetTrainerState": {T, A},
        "GetTrainerState": {R, T, A},
        "BeginWeightUpdate": {T, A},
        "CompleteWeightUpdate": {W, T, A},
    }


def test_worker_scoped_rows_are_unary_calls_naming_a_worker() -> None:
    rpcs = _rpcs()
    for method, access in ACCESS.items():
        if access.worker_scoped:
            rpc = rpcs[method]
            assert not rpc.client_streaming and not rpc.server_streaming, method
            assert "worker_id" in rpc.input_type.fields_by_name, method
            assert Role.WORKER in access.roles, method
    scoped = {m.rsplit("/", 1)[1] for m, a in ACCESS.items() if a.worker_scoped}
    assert scoped == {
        "RegisterWorker",
        "Heartbeat",
        "DrainWorker",
        "GetWorker",
        "CompleteWeightUpdate",
    }


def test_an_rpc_without_a_row_is_admin_only_and_probes_are_open() -> None:
    assert access_of("/sessionrouter.v1.SessionService/Future").roles == {A}
    assert is_open("/grpc.health.v1.Health/Check")
    assert is_open("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
    assert not is_open("/sessionrouter.v1.WorkerService/ListWorkers")


def test_a_token_file_maps_each_token_to_its_role() -> None:
    table = TokenTable.parse(
        "# comment\n\nadmin:a1\nrollout:r1\n  rollout:r2  \ntrainer:t1\n"
        "worker:w1:gpu-7-*, gpu-8\nworker:w2:*\n"
    )
    roles = {t: table.identify(t.encode()) for t in ("a1", "r1", "r2", "t1", "w1", "w2")}
    assert {t: c.role if c else None for t, c in roles.items()} == {
        "a1": A,
        "r1": R,
        "r2": R,
        "t1": T,
        "w1": W,
        "w2": W,
    }
    assert table.identify(b"r3") is None and table.identify(b"") is None
    w1 = roles["w1"]
    assert w1 is not None and w1.worker_globs == ("gpu-7-*", "gpu-8")
    assert w1.binds("gpu-7-a") and w1.binds("gpu-8")
    assert not w1.binds("gpu-80") and not w1.binds("GPU-7-a")
    w2 = roles["w2"]
    assert w2 is not None and w2.binds("anything")


def test_a_single_bare_token_is_the_admin_token_of_earlier_versions() -> None:
    table = TokenTable.parse("  s3cret\n")
    credential = table.identify(b"s3cret")
    assert credential is not None and credential.role is A


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "holds no token"),
        ("  \n\t\n", "holds no token"),
        ("# only a comment\n", "holds no token"),
        ("s3cret\nadmin:a1\n", "line 1: expected ROLE:TOKEN"),
        ("admin:a1\nroot:x\n", "line 2: expected ROLE:TOKEN"),
        ("worker:w1\n", "line 1: a worker token needs the worker ids"),
        ("worker:w1: , \n", "line 1: a worker token needs the worker ids"),
        ("rollout:r1:w-*\n", "line 1: only worker tokens take worker ids"),
        ("admin:\n", "line 1: empty token"),
        ("admin:a b\n", "line 1: a token is 1-4096 printable characters"),
        ("admin:a1\nrollout:a1\n", "line 2: the token of line 1 again"),
    ],
)
def test_bad_token_files_are_refused_naming_the_line(text: str, problem: str) -> None:
    with pytest.raises(CredentialError, match=problem):
        TokenTable.parse(text)


def test_an_empty_token_file_or_variable_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text(" \n")
    with pytest.raises(ConfigError, match=r"auth_token_file .*holds no token"):
        build_config(flags={"auth_token_file": str(path), "in_memory": True})
    with pytest.raises(ConfigError, match=r"\$SESSIONROUTER_TOKEN: holds no token"):
        build_config(flags={"in_memory": True}, token_env="   ")
    path.write_text("rollout:r1\n")
    config = build_config(flags={"auth_token_file": str(path), "in_memory": True})
    assert config.tokens is not None and config.tokens.roles() == {R}


def test_an_empty_token_file_refuses_to_start_with_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "tokens"
    path.write_text("\n   \n")
    assert cli.main(["serve", "--token-file", str(path), "--in-memory"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("sessionrouter: error: auth_token_file")
    assert "refusing to start without authentication" in err[0]


def test_a_client_ca_needs_a_server_certificate() -> None:
    with pytest.raises(ConfigError, match="tls_client_ca_file"):
        build_config(flags={"tls_client_ca_file": "ca.pem", "in_memory": True})
