"""numba for the compiled CPU kernels (the GGML encoders here, methods/gptq_cpu.py), optional.

numba is a core dependency, but its releases lag new Python versions by months; where it
cannot be imported, callers fall back to their torch implementations (same results, slower).
`njit` lets a codec module hold its numba kernels beside its torch code either way: where
numba is missing the kernels stay plain Python functions that nothing calls.
"""

from __future__ import annotations

import functools
import logging

import numpy as np

__all__ = ["compiled_available", "njit", "JIT", "F32", "EPS"]

log = logging.getLogger("quantkit")

# every kernel: cached on disk, GIL released (row ranges run in threads), numpy's float
# semantics (division by zero gives inf, as in C), no bounds checks in the hot loops
JIT = {"cache": True, "nogil": True, "error_model": "numpy", "boundscheck": False}
F32 = np.float32
EPS = F32(1e-15)  # GROUP_MAX_EPS of ggml-quants.c


@functools.cache
def compiled_available() -> bool:
    try:
        import numba  # noqa: F401
    except ImportError as exc:
        log.warning("numba is not importable (%s): the compiled CPU kernels (GGUF encoders, "
                    "GPTQ column loop) fall back to torch, several times slower", exc)
        return False
    return True


def njit(*args, **options):
    """numba.njit where numba imports (it compiles at the first call), else the function as is."""
    if compiled_available():
        import numba

        return numba.njit(*args, **options)
    if args and callable(args[0]):
        return args[0]
    return lambda fn: fn
