#!/usr/bin/env bash
# Builds what scripts/gpu_check.sh needs on a GPU machine that has torch but no network (docs/gpu.md):
#   .whl/      the wheels of our runtime (and pytest's) that such a machine lacks or has at other versions,
#              for CPython 3.12 on x86-64 Linux; torch and numpy are the machine's own
#   .gpu/a/    the bundled GGUF's first part, .gpu/b/ the rest, and its SHA-256 in both
# Two folders because one transfer to the machine holds 64 MiB: call 1 carries .whl and .gpu/a, call 2
# carries .gpu/b (scripts/gpu_check.sh says how). Both are ignored through .git/info/exclude, never
# committed. Reproducible: rerunning rebuilds the same files (pip's cache makes it quick).
#   scripts/gpu_check_prepare.sh          build (needs the dev venv, .venv, with the model wheel)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
# The first part's size: call 1 also carries the wheels (~17 MB) and the tree (~3 MB); call 2 the rest
# of the model (~58 MB) and the tree; each call at most 64 MiB.
PART1_BYTES=${PART1_BYTES:-40000000}

exclude=.git/info/exclude
mkdir -p .git/info && touch "$exclude"
for dir in /.whl/ /.gpu/; do
  grep -qxF "$dir" "$exclude" || echo "$dir" >> "$exclude"
done

# What `python -m engine --backend cuda`, the converter, bench/gpu_check.py and
# `pytest tests/engine/test_model_cuda.py` import beyond the standard library (found by importing them
# and listing the distributions their modules came from), pinned as in pyproject.toml. The machine has
# their other needs (typing-extensions, packaging, requests, tqdm, pyyaml, jinja2, safetensors, pygments).
pin() { grep -o "\"$1==[^\"]*\"" pyproject.toml | tr -d '"'; }
resolved() { "$PY" -c "import importlib.metadata as m; print('$1==' + m.version('$1'))"; }
wheels=(
  "$(pin grpcio)" "$(pin grpcio-health-checking)" "$(pin grpcio-reflection)" "$(pin protobuf)"
  "$(pin googleapis-common-protos)" "$(pin opentelemetry-api)" "$(pin opentelemetry-sdk)"
  "$(pin opentelemetry-instrumentation-grpc)" "$(pin prometheus-client)" "$(pin gguf)" "$(pin uvloop)"
  "$(pin tokenizers)" "$(pin pytest)" "$(pin pytest-asyncio)"
  # Not pinned by us: the versions our dev venv resolved.
  "$(resolved opentelemetry-semantic-conventions)" "$(resolved opentelemetry-instrumentation)"
  "$(resolved pluggy)" "$(resolved iniconfig)" "$(resolved wrapt)"
)
rm -rf .whl && mkdir .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d .whl "${wheels[@]}"
[ "$(find .whl -name '*.whl' | wc -l)" = "${#wheels[@]}" ] || { echo "expected ${#wheels[@]} wheels in .whl" >&2; exit 1; }

model=$("$PY" -c 'from chatmesh.model_files import bundled_model_path as p; print(p())')
rm -rf .gpu && mkdir -p .gpu/a .gpu/b
head -c "$PART1_BYTES" "$model" > .gpu/a/model.part1
tail -c +"$((PART1_BYTES + 1))" "$model" > .gpu/b/model.part2
(cd "$(dirname "$model")" && sha256sum "$(basename "$model")") | tee .gpu/a/model.sha256 > .gpu/b/model.sha256
cat .gpu/a/model.part1 .gpu/b/model.part2 | cmp - "$model"

# What each call sends: the working tree (tracked and untracked, not ignored) and what it carries.
tree=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
call1=$((tree + $(du -sbc .whl .gpu/a | tail -1 | cut -f1)))
call2=$((tree + $(du -sb .gpu/b | cut -f1)))
echo "call 1 sends $call1 bytes, call 2 $call2 (the tree: $tree; at most 67108864 a call)"
((call1 <= 67108864 && call2 <= 67108864)) || { echo "too large for one call: move PART1_BYTES" >&2; exit 1; }
