"""Helpers shared by the benchmark scripts: start a router process, time things, print tables.

Benchmarks run the server in its own process (as in production) on 127.0.0.1, bounded in
count and time, and report medians over repeats plus ratios against a baseline measured in
the same run, since absolute numbers on a shared machine drift.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def header(title: str) -> None:
    """Prints what was measured, where and with what, so a pasted table can be trusted."""
    import grpc
    import numpy as np

    print(f"# {title}")
    print(f"# command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(
        f"# python {platform.python_version()}, grpcio {grpc.__version__}, numpy"
        f" {np.__version__}, {os.cpu_count()} cpus, load {os.getloadavg()[0]:.2f}"
    )


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


@dataclasses.dataclass(frozen=True)
class Server:
    """A server process started by ``serve``: where it listens, and its pid (for /proc)."""

    address: str
    pid: int

    def cpu_seconds(self) -> float:
        """User plus system CPU time the process has used so far (from /proc/PID/stat)."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def serve(args: Sequence[str], timeout_s: float = 30.0) -> Iterator[Server]:
    """Runs a server command that takes ``--port-file`` and yields it once it listens.

    Its output goes to a file, not a pipe: a router at its default log level writes lines
    that would fill an unread pipe and stall it. The command is stopped with SIGTERM (then
    SIGKILL) when the block ends."""
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port"
        log = Path(tmp) / "server.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [*args, "--port-file", str(port_file)],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
        try:
            deadline = time.monotonic() + timeout_s
            # Not only "exists": a server that writes the file in place (the ack-only one)
            # can be seen between its creation and its write, with no port in it yet.
            while not (port_file.exists() and port_file.read_text().strip()):
                if proc.poll() is not None:
                    err = log.read_text(errors="replace")
                    raise RuntimeError(f"server exited with {proc.returncode}: {err[-2000:]}")
                if time.monotonic() > deadline:
                    raise TimeoutError("server did not write its port file in time")
                time.sleep(0.05)
            yield Server(f"127.0.0.1:{port_file.read_text().strip()}", proc.pid)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def server_process(args: Sequence[str], timeout_s: float = 30.0) -> Iterator[str]:
    """``serve``, yielding only the ``127.0.0.1:port`` address."""
    with serve(args, timeout_s) as server:
        yield server.address


def router_command(*extra: str) -> list[str]:
    """The real router at its default settings (the default log level too: what users run),
    without a journal (benchmarks of the journal set their own)."""
    cmd = [sys.executable, "-m", "sessionrouter.server", "serve", "--listen", "127.0.0.1:0"]
    if "--in-memory" in _serve_help():
        cmd.append("--in-memory")
    return [*cmd, *extra]


def _serve_help() -> str:
    return subprocess.run(
        [sys.executable, "-m", "sessionrouter.server", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
