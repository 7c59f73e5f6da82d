"""Builds the image and runs it, where a container engine answers; skips elsewhere.

With docker or podman reachable (`ENGINE info` succeeds), the test builds the Dockerfile,
checks that the image runs as a non-root user, starts it with its default command and the gRPC
port published on 127.0.0.1, waits for grpc.health.v1 to report SERVING, and stops it as the
kubelet would (SIGTERM), expecting exit status 0. Building pulls the Python base image, so the
engine needs a registry it can pull from.
"""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ._tools import REPO_ROOT


def reachable_engine() -> str | None:
    for engine in ("docker", "podman"):
        if shutil.which(engine) is None:
            continue
        done = subprocess.run([engine, "info"], capture_output=True, timeout=30, check=False)
        if done.returncode == 0:
            return engine
    return None


def run(*argv: str, timeout: float = 120) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, f"{' '.join(argv)}:\n{done.stdout}\n{done.stderr}"
    return done.stdout.strip()


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_image_builds_runs_as_non_root_and_serves() -> None:
    engine = reachable_engine()
    if engine is None:
        pytest.skip(
            "no container engine reachable (docker/podman missing, or `info` fails): "
            "not building the image"
        )
    tag = f"sessionrouter-test:{uuid.uuid4().hex[:8]}"
    run(engine, "build", "-t", tag, str(REPO_ROOT), timeout=1100)
    container = ""
    try:
        assert run(engine, "run", "--rm", "--entrypoint", "id", tag, "-u") != "0"
        container = run(engine, "run", "-d", "-p", "127.0.0.1::50051", tag)
        port = run(engine, "port", container, "50051/tcp").splitlines()[0].rsplit(":", 1)[1]
        deadline = time.monotonic() + 60
        status = None
        while status != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, run(engine, "logs", container)
            try:
                with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                    status = (
                        health_pb2_grpc.HealthStub(channel)
                        .Check(health_pb2.HealthCheckRequest(), timeout=2)
                        .status
                    )
            except grpc.RpcError:
                time.sleep(0.5)
        run(engine, "stop", "--time", "30", container)
        assert run(engine, "inspect", "--format", "{{.State.ExitCode}}", container) == "0"
    finally:
        if container:
            subprocess.run([engine, "rm", "-f", container], capture_output=True, check=False)
        subprocess.run([engine, "rmi", "-f", tag], capture_output=True, check=False)
