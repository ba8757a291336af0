"""IQ4_NL and IQ4_XS: 4-bit codes into llama.cpp's 16 non-uniform levels (kvalues_iq4nl) times
a block scale. torch and numba encoders (quantize_row_iq4_nl_impl, ntry 7, as
ggml_quantize_chunk calls it), torch decoders (dequantize_row_iq4_*), bit-exact with ggml.

Block layouts (little endian, byte offsets):

  IQ4_NL  18 B / 32:  | d f16 | qs[16] |                            x = d*K[q]
  IQ4_XS 136 B / 256: | d f16 | scales_h u16 | scales_l[4] | qs[128] |  x = d*(ls-32)*K[q]
        K = kvalues_iq4nl (16 non-uniform levels, -127..113); qs as Q4_0's per 32 values;
        8 blocks of 32 with 6-bit ls: low nibble in scales_l[j/2] (j odd: high half),
        2 high bits at bit 2j of scales_h
numba kernels (`*_numba`) take whole rows and add each row's squared reconstruction
error to `err`; see quantkit.ggml.compiled for the float rules that keep their bytes
equal to llama.cpp's.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType

from quantkit.ggml.codec import Codec
from quantkit.ggml.common import (
    GROUP_MAX_EPS,
    _f16,
    _f16_bytes,
    _groups,
    _lo_hi,
    _nibbles,
    _u8,
    _ungroup,
    divs,
    rdiv,
    seq_sum,
    sqrt32,
)
from quantkit.ggml.compiled import _clamp, _lanes, _nint, _put_f16, _sq_diff
from quantkit.ggml.jit import EPS, F32, JIT, njit

Q = GGMLQuantizationType

# ----------------------------------------------------------------- torch encoders

# llama.cpp's kvalues_iq4nl: the 16 non-uniform 4-bit levels of IQ4_NL / IQ4_XS
IQ4NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _best_index_iq4nl_torch(x: torch.Tensor) -> torch.Tensor:
    """best_index_int8(16, kvalues_iq4nl, x) per element: the nearest level, ties to the lower
    one, with the C comparisons in float32 (NaN -> 15, as the C binary search ends)."""
    v = torch.tensor(IQ4NL_VALUES, dtype=torch.float32, device=x.device)
    mu = torch.searchsorted(v, x.contiguous(), right=True).clamp_(1, 15)
    idx = torch.where((x - v[mu - 1]) < (v[mu] - x), mu - 1, mu)
    idx = torch.where(x <= v[0], torch.zeros_like(idx), idx)
    return torch.where(x >= v[15], torch.full_like(idx, 15), idx)


def _make_iq4nl_torch(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The block-scale search of quantize_row_iq4_nl_impl (ntry 7): x, w [32, G] -> scale [G].

    The start is the least-squares scale of the codes for d = max/127; then 15 inverse scales
    (itry - 127)/max are tried and kept when sumqx^2/sumq2 grows. The 16 candidates are
    independent and summed in one batch ([32, 16, G]); only the choice is a sequential scan.
    Blocks with max |x| < GROUP_MAX_EPS get 0.
    """
    v = torch.tensor(IQ4NL_VALUES, dtype=torch.float32, device=x.device)
    ax = x.abs()
    idx = ax.argmax(0, keepdim=True)  # first occurrence, as the C strict '>'
    zero_group = ax.gather(0, idx)[0] < GROUP_MAX_EPS
    mx = torch.where(zero_group, torch.ones_like(ax[0]), x.gather(0, idx)[0])
    first = rdiv(1.0, divs(-mx, -127.0))
    inv = torch.stack([first] + [rdiv(float(t - 127), mx) for t in range(-7, 8)])  # [16, G]
    q = v[_best_index_iq4nl_torch(x[:, None, :] * inv[None])]  # [32, 16, G]
    wq = w[:, None, :] * q
    sums = seq_sum(torch.stack([wq * x[:, None, :], wq * q], 1))  # [2, 16, G]
    sumqx, sumq2 = sums[0], sums[1]
    pos = sumq2[0] > 0
    scale = torch.where(pos, sumqx[0] / torch.where(pos, sumq2[0], torch.ones_like(mx)), torch.zeros_like(mx))
    best = scale * sumqx[0]
    for c in range(1, 16):
        take = (sumq2[c] > 0) & (sumqx[c] * sumqx[c] > best * sumq2[c])
        new_scale = sumqx[c] / sumq2[c]
        scale = torch.where(take, new_scale, scale)
        best = torch.where(take, new_scale * sumqx[c], best)
    return torch.where(zero_group, torch.zeros_like(scale), scale)

