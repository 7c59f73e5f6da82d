"""Programs run as a user would run them, against a real router in its own process.

The README programs and ``examples/`` are separate processes talking to a router over
loopback; so is the router (``tests.router_process``, possibly from another virtualenv),
stopped with SIGTERM (the graceful drain) at the end.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from tests.router_process import RouterProcess

ROOT = Path(__file__).resolve().parents[2]


def example_router(
    run_dir: Path, *, persist: bool = True, python: str | Path = sys.executable, workers: int = 8
) -> RouterProcess:
    """A router with ``workers`` demo workers, its journal in ``run_dir/state`` when
    ``persist`` (else in memory); ``with example_router(...) as address:`` runs it.
    ``python`` is the interpreter of the virtualenv the router runs from."""
    state = ["--state-dir", str(run_dir / "state")] if persist else ["--in-memory"]
    return RouterProcess(
        run_dir,
        *("--demo-workers", str(workers), "--log-level", "warning", *state),
        python=python,
    )


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
