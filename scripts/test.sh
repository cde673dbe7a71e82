#!/usr/bin/env bash
# Set everything up, then lint, type-check and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/ruff check overlap tests examples
.venv/bin/mypy
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "${TMPDIR:-/tmp}/overlap-site"
.venv/bin/python -m pytest "$@"
