#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite with the real engines.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
# -rs lists every skip; a skip not on tests/allowed_skips.txt fails the run (tests/conftest.py)
exec .venv/bin/python -m pytest -q -p no:cacheprovider -rs --durations=20 "$@"
