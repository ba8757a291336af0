"""Whether the numba-compiled CPU kernels (kquants_cpu, gptq_cpu) can run here.

numba is a core dependency, but its releases lag new Python versions by months; where it
cannot be imported, callers fall back to their torch implementations (same results, slower).
"""

from __future__ import annotations

import functools
import logging

__all__ = ["compiled_available"]

log = logging.getLogger("quantkit")


@functools.cache
def compiled_available() -> bool:
    try:
        import numba  # noqa: F401
    except ImportError as exc:
        log.warning("numba is not importable (%s): the compiled CPU kernels (GGUF encoders, "
                    "GPTQ column loop) fall back to torch, several times slower", exc)
        return False
    return True
