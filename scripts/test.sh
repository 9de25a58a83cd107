#!/usr/bin/env bash
# Install everything, lint, type-check, and run the whole CPU test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
ruff check .
ruff format --check .
mypy  # strict, on the packages pyproject.toml's [tool.mypy] lists
python3 -m pytest -q "$@"
