#!/usr/bin/env bash
# Regenerates the Python stubs of every .proto under proto/ into OUT (default: dataplane/, i.e. the committed
# package ibex_dataplane.proto_gen). tests/contracts/test_proto.py runs this into a temporary folder and fails on
# any difference from the committed stubs.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-dataplane}
PY=${PYTHON:-.venv/bin/python}
mapfile -t protos < <(find proto -name '*.proto' | sort)
"$PY" -m grpc_tools.protoc --proto_path=ibex_dataplane/proto_gen=proto \
  --python_out="$OUT" --pyi_out="$OUT" --grpc_python_out="$OUT" "${protos[@]}"
# Every folder of generated modules is a regular package (setuptools packs only those).
find "$OUT/ibex_dataplane/proto_gen" -type d -exec sh -c 'for d; do [ -f "$d/__init__.py" ] || : > "$d/__init__.py"; done' _ {} +