def _iq4_torch(x: torch.Tensor, qw: torch.Tensor | None, sbs: int) -> torch.Tensor:
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
    scales = _make_iq4nl_torch(xg, w)
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
    L = _ungroup(_best_index_iq4nl_torch(xg * inv[None, :]), g)  # [G, 32]
    qs = _nibbles(L[:, :16], L[:, 16:]).reshape(header.shape[0], -1)
    return torch.cat([header, qs], 1)


def _iq4_nl_torch(x, qw, prep=None):
    return _iq4_torch(x, qw, 32)


def _iq4_xs_torch(x, qw, prep=None):
    return _iq4_torch(x, qw, 256)

# ----------------------------------------------------------------- numba encoders

_IQ4NL_F32 = np.array(IQ4NL_VALUES, np.float32)  # numba reads a global array as a constant


@njit(**JIT)
def _best_index_iq4nl_numba(v, x):
    """best_index_int8(16, kvalues_iq4nl, x): the nearest level, ties to the lower one."""
    mu = 1  # the C binary search's end: the first level above x (counted without branches)
    for i in range(1, 15):
        mu += 1 if x >= v[i] else 0
    idx = mu - 1 if x - v[mu - 1] < v[mu] - x else mu
    idx = 0 if x <= v[0] else idx
    return 15 if x >= v[15] else idx


@njit(**JIT)
def _iq4nl_search_numba(xt, wt, scales):
    """The block-scale search of quantize_row_iq4_nl_impl (ntry 7) on every lane of xt, wt
    [32, G]: the least-squares scale of the nearest-level codes for d = max/127, then 15
    inverse scales (itry - 127)/max, kept when sumqx^2/sumq2 grows; scales[G] (0 where
    max |x| < GROUP_MAX_EPS)."""
    v = _IQ4NL_F32
    n, G = xt.shape
    mx = np.zeros(G, np.float32)
    amax = np.zeros(G, np.float32)
    inv = np.empty(G, np.float32)
    sumqx = np.empty(G, np.float32)
    sumq2 = np.empty(G, np.float32)
    best = np.empty(G, np.float32)
    for i in range(n):
        for g in range(G):
            ax = abs(xt[i, g])
            big = ax > amax[g]
            amax[g] = ax if big else amax[g]
            mx[g] = xt[i, g] if big else mx[g]
    for g in range(G):
        mx[g] = mx[g] if amax[g] >= EPS else F32(1)  # empty lanes: finished below
    for c in range(16):
        for g in range(G):
            inv[g] = F32(1) / (-mx[g] / v[0]) if c == 0 else F32(c - 8 - 127) / mx[g]
            sumqx[g] = F32(0)
            sumq2[g] = F32(0)
        for i in range(n):
            for g in range(G):
                q = v[_best_index_iq4nl_numba(v, inv[g] * xt[i, g])]
                wq = wt[i, g] * q
                sumqx[g] += wq * xt[i, g]
                sumq2[g] += wq * q
        for g in range(G):
            if c == 0:
                scales[g] = sumqx[g] / sumq2[g] if sumq2[g] > 0 else F32(0)
                best[g] = scales[g] * sumqx[g]
            elif sumq2[g] > 0 and sumqx[g] * sumqx[g] > best[g] * sumq2[g]:
                scales[g] = sumqx[g] / sumq2[g]
                best[g] = scales[g] * sumqx[g]
    for g in range(G):
        scales[g] = scales[g] if amax[g] >= EPS else F32(0)


