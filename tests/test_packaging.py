"""Trainers install the package with ``pip install .`` or ``pip install git+...``: the wheel
must hold the namespaced packages, the generated stubs with their type stubs, and the
console script; never a bare top-level ``server`` or ``client``."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCE_ROOTS = ("server", "client", "gen/python")
"""Where the ``sessionrouter`` namespace's packages live in the repository."""


def source_modules() -> set[str]:
    """Every module and type stub under the source roots, as its path inside a wheel."""
    found = set()
    for root in SOURCE_ROOTS:
        base = ROOT / root
        for path in (base / "sessionrouter").rglob("*"):
            if path.suffix in (".py", ".pyi") and "__pycache__" not in path.parts:
                found.add(path.relative_to(base).as_posix())
    return found


@pytest.mark.slow  # builds a wheel: about 10 s
@pytest.mark.timeout(300)
def test_wheel_holds_namespaced_packages_stubs_and_entry_point(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("sessionrouter-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    top_level = {n.split("/", 1)[0] for n in names}
    assert {t for t in top_level if not t.endswith(".dist-info")} == {"sessionrouter"}
    for required in (
        "sessionrouter/server/core/router.py",
        "sessionrouter/server/py.typed",
        "sessionrouter/client/__init__.py",
        "sessionrouter/client/py.typed",
        "sessionrouter/v1/session_service_pb2.py",
        "sessionrouter/v1/session_service_pb2.pyi",
        "sessionrouter/v1/session_service_pb2_grpc.py",
        "sessionrouter/v1/worker_service_pb2_grpc.pyi",
        "sessionrouter/v1/py.typed",
    ):
        assert required in names, required
    wheel_modules = {n for n in names if n.endswith((".py", ".pyi"))}
    assert wheel_modules == source_modules()
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "sessionrouter = sessionrouter.server.cli:main" in (
        zipfile.ZipFile(wheel).read(entry_points).decode()
    )
