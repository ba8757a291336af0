"""Keeping freed memory out of RSS (glibc), so measured peaks follow the memory model.

Without this, streaming RSS crept up by ~30 MB per block and by up to 1.4 GB while a writer
packed 250 results of a 1 GB model, run to run different (worker threads' malloc arenas),
although no tensor was still referenced: gc found none, malloc_trim gave it all back.
"""

from __future__ import annotations

import contextlib
import ctypes

__all__ = ["trim_heap", "keep_heap_small", "end_small_heap", "reuse_freed_memory",
           "REUSE_MMAP_THRESHOLD"]

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
