"""Virtualenvs at the ends of the dependency range we declare, cached under ``.tools/compat``.

``pyproject.toml`` promises ``protobuf>=5.26.1,<8`` and ``grpcio>=1.64.3,<2``; a trainer's
environment may sit anywhere in that range (AReaL needs protobuf<7, sglang pins grpcio 1.75.1).
Each ``PinSet`` is one such environment: its pins plus ``sessionrouter`` (the client only, or
with the ``[server]`` extra), installed by pip's resolver from PyPI wheels, as a user's
``pip install`` would. A venv is built once per pin set and keyed by a hash of the pins, the
project's declared dependencies and the Python version, so changing any of them builds a new
one; a file lock keeps concurrent runs from building the same venv twice. The package itself
is reinstalled from a freshly built wheel on every run (``install_wheel``), without touching
the dependencies.

    python -m tests.compat.venvs    # builds (or checks) every venv; `make compat-venvs`
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".tools" / "compat"


@dataclass(frozen=True)
class PinSet:
    """One environment of the range: exact pins of the packages that bound it."""

    name: str
    pins: tuple[str, ...]
    server: bool = False
    """Install ``sessionrouter[server]`` (else the client only, what trainers install)."""

    @property
    def protobuf(self) -> str:
        return next(p.split("==")[1] for p in self.pins if p.startswith("protobuf=="))

    @property
    def grpcio(self) -> str:
        return next(p.split("==")[1] for p in self.pins if p.startswith("grpcio=="))

    def key(self) -> str:
        project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
        declared = {
            "pins": self.pins,
            "server": self.server,
            "dependencies": project["dependencies"],
            "server_extra": project["optional-dependencies"]["server"],
            "python": list(sys.version_info[:2]),
        }
        digest = hashlib.sha256(json.dumps(declared, sort_keys=True).encode()).hexdigest()
        return f"{self.name}-{digest[:12]}"

    def directory(self) -> Path:
        return CACHE / self.key()

    def python(self) -> Path:
        return self.directory() / "bin" / "python"


# The floor is the oldest the committed stubs support (grpcio-tools 1.64.3 writes gencode
# 5.26.1 and a grpcio>=1.64.3 check); protobuf 6 is what AReaL's stack resolves to, with the
# grpcio sglang pins; the ceiling is the newest protobuf and grpcio on PyPI when last bumped.
FLOOR = ("protobuf==5.26.1", "grpcio==1.64.3", "grpcio-status==1.64.3", "numpy==1.26.4")
PROTOBUF6 = ("protobuf==6.33.6", "grpcio==1.75.1", "grpcio-status==1.75.1")
CEILING = ("protobuf==7.36.2", "grpcio==1.85.3", "grpcio-status==1.85.3")

CLIENT_PIN_SETS = (
    PinSet("client-floor", FLOOR),
    PinSet("client-protobuf6", PROTOBUF6),
    PinSet("client-ceiling", CEILING),
)
SERVER_PIN_SETS = (
    PinSet(
        "server-floor",
        (
            *FLOOR,
            "grpcio-health-checking==1.64.3",
            "grpcio-reflection==1.64.3",
            "prometheus-client==0.20.0",
        ),
        server=True,
    ),
    PinSet(
        "server-protobuf6",
        (*PROTOBUF6, "grpcio-health-checking==1.75.1", "grpcio-reflection==1.75.1"),
        server=True,
    ),
)
PIN_SETS = CLIENT_PIN_SETS + SERVER_PIN_SETS


def build_wheel(out: Path) -> Path:
    """Builds the sessionrouter wheel of this checkout into ``out``."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = out.glob("sessionrouter-*.whl")
    return wheel


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def ensure_venv(pin_set: PinSet, wheel: Path) -> Path:
    """The venv of ``pin_set``, built by pip from PyPI wheels if it is not cached yet.

    The build is what a user's ``pip install "sessionrouter[...]" <pins>`` does: the resolver
    must accept our declared ranges together with the pins, using binary wheels only (a pin
    without a cp311 wheel fails here rather than compiling for minutes).
    """
    directory = pin_set.directory()
    ready = directory / ".ready"
    with _locked(directory.with_name(directory.name + ".lock")):
        if ready.exists():
            return directory
        shutil.rmtree(directory, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(directory)], check=True)
        requirement = f"sessionrouter[server] @ {wheel.as_uri()}" if pin_set.server else str(wheel)
        _pip(pin_set, "install", "--only-binary=:all:", requirement, *pin_set.pins)
        ready.write_text(" ".join(pin_set.pins) + "\n")
    return directory


def install_wheel(pin_set: PinSet, wheel: Path) -> None:
    """Replaces the installed sessionrouter with ``wheel``, dependencies untouched."""
    _pip(pin_set, "install", "--no-deps", "--force-reinstall", "--no-index", str(wheel))


def _pip(pin_set: PinSet, *args: str) -> None:
    done = subprocess.run(
        [str(pin_set.python()), "-m", "pip", "--disable-pip-version-check", "-q", *args],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"pip {' '.join(args)} failed in {pin_set.name}:\n{done.stdout}{done.stderr}"
        )


def main() -> int:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        wheel = build_wheel(Path(tmp))
        for pin_set in PIN_SETS:
            print(f"compat: {pin_set.name}: {ensure_venv(pin_set, wheel)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
