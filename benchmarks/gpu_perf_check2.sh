#!/usr/bin/env bash
# Second device call of the GPU-perf branch: where GPTQ's first block goes (fresh Triton cache
# vs a warm one, per-block times), then the bit-for-bit GPU comparison against the old code
# copied from OLD_ROOT (the parent checkout) into /tmp/oldroot.
set -uo pipefail
OUT="${OUT:-benchmarks/results}"
OLD_ROOT="${OLD_ROOT:-..}"
export PYTHONUNBUFFERED=1
echo "triton cache entries before: $(ls ~/.triton/cache 2>/dev/null | wc -l)"
for run in cold warm; do
  python3 benchmarks/gpu_quantkit_vs_llmcompressor.py --tools quantkit --methods gptq,awq \
    --out "$OUT/quantkit_${run}_triton_cache.json" | grep RESULT
done
rm -rf /tmp/oldroot && mkdir -p /tmp/oldroot && cp -r "$OLD_ROOT/quantkit" /tmp/oldroot/
grep -c fetch_to_cpu /tmp/oldroot/quantkit/pipeline/blocks.py quantkit/pipeline/blocks.py
python3 benchmarks/gpu_equivalence_check.py --root /tmp/oldroot --out "$OUT/equiv_old.json"
python3 benchmarks/gpu_equivalence_check.py --root . --out "$OUT/equiv_new.json"
python3 benchmarks/gpu_equivalence_check.py --compare "$OUT/equiv_old.json" "$OUT/equiv_new.json"
