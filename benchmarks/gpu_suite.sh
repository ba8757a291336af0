#!/usr/bin/env bash
# The whole GPU-machine run in one command (device time is scarce): llm-compressor's wheels
# (carried in .whl/, see ../shared/docs/environment.md) installed into /tmp/site, then
#   1. GPTQ and AWQ, quantkit vs llm-compressor, Llama-3.1-8B shapes, 128 x 2048 tokens
#   2. FP8 _scaled_mm vs bf16 Linear speed
# Results land in $OUT (copy them to benchmarks/results/ with the GPU's name in the file name).
set -uo pipefail
OUT="${OUT:-benchmarks/results}"
LAYERS="${LAYERS:-4}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 benchmarks/fp8_scaled_mm_gpu.py --out "$OUT/fp8_scaled_mm.json" | tail -n 45
python3 benchmarks/gpu_quantkit_vs_llmcompressor.py --layers "$LAYERS" \
  --out "$OUT/gptq_awq_quantkit_vs_llmcompressor.json"
