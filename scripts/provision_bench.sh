#!/usr/bin/env bash
# Installs the benchmark extra (`make bench`): llama-cpp-python and llama.cpp's own native tools
# (llama-bench, llama-batched-bench), the side-by-side peers, and matplotlib. llama-cpp-python compiles
# llama.cpp from source, and the tools are built from the same source (the sdist's vendored llama.cpp)
# into .cache/llama.cpp/bin: each build takes ~8 minutes on 2 cores the first time.
#
# ISA flags: we enable exactly the AVX/AVX-512 extensions /proc/cpuinfo lists, and never AMX. With
# GGML_NATIVE=ON llama.cpp compiles its AMX kernels on CPUs that advertise AMX, and on our build VMs
# (Sapphire Rapids guests) the first tile instruction dies with SIGILL: the CPU lists AMX, the guest
# cannot use it. A wheel cached by pip from another machine can have the same problem: if the installed
# llama-cpp-python cannot load the model, it is rebuilt from source here.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
ggml() { if [[ " $flags " == *" $2 "* ]]; then echo "-DGGML_$1=ON"; else echo "-DGGML_$1=OFF"; fi; }
CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DLLAMA_CURL=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
CMAKE_ARGS+=" $(ggml AVX avx) $(ggml AVX2 avx2) $(ggml BMI2 bmi2) $(ggml FMA fma) $(ggml F16C f16c)"
CMAKE_ARGS+=" $(ggml AVX_VNNI avx_vnni) $(ggml AVX512 avx512f) $(ggml AVX512_VBMI avx512vbmi)"
CMAKE_ARGS+=" $(ggml AVX512_VNNI avx512_vnni) $(ggml AVX512_BF16 avx512_bf16)"
export CMAKE_ARGS
printf '\n==> %s\n' "installing the [bench] extra (llama-cpp-python builds llama.cpp from source: up to ~8 min)"
.venv/bin/python -m pip install --progress-bar off -q -e ".[bench]"
# Loading alone does not reach the matrix kernels (where an AMX build dies): evaluate a ~60-token batch.
check='import llama_cpp, sys
from chatmesh.model_files import bundled_model_path
llm = llama_cpp.Llama(model_path=str(bundled_model_path()), n_ctx=128, n_batch=128, verbose=False)
llm.eval(llm.tokenize(b"The quick brown fox jumps over the lazy dog. " * 6))'
if ! .venv/bin/python -c "$check" 2>/dev/null; then
  printf '\n==> %s\n' "the installed llama-cpp-python does not run on this CPU; rebuilding it from source"
  .venv/bin/python -m pip install --progress-bar off -q --no-cache-dir --force-reinstall --no-deps \
    "$(grep -o 'llama-cpp-python==[0-9.]*' pyproject.toml)"
  .venv/bin/python -c "$check"
fi
echo "llama-cpp-python: ok"

# The native tools, from the same llama.cpp source as the binding, with the same ISA flags.
version=$(grep -o 'llama-cpp-python==[0-9.]*' pyproject.toml | cut -d= -f3)
tools=.cache/llama.cpp
if [[ "$(cat "$tools/bin/VERSION" 2>/dev/null)" != "$version" ]]; then
  printf '\n==> %s\n' "building llama.cpp $version's llama-bench and llama-batched-bench (up to ~8 min)"
  rm -rf "$tools" && mkdir -p "$tools"
  .venv/bin/python -m pip download --progress-bar off -q --no-deps --no-binary :all: \
    "llama-cpp-python==$version" -d "$tools"
  tar xzf "$tools"/llama_cpp_python-*.tar.gz -C "$tools"
  src=$(echo "$tools"/llama_cpp_python-*/vendor/llama.cpp)
  log="$tools/build.log"
  command -v cmake >/dev/null || { .venv/bin/python -m pip install -q cmake && export PATH="$PWD/.venv/bin:$PATH"; }
  # shellcheck disable=SC2086  # CMAKE_ARGS is a list of flags
  { cmake -S "$src" -B "$tools/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF $CMAKE_ARGS &&
    cmake --build "$tools/build" -j "$(nproc)" --target llama-bench llama-batched-bench; } >"$log" 2>&1 ||
    { tail -40 "$log"; echo "the llama.cpp tools did not build (whole log: $log)"; exit 1; }
  mkdir -p "$tools/bin"
  cp "$tools/build/bin/llama-bench" "$tools/build/bin/llama-batched-bench" "$tools/bin/"
  rm -rf "$tools/build" "$tools"/llama_cpp_python-* && echo "$version" > "$tools/bin/VERSION"
fi
echo "llama.cpp tools: ok ($tools/bin)"
