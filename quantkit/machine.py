"""Facts about the machine this process runs on: memory, CPU, torch's bf16 and GPUs, malloc's
huge pages, and where quantkit keeps its cache.

Why one module at the bottom: planning (pipeline), scoring (eval), reports and engine probes
all ask these questions; answered here, none of them reaches into another for a fact about the
host. It imports nothing of quantkit and no torch at import time: the `quantkit` command reads
it (quantkit.launch) before anything heavy is loaded.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import resource
import sys
from pathlib import Path

__all__ = ["cache_dir", "cpu_info", "meminfo", "proc_status_bytes", "rss_bytes",
           "available_memory", "MEMORY_LIMIT_ENV", "torch_cpu_bf16_native", "torch_info", "hardware",
           "huge_page_state", "huge_page_env", "HUGE_PAGE_TUNABLE"]

MEMORY_LIMIT_ENV = "QUANTKIT_MEMORY_LIMIT_BYTES"


def cache_dir() -> Path:
    """Where built-in models are built once (outside the repo)."""
    root = os.environ.get("QUANTKIT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "quantkit")
    return Path(root)


# ---------------------------------------------------------------- CPU and memory


@functools.lru_cache(maxsize=1)
def cpu_info() -> dict:
    """CPU model and flags from /proc/cpuinfo (informational: engines are asked, not guessed);
    flags_hash fingerprints the CPU for caches of what was probed on it."""
    model, flags = "unknown", []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = value.split()
    except OSError:
        pass
    simd = [f for f in flags if f.startswith(("avx", "amx", "fma", "f16c", "sse4"))]
    return {"model": model, "cores": len(os.sched_getaffinity(0)), "simd_flags": simd,
            "flags_hash": hashlib.sha256(" ".join(flags).encode()).hexdigest()[:16]}


def meminfo() -> dict:
    """MemTotal, MemAvailable and the cgroup limit (where one is set), in bytes."""
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            value = Path(path).read_text().strip()
        except OSError:
            continue
        if value.isdigit() and int(value) < 2**60:
            out["cgroup_limit"] = int(value)
        break
    return out


def _read_int(path: str) -> int | None:
    try:
        v = Path(path).read_text().strip()
        return None if v in ("max", "") else int(v)
    except (OSError, ValueError):
        return None


def proc_status_bytes(key: str) -> int:
    """A size field of /proc/self/status (VmRSS, VmSize, VmHWM) in bytes; 0 where absent."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def rss_bytes() -> int:
    """This process's resident memory now."""
    return proc_status_bytes("VmRSS")


def available_memory() -> tuple[int, str]:
    """Bytes this process may grow to (its RSS now + what it can still get), and why.

    The tightest of: $QUANTKIT_MEMORY_LIMIT_BYTES, MemAvailable, the cgroup limit, RLIMIT_AS.
    """
    rss = proc_status_bytes("VmRSS")
    options: list[tuple[int, str]] = []
    env = os.environ.get(MEMORY_LIMIT_ENV)
    if env:
        options.append((int(env), f"${MEMORY_LIMIT_ENV}"))
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                options.append((rss + int(line.split()[1]) * 1024, "MemAvailable"))
    except OSError:
        pass
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                          "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        lim, used = _read_int(limit), _read_int(usage)
        if lim is not None and used is not None and lim < 2**60:
            options.append((rss + max(0, lim - used), "cgroup memory limit"))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        options.append((rss + max(0, soft - proc_status_bytes("VmSize")), "RLIMIT_AS (ulimit -v)"))
    if not options:
        return 2**62, "unknown"
    return min(options)


# ---------------------------------------------------------------- torch
# torch is imported inside these functions: this module is read before torch loads
# (quantkit.launch), and importing torch costs seconds


def torch_cpu_bf16_native() -> bool:
    """Whether torch's CPU GEMMs run bfloat16 natively here, asked of torch (its oneDNN
    build and its own checks for AMX tiles / AVX512-BF16, which include the OS enabling the
    tiles). There a bf16 Linear runs ~2x (AVX512-BF16) to ~10x (AMX) faster than float32 with
    float32 accumulation; elsewhere (AVX2, AVX512 without BF16) torch emulates bf16, no faster
    than float32, so quantize keeps float32 there."""
    import torch

    try:
        return bool(torch.backends.mkldnn.is_available()
                    and (torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()))
    except (AttributeError, RuntimeError):  # a torch without these queries: assume emulated
        return False


