#!/usr/bin/env bash
# Q4_K_M with an importance matrix collected from calibration data (--calib), then scored by
# llama.cpp's own logits against the unquantized model.
set -euo pipefail
cd "$(dirname "$0")/.."
Q=.venv/bin/quantkit
O=out/examples
$Q quantize smollm2-135m --method gguf --gguf-type q4_k_m --calib mixed --calib-samples 32 \
  -o $O/smollm2-q4_k_m.gguf --force
$Q info $O/smollm2-q4_k_m.gguf
$Q eval $O/smollm2-q4_k_m.gguf --base smollm2-135m --max-windows 8 --json $O/q4_k_m_eval.json
