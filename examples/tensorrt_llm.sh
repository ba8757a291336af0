#!/usr/bin/env bash
# Checkpoints for TensorRT-LLM's PyTorch backend (ModelOpt layout: hf_quant_config.json).
# TensorRT-LLM cannot run on this machine: `verify` checks its loader rules instead.
set -euo pipefail
cd "$(dirname "$0")/.."
Q=.venv/bin/quantkit
O=out/examples
$Q quantize smollm2-135m --method fp8 --scheme dynamic --format modelopt -o $O/fp8-modelopt --force
$Q verify $O/fp8-modelopt --engine trtllm
$Q quantize smollm2-135m --method awq --bits 4 --group-size 64 --sym --format modelopt \
  --calib-samples 64 -o $O/awq-modelopt --force
$Q verify $O/awq-modelopt --engine trtllm
