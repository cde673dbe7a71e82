#!/usr/bin/env bash
# Set everything up, then run the local demo (2 ranks on this machine).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh demo
.venv/bin/overlap demo "$@"
