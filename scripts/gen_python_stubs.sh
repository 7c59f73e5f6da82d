#!/usr/bin/env bash
# Generates the Python stubs (+ .pyi type stubs) of protos/ into OUT/sessionrouter/v1.
# Usage: scripts/gen_python_stubs.sh VENV OUT
set -euo pipefail
venv=$1 out=$2
rm -rf "$out/sessionrouter/v1" && mkdir -p "$out/sessionrouter/v1"
"$venv/bin/python" -m grpc_tools.protoc -Iprotos \
  --python_out="$out" --grpc_python_out="$out" \
  --mypy_out="$out" --mypy_grpc_out="$out" \
  --plugin=protoc-gen-mypy="$venv/bin/protoc-gen-mypy" \
  --plugin=protoc-gen-mypy_grpc="$venv/bin/protoc-gen-mypy_grpc" \
  protos/sessionrouter/v1/*.proto > /dev/null
# resources.proto has no service: its empty *_grpc modules are noise.
rm -f "$out/sessionrouter/v1/resources_pb2_grpc.py" "$out/sessionrouter/v1/resources_pb2_grpc.pyi"
touch "$out/sessionrouter/v1/__init__.py" "$out/sessionrouter/v1/py.typed"
