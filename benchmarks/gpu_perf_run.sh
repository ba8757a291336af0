#!/usr/bin/env bash
# One device call for the GPU-perf branch (run from the checkout root that holds this tree;
# llm-compressor wheels in .whl/): transfer self-test (stops on failure), then the
# quantkit-vs-llm-compressor GPTQ/AWQ benchmark, then a bit-for-bit comparison of this tree's
# GPU artifacts with those of the checkout in OLD_ROOT (default: the parent directory).
set -uo pipefail
OUT="${OUT:-benchmarks/results}"
OLD_ROOT="${OLD_ROOT:-..}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv
python3 benchmarks/gpu_transfer_selftest.py || exit 1
python3 benchmarks/gpu_quantkit_vs_llmcompressor.py --layers 4 \
  --out "$OUT/gptq_awq_h100_quantkit_vs_llmcompressor.json"
python3 benchmarks/gpu_equivalence_check.py --root "$OLD_ROOT" --out "$OUT/equiv_old.json"
python3 benchmarks/gpu_equivalence_check.py --root . --out "$OUT/equiv_new.json"
python3 benchmarks/gpu_equivalence_check.py --compare "$OUT/equiv_old.json" "$OUT/equiv_new.json"
