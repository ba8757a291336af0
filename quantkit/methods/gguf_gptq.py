"""GPTQ error feedback onto llama.cpp's own block grids (`--method gguf --rounding gptq`).

llama.cpp rounds every block on its own (imatrix-weighted at best). Here each Linear goes
through GPTQ's column loop (quantkit.methods.gptq) and the round-to-grid step is the GGML
block grid itself, so the file is an ordinary GGUF of that type:

  * when the loop reaches a super-block (256 columns), its scales/mins are chosen by
    llama.cpp's own encoder (make_qkx2/3 for Q2_K/Q4_K/Q5_K, make_q3 / make_qx for Q3_K,
    the Q6_K search), imatrix-weighted by the
    imatrix when one is given, else by diag(H), on the CURRENT (error-updated) columns;
  * each column of the super-block is then rounded to that fixed grid with llama.cpp's own
    rounding formula and its error is carried into the later columns through H^-1;
  * the final codes are packed into the super-block bytes the encoder produced (its scale
    bytes are kept as they are), so the writer gets finished GGML blocks.

With H = I nothing is fed back and the bytes are `encode_rows`'s, bit for bit (the tests
check it for the K-quants). Supported grids: GPTQ_GRIDS (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and
the 32-wide Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: every type of the Q2_K ... Q8_0 mixes, also the
row-width fallbacks of widths that are not multiples of 256; IQ4_NL and IQ4_XS, whose 16 levels
are llama.cpp's non-uniform kvalues times the block scale). The IQ3/IQ2/IQ1 types round groups
of 4 or 8 values to lattice points together, not one column at a time, so they are encoded by
the plain llama.cpp encoder and the result says so (QuantResult.fallback, in the file's
quantkit.metadata stats).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType

from quantkit.ggml.codec import codec, encode_slice
from quantkit.ggml.iq4 import IQ4NL_VALUES
from quantkit.methods.gptq import gptq_column_loop, inverse_hessian_factor, one_cpu_thread

__all__ = ["GPTQ_GRIDS", "GGMLColumnGrid", "gptq_ggml", "grid_block", "hessian_factor"]

Q = GGMLQuantizationType
SUPER_BLOCK = 256  # the column-loop block: whole K-quant super-blocks, whole 32-blocks
GPTQ_GRIDS = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
              Q.IQ4_NL, Q.IQ4_XS)


def _f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).reshape(-1).float()


def _q4k_grid(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K bytes [N, 144] -> (step d*sc, offset dmin*m) per sub-block of 32, [N, 8] each."""
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    s = blocks[:, 4:16].to(torch.int32)
    sc = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)], 1)
    mn = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], 1)
    return d[:, None] * sc.float(), dmin[:, None] * mn.float()


