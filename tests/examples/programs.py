"""A real router in its own process, for programs that run as a user would run them.

The README programs and ``examples/`` are separate processes talking to a router over
loopback; so is the router here: ``sessionrouter serve`` (or ``python -m
sessionrouter.server`` of another virtualenv) on ``127.0.0.1:0``, its port read from
``--port-file`` once it serves, stopped with SIGTERM (the graceful drain) at the end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def router_process(
    run_dir: Path,
    *,
    persist: bool = True,
    python: str | Path = sys.executable,
    workers: int = 8,
    start_timeout_s: float = 60.0,
) -> Iterator[str]:
    """Runs a router with ``workers`` demo workers; yields its ``127.0.0.1:PORT``.

    The port file and the router's log go to ``run_dir``, and so does its journal
    (``run_dir/state``) when ``persist``; otherwise it runs in memory. ``python`` is the
    interpreter of the virtualenv the router runs from.
    """
    port_file = run_dir / "router.port"
    port_file.unlink(missing_ok=True)
    state = ["--state-dir", str(run_dir / "state")] if persist else ["--in-memory"]
    args = [
        str(python),
        *("-m", "sessionrouter.server", "serve", "--listen", "127.0.0.1:0"),
        *("--port-file", str(port_file), "--demo-workers", str(workers)),
        *("--log-level", "warning", *state),
    ]
    with (run_dir / "router.log").open("a") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=run_dir)
        try:
            deadline = time.monotonic() + start_timeout_s
            while not (port_file.exists() and port_file.read_text().strip()):
                if proc.poll() is not None:
                    log.flush()
                    out = (run_dir / "router.log").read_text()
                    raise RuntimeError(f"router exited {proc.returncode} before serving:\n{out}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"router did not serve within {start_timeout_s} s")
                time.sleep(0.05)
            yield f"127.0.0.1:{int(port_file.read_text())}"
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def run_program(
    args: Sequence[str | Path],
    address: str,
    *,
    cwd: Path,
    timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Runs a client program against ``address`` with warnings as errors; fails on exit != 0."""
    full_env = {**os.environ, **(env or {}), "SESSIONROUTER_ADDRESS": address}
    full_env["PYTHONWARNINGS"] = "error"
    done = subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert done.returncode == 0, (
        f"{' '.join(map(str, args))} exited {done.returncode}\n"
        f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    )
    return done
