"""Runs a server as a child process for the interop and load tests.

`running_server()` starts the real router (`python -m sessionrouter.server serve --listen
127.0.0.1:0 --port-file PATH --in-memory`, the flag only when `serve --help` lists it) or the
trivial baseline (`scripts/trivial_server.py`), waits until the port file appears, yields
`127.0.0.1:PORT`, and on exit stops the process with SIGTERM, then SIGKILL after a grace
period. The server's output goes to a log file whose tail goes into every start error, and is
printed when the body of the `with` fails.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

REPO_ROOT = Path(__file__).resolve().parents[2]
TRIVIAL_SERVER = REPO_ROOT / "scripts" / "trivial_server.py"

ServerKind = Literal["real", "trivial"]


class ServerStartError(RuntimeError):
    """The server exited or did not write its port file in time."""


REAL_SERVER = (sys.executable, "-m", "sessionrouter.server", "serve")


@functools.cache
def _in_memory_flag() -> tuple[str, ...]:
    """`--in-memory` when the router has it (it keeps state off disk); a router without the
    flag has no durable state to keep off disk."""
    done = subprocess.run([*REAL_SERVER, "--help"], capture_output=True, text=True, timeout=60)
    return ("--in-memory",) if "--in-memory" in done.stdout else ()


def server_command(kind: ServerKind, port_file: Path) -> list[str]:
    """The argv that starts a server of this kind on an ephemeral port of 127.0.0.1."""
    listen = ["--listen", "127.0.0.1:0", "--port-file", str(port_file)]
    if kind == "trivial":
        return [sys.executable, str(TRIVIAL_SERVER), *listen]
    return [*REAL_SERVER, *listen, *_in_memory_flag()]


def _tail(log: Path, lines: int = 40) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return "(no server output)"
    return "\n".join(text.splitlines()[-lines:]) or "(no server output)"


def _read_port(port_file: Path) -> int | None:
    try:
        text = port_file.read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() and int(text) > 0 else None


def stop_process(proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL when the process is still alive after `grace` seconds."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=grace)


@contextlib.contextmanager
def running_server(
    kind: ServerKind = "real",
    *,
    extra_args: Sequence[str] = (),
    start_timeout: float = 30.0,
    grace: float = 10.0,
) -> Iterator[str]:
    """Starts a server, yields its address `127.0.0.1:PORT`, and stops it on exit."""
    with tempfile.TemporaryDirectory(prefix=f"sessionrouter-{kind}-") as tmp:
        port_file = Path(tmp) / "port"
        log = Path(tmp) / "server.log"
        argv = [*server_command(kind, port_file), *extra_args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with log.open("wb") as out:
            proc = subprocess.Popen(
                argv, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, env=env
            )
        try:
            deadline = time.monotonic() + start_timeout
            port = _read_port(port_file)
            while port is None:
                if proc.poll() is not None:
                    raise ServerStartError(
                        f"{' '.join(argv)} exited with {proc.returncode} before serving:\n"
                        + _tail(log)
                    )
                if time.monotonic() > deadline:
                    raise ServerStartError(
                        f"{' '.join(argv)} wrote no port file within {start_timeout:.0f} s:\n"
                        + _tail(log)
                    )
                time.sleep(0.05)
                port = _read_port(port_file)
            try:
                yield f"127.0.0.1:{port}"
            except BaseException:
                # Captured by pytest and shown with the failure.
                print(f"--- {kind} server output (tail) ---\n{_tail(log)}")
                raise
        finally:
            stop_process(proc, grace)