def _q2k_grid(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q2_K bytes [N, 84] -> (step d*sc, offset dmin*m) per sub-block of 16, [N, 16] each."""
    s = blocks[:, 0:16].to(torch.int32)
    d, dmin = _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
    return d[:, None] * (s & 15).float(), dmin[:, None] * (s >> 4).float()


def _q3k_grid(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q3_K bytes [N, 110] -> (step d*(sc-32) per sub-block of 16 [N, 16], no offset)."""
    s = blocks[:, 96:108].to(torch.int32)
    low = torch.cat([s[:, 0:8] & 15, s[:, 0:8] >> 4], 1)  # sc_j & 15, j = 0..15
    j = torch.arange(16)
    high = (s[:, 8 + j % 4] >> (2 * (j // 4))) & 3  # sc_j >> 4 sits in byte 8 + j%4 at 2*(j//4)
    step = _f16(blocks[:, 108:110])[:, None] * ((low | (high << 4)) - 32).float()
    return step, torch.zeros_like(step)


def _q6k_grid(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K bytes [N, 210] -> (step d*sc per sub-block of 16 [N, 16], no offset)."""
    sc = blocks[:, 192:208].contiguous().view(torch.int8).float()
    step = _f16(blocks[:, 208:210])[:, None] * sc
    return step, torch.zeros_like(step)


def _pack_q4k(blocks: torch.Tensor, q: torch.Tensor) -> None:
    """Codes [N, 256] (0..15) into the qs bytes of Q4_K blocks [N, 144], in place."""
    q = q.to(torch.int32).reshape(-1, 4, 2, 32)  # chunk, half, lane
    blocks[:, 16:144] = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128).to(torch.uint8)


def _pack_q5k(blocks: torch.Tensor, q: torch.Tensor) -> None:
    """Codes [N, 256] (0..31) into the qh/qs bytes of Q5_K blocks [N, 176], in place."""
    q = q.to(torch.int32).reshape(-1, 4, 2, 32)  # chunk, half, lane
    blocks[:, 48:176] = ((q[:, :, 0] & 15) | ((q[:, :, 1] & 15) << 4)).reshape(-1, 128).to(torch.uint8)
    shifts = (2 * torch.arange(4))[None, :, None, None] + torch.arange(2)[None, None, :, None]
    blocks[:, 16:48] = ((q >> 4) << shifts).sum((1, 2)).to(torch.uint8)  # qh[l] bit 2c+h


def _pack_2bit_low(q: torch.Tensor) -> torch.Tensor:
    """The low 2 bits of codes [N, 256] as Q2_K/Q3_K's qs [N, 64]: value 128h + 32k + l at
    bits 2k of byte 32h + l."""
    lo = (q.to(torch.int32) & 3).reshape(-1, 2, 4, 32)  # half, quarter, lane
    return (lo << (2 * torch.arange(4))[None, None, :, None]).sum(2).reshape(-1, 64).to(torch.uint8)


def _pack_q2k(blocks: torch.Tensor, q: torch.Tensor) -> None:
    """Codes [N, 256] (0..3) into the qs bytes of Q2_K blocks [N, 84], in place."""
    blocks[:, 16:80] = _pack_2bit_low(q)


def _pack_q3k(blocks: torch.Tensor, q: torch.Tensor) -> None:
    """Codes [N, 256] (0..7 = value + 4) into the hmask/qs bytes of Q3_K blocks [N, 110]."""
    hi = (q.to(torch.int32) >> 2).reshape(-1, 8, 32)  # bit 2 of value 32b + m -> hmask[m] bit b
    blocks[:, 0:32] = (hi << torch.arange(8)[None, :, None]).sum(1).to(torch.uint8)
    blocks[:, 32:96] = _pack_2bit_low(q)


def _pack_q6k(blocks: torch.Tensor, q: torch.Tensor) -> None:
    """Codes [N, 256] (0..63) into the ql/qh bytes of Q6_K blocks [N, 210], in place."""
    v = q.to(torch.int32).reshape(-1, 2, 4, 32)  # half, quarter, lane
    lo, hi = v & 15, v >> 4
    ql = torch.stack([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], 2)
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    blocks[:, 0:128] = ql.reshape(-1, 128).to(torch.uint8)
    blocks[:, 128:192] = qh.reshape(-1, 64).to(torch.uint8)


def _d_grid(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_0 / Q5_0 / Q8_0 bytes [N, size] -> (step d [N, 1], no offset): one scale per 32 values."""
    step = _f16(blocks[:, 0:2])[:, None]
    return step, torch.zeros_like(step)


def _dm_grid(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_1 / Q5_1 bytes [N, size] -> (step d [N, 1], offset -m [N, 1]): x = d*q + m."""
    return _f16(blocks[:, 0:2])[:, None], -_f16(blocks[:, 2:4])[:, None]


def _iq4xs_grid(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """IQ4_XS bytes [N, 136] -> (step d*(ls-32) per sub-block of 32 [N, 8], no offset); the
    values are step * kvalues[code]."""
    d = _f16(blocks[:, 0:2])
    sh = blocks[:, 2:4].to(torch.int32)
    high = ((sh[:, 0] | (sh[:, 1] << 8))[:, None] >> (2 * torch.arange(8))) & 3
    sl = blocks[:, 4:8].to(torch.int32)
    low = torch.stack([sl & 15, sl >> 4], 2).reshape(-1, 8)
    step = d[:, None] * ((low | (high << 4)) - 32).float()
    return step, torch.zeros_like(step)


def _nibbles32(q: torch.Tensor) -> torch.Tensor:
    """Codes [N, 32] -> the 32-wide types' qs [N, 16]: q[j] & 15 | (q[j+16] & 15) << 4."""
    return ((q[:, :16] & 15) | ((q[:, 16:] & 15) << 4)).to(torch.uint8)


def _qh32(q: torch.Tensor) -> torch.Tensor:
    """Bit 4 of codes [N, 32] as a little-endian uint32 [N, 4] (bit j = q[j] >> 4)."""
    qh = ((q >> 4) << torch.arange(32)).sum(1, keepdim=True)
    return ((qh >> (8 * torch.arange(4))) & 255).to(torch.uint8)


def _pack_q4_0(blocks: torch.Tensor, q: torch.Tensor) -> None:
    """Codes [N, 32] (0..15) into the qs bytes of Q4_0 blocks [N, 18], in place."""
    blocks[:, 2:18] = _nibbles32(q.to(torch.int64))


def _pack_q4_1(blocks: torch.Tensor, q: torch.Tensor) -> None:
    """Codes [N, 32] (0..15) into the qs bytes of Q4_1 blocks [N, 20], in place."""
    blocks[:, 4:20] = _nibbles32(q.to(torch.int64))


def _pack_q5_0(blocks: torch.Tensor, q: torch.Tensor) -> None:
    """Codes [N, 32] (0..31) into the qh/qs bytes of Q5_0 blocks [N, 22], in place."""
    q = q.to(torch.int64)
    blocks[:, 2:6] = _qh32(q)
    blocks[:, 6:22] = _nibbles32(q)


def _pack_q5_1(blocks: torch.Tensor, q: torch.Tensor) -> None:
    """Codes [N, 32] (0..31) into the qh/qs bytes of Q5_1 blocks [N, 24], in place."""
    q = q.to(torch.int64)
    blocks[:, 4:8] = _qh32(q)
    blocks[:, 8:24] = _nibbles32(q)


def _pack_iq4nl(blocks: torch.Tensor, q: torch.Tensor) -> None:
    """Level indices [N, 32] (0..15) into the qs bytes of IQ4_NL blocks [N, 18], in place."""
    blocks[:, 2:18] = _nibbles32(q.to(torch.int64))


def _pack_iq4xs(blocks: torch.Tensor, q: torch.Tensor) -> None:
    """Level indices [N, 256] (0..15) into the qs bytes of IQ4_XS blocks [N, 136], in place."""
    q = q.to(torch.int64).reshape(-1, 8, 32)
    blocks[:, 8:136] = ((q[:, :, :16] & 15) | ((q[:, :, 16:] & 15) << 4)).reshape(-1, 128).to(torch.uint8)


def _pack_q8_0(blocks: torch.Tensor, q: torch.Tensor) -> None:
    """Codes [N, 32] (0..255 = value + 128) into the int8 qs of Q8_0 blocks [N, 34], in place."""
    blocks[:, 2:34] = (q.to(torch.int32) - 128).to(torch.int8).view(torch.uint8)


@dataclass(frozen=True)
class _Grid:
    """One GGML type's grid: `block` values share the bytes `grid_of` reads a step (and an
    offset) from, per sub-block of `sub`; integer values lo..hi, stored as value - lo."""
    block: int
    sub: int
    size: int
    grid_of: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    pack: Callable[[torch.Tensor, torch.Tensor], None]
    lo: int
    hi: int
    with_min: bool = False
    levels: tuple[int, ...] = ()  # non-uniform: value = step * levels[code] (IQ4)


_GRIDS = {Q.Q2_K: _Grid(256, 16, 84, _q2k_grid, _pack_q2k, 0, 3, with_min=True),
          Q.Q3_K: _Grid(256, 16, 110, _q3k_grid, _pack_q3k, -4, 3),
          Q.Q4_K: _Grid(256, 32, 144, _q4k_grid, _pack_q4k, 0, 15, with_min=True),
          Q.Q5_K: _Grid(256, 32, 176, _q4k_grid, _pack_q5k, 0, 31, with_min=True),
          Q.Q6_K: _Grid(256, 16, 210, _q6k_grid, _pack_q6k, -32, 31),
          Q.Q4_0: _Grid(32, 32, 18, _d_grid, _pack_q4_0, -8, 7),
          Q.Q4_1: _Grid(32, 32, 20, _dm_grid, _pack_q4_1, 0, 15, with_min=True),
          Q.Q5_0: _Grid(32, 32, 22, _d_grid, _pack_q5_0, -16, 15),
          Q.Q5_1: _Grid(32, 32, 24, _dm_grid, _pack_q5_1, 0, 31, with_min=True),
          Q.Q8_0: _Grid(32, 32, 34, _d_grid, _pack_q8_0, -128, 127),
          Q.IQ4_NL: _Grid(32, 32, 18, _d_grid, _pack_iq4nl, 0, 15, levels=IQ4NL_VALUES),
          Q.IQ4_XS: _Grid(256, 32, 136, _iq4xs_grid, _pack_iq4xs, 0, 15, levels=IQ4NL_VALUES)}


class GGMLColumnGrid:
    """GPTQ's round-to-grid step onto a GGML block grid (GPTQ_GRIDS).

    At each block start (256 columns for K-quants, 32 for the 32-wide types) the encoder picks the
    grid from the updated columns; each column is then rounded to that grid as ggml-quants.c
    rounds once the stored (fp16) scales are fixed:
      Q2_K  q = clamp(nearest((x + dmin*m) / (d*sc)), 0, 3),    x' = d*sc*q - dmin*m
      Q3_K  q = clamp(nearest(x / (d*(sc-32))), -4, 3),         x' = d*(sc-32)*q
      Q4_K  q = clamp(nearest((x + dmin*m) / (d*sc)), 0, 15),   x' = d*sc*q - dmin*m
      Q5_K  q = clamp(nearest((x + dmin*m) / (d*sc)), 0, 31),   x' = d*sc*q - dmin*m
      Q6_K  q = clamp(nearest(x / (d*sc)), -32, 31),            x' = d*sc*q
      Q4_0  q = clamp(nearest(x / d), -8, 7),                   x' = d*q
      Q4_1  q = clamp(nearest((x - m) / d), 0, 15),             x' = d*q + m
      Q5_0  q = clamp(nearest(x / d), -16, 15),                 x' = d*q
      Q5_1  q = clamp(nearest((x - m) / d), 0, 31),             x' = d*q + m
      Q8_0  q = clamp(nearest(x / d), -128, 127),               x' = d*q
      IQ4_NL / IQ4_XS  q = the level of kvalues nearest x / step (the upper one on a tie, as
            best_index_iq4nl),                                  x' = step*kvalues[q]
    (32-wide types: llama.cpp rounds with its float32 scale before storing it in fp16, so with
    H = I a code can differ from its in rare ties; the grid is the stored one either way.
    A zero step gives value 0 - offset whatever the code.)
    """

    def __init__(self, qtype: Q, n: int, k: int, qw: torch.Tensor | None,
                 rows: torch.Tensor | None = None) -> None:
        if qtype not in _GRIDS:
            raise ValueError(f"no GPTQ grid for GGML type {qtype.name}")
        self.qtype = qtype
        self.g = _GRIDS[qtype]
        self.qw = qw
        self.rows = rows  # the original rows: the legacy types' imatrix weights read their sum(x^2) / K
        self.blocks = torch.empty(n, k // self.g.block, self.g.size, dtype=torch.uint8)
        self.dequantized = torch.empty(n, k)
        self._step = self._offset = None

    def round_column(self, col: int, block: torch.Tensor, i: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.g
        sb, j = divmod(col, g.block)
        if j == 0:  # the grid of this block, from its error-updated columns
            if i + g.block > block.shape[1]:
                raise ValueError(f"the GPTQ column block must hold whole {g.block}-column blocks")
            qw = None if self.qw is None else self.qw[col:col + g.block]
            self.blocks[:, sb] = encode_slice(block[:, i:i + g.block], self.qtype, qw, self.rows)
            self._step, self._offset = g.grid_of(self.blocks[:, sb])
        step = self._step[:, j // g.sub]
        offset = self._offset[:, j // g.sub]
        zero = step == 0
        safe = torch.where(zero, torch.ones_like(step), step)
        x = block[:, i]
        if g.levels:
            levels = torch.tensor(g.levels, dtype=torch.float32)
            t = torch.where(zero, 0.0, x / safe)
            dist = (t[:, None] - levels[None, :]).abs()
            q = (levels.numel() - 1 - dist.flip(1).argmin(1)).float()  # ties: the upper level
            q = torch.where(zero, 0.0, q)
            deq = torch.where(zero, 0.0, step * levels[q.long()])
            self.dequantized[:, col] = deq
            return q - g.lo, deq
        if g.with_min:
            q = torch.where(zero, 0.0, torch.round((x + offset) / safe).clamp_(g.lo, g.hi))
            deq = step * q - offset
        else:
            q = torch.where(zero, 0.0, torch.round(x / safe).clamp_(g.lo, g.hi))
            deq = step * q
        self.dequantized[:, col] = deq
        return q - g.lo, deq

    def finish(self, codes: torch.Tensor) -> torch.Tensor:
        """Pack the loop's codes [N, K] into the super-blocks: bytes [N, row_bytes]."""
        n, nsb, size = self.blocks.shape
        b = self.g.block
        for sb in range(nsb):
            self.g.pack(self.blocks[:, sb], codes[:, sb * b:(sb + 1) * b])
        return self.blocks.reshape(n, nsb * size)


def gptq_ggml(weight: torch.Tensor, hinv: torch.Tensor, qtype: Q, qw: torch.Tensor | None,
              loop: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GGML bytes [N, row_bytes] of `weight` [N, K] rounded by GPTQ onto the `qtype` grid, and
    the weight those bytes decode to (float32 [N, K]). `hinv` is the upper Cholesky factor
    of the damped H^-1 (gptq.inverse_hessian_factor); `qw` [K] weights the scale search.
    `loop`: "compiled" (numba encoders + column kernel, rows split over threads; the default
    where numba imports) or "torch" (GGMLColumnGrid in gptq_column_loop, the reference)."""
    w = weight.detach().to(torch.float32, copy=True).cpu()
    n, k = w.shape
    if qtype not in _GRIDS or k % _GRIDS[qtype].block:
        raise ValueError(f"no GPTQ grid for {qtype.name} rows of width {k}")
    rows = weight.detach().float().cpu()
    hinv = hinv.detach().float().cpu()
    if loop is None:
        from quantkit.ggml.jit import compiled_available

        loop = "compiled" if compiled_available() else "torch"
    if loop == "compiled":
        return _gptq_ggml_compiled(w, hinv, qtype, qw, rows)
    if loop != "torch":
        raise ValueError(f"unknown GPTQ loop {loop!r} (compiled or torch)")
    grid = GGMLColumnGrid(qtype, n, k, qw, rows)
    with one_cpu_thread(w.device):
        codes = gptq_column_loop(w, hinv, grid, SUPER_BLOCK)
    return grid.finish(codes), grid.dequantized


def _gptq_ggml_compiled(w: torch.Tensor, hinv: torch.Tensor, qtype: Q, qw: torch.Tensor | None,
                        rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gptq_ggml's loop with numba: each GGML block's grid from the compiled encoder, its
    columns through gptq_cpu.grid_columns, the lazy update by one matmul per 256 columns.
    Rows never interact (H^-1 is shared, read only), so row ranges run in parallel threads,
    each with one torch thread; the bytes do not depend on the split (one range in
    --reproducible mode, as the int GPTQ kernel)."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from quantkit import reproducible
    from quantkit.ggml.legacy import row_sigma2_numba
    from quantkit.methods.gptq_cpu import grid_columns

    g = _GRIDS[qtype]
    n, k = w.shape
    q = np.empty(0, np.float32) if qw is None else qw.detach().float().cpu().reshape(k).contiguous().numpy()
    slice_enc = codec(qtype).compiled_slice_encoder if q.shape[0] else None
    enc = codec(qtype).compiled_encoder
    sigma2 = np.empty(n, np.float32)
    if slice_enc is not None:  # the legacy imatrix weights read the ORIGINAL whole rows
        row_sigma2_numba(rows.contiguous().numpy(), sigma2)
    blocks = torch.empty(n, k // g.block, g.size, dtype=torch.uint8)
    codes_t = np.empty((k, n), np.float32)
    deq_t = np.empty((k, n), np.float32)
    h = hinv.numpy()
    levels = np.asarray(g.levels, np.float32)

    def run(r0: int, r1: int) -> None:
        m = r1 - r0
        wr = w[r0:r1]
        errsum = np.zeros(m, np.float64)
        for i1 in range(0, k, SUPER_BLOCK):
            i2 = min(i1 + SUPER_BLOCK, k)
            wt = np.ascontiguousarray(wr[:, i1:i2].numpy().T)  # [b, m]: columns of these rows
            err_t = np.empty((i2 - i1, m), np.float32)
            cod, deq = np.empty((i2 - i1, m), np.float32), np.empty((i2 - i1, m), np.float32)
            hinv1 = np.ascontiguousarray(h[i1:i2, i1:i2])
            for j0 in range(0, i2 - i1, g.block):
                x = np.ascontiguousarray(wt[j0:j0 + g.block].T)  # [m, block], error-updated
                out = np.empty((m, g.size), np.uint8)
                qs = q[i1 + j0:i1 + j0 + g.block] if q.shape[0] else q
                if slice_enc is not None:
                    slice_enc(x, qs, sigma2[r0:r1], out, errsum)
                else:
                    enc(x, qs, out, errsum)
                blocks[r0:r1, (i1 + j0) // g.block] = torch.from_numpy(out)
                step, offset = g.grid_of(torch.from_numpy(out))
                grid_columns(wt, hinv1, j0, j0 + g.block, step.T.contiguous().numpy(),
                             offset.T.contiguous().numpy(), g.sub, g.lo, g.hi, g.with_min,
                             levels, cod, err_t, deq)
            codes_t[i1:i2, r0:r1] = cod
            deq_t[i1:i2, r0:r1] = deq
            if i2 < k:  # the block's errors into the later columns (lazy batch update)
                wr[:, i2:].addmm_(torch.from_numpy(err_t).T, hinv[i1:i2, i2:], alpha=-1.0)

    threads = 1 if reproducible.active() else min(torch.get_num_threads(), max(1, n // 64))
    step = -(-n // threads)
    with one_cpu_thread(w.device):
        if threads == 1:
            run(0, n)
        else:
            with ThreadPoolExecutor(threads, thread_name_prefix="quantkit-gguf-gptq") as pool:
                list(pool.map(lambda r0: run(r0, min(n, r0 + step)), range(0, n, step)))
    codes = torch.from_numpy(codes_t).T
    for sb in range(k // g.block):
        g.pack(blocks[:, sb], codes[:, sb * g.block:(sb + 1) * g.block])
    return blocks.reshape(n, -1), torch.from_numpy(deq_t).T.contiguous()


def hessian_factor(hessian: torch.Tensor, damp: float, name: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """(upper Cholesky factor of the damped H^-1, diag(H) with dead columns set to 1)."""
    h = hessian.detach().to(torch.float32).cpu().clone()
    h.diagonal().masked_fill_(h.diagonal() == 0, 1.0)
    diag = h.diagonal().clone()
    hinv, _ = inverse_hessian_factor(h, damp, name)
    return hinv, diag


def grid_block(qtype: Q) -> int:
    """Columns that share one grid choice (the row width must be a multiple)."""
    return _GRIDS[qtype].block
