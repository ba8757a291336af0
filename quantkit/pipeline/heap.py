"""Keeping freed memory out of RSS (glibc), so measured peaks follow the memory model.

Without this, streaming RSS crept up by ~30 MB per block and by up to 1.4 GB while a writer
packed 250 results of a 1 GB model, run to run different (worker threads' malloc arenas),
although no tensor was still referenced: gc found none, malloc_trim gave it all back.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from pathlib import Path

__all__ = ["trim_heap", "keep_heap_small", "end_small_heap", "reuse_freed_memory",
           "REUSE_MMAP_THRESHOLD", "huge_page_env", "huge_page_state", "reexec_with_huge_pages",
           "HUGE_PAGE_TUNABLE"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_SMALL = {"mmap": 256 * 2**10, "trim": 128 * 2**10}  # keep_heap_small's settings (glibc's trim default)
# reuse_freed_memory: allocations from this size up still get their own mmap
REUSE_MMAP_THRESHOLD = 32 * 2**20
_small_heap = False


def _libc():
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def trim_heap() -> None:
    """Return free heap pages of every malloc arena to the OS (no-op without glibc)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def keep_heap_small() -> None:
    """Serve allocations >= 256 KiB by their own mmap, unmapped when freed (glibc otherwise
    raises that threshold to 32 MiB after each large free, and tensors land in the heap), and
    let torch's worker threads share two arenas instead of one each (fragments add up)."""
    global _small_heap
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(_M_MMAP_THRESHOLD, _SMALL["mmap"])
        libc.mallopt(_M_ARENA_MAX, 2)
        _small_heap = True


def end_small_heap() -> None:
    """Undo keep_heap_small when a quantization ends in a process that goes on (the Python API,
    the test suite): allocations up to 32 MiB come from the heap again and up to 64 MiB of freed
    memory stays there, the state glibc's own adaptive settings reach after large frees
    (they cannot be switched back on). Why: with every tensor a fresh mmap that the kernel
    faults in and zeroes, later work in the same process paid for it (scoring SmolLM2 and two
    FP8 artifacts on 4 x 512 tokens: 41-47 s after a quantization vs 34 s without, 2 cores)."""
    global _small_heap
    libc = _libc()
    if not _small_heap or libc is None or not hasattr(libc, "mallopt"):
        return
    libc.mallopt(_M_MMAP_THRESHOLD, REUSE_MMAP_THRESHOLD)
    libc.mallopt(_M_TRIM_THRESHOLD, 2 * REUSE_MMAP_THRESHOLD)
    _small_heap = False
    trim_heap()


@contextlib.contextmanager
def reuse_freed_memory():
    """Inside: tensors up to 32 MiB come from the heap and freed ones are reused; after:
    keep_heap_small's settings again and the heap trimmed.

    Why: a calibration forward makes and frees dozens of activation tensors per batch
    (24 MiB each for 8 x 512 tokens of SmolLM2's MLP). With keep_heap_small every one is a
    fresh mmap that the kernel faults in and zeroes: one block forward took 2.48 s instead
    of 1.79 s on 2 cores. The memory it holds is a block's working set plus glibc's
    fragmentation of it (GPTQ on SmolLM2: peak RSS 2.9 vs 2.1 GiB for ~10 % less time),
    returned at the end. The CPU one-pass GPTQ forward (quantkit.pipeline.staged) runs without
    it: with every batch paused mid-block the freed tensors sit between live ones and stay
    (SmolLM2 GPTQ, 64 x 512 tokens: peak 2123 vs 1202 MiB).
    """
    libc = _libc()
    if not _small_heap or libc is None or not hasattr(libc, "mallopt"):
        yield
        return
    libc.mallopt(_M_MMAP_THRESHOLD, REUSE_MMAP_THRESHOLD)
    libc.mallopt(_M_TRIM_THRESHOLD, 2**30)
    try:
        yield
    finally:
        libc.mallopt(_M_MMAP_THRESHOLD, _SMALL["mmap"])
        libc.mallopt(_M_TRIM_THRESHOLD, _SMALL["trim"])
        trim_heap()


# Transparent huge pages for malloc's mmapped chunks (glibc >= 2.35). keep_heap_small gives every
# activation tensor its own mapping, which the kernel faults in and zeroes page by page: with 4 KiB
# pages that was ~11 % of a CPU GPTQ run of SmolLM2 (64 x 512 tokens, 2 cores: 115.5 -> 102.5 s,
# peak RSS 1103 -> 1108 MiB; benchmarks/gptq_cpu_phases.py). glibc reads its tunables only when a
# process starts, so the `quantkit` command sets it and starts itself again (quantkit.launch).
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


def reexec_with_huge_pages() -> None:
    """Start this process again (same PID, same command line) with huge_page_env, once; returns
    where nothing would change or the exec fails. Call before anything heavy is imported."""
    env = huge_page_env()
    if env is None:
        return
    argv = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, argv, env)
    except OSError:
        return
