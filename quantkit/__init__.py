"""quantkit: quantize LLMs (RTN, GPTQ, AWQ, FP8, GGUF), evaluate and compare the artifacts."""

import os as _os

__version__ = "0.1.0"

# OpenBLAS (scipy's: the CPU Hessians, pipeline/stats.py) keeps its idle threads spinning
# ~2^28 cycles after every call, on cores that torch's next GEMMs and GPTQ's solve need: a
# CPU GPTQ run of SmolLM2, and its solve most, ran faster with 2^4 than with the default
# (benchmarks/gptq_cpu_phases.py; benchmarks/README.md, OPENBLAS_THREAD_TIMEOUT). OpenBLAS
# reads this when it loads (transformers loads scipy.linalg with a model), so it is set here,
# first; a value the user set is kept.
_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

# reproducible mode (QUANTKIT_REPRODUCIBLE=1): pin every library's kernels to its AVX2 path
# before torch / numpy / scipy load (they read these switches only then); see reproducible.py
from quantkit import reproducible as _reproducible  # noqa: E402

_reproducible.apply_from_env()
