#!/usr/bin/env bash
# Install everything, lint, and run the whole CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
ruff check .
python3 -m pytest -q "$@"
