"""A real ``sessionrouter serve`` process on 127.0.0.1:0, for tests that need one: the port
is the one the router bound and wrote to its ``--port-file``, its stderr goes to a log file
the test can read."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path

SESSIONROUTER = Path(sys.executable).with_name("sessionrouter")


class RouterProcess:
    """One router process; ``start`` waits until it serves (or exits)."""

    def __init__(self, workdir: Path, *args: str) -> None:
        self.workdir = workdir
        self.args = args
        self.log = workdir / "router.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""

    def launch(self, *extra: str) -> subprocess.Popen[bytes]:
        port_file = self.workdir / "port"
        port_file.unlink(missing_ok=True)
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    str(SESSIONROUTER),
                    "serve",
                    *("--listen", "127.0.0.1:0", "--port-file", str(port_file)),
                    *self.args,
                    *extra,
                ],
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        return self.proc

    def start(self, *extra: str) -> str:
        proc = self.launch(*extra)
        port_file = self.workdir / "port"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"router exited {proc.returncode}: {self.tail()}")
            with contextlib.suppress(FileNotFoundError):
                text = port_file.read_text().strip()
                if text.isdigit():
                    self.address = f"127.0.0.1:{text}"
                    return self.address
            time.sleep(0.02)
        raise AssertionError(f"router did not start: {self.tail()}")

    def exits(self, *extra: str, timeout: float = 60) -> tuple[int, str]:
        """Runs a router that is expected to refuse to start: its exit code and log."""
        proc = self.launch(*extra)
        code = proc.wait(timeout)
        return code, self.tail()

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> int:
        """SIGTERM, then the exit code (a graceful drain)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(30)
