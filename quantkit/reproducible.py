"""Reproducible mode: the same float32 kernels on every x86-64 CPU with AVX2, and the facts
that decide which kernels ran (recorded in every artifact's quantkit.json).

Why: GPTQ's rounding decisions follow float32 sums, and the libraries pick their kernels per
CPU (MKL and oneDNN: AVX2 / AVX-512 / AMX; ATen's vectorised ops: AVX2 / AVX-512; scipy's
OpenBLAS, which computes the CPU Hessians: Haswell / SkylakeX / ...). Different kernels sum in
a different order, the last bits differ, one rounding flips, and GPTQ's error feedback carries
the flip into every later column (benchmarks/determinism_ab.py). The switches below pin every
library to its AVX2 path; they are read when each library loads, so they must be in the
environment before torch / numpy / scipy are imported: `quantkit/__init__.py` applies them
when QUANTKIT_REPRODUCIBLE=1, and `quantkit quantize --reproducible` re-executes itself with
that variable set. This module imports nothing heavy at import time.
"""

from __future__ import annotations

import os
import sys

__all__ = ["ENV_VAR", "PINNED", "active", "apply_from_env", "reexec_with_mode", "kernel_facts"]

ENV_VAR = "QUANTKIT_REPRODUCIBLE"
# every library's own switch to its AVX2 code path (the lowest common one of x86-64 CPUs
# that run the rest of quantkit at a useful speed)
PINNED = {
    "MKL_CBWR": "AVX2,STRICT",  # MKL Conditional Numerical Reproducibility (torch's sgemm, LAPACK)
    "OPENBLAS_CORETYPE": "Haswell",  # scipy's OpenBLAS (ssyrk: the CPU Hessians)
    "ATEN_CPU_CAPABILITY": "avx2",  # torch's own vectorised kernels (norms, softmax, reductions)
    "ONEDNN_MAX_CPU_ISA": "AVX2",  # oneDNN (torch's mkldnn ops)
    "DNNL_MAX_CPU_ISA": "AVX2",
    # OpenBLAS splits ssyrk's sums by thread count (measured: 1 vs 2 threads give different
    # Grams; benchmarks/README.md, Determinism across CPU kernels); one thread is the count
    # every machine has. torch's own threads stay as they are: MKL_CBWR STRICT sgemm and
    # ATen's ops do not depend on them, and the GPTQ factorisation runs on one thread in this
    # mode (methods/gptq.py).
    "OPENBLAS_NUM_THREADS": "1",
}
_APPLIED = False
_LIBRARIES = ("torch", "numpy", "scipy")


def apply_from_env() -> None:
    """Pin the kernels when QUANTKIT_REPRODUCIBLE=1 (called from quantkit/__init__.py, first)."""
    global _APPLIED
    if os.environ.get(ENV_VAR) != "1":
        return
    os.environ.update(PINNED)
    _APPLIED = not any(name in sys.modules for name in _LIBRARIES)


def active() -> bool:
    """True when this process pinned the kernels before any numeric library loaded."""
    return _APPLIED


def reexec_with_mode() -> None:
    """Run this same command again with QUANTKIT_REPRODUCIBLE=1 (the libraries are loaded
    already and read their switches only when they load); does not return."""
    from quantkit.errors import QuantkitError

    if os.environ.get(ENV_VAR) == "1":  # set, but a library loaded before quantkit did
        raise QuantkitError(
            f"reproducible mode could not pin the kernels: {', '.join(n for n in _LIBRARIES if n in sys.modules)} "
            "was imported before quantkit.",
            f"Run the `quantkit` command itself, or set {ENV_VAR}=1 and import quantkit first.")
    os.environ[ENV_VAR] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def check_cpu() -> None:
    """Refuse on a CPU without AVX2: the pinned paths would be illegal instructions there."""
    from quantkit.errors import QuantkitError

    flags = cpu_flags()
    if flags and "avx2" not in flags:
        raise QuantkitError("reproducible mode pins every library to its AVX2 kernels, and this "
                            "CPU has no AVX2.", "Run without --reproducible on this machine.")


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo); empty where unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


_KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16",
                 "amx_tile", "amx_bf16", "amx_int8")
_SWITCHES = (*PINNED, "MKL_ENABLE_INSTRUCTIONS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
             "OPENBLAS_NUM_THREADS")


def kernel_facts() -> dict:
    """What decides the float32 kernels of this run, so two artifacts can be compared: the CPU
    and its vector flags, torch's dispatch level and threads, OpenBLAS's kernel family and
    threads (threadpoolctl, where installed), the switches in the environment, the mode."""
    import torch

    facts: dict = {
        "reproducible": active(),
        "cpu": _cpu_model(),
        "cpu_flags": sorted(f for f in cpu_flags() if f in _KERNEL_FLAGS),
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "mkl": torch.backends.mkl.is_available(),
        "env": {k: os.environ[k] for k in _SWITCHES if k in os.environ},
    }
    try:
        import scipy.linalg  # noqa: F401  (loads scipy's OpenBLAS, which the Hessians use)
        from threadpoolctl import threadpool_info
    except ImportError:
        return facts
    facts["blas"] = [{"library": i.get("internal_api"), "version": i.get("version"),
                      "kernel": i.get("architecture"), "threads": i.get("num_threads")}
                     for i in threadpool_info() if i.get("user_api") == "blas"]
    return facts
