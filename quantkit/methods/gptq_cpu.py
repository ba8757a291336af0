"""GPTQ's inner column loop compiled for the CPU (numba): the CPU twin of gptq_triton.

Why: the torch loop is `block_size` sequential steps of ~8 tensor ops each, so on a CPU it
is bound by per-op overhead and by memory-bound rank-1 updates (SmolLM2: ~26 s of a 200 s
GPTQ run on 2 cores). Rows of W are independent within a block (only the shared H^-1 row
couples columns), so the block is transposed to [column, row] and every step is a loop
over contiguous rows, which compiles to SIMD; row ranges run in parallel threads.

The arithmetic is the torch loop's (`gptq.gptq_column_loop`, `IntColumnGrid`), op for op:
group parameters from the error-updated columns at each group start,
q = clamp(rint(w / s) + z, 0, qmax),
err = (w - (q*s - z*s)) / H^-1_ii, then w_j -= err * H^-1_ij for the later columns.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from numba import njit

__all__ = ["grid_columns", "gptq_block"]

F32 = np.float32


@njit(cache=True, nogil=True, error_model="numpy", boundscheck=False)
def _block(wt, hinv, scale, zero, col_group, qmax, fixed, sym, g, codes_t, err_t):
    """Columns of wt [b, n] (transposed block, updated in place) in order.

    scale/zero [n_groups, n] are read when `fixed`, else written at each group start.
    """
    b, n = wt.shape
    s = np.ones(n, np.float32)
    z = np.zeros(n, np.float32)
    zs = np.zeros(n, np.float32)
    fq = F32(qmax)
    half_range = F32((qmax + 1) / 2 - 0.5)
    cur = -1
    for i in range(b):
        grp = col_group[i]
        if grp != cur:
            cur = grp
            if not fixed:  # this group's parameters from its (updated) columns i .. i+g-1
                for r in range(n):
                    if sym:
                        amax = F32(0)
                        for c in range(i, i + g):
                            amax = max(amax, abs(wt[c, r]))
                        sc = amax / half_range
                        zr = F32((qmax + 1) // 2)
                    else:
                        lo = F32(0)
                        hi = F32(0)
                        for c in range(i, i + g):
                            lo = min(lo, wt[c, r])
                            hi = max(hi, wt[c, r])
                        sc = (hi - lo) / fq
                        sc = sc if sc > 0 else F32(1)
                        zr = min(max(np.rint(-lo / sc), F32(0)), fq)
                    scale[grp, r] = sc if sc > 0 else F32(1e-8)
                    zero[grp, r] = zr
            for r in range(n):
                s[r] = scale[grp, r]
                z[r] = zero[grp, r]
                zs[r] = z[r] * s[r]
        d = hinv[i, i]
        for r in range(n):
            q = min(max(np.rint(wt[i, r] / s[r]) + z[r], F32(0)), fq)
            codes_t[i, r] = q
            err_t[i, r] = (wt[i, r] - (q * s[r] - zs[r])) / d
        for j in range(i + 1, b):
            h = hinv[i, j]
            for r in range(n):
                wt[j, r] -= err_t[i, r] * h


@njit(cache=True, nogil=True, error_model="numpy", boundscheck=False)
def grid_columns(wt, hinv, c0, c1, step_t, off_t, sub, lo, hi, with_min, levels, codes_t, err_t,
                 deq_t):
    """Columns c0..c1 of wt [b, n] (transposed block, updated in place) onto a fixed grid:
    the GGML round-to-grid step of gguf_gptq.GGMLColumnGrid, op for op. Sub-block s of the
    columns (width `sub`) has step_t[s] / off_t[s] [n]; a zero step gives value -offset.
    Non-empty `levels` (ascending): value = step * levels[code], the nearest level (the upper
    one on a tie)."""
    b, n = wt.shape
    flo, fhi = F32(lo), F32(hi)
    nl = levels.shape[0]
    for i in range(c0, c1):
        s = (i - c0) // sub
        d = hinv[i, i]
        for r in range(n):
            st = step_t[s, r]
            of = off_t[s, r] if with_min else F32(0)
            if nl:
                q = F32(0)
                deq = F32(0)
                if st != 0:
                    t = wt[i, r] / st
                    best = abs(t - levels[0])
                    k = 0
                    for m in range(1, nl):
                        dm = abs(t - levels[m])
                        if dm <= best:
                            best = dm
                            k = m
                    q = F32(k)
                    deq = st * levels[k]
            else:
                if st == 0:
                    q = F32(0)
                elif with_min:
                    q = min(max(np.rint((wt[i, r] + of) / st), flo), fhi)
                else:
                    q = min(max(np.rint(wt[i, r] / st), flo), fhi)
                deq = st * q - of
            codes_t[i, r] = q - flo
            deq_t[i, r] = deq
            err_t[i, r] = (wt[i, r] - deq) / d
        for j in range(i + 1, b):
            h = hinv[i, j]
            for r in range(n):
                wt[j, r] -= err_t[i, r] * h


_POOL: ThreadPoolExecutor | None = None


def gptq_block(w1: torch.Tensor, hinv1: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
               col_group: list[int], *, bits: int, symmetric: bool, group_size: int,
               fixed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the columns of `w1` [N, b] in order; returns (codes, err) [N, b] float32.

    `hinv1` is the [b, b] diagonal block of the upper Cholesky factor of H^-1; `scale`/`zero`
    are the float32 [n_groups, N] tables (read when `fixed`, else written at each group
    start); `col_group[i]` is column i's group. Same contract as gptq_triton.gptq_block.
    """
    global _POOL
    n, b = w1.shape
    h = np.ascontiguousarray(hinv1.numpy(), dtype=np.float32)
    groups = np.asarray(col_group, dtype=np.int64)
    sc, zr = scale.numpy(), zero.numpy()  # views: written through when not fixed
    codes = torch.empty(n, b)
    err = torch.empty(n, b)
    qmax = 2**bits - 1
    threads = min(torch.get_num_threads(), max(1, n // 256))
    step = -(-n // threads)

    def run(r0: int) -> None:
        r1 = min(n, r0 + step)  # this thread's rows, transposed into contiguous [b, rows]
        wt = np.ascontiguousarray(w1[r0:r1].T.numpy(), dtype=np.float32)
        codes_t = np.empty_like(wt)
        err_t = np.empty_like(wt)
        _block(wt, h, sc[:, r0:r1], zr[:, r0:r1], groups, qmax, fixed, symmetric, group_size,
               codes_t, err_t)
        codes[r0:r1] = torch.from_numpy(codes_t).T
        err[r0:r1] = torch.from_numpy(err_t).T

    if threads == 1:
        run(0)
    else:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max(2, torch.get_num_threads()), thread_name_prefix="quantkit-gptq")
        list(_POOL.map(run, range(0, n, step)))
    return codes, err
