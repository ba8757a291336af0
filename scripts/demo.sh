#!/usr/bin/env bash
# Set up (idempotent), then the main job on the built-in real model (SmolLM2-135M-Instruct):
# quantize with RTN int4, evaluate against the unquantized model, print the results table.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
Q=.venv/bin/quantkit
mkdir -p out
$Q quantize smollm2-135m --method rtn --bits 4 --group-size 64 -o out/smollm2-rtn-w4g64 --force
$Q info out/smollm2-rtn-w4g64
$Q eval out/smollm2-rtn-w4g64 --base smollm2-135m --json out/smollm2-rtn-w4g64.eval.json
