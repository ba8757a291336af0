"""GGML block encoders (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K-Q6_K, IQ4_NL, IQ4_XS, IQ3_XXS, IQ3_S,
IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M), bit-exact with ggml-quants.c.

`encode_rows(w, qtype, qw)` turns float32 rows [N, K] into the bytes llama.cpp writes,
[N, K / block * block_bytes] uint8. `qw` is the imatrix row ([K], shared by every row);
without it the `_ref` algorithms run, with it the `_impl` ones (Q8_0 ignores it); IQ2_XXS,
IQ2_XS and IQ1_S have no algorithm without it (ggml_quantize_requires_imatrix), so qw is
required (IQ1_M weights by x^2 without one, as ggml does).
Block layouts (little endian, byte offsets):

  Q8_0  34 B / 32:  | d f16 | qs[32] int8 |                         x = d*q
  Q4_0  18 B / 32:  | d f16 | qs[16] |                              x = d*(q-8)
  Q4_1  20 B / 32:  | d f16 | m f16 | qs[16] |                      x = d*q + m
  Q5_0  22 B / 32:  | d f16 | qh u32 | qs[16] |                     x = d*(q-16)
  Q5_1  24 B / 32:  | d f16 | m f16 | qh u32 | qs[16] |             x = d*q + m
        qs[j] = q[j] & 15 | (q[j+16] & 15) << 4; qh bit j = q[j] >> 4, bit j+16 = q[j+16] >> 4
  Q4_K 144 B / 256: | d f16 | dmin f16 | scales[12] | qs[128] |     x = d*sc*q - dmin*m
  Q5_K 176 B / 256: | d f16 | dmin f16 | scales[12] | qh[32] | qs[128] |
        8 sub-blocks of 32, 6-bit sc/m packed as
          j<4:  scales[j] = sc_j | (sc_{j+4} >> 4) << 6, scales[j+4] = m_j | (m_{j+4} >> 4) << 6
          j>=4: scales[j+4] = (sc_j & 15) | (m_j & 15) << 4
        qs byte 32c+l = q[64c+l] & 15 | (q[64c+32+l] & 15) << 4 (c = 0..3)
        Q5_K qh[l] bit 2c = q[64c+l] >> 4, bit 2c+1 = q[64c+32+l] >> 4
  Q2_K  84 B / 256: | scales[16] | qs[64] | d f16 | dmin f16 |     x = d*sc*q - dmin*m
        16 sub-blocks of 16, 2-bit codes packed as Q3_K's low bits; scales[j] = sc_j | m_j << 4
  Q3_K 110 B / 256: | hmask[32] | qs[64] | scales[12] | d f16 |      x = d*(sc-32)*(q-4)
        16 sub-blocks of 16, 3-bit codes q = lo | hi << 2, 6-bit scales sc:
          hmask[m] bit b = hi of value 32b+m; qs[32h+l] = lo of v[32k+l] at bit 2k (v = q[128h:])
          scales[j] = sc_j & 15 | (sc_{j+8} & 15) << 4 (j < 8); scales[8+k] bits 2c = sc_{4c+k} >> 4
  Q6_K 210 B / 256: | ql[128] | qh[64] | scales[16] int8 | d f16 |  x = d*sc*(q-32)
        16 sub-blocks of 16; per half h (128 values, v = q[128h:]):
          ql[64h+l]    = v[l] & 15    | (v[l+64] & 15) << 4
          ql[64h+32+l] = v[l+32] & 15 | (v[l+96] & 15) << 4
          qh[32h+l]    = v[l]>>4 | (v[l+32]>>4) << 2 | (v[l+64]>>4) << 4 | (v[l+96]>>4) << 6
  IQ4_NL  18 B / 32:  | d f16 | qs[16] |                            x = d*K[q]
  IQ4_XS 136 B / 256: | d f16 | scales_h u16 | scales_l[4] | qs[128] |  x = d*(ls-32)*K[q]
        K = kvalues_iq4nl (16 non-uniform levels, -127..113); qs as Q4_0's per 32 values;
        8 blocks of 32 with 6-bit ls: low nibble in scales_l[j/2] (j odd: high half),
        2 high bits at bit 2j of scales_h
  IQ3_XXS 98 B / 256: | d f16 | grid index[64] | 8 x u32: 4 x 7 sign bits | ls << 28 |
  IQ3_S  110 B / 256: | d f16 | index low[64] | index bit 8 [8] | signs[32] | scales[4] |
        8 blocks of 32 in groups of 4 values, each a point of a 4-D grid (kquants_grid);
        IQ3_XXS x = d*(0.5+ls)*0.5*grid*sign (the 8th sign of 8 is the parity of the 7 stored),
        IQ3_S x = d*(1+2*ls)*grid*sign.
  IQ2_S   82 B / 256: | d f16 | index low[32] | signs[32] | index bits 8-9 [8] | scales[8] |
        16 blocks of 16 in groups of 8 on a 1024-point grid; x = d*(0.5+ls)*0.25*grid*sign
  IQ2_XS  74 B / 256: | d f16 | 32 x u16: grid index (9 bits) | 7 sign bits << 9 | scales[8] |
        as IQ2_S on a 512-point grid, the 8th sign of 8 the parity of the 7 stored
  IQ2_XXS 66 B / 256: | d f16 | 8 x (grid index[4] | u32: 4 x 7 sign bits | ls << 28) |
        8 blocks of 32 in groups of 8 on a 256-point grid; x = d*(0.5+ls)*0.25*grid*sign
  IQ1_S   50 B / 256: | d f16 | index low[32] | 8 x u16: 4 x 3 index bits | ls << 12 | sign << 15 |
  IQ1_M   56 B / 256: | index low[32] | qh[16]: 2 x (3 index bits | sign << 3) | 4 x u16 scales |
        groups of 8 on the 2048-point grid of {-1, 0, 1} (iq1s_grid), x = d*(2ls+1)*(grid+delta),
        delta = -1/8 where the sign bit is set, else 1/8. IQ1_S: 8 blocks of 32, one delta
        each; IQ1_M: 16 blocks of 16 (3-bit ls, 4 per u16), a delta per 8, and the fp16 d in
        the top nibbles of the 4 scale words (bits 0-3 of d in word 0, ..., 12-15 in word 3).
        The grid types have compiled (numba) encoders only: on a GPU the rows are encoded
        on the CPU and the bytes moved back.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from quantkit.methods.jit import compiled_available
from quantkit.methods.kquants_math import (
    GROUP_MAX_EPS,
    best_index_iq4nl,
    divs,
    make_iq4nl,
    make_q3,
    make_qkx,
    make_qp,
    make_qx,
    rdiv,
    roundf,
    seq_sum,
    sqrt32,
)

__all__ = ["encode_rows", "encode_slice", "SUPPORTED", "COMPILED_ONLY", "REQUIRES_QW", "row_bytes", "BACKENDS",
           "preload_compiled"]

Q = GGMLQuantizationType
SUPPORTED = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS,
             Q.IQ3_XXS, Q.IQ3_S, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ1_S, Q.IQ1_M)
# grid-search types with no torch port: every backend runs the numba encoder on CPU rows
COMPILED_ONLY = (Q.IQ3_XXS, Q.IQ3_S, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ1_S, Q.IQ1_M)
# ggml_quantize_requires_imatrix: ggml's quantizer asserts an imatrix for these
REQUIRES_QW = (Q.IQ2_XXS, Q.IQ2_XS, Q.IQ1_S)
# values per encoder call on CPU: small enough that an encoder's temporaries stay in cache,
# large enough to amortise the per-op cost of its long op chains. Measured on 2 cores
# (benchmarks/kquant_encoder_speed.py): Q6_K's 19-candidate [16, 19, G] arrays want 64K,
# Q4_K 128K, the 32-wide legacy types 256K.
_CHUNK = 1 << 16
_CHUNK_BY_TYPE = {Q.Q4_K: 1 << 17, Q.Q8_0: 1 << 18, Q.Q4_0: 1 << 18, Q.Q4_1: 1 << 18, Q.Q5_0: 1 << 18, Q.Q5_1: 1 << 18}
_CHUNK_GPU = 1 << 24
_SLAB = 1 << 23  # values per slab for the whole-row / super-block sums


def row_bytes(qtype: int, k: int) -> int:
    block, size = GGML_QUANT_SIZES[Q(qtype)]
    return k // block * size


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).to(torch.uint8)


def _f16_bytes(t: torch.Tensor) -> torch.Tensor:
    """[B] float32 -> [B, 2] little-endian fp16 bytes (round to nearest even, as GGML)."""
    return t.to(torch.float16).contiguous().view(torch.uint8).view(-1, 2)


def _groups(x: torch.Tensor, n: int) -> torch.Tensor:
    """[B, m*n] -> [n, B*m]: element-major layout for the per-group loops."""
    b = x.shape[0]
    return x.reshape(b, -1, n).permute(2, 0, 1).reshape(n, -1)


def _ungroup(x: torch.Tensor, b: int) -> torch.Tensor:
    n = x.shape[0]
    return x.reshape(n, b, -1).permute(1, 2, 0).reshape(b, -1)


def _row_sigma2(x: torch.Tensor) -> torch.Tensor:
    """sum(x^2)/K per row, summed in column order: the legacy types' imatrix weighting."""
    xt = x.t()
    return divs(seq_sum(xt * xt), float(x.shape[1]))


