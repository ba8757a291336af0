#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite with the real engines.
# Test files run on QK_TEST_WORKERS parallel workers (default 2): much of a test's time is
# process start-up, imports and engine loading, which a second worker overlaps.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "${QK_TEST_WORKERS:-2}" --dist loadfile \
  --durations=25 "$@"
