#!/usr/bin/env bash
# The whole GPU-machine run (device time is scarce): llm-compressor's wheels (carried in
# $WHEELS, default .whl/, see ../shared/docs/environment.md) installed into /tmp/site, then
# gpu_gptq_check.py (GPTQ vs a textbook float64 GPTQ), then GPTQ (8 blocks) and/or AWQ
# (4 blocks): quantkit vs llm-compressor with the model on the CPU, onloaded per block (like
# for like), Llama-3.1-8B shapes, 128 x 2048 tokens, after --check (offloaded == on-GPU
# results), in two timed scopes: model in memory -> weights in memory, and checkpoint on disk
# -> artifact on disk (page cache dropped before each disk run).
#   bash benchmarks/gpu_suite.sh [gptq] [awq]      (both when none is named; one per device
#                                                   call keeps each call under 10 minutes)
# Parts `gptq32` / `awq32`: the whole 32-block model, disk scope only (default variant),
# quantkit then llm-compressor. Part `ab`: benchmarks/gpu_disk_ab.py, the artifacts of the
# tree at $OLD_ROOT (e.g. main's quantkit/, carried) and of this tree from the same checkpoint
# compared byte for byte on the GPU, and the NaN-in-a-block refusal there.
# Results land in $OUT (copy them to benchmarks/results/ with the GPU's name in the file name).
set -uo pipefail
OUT="${OUT:-benchmarks/results}"
WHEELS="${WHEELS:-.whl}"
PARTS="${*:-gptq awq}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site "$WHEELS"/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv
df -h /tmp | tail -1
python3 benchmarks/gpu_gptq_check.py  # GPTQ on the GPU (in-place H^-1 factor) vs textbook float64
for part in $PARTS; do
  case "$part" in
    gptq) layers=8 ;;
    awq) layers=4 ;;
    gptq32|awq32)
      python3 benchmarks/gpu_quantkit_vs_llmcompressor.py --methods "${part%32}" --layers 32 \
        --scopes disk --disk-variants default --drop-page-cache \
        --out "$OUT/${part%32}_32_layers_disk.json" 2>&1 | grep -v "AWQ: skipping"
      continue ;;
    ab)
      python3 benchmarks/gpu_disk_ab.py --old-root "${OLD_ROOT:?OLD_ROOT: the tree to compare}" \
        --layers 2 --methods "${AB_METHODS:-gptq}" --out "$OUT/disk_ab.json"
      continue ;;
    *) echo "unknown part $part (gptq, awq, gptq32, awq32, ab)"; exit 2 ;;
  esac
  python3 benchmarks/gpu_quantkit_vs_llmcompressor.py --check --methods "$part" \
    --layers "$layers" --scopes memory,disk --disk-variants default,offload,no-resume \
    --drop-page-cache --out "$OUT/${part}_${layers}_layers.json" 2>&1 | grep -v "AWQ: skipping"
done
