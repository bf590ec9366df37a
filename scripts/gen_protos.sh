#!/usr/bin/env bash
# Generates the Python gRPC code for every .proto under protos/ into chatmesh/<pkg>/v1/.
# Reproducible: the output depends only on the .proto files and the pinned grpcio-tools.
#   scripts/gen_protos.sh           regenerate in place
#   scripts/gen_protos.sh --check   fail if the generated files in the tree are stale
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
mapfile -t files < <(cd protos && find chatmesh -name '*.proto' | sort)
mapfile -t dirs < <(printf '%s\n' "${files[@]}" | xargs -n1 dirname | sort -u)

generate() {  # $1: output root
  "$PY" -m grpc_tools.protoc -I protos --python_out="$1" --pyi_out="$1" --grpc_python_out="$1" "${files[@]}"
  for dir in "${dirs[@]}"; do  # regular packages, so packaging finds them
    d=$dir
    while [ "$d" != "chatmesh" ] && [ "$d" != "." ]; do
      : > "$1/$d/__init__.py"
      d=$(dirname "$d")
    done
  done
}

if [ "${1:-}" = "--check" ]; then
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  generate "$tmp"
  stale=0
  for dir in "${dirs[@]}"; do
    diff -r -q -x __pycache__ "$tmp/$dir" "$dir" || stale=1
  done
  [ $stale = 0 ] || { echo "generated protobuf code is stale: run 'make protos' and commit the result" >&2; exit 1; }
  echo "generated protobuf code is up to date"
else
  for dir in "${dirs[@]}"; do rm -f "$dir"/*_pb2.py "$dir"/*_pb2.pyi "$dir"/*_pb2_grpc.py; done
  generate .
  echo "generated Python for ${#files[@]} proto files"
fi
