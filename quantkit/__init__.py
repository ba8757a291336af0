"""quantkit: quantize LLMs (RTN, GPTQ, AWQ, FP8, GGUF), evaluate and compare the artifacts."""

import os as _os

__version__ = "0.1.0"

# OpenBLAS (scipy's: the CPU Hessians, pipeline/stats.py) keeps its idle threads spinning
# ~2^28 cycles (~0.1 s) after every call, on cores that torch's next GEMMs and GPTQ's solve
# need: on 2 cores a GPTQ run of SmolLM2 took 97 s with the default and 92 s with 2^4 (solve
# 8.7 -> 5.8 s). OpenBLAS reads this when it loads (transformers loads scipy.linalg with a
# model), so it is set here, first; a value the user set is kept.
_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

# reproducible mode (QUANTKIT_REPRODUCIBLE=1): pin every library's kernels to its AVX2 path
# before torch / numpy / scipy load (they read these switches only then); see reproducible.py
from quantkit import reproducible as _reproducible  # noqa: E402

_reproducible.apply_from_env()
