"""Toolchain checks and builds for the interop tests.

A missing toolchain fails the test with the name of the tool (a green run must mean the
clients ran), unless SESSIONROUTER_SKIP_INTEROP=1 asks to skip them. Builds go through the
make targets of mk/polyglot.mk, which are stamped: after `make interop-deps` they cost nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from ._server import REPO_ROOT

SKIP_ENV = "SESSIONROUTER_SKIP_INTEROP"


def require_tools(*tools: str) -> None:
    """Skips when interop is switched off; fails when a tool is not on PATH."""
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{SKIP_ENV}=1: interop tests switched off")
    missing = [tool for tool in (*tools, "make") if shutil.which(tool) is None]
    if missing:
        pytest.fail(
            f"this interop test needs {', '.join(missing)} on PATH: install the toolchain, "
            f"or set {SKIP_ENV}=1 to skip the interop tests",
            pytrace=False,
        )


def make(target: str, timeout: float = 540) -> None:
    """Runs `make TARGET` at the repository root; fails the test with its output."""
    try:
        done = subprocess.run(
            ["make", "--no-print-directory", target],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"make {target} ran over {e.timeout:.0f} s", pytrace=False)
    if done.returncode != 0:
        pytest.fail(
            f"make {target} exited with {done.returncode}:\n{done.stdout[-4000:]}"
            f"\n{done.stderr[-4000:]}",
            pytrace=False,
        )
