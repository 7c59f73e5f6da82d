"""The image's build context holds what its Dockerfile copies, and that is enough to build the
package, without a container engine.

The test reads the Dockerfile's COPY sources (build stage), copies exactly those into an empty
directory, as `docker build` would send them past .dockerignore, and builds the wheel there:
a file the package needs that the Dockerfile does not copy fails the build here. It also checks
that .dockerignore lets every COPY source through.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from ._tools import REPO_ROOT


def copy_sources() -> list[str]:
    """The sources of the Dockerfile's COPY instructions that read the build context."""
    sources = []
    for line in (REPO_ROOT / "Dockerfile").read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not any(w.startswith("--from") for w in words):
            sources += words[1:-1]
    return sources


def allowed_by_dockerignore() -> set[str]:
    """The paths a `*` + `!path` .dockerignore lets through (the form this one has)."""
    lines = [
        line.strip()
        for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[0] == "*", ".dockerignore should exclude everything first, then allow"
    return {line[1:].rstrip("/") for line in lines if line.startswith("!")}


def test_every_copied_path_passes_the_dockerignore() -> None:
    sources = copy_sources()
    assert {"pyproject.toml", "server", "client", "gen/python"} <= set(sources), sources
    assert set(sources) <= allowed_by_dockerignore(), sources


def test_the_copied_files_build_the_package(tmp_path: Path) -> None:
    context = tmp_path / "context"
    for source in copy_sources():
        target = context / source
        target.parent.mkdir(parents=True, exist_ok=True)
        if (REPO_ROOT / source).is_dir():
            shutil.copytree(
                REPO_ROOT / source, target, ignore=shutil.ignore_patterns("__pycache__")
            )
        else:
            shutil.copy(REPO_ROOT / source, target)
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    done = subprocess.run(
        [*pip_wheel, "-q", "-w", str(tmp_path / "dist"), str(context)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = (tmp_path / "dist").glob("sessionrouter-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("server/cli.py", "client/__init__.py", "v1/session_service_pb2.py"):
        assert f"sessionrouter/{module}" in names, sorted(names)
