"""A real ``sessionrouter serve`` process on 127.0.0.1, for tests that need one as users run it.

The port is the one the router bound and wrote to its ``--port-file`` (the first start binds
port 0); its stdout and stderr go to ``router.log`` in the test's directory, whose tail goes
into every start error. A router can be stopped gracefully (SIGTERM, the drain), killed
(SIGKILL, the crash tests), started again on its state directory, on a new port or, with
``keep_port``, on the port it had (as a process manager restarts a router behind a proxy that
knows one upstream address), or run to see it refuse to start (``exits``). ``python`` is the
interpreter of the virtualenv it runs from (another one for the compatibility tests).
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType


def static_workers(count: int, capacity: int) -> list[str]:
    """``--worker`` flags for ``count`` workers ``w0..`` at unroutable addresses (nothing is
    ever sent to a worker: the router only hands its address out)."""
    return [f"--worker=w{i}=10.0.0.{i}:1,{capacity}" for i in range(count)]


class RouterProcess:
    """One router process; ``start`` returns once it serves (or fails saying why)."""

    def __init__(
        self,
        workdir: Path,
        *args: str,
        python: str | Path = sys.executable,
        keep_port: bool = False,
        start_timeout_s: float = 60.0,
    ) -> None:
        self.workdir = workdir
        self.args = args
        self.python = python
        self.keep_port = keep_port
        self.start_timeout_s = start_timeout_s
        self.log = workdir / "router.log"
        self.port_file = workdir / "router.port"
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.starts = 0
        """Starts that reached serving."""

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def launch(self, *extra: str) -> subprocess.Popen[bytes]:
        """Starts the process without waiting for it to serve."""
        self.port_file.unlink(missing_ok=True)
        port = self.port if self.keep_port else 0
        argv = [
            str(self.python),
            *("-m", "sessionrouter.server", "serve"),
            *("--listen", f"127.0.0.1:{port}", "--port-file", str(self.port_file)),
            *self.args,
            *extra,
        ]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir
            )
        return self.proc

    def start(self, *extra: str) -> str:
        """Starts the router (``extra`` flags for this start only); returns its address."""
        proc = self.launch(*extra)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"router exited {proc.returncode}: {self.tail()}")
            with contextlib.suppress(FileNotFoundError):
                text = self.port_file.read_text().strip()
                if text.isdigit():
                    self.port = int(text)
                    self.starts += 1
                    return self.address
            time.sleep(0.02)
        raise AssertionError(f"router did not serve in {self.start_timeout_s:.0f} s: {self.tail()}")

    def exits(self, *extra: str, timeout: float = 60) -> tuple[int, str]:
        """Runs a router that is expected to refuse to start: its exit code and log."""
        code = self.launch(*extra).wait(timeout)
        return code, self.tail(200)

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM (the graceful drain), SIGKILL after ``timeout`` s; the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        return self.proc.returncode

    def kill9(self) -> None:
        """SIGKILL: a crash, nothing flushed."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def restart(self) -> float:
        """A graceful stop, then a start; the seconds the router was away."""
        began = time.monotonic()
        assert self.stop() == 0, self.tail()
        self.start()
        return time.monotonic() - began

    def tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the router's output."""
        if not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> str:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
