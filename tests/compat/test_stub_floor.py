"""The committed stubs never ask for more than the floor the package declares.

grpcio-tools stamps its version into every ``*_pb2_grpc.py`` (below it, grpcio warns or, from
1.65 on, refuses to import them) and its protobuf gencode version into every ``*_pb2.py``
(from gencode 5.27 on, an import-time check against the runtime). If the generator pin is
raised without raising the declared floors, trainers at the floor get stubs that do not load;
this catches it without building a venv.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
STUBS = ROOT / "gen" / "python" / "sessionrouter" / "v1"


def declared_floor(package: str) -> Version:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for requirement in project["dependencies"]:
        match = re.fullmatch(rf"{re.escape(package)}>=([\d.]+)(,.*)?", requirement)
        if match:
            return Version(match.group(1))
    raise AssertionError(f"{package} has no >= floor in {project['dependencies']}")


def test_grpc_stubs_need_no_newer_grpcio_than_the_floor() -> None:
    stubs = sorted(STUBS.glob("*_pb2_grpc.py"))
    assert stubs
    for stub in stubs:
        (generated,) = re.findall(r"^GRPC_GENERATED_VERSION = '([\d.]+)'$", stub.read_text(), re.M)
        assert Version(generated) <= declared_floor("grpcio"), stub.name


def test_message_stubs_need_no_newer_protobuf_than_the_floor() -> None:
    stubs = sorted(STUBS.glob("*_pb2.py"))
    assert stubs
    for stub in stubs:
        text = stub.read_text()
        (gencode,) = re.findall(r"^# Protobuf Python Version: ([\d.]+)$", text, re.M)
        assert Version(gencode) <= declared_floor("protobuf"), stub.name
        for major, minor, patch in re.findall(
            r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),"
            r"\s*(\d+),\s*(\d+),",
            text,
        ):
            assert Version(f"{major}.{minor}.{patch}") <= declared_floor("protobuf"), stub.name
