#!/usr/bin/env bash
# The 10-minute soak (scripts/soak.py): mixed traffic on the embedded model, then checks for
# leaked KV blocks, requests that did not end exactly once, and memory growth.
# Usage: scripts/soak.sh [seconds] [extra soak.py flags...]; figures in soak.json.
set -euo pipefail
cd "$(dirname "$0")/.."
duration="${1:-600}"
shift || true
exec python scripts/soak.py --duration "$duration" --json soak.json "$@"