def hardware() -> dict:
    """The machine a measurement was made on (CPU model, torch's threads, Python, torch, GPU):
    stored with every eval record and part of the keys of cached speed results."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "threads": torch.get_num_threads(), "python": sys.version.split()[0],
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def torch_info() -> dict:
    """torch's version, its CUDA and GPUs, and whether its CPU GEMMs run bf16 natively."""
    import torch

    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append({"name": p.name, "memory_bytes": int(p.total_memory)})
    return {"version": torch.__version__, "cuda": torch.version.cuda, "gpus": gpus,
            "cpu_bf16_native": torch_cpu_bf16_native()}


# ---------------------------------------------------------------- malloc's huge pages
# Transparent huge pages for malloc's mmapped chunks (glibc >= 2.35). keep_heap_small
# (quantkit.pipeline.heap) gives every activation tensor its own mapping, which the kernel faults
# in and zeroes page by page; with 4 KiB pages that is a measurable share of a CPU GPTQ run
# (benchmarks/gptq_cpu_phases.py). glibc reads its tunables only when a process starts, so the
# `quantkit` command sets it and starts itself again (quantkit.launch).
HUGE_PAGE_TUNABLE = "glibc.malloc.hugetlb=1"
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_OPT_OUT = "QUANTKIT_HUGE_PAGES"  # "0": leave malloc as it is


def _glibc_version() -> tuple[int, int] | None:
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # "glibc 2.36"
        major, minor = version.split(".")[:2]
        return (int(major), int(minor)) if name == "glibc" else None
    except (AttributeError, ValueError, OSError):
        return None


def _thp_mode() -> str | None:
    """The kernel's transparent huge page mode (always / madvise / never), None if unknown."""
    try:
        text = _THP_MODE.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")] if "[" in text and "]" in text else None


def _no_help(env) -> str | None:
    """Why adding the tunable to `env` would change nothing here, or None where it helps."""
    glibc, mode = _glibc_version(), _thp_mode()
    if env.get(_OPT_OUT) == "0":
        return f"{_OPT_OUT}=0"
    if "glibc.malloc.hugetlb" in env.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES already names glibc.malloc.hugetlb (the user's choice is kept)"
    if not sys.platform.startswith("linux") or mode is None or glibc is None:
        return "not Linux with glibc and transparent huge pages"
    if mode != "madvise":  # always: the kernel already does it; never: it cannot
        return f"the kernel's THP mode is {mode}"
    if glibc < (2, 35):
        return f"glibc {glibc[0]}.{glibc[1]} has no malloc huge page tunable (2.35+)"
    return None


def huge_page_state(environ: dict | None = None) -> dict:
    """Whether this process's malloc asks for huge pages, and why (for `quantkit doctor`)."""
    env = os.environ if environ is None else environ
    tunables = env.get("GLIBC_TUNABLES", "")
    glibc, mode = _glibc_version(), _thp_mode()
    on = any(t in ("glibc.malloc.hugetlb=1", "glibc.malloc.hugetlb=2")
             for t in tunables.split(":")) or mode == "always"
    if mode == "always":
        why = "the kernel gives every large mapping huge pages (THP mode always)"
    elif on:
        why = f"GLIBC_TUNABLES={tunables} (THP mode {mode})"
    else:
        why = _no_help(env) or "the process was not started by the quantkit command"
    return {"on": on, "thp_mode": mode, "glibc": None if glibc is None else f"{glibc[0]}.{glibc[1]}",
            "why": why}


def huge_page_env(environ: dict | None = None) -> dict | None:
    """`environ` plus glibc's malloc huge page tunable (after any tunables already there), or
    None where it would change nothing (_no_help says why)."""
    env = dict(os.environ if environ is None else environ)
    if _no_help(env) is not None:
        return None
    tunables = env.get("GLIBC_TUNABLES", "")
    env["GLIBC_TUNABLES"] = f"{tunables}:{HUGE_PAGE_TUNABLE}" if tunables else HUGE_PAGE_TUNABLE
    return env
