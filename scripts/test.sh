#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite with the real engines.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=20 "$@"
