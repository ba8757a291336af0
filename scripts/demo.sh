#!/usr/bin/env bash
# Set up (idempotent), then the main job on the built-in real model (SmolLM2-135M-Instruct):
# quantize it with every backend, evaluate each against the unquantized model, and write the
# comparison as reports/demo.html (+ .md and .json twins).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
Q=.venv/bin/quantkit
M=smollm2-135m
O=out/demo
mkdir -p "$O" reports
CAL=(--calib mixed --calib-samples 64 --calib-seqlen 512)
# held-out text: 16 windows x 512 tokens (8,176 scored tokens; the CLI's default is 32): the demo
# scores the base and five artifacts, which is most of its time on CPUs without native bf16
HELD=(--heldout mixed --max-windows 16)
$Q quantize $M --method rtn  --bits 4 --group-size 64 -o "$O/rtn-w4g64" --force
$Q quantize $M --method gptq --bits 4 --group-size 64 --act-order "${CAL[@]}" -o "$O/gptq-w4g64" --force
$Q quantize $M --method awq  --bits 4 --group-size 64 --format awq "${CAL[@]}" -o "$O/awq-w4g64" --force
$Q quantize $M --method fp8  --scheme dynamic -o "$O/fp8-dynamic" --force
$Q quantize $M --method gguf --gguf-type q4_k_m -o "$O/q4_k_m.gguf" --force
# one artifact's evaluation: held-out PPL / KLD / top-1 scored in llama.cpp against the base, plus
# prefill/decode tokens/s and peak memory in llama.cpp; a single-file artifact's results go to --json
$Q eval "$O/q4_k_m.gguf" --base $M "${HELD[@]}" --speed --json "$O/q4_k_m.eval.json"
# every artifact side by side: the others are scored here, the base once for all of them (the GGUF's
# results above are reused); --speed: every row's and the base's speed and peak memory in its own
# engine; where vLLM cannot run an artifact on this CPU the cell says why
$Q compare --speed "$O/rtn-w4g64" "$O/gptq-w4g64" "$O/awq-w4g64" "$O/fp8-dynamic" "$O/q4_k_m.eval.json" \
  --base $M "${HELD[@]}" --title "quantkit demo: SmolLM2-135M-Instruct" --report reports/demo.html
echo "open reports/demo.html in a browser"
