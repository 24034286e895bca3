#!/usr/bin/env bash
# Regenerate the Python stubs for api.proto (checked in; run after editing the proto).
#
#   exporter/kubelet_api/generate.sh            # uses `python` on PATH
#   PYTHON=.venv/bin/python exporter/kubelet_api/generate.sh
#
# Needs grpcio-tools. The generated code refuses to import under a protobuf runtime
# older than the protoc bundled with grpcio-tools, and api_pb2_grpc.py under a grpcio
# older than grpcio-tools: regenerate with the oldest versions you intend to support.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python}"

cd "$here"
"$python" -m grpc_tools.protoc \
    --proto_path=. \
    --python_out=. \
    --pyi_out=. \
    --grpc_python_out=. \
    api.proto

# grpc_tools emits `import api_pb2 as api__pb2`, which only works with this directory on
# sys.path; make it relative so the stubs work inside the package.
sed -i -E 's/^import api_pb2 as api__pb2$/from . import api_pb2 as api__pb2/' api_pb2_grpc.py
grep -q '^from \. import api_pb2 as api__pb2$' api_pb2_grpc.py || {
    echo "generate.sh: could not rewrite the api_pb2 import in api_pb2_grpc.py" >&2
    exit 1
}

# pyproject's ruff exclude covers api_pb2*.py but not the .pyi: keep the linter and the
# formatter off generated text.
sed -i '1i # ruff: noqa\n# fmt: off' api_pb2.pyi
