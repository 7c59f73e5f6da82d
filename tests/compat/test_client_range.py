"""The package installs and works at both ends of the range it declares.

For each pin set of ``tests/compat/venvs.py`` (protobuf 5.26.1 + grpcio 1.64.3, protobuf 6.33
+ grpcio 1.75.1, protobuf 7.x + grpcio 1.85) a venv made by pip from PyPI holds this checkout's
wheel: the client-only venvs run the README programs (twice, against one router with a
persisted journal), the batch-builder example and a probe of every kind of call against a
router of the main venv; the ``[server]`` venvs serve that probe and the README programs to
their own client and to the main venv's. Warnings are errors throughout, so a stub or runtime
version warning fails too. Venvs are cached (``.tools/compat``); a cold run builds them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.compat.venvs import (
    CLIENT_PIN_SETS,
    SERVER_PIN_SETS,
    PinSet,
    build_wheel,
    ensure_venv,
    install_wheel,
)
from tests.examples.programs import ROOT, example_router, run_program
from tests.examples.test_readme import check_outputs, write_programs

PROBE = Path(__file__).with_name("client_probe.py")
VERSIONS = (
    "import json; from importlib.metadata import version as v;"
    " print(json.dumps({p: v(p) for p in ('protobuf', 'grpcio', 'grpcio-status', 'numpy')}))"
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def prepared(pin_set: PinSet, wheel: Path) -> Path:
    """The pin set's venv with this checkout installed; its python."""
    ensure_venv(pin_set, wheel)
    install_wheel(pin_set, wheel)
    python = pin_set.python()
    installed = json.loads(subprocess.check_output([python, "-c", VERSIONS], text=True))
    for pin in pin_set.pins:
        name, _, wanted = pin.partition("==")
        if name in installed:
            assert installed[name] == wanted, (pin_set.name, installed)
    check = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    return python


def run_readme_twice(python: Path, address: str, work: Path) -> None:
    work.mkdir()
    programs = write_programs(work)
    check_outputs(
        [[run_program([python, p], address, cwd=work).stdout for p in programs] for _ in (1, 2)]
    )


def probe(python: Path, address: str, cwd: Path, pin_set: PinSet | None) -> None:
    out = json.loads(run_program([python, PROBE], address, cwd=cwd).stdout)
    if pin_set is not None:
        assert (out["protobuf"], out["grpcio"]) == (pin_set.protobuf, pin_set.grpcio), out


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("pin_set", CLIENT_PIN_SETS, ids=lambda p: p.name)
def test_client_install_runs_the_readme_against_the_router(
    pin_set: PinSet, wheel: Path, tmp_path: Path
) -> None:
    python = prepared(pin_set, wheel)
    # The client alone cannot serve: the command names the extra, in one line, and exits 2.
    serve = subprocess.run(
        [pin_set.directory() / "bin" / "sessionrouter", "serve", "--in-memory"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert serve.returncode == 2, serve
    assert serve.stdout == ""
    assert serve.stderr.count("\n") == 1 and 'pip install "sessionrouter[server]"' in serve.stderr
    assert "grpcio-health-checking" in serve.stderr
    with example_router(tmp_path, persist=True) as address:
        run_readme_twice(python, address, tmp_path / "readme")
        probe(python, address, tmp_path, pin_set)
        done = run_program([python, ROOT / "examples" / "batch_builder.py"], address, cwd=tmp_path)
        assert len(json.loads(done.stdout)["batch"]["group_ids"]) == 3


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("pin_set", SERVER_PIN_SETS, ids=lambda p: p.name)
def test_server_extra_serves_old_and_new_clients(
    pin_set: PinSet, wheel: Path, tmp_path: Path
) -> None:
    python = prepared(pin_set, wheel)
    with example_router(tmp_path, persist=True, python=python) as address:
        run_readme_twice(python, address, tmp_path / "readme")
        probe(python, address, tmp_path, pin_set)  # its own client
        probe(Path(sys.executable), address, tmp_path, None)  # the main venv's, newest
