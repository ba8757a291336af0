"""GPTQ's inner column loop as one Triton kernel per block of columns (CUDA only).

Why: the reference loop is `block_size` sequential steps of a few tiny tensor ops each, so on
a GPU it is bound by kernel launches (~10 per column, 26k columns per Llama-8B block). Rows of
W are independent within a block (only the shared H^-1 row couples columns), so one program
keeps a tile of rows in registers and walks the columns itself: one launch per block.

The arithmetic is the torch loop's (`gptq.gptq_column_loop` with `IntColumnGrid`): group
parameters from the error-updated columns at each group start, round half to even, clamp,
error / H^-1_ii, rank-1 update of the later columns; only the summation order of float ops
may differ.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["available", "gptq_block", "warm_up"]

_ROWS_PER_PROGRAM = 16

try:  # triton ships with CUDA builds of torch; the CPU wheel has none
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - CPU installs
    triton = None


def available(device: torch.device) -> bool:
    import os

    return (triton is not None and device.type == "cuda"
            and os.environ.get("QUANTKIT_GPTQ_TRITON", "1") != "0")


if triton is not None:

    @triton.jit
    def _gptq_block_kernel(w_ptr, hinv_ptr, codes_ptr, err_ptr, scale_ptr, zero_ptr, colgrp_ptr,
                           n_rows, n_cols, stride_w, stride_s, qmax, half_range, sym_zero,
                           FIXED: tl.constexpr, SYM: tl.constexpr, G: tl.constexpr,
                           BS: tl.constexpr, BN: tl.constexpr):
        rows = tl.program_id(0) * BN + tl.arange(0, BN)
        rmask = rows < n_rows
        cols = tl.arange(0, BS)
        cmask = cols < n_cols
        tile = rmask[:, None] & cmask[None, :]
        w = tl.load(w_ptr + rows[:, None] * stride_w + cols[None, :], mask=tile, other=0.0)
        codes = tl.zeros([BN, BS], dtype=tl.float32)
        errs = tl.zeros([BN, BS], dtype=tl.float32)
        s = tl.full([BN], 1.0, tl.float32)
        z = tl.zeros([BN], dtype=tl.float32)
        for i in range(0, n_cols):
            sel = cols[None, :] == i
            grp = tl.load(colgrp_ptr + i)
            if FIXED:
                s = tl.load(scale_ptr + grp * stride_s + rows, mask=rmask, other=1.0)
                z = tl.load(zero_ptr + grp * stride_s + rows, mask=rmask, other=0.0)
            else:
                if i % G == 0:  # a group starts: its parameters from the updated columns
                    in_g = ((cols >= i) & (cols < i + G))[None, :]
                    if SYM:
                        amax = tl.max(tl.where(in_g, tl.abs(w), 0.0), axis=1)
                        s = libdevice.div_rn(amax, half_range)
                        z = tl.full([BN], 0.0, tl.float32) + sym_zero
                    else:
                        wmin = tl.minimum(tl.min(tl.where(in_g, w, float("inf")), axis=1), 0.0)
                        wmax = tl.maximum(tl.max(tl.where(in_g, w, float("-inf")), axis=1), 0.0)
                        s = libdevice.div_rn(wmax - wmin, qmax)
                        s = tl.where(s > 0, s, 1.0)
                        z = tl.minimum(tl.maximum(libdevice.rint(libdevice.div_rn(-wmin, s)), 0.0), qmax)
                    s = tl.where(s > 0, s, 1e-8)
                    tl.store(scale_ptr + grp * stride_s + rows, s, mask=rmask)
                    tl.store(zero_ptr + grp * stride_s + rows, z, mask=rmask)
            col = tl.sum(tl.where(sel, w, 0.0), axis=1)
            q = tl.minimum(tl.maximum(libdevice.rint(libdevice.div_rn(col, s)) + z, 0.0), qmax)
            d = tl.load(hinv_ptr + i * BS + i)
            e = libdevice.div_rn(col - (q * s - z * s), d)
            h_row = tl.load(hinv_ptr + i * BS + cols, mask=cmask & (cols > i), other=0.0)
            w = w - e[:, None] * h_row[None, :]
            codes = tl.where(sel, q[:, None], codes)
            errs = tl.where(sel, e[:, None], errs)
        out = rows[:, None] * BS + cols[None, :]
        tl.store(codes_ptr + out, codes, mask=tile)
        tl.store(err_ptr + out, errs, mask=tile)


_warming: threading.Thread | None = None


def warm_up(device: torch.device, *, bits: int, symmetric: bool, group_size: int, fixed: bool,
            block_width: int) -> None:
    """Compile the kernel for these settings in a background thread, now.

    Why: on a machine with an empty Triton cache the first launch compiles the kernel and its
    C launcher (~3 s on the H100 machine), all inside the first block. Started before the
    calibration inputs are captured, it overlaps the capture and the first block's
    statistics. The tiny launch has the same specialization (constexprs, dtypes, sizes
    divisible by 16) as the real ones; gptq_block waits for it, so nothing compiles twice.
    Failures are ignored here: the real call compiles again and reports them.
    """
    global _warming
    if not available(device) or _warming is not None or group_size <= 0:
        return

    def compile_once() -> None:
        try:
            with torch.cuda.device(device):
                rows = 16
                groups = triton.cdiv(block_width, group_size)
                gptq_block(torch.zeros(rows, block_width, device=device),
                           torch.eye(block_width, device=device),
                           torch.ones(groups, rows, device=device), torch.zeros(groups, rows, device=device),
                           torch.arange(block_width, device=device, dtype=torch.int32) // group_size,
                           bits=bits, symmetric=symmetric, group_size=group_size, fixed=fixed,
                           _wait=False)
                torch.cuda.current_stream().synchronize()
        except Exception:  # noqa: BLE001 - the real launch reports it
            pass

    _warming = threading.Thread(target=compile_once, name="quantkit-gptq-triton-warm-up", daemon=True)
    _warming.start()


def _wait_for_warm_up() -> None:
    if _warming is not None:  # the warm-up itself calls gptq_block with _wait=False
        _warming.join()


def gptq_block(w1: torch.Tensor, hinv1: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
               col_group: torch.Tensor, *, bits: int, symmetric: bool, group_size: int,
               fixed: bool, _wait: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the columns of `w1` [N, b] in order; returns (codes, err) [N, b] float32.

    `hinv1` is the [b, b] diagonal block of the upper Cholesky factor of H^-1; `scale`/`zero`
    are the [n_groups, N] tables (read when `fixed`, else written at each group start);
    `col_group[i]` is column i's group (int32, on the GPU).
    """
    if _wait:
        _wait_for_warm_up()
    w1 = w1.contiguous()
    n, b = w1.shape
    bs = triton.next_power_of_2(b)
    hinv_pad = torch.zeros(bs, bs, device=w1.device, dtype=torch.float32)
    hinv_pad[:b, :b] = hinv1
    codes = torch.empty(n, bs, device=w1.device, dtype=torch.float32)
    err = torch.empty_like(codes)
    qmax = 2**bits - 1
    # rows per program: at most two [bn, bs] fp32 tiles in registers. One fixed value for
    # every N (was 8/16/64 by N): each distinct BN is a separate JIT compile (each paid on
    # a fresh machine, inside the first block), and 16 rows still give >= 256 programs
    # for N = 4096. Rows are independent, so BN never changes the results.
    bn = max(1, min(_ROWS_PER_PROGRAM, 8192 // bs))
    grid = (triton.cdiv(n, bn),)
    _gptq_block_kernel[grid](
        w1, hinv_pad, codes, err, scale, zero, col_group, n, b, w1.stride(0),
        scale.stride(0), float(qmax), float((qmax + 1) / 2 - 0.5), float((qmax + 1) // 2),
        FIXED=fixed, SYM=symmetric, G=group_size, BS=bs, BN=bn)
    return codes[:, :b], err[:, :b]