@njit(**JIT)
def _iq4_numba(x2, qw, out, err, sbs, size):
    """IQ4_NL (sbs 32, 18 B: | d f16 | qs[16] |) and IQ4_XS (sbs 256, 136 B: | d f16 |
    scales_h u16 | scales_l[4] | qs[128] |): quantize_row_iq4_nl_impl with ntry 7, as
    ggml_quantize_chunk calls it (weights x^2, or qw * sqrt(sigma2 + x^2) with an imatrix).
    Each 32-value block searches its float scale over the nearest-level codes; IQ4_XS then
    stores 6-bit block scales l of d = -max_scale/32 and re-picks the codes from d*l."""
    v = _IQ4NL_F32
    rows, k = x2.shape
    nsb = k // sbs
    nblk = sbs // 32
    G = k // 32
    use_w = qw.shape[0] > 0
    xt = np.empty((32, G), np.float32)
    wt = np.empty((32, G), np.float32)
    L = np.empty(sbs, np.int64)
    row_scales = np.empty(G, np.float32)
    for r in range(rows):
        e = 0.0
        _lanes(x2[r], 32, xt)
        for s in range(nsb):
            x = x2[r, sbs * s:sbs * s + sbs]
            sigma2 = F32(0)
            for j in range(sbs):
                sigma2 += x[j] * x[j]
            sigma2 *= F32(2) / F32(sbs)
            for g in range(nblk * s, nblk * s + nblk):
                for i in range(32):
                    wt[i, g] = qw[32 * g + i] * np.sqrt(sigma2 + xt[i, g] * xt[i, g]) if use_w \
                        else xt[i, g] * xt[i, g]
        _iq4nl_search_numba(xt, wt, row_scales)
        for s in range(nsb):
            x = x2[r, sbs * s:sbs * s + sbs]
            o = out[r, size * s:size * s + size]
            scales = row_scales[nblk * s:nblk * s + nblk]
            max_scale = F32(0)
            amax_scale = F32(0)
            for ib in range(nblk):
                if abs(scales[ib]) > amax_scale:
                    amax_scale = abs(scales[ib])
                    max_scale = scales[ib]
            if nblk > 1:
                d = -max_scale / F32(32)
                d16 = _put_f16(o, 0, d)
                inv = F32(1) / d if d != 0 else F32(0)
                scales_h = 0
                for ib in range(nblk):
                    ll = int(_clamp(_nint(inv * scales[ib]), F32(-32), F32(31)))
                    dl = d * F32(ll)
                    idl = F32(1) / dl if dl != 0 else F32(0)
                    dq = d16 * F32(ll)
                    for j in range(32):
                        L[32 * ib + j] = _best_index_iq4nl_numba(v, idl * x[32 * ib + j])
                        e += _sq_diff(dq * v[L[32 * ib + j]], x[32 * ib + j])
                    ll += 32
                    if ib % 2 == 0:
                        o[4 + ib // 2] = ll & 15
                    else:
                        o[4 + ib // 2] |= (ll & 15) << 4
                    scales_h |= (ll >> 4) << (2 * ib)
                o[2] = scales_h & 255
                o[3] = scales_h >> 8
                qs = 8
            else:
                d16 = _put_f16(o, 0, scales[0])
                inv = F32(1) / scales[0] if scales[0] != 0 else F32(0)
                for j in range(32):
                    L[j] = _best_index_iq4nl_numba(v, inv * x[j])
                    e += _sq_diff(d16 * v[L[j]], x[j])
                qs = 2
            for i in range(nblk):
                for j in range(16):
                    o[qs + 16 * i + j] = L[32 * i + j] | (L[32 * i + 16 + j] << 4)
        err[r] += e
    return out


@njit(**JIT)
def _iq4_nl_numba(x2, qw, out, err):
    return _iq4_numba(x2, qw, out, err, 32, 18)


@njit(**JIT)
def _iq4_xs_numba(x2, qw, out, err):
    return _iq4_numba(x2, qw, out, err, 256, 136)

# ----------------------------------------------------------------- torch decoders

_IQ4NL = torch.tensor(IQ4NL_VALUES, dtype=torch.float32)


def _iq4_levels_decode(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] code bytes -> [..., 32] kvalues_iq4nl levels (low nibbles, then high)."""
    lo, hi = _lo_hi(qs)
    return _IQ4NL.to(qs.device)[torch.cat([lo, hi], -1).long()]


def _iq4_nl_decode(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2])[:, None] * _iq4_levels_decode(b[:, 2:])


def _iq4_xs_decode(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    high = b[:, 2].to(torch.int32) | (b[:, 3].to(torch.int32) << 8)
    ib = torch.arange(8, device=b.device)
    low = (b[:, 4 + ib // 2].to(torch.int32) >> (4 * (ib % 2))) & 15
    ls = low | (((high[:, None] >> (2 * ib)) & 3) << 4)
    dl = _f16(b[:, :2])[:, None] * (ls - 32).float()  # [nb, 8]
    return (dl[:, :, None] * _iq4_levels_decode(b[:, 8:].reshape(nb, 8, 16))).reshape(nb, 256)

CODECS = (
    Codec(Q.IQ4_NL, torch_encoder=_iq4_nl_torch, compiled_encoder=_iq4_nl_numba,
          torch_decoder=_iq4_nl_decode),
    Codec(Q.IQ4_XS, torch_encoder=_iq4_xs_torch, compiled_encoder=_iq4_xs_numba,
          torch_decoder=_iq4_xs_decode),
)