def _block_sum_x2(x: torch.Tensor) -> torch.Tensor:
    """sum(x^2) per 256-value super-block, in order: the K-quant imatrix weighting."""
    xt = x.reshape(-1, 256).t()
    return seq_sum(xt * xt)


def _sq(t: torch.Tensor) -> torch.Tensor:
    return t * t


def _pos_max(t: torch.Tensor) -> torch.Tensor:
    """Row max of [B, 8] floored at +0: the C `m = 0; if (v > m) m = v` (never -0.0)."""
    m = t.amax(1)
    return torch.where(m > 0, m, torch.zeros_like(m))


def _nibbles(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    return _u8((lo.to(torch.int32) & 15) | ((hi.to(torch.int32) & 15) << 4))


def _qh32(q: torch.Tensor) -> torch.Tensor:
    """Bit 4 of each of 32 codes -> a little-endian uint32 as 4 bytes, [B, 4]."""
    bits = (q.to(torch.int64) >> 4) & 1
    word = (bits << torch.arange(32, device=q.device)).sum(1)
    return torch.stack([_u8((word >> (8 * i)) & 255) for i in range(4)], dim=1)


# ----------------------------------------------------------------- 32-wide blocks

def _q8_0(x: torch.Tensor, qw: torch.Tensor | None, prep=None) -> torch.Tensor:
    xb = x.reshape(-1, 32)
    d = divs(xb.abs().amax(1), 127.0)
    inv = torch.where(d != 0, rdiv(1.0, d), torch.zeros_like(d))
    q = roundf(xb * inv[:, None]).to(torch.int8).view(torch.uint8)
    return torch.cat([_f16_bytes(d), q], 1)


def _absmax_signed(xb: torch.Tensor) -> torch.Tensor:
    idx = xb.abs().argmax(1, keepdim=True)
    return xb.gather(1, idx)[:, 0]


def _legacy_sym(x: torch.Tensor, qw: torch.Tensor | None, nmax: int, sigma2=None) -> tuple:
    """Q4_0 (nmax 8) / Q5_0 (nmax 16): (d [B], q [B, 32] in [0, 2*nmax))."""
    xb = x.reshape(-1, 32)
    if qw is None:
        d = divs(_absmax_signed(xb), float(-nmax))
        inv = torch.where(d != 0, rdiv(1.0, d), torch.zeros_like(d))
        q = torch.trunc(xb * inv[:, None] + (nmax + 0.5)).clamp_(max=2 * nmax - 1)
        return d, q
    w = qw.reshape(1, -1, 32) * sqrt32(sigma2[:, None, None] + _sq(x.reshape(x.shape[0], -1, 32)))
    d, q = make_qx(_groups(xb, 32), nmax, _groups(w.reshape(-1, 32), 32))
    return d, _ungroup(q, xb.shape[0])


def _q4_0(x, qw, prep=None):
    d, q = _legacy_sym(x, qw, 8, prep)
    return torch.cat([_f16_bytes(d), _nibbles(q[:, :16], q[:, 16:])], 1)


def _q5_0(x, qw, prep=None):
    d, q = _legacy_sym(x, qw, 16, prep)
    return torch.cat([_f16_bytes(d), _qh32(q), _nibbles(q[:, :16], q[:, 16:])], 1)


def _legacy_asym(x: torch.Tensor, qw: torch.Tensor | None, nmax: int, sigma2=None) -> tuple:
    """Q4_1 (nmax 15) / Q5_1 (nmax 31): (d [B], m [B], q [B, 32] in [0, nmax]), x = d*q + m."""
    xb = x.reshape(-1, 32)
    if qw is None:
        mn, mx = xb.amin(1), xb.amax(1)
        d = divs(mx - mn, float(nmax))
        inv = torch.where(d != 0, rdiv(1.0, d), torch.zeros_like(d))
        q = torch.trunc((xb - mn[:, None]) * inv[:, None] + 0.5)
        if nmax == 15:
            q = q.clamp_(max=15)  # Q4_1 clamps; Q5_1 keeps the low 5 bits
        return d, mn, q
    w = qw.reshape(1, -1, 32) * sqrt32(sigma2[:, None, None] + _sq(x.reshape(x.shape[0], -1, 32)))
    d, the_min, q = make_qkx(_groups(xb, 32), _groups(w.reshape(-1, 32), 32), nmax, -0.9, 0.05, 36)
    return d, -the_min, _ungroup(q, xb.shape[0])


def _q4_1(x: torch.Tensor, qw: torch.Tensor | None, sigma2=None) -> torch.Tensor:
    d, m, q = _legacy_asym(x, qw, 15, sigma2)
    return torch.cat([_f16_bytes(d), _f16_bytes(m), _nibbles(q[:, :16], q[:, 16:])], 1)


def _q5_1(x: torch.Tensor, qw: torch.Tensor | None, sigma2=None) -> torch.Tensor:
    d, m, q = _legacy_asym(x, qw, 31, sigma2)
    return torch.cat([_f16_bytes(d), _f16_bytes(m), _qh32(q), _nibbles(q[:, :16], q[:, 16:])], 1)


# ----------------------------------------------------------------- 256-wide K-quants

def _q45_k(x: torch.Tensor, qw: torch.Tensor | None, nmax: int, prep=None) -> torch.Tensor:
    xb = x.reshape(-1, 256)
    nb = xb.shape[0]
    xg = _groups(xb, 32)  # [32, nb*8]
    if qw is None:
        av_x = sqrt32(divs(seq_sum(xg * xg), 32.0))
        w = av_x + xg.abs()
        rmin, nstep = (-1.0, 20) if nmax == 15 else (-0.5, 15)
        scales, mins, L = make_qkx(xg, w, nmax, rmin, 0.1, nstep)
        scales, mins = scales.view(nb, 8), mins.view(nb, 8)
        max_scale, max_min = _pos_max(scales), _pos_max(mins)
        inv_s = torch.where(max_scale > 0, rdiv(63.0, max_scale), torch.zeros_like(max_scale))
        inv_m = torch.where(max_min > 0, rdiv(63.0, max_min), torch.zeros_like(max_min))
        ls = (torch.round(inv_s[:, None] * scales).to(torch.int32) & 255).clamp_(max=63)
        lm = (torch.round(inv_m[:, None] * mins).to(torch.int32) & 255).clamp_(max=63)
        d, dmin = divs(max_scale, 63.0), divs(max_min, 63.0)
    else:
        sigma2 = divs(2.0 * prep, 256.0)  # prep: sum(x^2) per super-block, [nb]
        qwb = qw.reshape(1, -1, 256).expand(x.shape[0], -1, -1).reshape(-1, 256)
        w = _groups(qwb, 32) * sqrt32(sigma2.repeat_interleave(8)[None, :] + xg * xg)
        sw = seq_sum(w).view(nb, 8).t()
        scales, mins, L = make_qkx(xg, w, nmax, -0.9, 0.05, 36)
        d, ls = make_qp(scales.view(nb, 8).t(), 63, sw)
        dmin, lm = make_qp(mins.view(nb, 8).t(), 63, sw)
        ls, lm = ls.t().to(torch.int32).clamp_(max=63), lm.t().to(torch.int32).clamp_(max=63)
    d16, dmin16 = d.to(torch.float16), dmin.to(torch.float16)
    dsub = (d16.float()[:, None] * ls.float()).reshape(-1)  # [nb*8], group order
    dm = (dmin16.float()[:, None] * lm.float()).reshape(-1)
    requant = torch.round((xg + dm) / dsub).clamp_(0, nmax)
    L = _ungroup(torch.where(dsub != 0, requant, L), nb).to(torch.int32)  # [nb, 256]
    sc = torch.zeros(nb, 12, dtype=torch.int32, device=x.device)
    sc[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    sc[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    sc[:, 8:12] = (ls[:, 4:8] & 15) | ((lm[:, 4:8] & 15) << 4)
    q = L.view(nb, 4, 2, 32)  # chunk c, half, lane
    qs = _nibbles(q[:, :, 0], q[:, :, 1]).reshape(nb, 128)
    parts = [_f16_bytes(d16.float()), _f16_bytes(dmin16.float()), _u8(sc)]
    if nmax == 31:
        hi = (q >> 4) & 1  # [nb, 4, 2, 32]
        shifts = (torch.arange(4, device=x.device) * 2)[None, :, None, None] + \
            torch.arange(2, device=x.device)[None, None, :, None]
        parts.append(_u8((hi << shifts).sum((1, 2))))
    parts.append(qs)
    return torch.cat(parts, 1)


def _q4_k(x, qw, prep=None):
    return _q45_k(x, qw, 15, prep)


def _q5_k(x, qw, prep=None):
    return _q45_k(x, qw, 31, prep)


def _q2_k(x: torch.Tensor, qw: torch.Tensor | None, prep=None) -> torch.Tensor:
    xb = x.reshape(-1, 256)
    nb = xb.shape[0]
    xg = _groups(xb, 16)  # [16, nb*16]
    if qw is None:
        scales, mins, L = make_qkx(xg, xg.abs(), 3, -0.5, 0.1, 15, mad=True)
        scales, mins = scales.view(nb, 16), mins.view(nb, 16)
        max_scale, max_min = _pos_max(scales), _pos_max(mins)
        inv_s = torch.where(max_scale > 0, rdiv(15.0, max_scale), torch.zeros_like(max_scale))
        inv_m = torch.where(max_min > 0, rdiv(15.0, max_min), torch.zeros_like(max_min))
        ls = torch.round(inv_s[:, None] * scales).to(torch.int32)
        lm = torch.round(inv_m[:, None] * mins).to(torch.int32)
        d, dmin = divs(max_scale, 15.0), divs(max_min, 15.0)
    else:
        sigma2 = divs(prep, 256.0)  # prep: sum(x^2) per super-block, [nb]
        qwb = qw.reshape(1, -1, 256).expand(x.shape[0], -1, -1).reshape(-1, 256)
        w = _groups(qwb, 16) * sqrt32(sigma2.repeat_interleave(16)[None, :] + xg * xg)
        sw = seq_sum(w).view(nb, 16).t()
        scales, mins, L = make_qkx(xg, w, 3, -0.9, 0.05, 36)
        d, ls = make_qp(scales.view(nb, 16).t(), 15, sw)
        dmin, lm = make_qp(mins.view(nb, 16).t(), 15, sw)
        ls, lm = ls.t().to(torch.int32), lm.t().to(torch.int32)
    byte = (ls | (lm << 4)) & 255  # uint8 stores, as the C
    d16, dmin16 = d.to(torch.float16), dmin.to(torch.float16)
    dsub = (d16.float()[:, None] * (byte & 15).float()).reshape(-1)
    dm = (dmin16.float()[:, None] * (byte >> 4).float()).reshape(-1)
    requant = torch.round((xg + dm) / dsub).clamp_(0, 3)
    L = _ungroup(torch.where(dsub != 0, requant, L), nb).to(torch.int32)
    lo = L.view(nb, 2, 4, 32)
    qs = _u8((lo << (2 * torch.arange(4, device=x.device))[None, None, :, None]).sum(2))
    return torch.cat([_u8(byte), qs.reshape(nb, 64), _f16_bytes(d16.float()), _f16_bytes(dmin16.float())], 1)


def _q3_k(x: torch.Tensor, qw: torch.Tensor | None, prep=None) -> torch.Tensor:
    xb = x.reshape(-1, 256)
    nb = xb.shape[0]
    xg = _groups(xb, 16)  # [16, nb*16]
    if qw is None:
        scales, L = make_q3(xg)
        scales = scales.view(nb, 16)
        max_scale = scales.gather(1, scales.abs().argmax(1, keepdim=True))[:, 0]
        nz = max_scale != 0
        iscale = rdiv(-32.0, torch.where(nz, max_scale, torch.ones_like(max_scale)))
        ls = torch.round(iscale[:, None] * scales).clamp_(-32, 31) + 32
        ls = torch.where(nz[:, None], ls, torch.zeros_like(ls))
        d = torch.where(nz, rdiv(1.0, iscale), torch.zeros_like(iscale))
    else:
        sigma2 = divs(2.0 * prep, 256.0)  # prep: sum(x^2) per super-block, [nb]
        qwb = qw.reshape(1, -1, 256).expand(x.shape[0], -1, -1).reshape(-1, 256)
        w = _groups(qwb, 16) * sqrt32(sigma2.repeat_interleave(16)[None, :] + xg * xg)
        sw = seq_sum(w).view(nb, 16).t()
        scales, L = make_qx(xg, 4, w)
        d, ls = make_qx(scales.view(nb, 16).t(), 32, sw)
        ls = ls.t()
    ls = ls.to(torch.int32)
    d16 = d.to(torch.float16)
    dsub = (d16.float()[:, None] * (ls - 32).float()).reshape(-1)
    requant = torch.round(xg / dsub).clamp_(-4, 3) + 4
    L = _ungroup(torch.where(dsub != 0, requant, L), nb).to(torch.int32)  # [nb, 256] in [0, 8)
    hi = (L >> 2).view(nb, 8, 32)  # bit 2 of value 32b + m -> bit b of hmask[m]
    hmask = _u8((hi << torch.arange(8, device=x.device)[None, :, None]).sum(1))
    lo = (L & 3).view(nb, 2, 4, 32)  # half, quarter, lane
    qs = _u8((lo << (2 * torch.arange(4, device=x.device))[None, None, :, None]).sum(2))
    sc = torch.zeros(nb, 12, dtype=torch.int32, device=x.device)
    sc[:, 0:8] = (ls[:, 0:8] & 15) | ((ls[:, 8:16] & 15) << 4)
    q = (ls.view(nb, 4, 4) >> 4) << (2 * torch.arange(4, device=x.device))[None, :, None]
    sc[:, 8:12] = q.sum(1)  # scale j = 4q + k: 2 high bits into byte 8 + k at 2q
    return torch.cat([hmask, qs.reshape(nb, 64), _u8(sc), _f16_bytes(d16.float())], 1)


def _q6_k(x: torch.Tensor, qw: torch.Tensor | None, prep=None) -> torch.Tensor:
    xb = x.reshape(-1, 256)
    nb = xb.shape[0]
    xg = _groups(xb, 16)  # [16, nb*16]
    qg = None
    if qw is not None:
        qg = _groups(qw.reshape(1, -1, 256).expand(x.shape[0], -1, -1).reshape(-1, 256), 16)
    scales, L = make_qx(xg, 32, qg)
    scales = scales.view(nb, 16)
    idx = scales.abs().argmax(1, keepdim=True)
    max_scale = scales.gather(1, idx)[:, 0]
    zero = max_scale.abs() < GROUP_MAX_EPS
    max_scale = torch.where(zero, torch.ones_like(max_scale), max_scale)
    iscale = rdiv(-128.0, max_scale)
    d16 = rdiv(1.0, iscale).to(torch.float16)
    sc = torch.round(iscale[:, None] * scales).clamp_(max=127)  # [nb, 16], fits int8
    dsub = (d16.float()[:, None] * sc).reshape(-1)
    requant = torch.round(xg / dsub).clamp_(-32, 31) + 32
    L = _ungroup(torch.where(dsub != 0, requant, L), nb).to(torch.int32)
    v = L.view(nb, 2, 4, 32)  # half, quarter, lane
    ql = torch.cat([_nibbles(v[:, :, 0], v[:, :, 2]), _nibbles(v[:, :, 1], v[:, :, 3])], 2)
    shifts = (torch.arange(4, device=x.device) * 2)[None, None, :, None]
    qh = _u8(((v >> 4) << shifts).sum(2))  # [nb, 2, 32]
    out = torch.cat([ql.reshape(nb, 128), qh.reshape(nb, 64),
                     sc.to(torch.int32).to(torch.int8).view(torch.uint8), _f16_bytes(d16.float())], 1)
    out[zero] = 0
    return out


def _iq4(x: torch.Tensor, qw: torch.Tensor | None, sbs: int) -> torch.Tensor:
    """IQ4_NL (sbs 32) / IQ4_XS (sbs 256): block scales searched over the kvalues_iq4nl codes;
    IQ4_XS stores them as 6-bit multiples l of d = -max_scale/32 and re-picks codes from d*l."""
    xg = _groups(x.reshape(-1, 32), 32)  # [32, G]
    g = xg.shape[1]
    if qw is None:
        w = xg * xg
    else:
        xs = x.reshape(-1, sbs).t()
        sigma2 = seq_sum(xs * xs) * (2.0 / sbs)  # a power of two: exact, as the C `*= 2.f/sbs`
        qwb = qw.reshape(1, -1, 32).expand(x.shape[0], -1, -1).reshape(-1, 32)
        w = _groups(qwb, 32) * sqrt32(sigma2.repeat_interleave(sbs // 32)[None, :] + xg * xg)
    scales = make_iq4nl(xg, w)
    if sbs == 32:
        inv = torch.where(scales != 0, rdiv(1.0, scales), torch.zeros_like(scales))
        header = _f16_bytes(scales)
    else:
        sc = scales.view(-1, 8)
        amax = sc.abs()
        max_scale = sc.gather(1, amax.argmax(1, keepdim=True))[:, 0]
        max_scale = torch.where(amax.amax(1) > 0, max_scale, torch.zeros_like(max_scale))
        d = divs(-max_scale, 32.0)  # -0.0 for an all-zero super-block, as in C
        inv_d = torch.where(d != 0, rdiv(1.0, d), torch.zeros_like(d))
        ls = (inv_d[:, None] * sc).round_().clamp_(-32, 31)
        dl = d[:, None] * ls
        inv = torch.where(dl != 0, rdiv(1.0, dl), torch.zeros_like(dl)).reshape(-1)
        ls = ls.to(torch.int32) + 32
        high = ((ls >> 4) << (2 * torch.arange(8, device=x.device))).sum(1)
        header = torch.cat([_f16_bytes(d), _u8(high & 255)[:, None], _u8(high >> 8)[:, None],
                            _nibbles(ls[:, 0::2], ls[:, 1::2])], 1)
    L = _ungroup(best_index_iq4nl(xg * inv[None, :]), g)  # [G, 32]
    qs = _nibbles(L[:, :16], L[:, 16:]).reshape(header.shape[0], -1)
    return torch.cat([header, qs], 1)


def _iq4_nl(x, qw, prep=None):
    return _iq4(x, qw, 32)


def _iq4_xs(x, qw, prep=None):
    return _iq4(x, qw, 256)


# imatrix paths that weight by a whole-row / whole-super-block sum of x^2: computed once per
# slab (a few long sequential loops) instead of per 64K-value chunk (many short ones)
_PREP = {Q.Q4_0: _row_sigma2, Q.Q4_1: _row_sigma2, Q.Q5_0: _row_sigma2, Q.Q5_1: _row_sigma2,
         Q.Q2_K: _block_sum_x2, Q.Q3_K: _block_sum_x2, Q.Q4_K: _block_sum_x2, Q.Q5_K: _block_sum_x2}

_ENCODERS = {Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1,
             Q.Q2_K: _q2_k, Q.Q3_K: _q3_k, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k,
             Q.IQ4_NL: _iq4_nl, Q.IQ4_XS: _iq4_xs}


BACKENDS = ("compiled", "torch")


def encode_slice(x: torch.Tensor, qtype: int, qw: torch.Tensor | None,
                 row_context: torch.Tensor) -> torch.Tensor:
    """Encode x [N, b], a column slice of rows [N, K], as `encode_rows` would encode it inside
    the whole rows: the legacy types' imatrix weights read sum(x^2)/K of the WHOLE row
    (`row_context`, the rows [N, K] that statistic is taken from); the K-quants' super-block
    statistics are local, so there the slice alone decides. Torch encoders (same bytes)."""
    qtype = Q(qtype)
    if qw is None or qtype not in _PREP or _PREP[qtype] is not _row_sigma2:
        return encode_rows(x, qtype, qw)
    sigma2 = _row_sigma2(row_context.float())
    return _ENCODERS[qtype](x.float().contiguous(), qw.float().reshape(-1), sigma2).reshape(x.shape[0], -1)


def encode_rows(w: torch.Tensor, qtype: int, qw: torch.Tensor | None = None,
                backend: str | None = None, errors: bool = False):
    """Encode float rows [N, K] (any float dtype, taken as float32) into GGML blocks.

    Returns uint8 [N, row_bytes(qtype, K)] on w's device; with errors=True the pair
    (bytes, float64 [N] sum over each row of (decoded - w)^2). K must be a multiple of the
    type's block size; qw, when given, is a float32 [K] importance vector.
    backend: "compiled" (numba loops, CPU tensors only; the default there) or "torch" (the
    vectorised encoders here; the default on a GPU). Both give the same bytes.
    """
    qtype = Q(qtype)
    enc = _ENCODERS.get(qtype)
    if enc is None and qtype not in COMPILED_ONLY:
        raise ValueError(f"no encoder for GGML type {qtype.name}")
    if qw is None and qtype in REQUIRES_QW:
        raise ValueError(f"{qtype.name} needs an importance matrix (qw): llama.cpp's quantizer has no "
                         f"{qtype.name} without one (ggml_quantize_requires_imatrix)")
    n, k = w.shape
    block = GGML_QUANT_SIZES[qtype][0]
    if k % block:
        raise ValueError(f"row width {k} is not a multiple of {block} ({qtype.name})")
    cpu = w.device.type == "cpu"
    backend = backend or ("compiled" if cpu and compiled_available() else "torch")
    if backend not in BACKENDS or (backend == "compiled" and not cpu):
        raise ValueError(f"encoder backend {backend!r} is not available for {w.device.type} "
                         f"tensors (choose from {BACKENDS}; 'compiled' runs on the CPU)")
    if qtype in COMPILED_ONLY:
        return _encode_on_cpu(w, qtype, qw, errors)
    w = w.to(torch.float32)
    if qw is not None:
        qw = qw.to(device=w.device, dtype=torch.float32).reshape(k)
    out = torch.empty(n, row_bytes(qtype, k), dtype=torch.uint8, device=w.device)
    if backend == "compiled":
        sq_err = _encode_compiled(w, qtype, qw, out)
    else:
        if n:
            _encode_torch(w, qtype, qw, out, enc)
        sq_err = None
        if errors:
            from quantkit.methods.kquants_decode import decode_rows

            sq_err = (decode_rows(out, qtype).double() - w.double()).square().sum(1)
    return (out, sq_err) if errors else out


def _encode_on_cpu(w: torch.Tensor, qtype: Q, qw: torch.Tensor | None, errors: bool):
    """The compiled-only types on any device: CPU float32 copies in, bytes back on w's device."""
    if not compiled_available():
        raise ValueError(f"{qtype.name} needs the compiled (numba) encoders, and numba cannot be "
                         f"imported here; install numba or choose another GGUF type")
    x = w.detach().to("cpu", torch.float32).contiguous()
    q = None if qw is None else qw.detach().to("cpu", torch.float32).reshape(w.shape[1]).contiguous()
    out = torch.empty(w.shape[0], row_bytes(qtype, w.shape[1]), dtype=torch.uint8)
    sq_err = _encode_compiled(x, qtype, q, out)
    out = out.to(w.device)
    return (out, sq_err.to(w.device)) if errors else out


def _encode_compiled(w: torch.Tensor, qtype: Q, qw: torch.Tensor | None,
                     out: torch.Tensor) -> torch.Tensor:
    """numba encoders (kquants_cpu) over row ranges in torch.get_num_threads() threads.

    Returns each row's squared reconstruction error, which the encoders add up as they go.
    """
    from quantkit.methods.kquants_cpu import ENCODERS

    enc = ENCODERS[int(qtype)]
    x = w.contiguous().numpy()
    q = np.empty(0, np.float32) if qw is None else qw.contiguous().numpy()
    o = out.numpy()
    err = np.zeros(x.shape[0], np.float64)
    n = x.shape[0]
    threads = min(torch.get_num_threads(), n)
    if threads <= 1 or x.size < (1 << 16):
        if n:
            enc(x, q, o, err)
        return torch.from_numpy(err)
    step = -(-n // (threads * 4))  # a few ranges per thread evens out uneven rows
    list(_pool(threads).map(lambda r: enc(x[r:r + step], q, o[r:r + step], err[r:r + step]),
                            range(0, n, step)))
    return torch.from_numpy(err)


def preload_compiled(qtypes) -> None:
    """Load the compiled encoders of `qtypes` in a background thread (no waiting).

    numba loads an encoder's cached machine code at its first call (~0.5 s in a fresh
    process, more when it compiles); done while the caller reads the tokenizer and the
    model, the first tensor does not wait for it. An encoder called before its load has
    finished waits on numba's compile lock, so nothing runs twice.
    """
    import threading

    ids = sorted({int(Q(t)) for t in qtypes if Q(t) in SUPPORTED})

    def load() -> None:
        from quantkit.methods.kquants_cpu import ENCODERS

        for t in ids:  # an imatrix row: same compiled code, and IQ2_XXS / IQ2_XS / IQ1_S require one
            x = np.zeros((1, 256), np.float32)
            ENCODERS[t](x, np.ones(256, np.float32), np.zeros((1, row_bytes(t, 256)), np.uint8),
                        np.zeros(1))

    if ids and compiled_available():
        threading.Thread(target=load, name="quantkit-kquant-preload", daemon=True).start()


_POOLS: dict[int, ThreadPoolExecutor] = {}


def _pool(threads: int) -> ThreadPoolExecutor:
    """One long-lived pool per thread count: starting threads per tensor cost ~2 ms each."""
    if threads not in _POOLS:
        _POOLS[threads] = ThreadPoolExecutor(threads, thread_name_prefix="quantkit-kquant")
    return _POOLS[threads]


def _encode_torch(w: torch.Tensor, qtype: Q, qw: torch.Tensor | None, out: torch.Tensor,
                  enc) -> torch.Tensor:
    """The vectorised torch encoders. They are long chains of small element-wise ops, so on
    CPU chunks of ~64K values run in parallel Python threads with one intra-op thread each
    (torch releases the GIL): intra-op threading of such small ops mostly spins.
    """
    n, k = w.shape
    cpu = w.device.type == "cpu"
    rows = max(1, (_CHUNK_BY_TYPE.get(qtype, _CHUNK) if cpu else _CHUNK_GPU) // k)
    slab = max(rows, _SLAB // k // rows * rows)
    prep_fn = _PREP.get(qtype) if qw is not None else None
    threads = torch.get_num_threads() if cpu else 1
    pool = ThreadPoolExecutor(threads) if threads > 1 else None
    if pool is not None:
        torch.set_num_threads(1)
    try:
        for s0 in range(0, n, slab):
            ws = w[s0:s0 + slab]
            prep = prep_fn(ws) if prep_fn is not None else None
            per_row = None if prep is None else prep.reshape(ws.shape[0], -1)

            def run(r: int, ws=ws, per_row=per_row, s0=s0) -> None:
                p = None if per_row is None else per_row[r:r + rows].reshape(-1)
                enc_out = enc(ws[r:r + rows].contiguous(), qw, p)
                out[s0 + r:s0 + r + rows] = enc_out.reshape(-1, out.shape[1])

            starts = range(0, ws.shape[0], rows)
            if pool is None:
                for r in starts:
                    run(r)
            else:
                list(pool.map(run, starts))
    finally:
        if pool is not None:
            pool.shutdown()
            torch.set_num_threads(threads)
    return out
