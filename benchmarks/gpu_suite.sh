#!/usr/bin/env bash
# The whole GPU-machine run in one command (device time is scarce): llm-compressor's wheels
# (carried in .whl/, see ../shared/docs/environment.md) installed into /tmp/site, then GPTQ
# (8 blocks) and AWQ (4 blocks), quantkit (activations on the GPU and offloaded to host
# memory) vs llm-compressor with the model on the CPU, onloaded per block (like for like),
# Llama-3.1-8B shapes, 128 x 2048 tokens, after --check (offloaded == on-GPU results) and
# gpu_gptq_check.py (GPTQ vs a textbook float64 GPTQ).
# Results land in $OUT (copy them to benchmarks/results/ with the GPU's name in the file name).
set -uo pipefail
OUT="${OUT:-benchmarks/results}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 benchmarks/gpu_gptq_check.py  # GPTQ on the GPU (in-place H^-1 factor) vs textbook float64
python3 benchmarks/gpu_quantkit_vs_llmcompressor.py --check --methods gptq --layers 8 \
  --out "$OUT/gptq_8_layers.json" 2>&1 | grep -v "AWQ: skipping"
python3 benchmarks/gpu_quantkit_vs_llmcompressor.py --check --methods awq --layers 4 \
  --out "$OUT/awq_4_layers.json" 2>&1 | grep -v "AWQ: skipping"
