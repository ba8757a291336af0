#!/usr/bin/env bash
# GPTQ int4 (group 64, act-order) for vLLM, in both formats vLLM reads, then its accuracy.
set -euo pipefail
cd "$(dirname "$0")/.."
Q=.venv/bin/quantkit
O=out/examples
$Q quantize smollm2-135m --method gptq --bits 4 --group-size 64 --act-order \
  --calib mixed --calib-samples 64 --calib-seqlen 512 -o $O/gptq-ct --force
$Q quantize smollm2-135m --method gptq --bits 4 --group-size 64 --format gptq \
  --calib mixed --calib-samples 64 --calib-seqlen 512 -o $O/gptq-v1 --force
$Q info $O/gptq-v1
$Q eval $O/gptq-ct --base smollm2-135m --max-windows 16
# on a GPU machine, or a CPU with AVX512-BF16:  vllm serve out/examples/gptq-ct
