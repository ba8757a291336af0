"""Keeping freed memory out of RSS (glibc), so measured peaks follow the memory model.

Without this, streaming RSS crept up by ~30 MB per block and by up to 1.4 GB while a writer
packed 250 results of a 1 GB model, run to run different (worker threads' malloc arenas),
although no tensor was still referenced: gc found none, malloc_trim gave it all back.
"""

from __future__ import annotations

import ctypes

__all__ = ["trim_heap", "keep_heap_small"]

_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


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
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(_M_MMAP_THRESHOLD, 256 * 2**10)
        libc.mallopt(_M_ARENA_MAX, 2)
