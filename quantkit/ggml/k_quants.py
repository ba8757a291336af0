"""The K-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (256-value super-blocks): torch and numba
encoders, torch decoders, bit-exact with ggml-quants.c (quantize_row_q*_K_ref / _impl,
dequantize_row_q*_K).

Block layouts (little endian, byte offsets):

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

With an imatrix Q2_K-Q5_K weight by sum(x^2) of each super-block (`prep`, computed once per slab).
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
    _pos_max,
    _u8,
    _ungroup,
    divs,
    make_qkx,
    make_qp,
    make_qx,
    nint_c,
    rdiv,
    seq_sum,
    sqrt32,
)
from quantkit.ggml.compiled import (
    _clamp,
    _lanes,
    _make_qkx,
    _make_qp,
    _make_qx,
    _nint,
    _nint_c,
    _put_f16,
    _sq_diff,
)
from quantkit.ggml.jit import EPS, F32, JIT, njit

Q = GGMLQuantizationType

# ----------------------------------------------------------------- torch encoders

def _make_q3_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """make_q3_quants(n, nmax 4, do_rmse) for every lane: x [n, G] -> (scale [G], L [n, G]
    codes + 4 in [0, 8)). Codes from -4/max, then up to 5 passes of coordinate descent with
    weights x^2, each element updated in order (sequential over n, vectorised over lanes)."""
    ax = x.abs()
    idx = ax.argmax(0, keepdim=True)
    amax = ax.gather(0, idx)[0]
    mx = x.gather(0, idx)[0]
    zero_group = amax < GROUP_MAX_EPS
    mx = torch.where(zero_group, torch.ones_like(mx), mx)
    iscale = rdiv(-4.0, mx)
    L = torch.round(x * iscale).clamp_(-4, 3)
    w = x * x
    wx = w * x
    sumlx = seq_sum(wx * L)
    suml2 = seq_sum((w * L) * L)
    for _ in range(5):
        changed = torch.zeros_like(zero_group)
        for i in range(x.shape[0]):
            li = L[i]
            slx = sumlx - wx[i] * li
            sl2 = suml2 - (w[i] * li) * li
            new_l = nint_c((x[i] * sl2) / slx).clamp_(-4, 3)
            ok = (slx > 0) & (new_l != li)
            slx = slx + wx[i] * new_l
            sl2 = sl2 + (w[i] * new_l) * new_l
            ok &= (sl2 > 0) & ((slx * slx) * suml2 > (sumlx * sumlx) * sl2)
            L[i] = torch.where(ok, new_l, li)
            sumlx = torch.where(ok, slx, sumlx)
            suml2 = torch.where(ok, sl2, suml2)
            changed |= ok
        if not bool(changed.any()):
            break
    pos = suml2 > 0
    scale = torch.where(pos, sumlx / torch.where(pos, suml2, torch.ones_like(suml2)),
                        torch.zeros_like(suml2))
    scale = torch.where(zero_group, torch.zeros_like(scale), scale)
    L = torch.where(zero_group[None, :], torch.zeros_like(L), L + 4)
    return scale, L

def _block_sum_x2_torch(x: torch.Tensor) -> torch.Tensor:
    """sum(x^2) per 256-value super-block, in order: the K-quant imatrix weighting."""
    xt = x.reshape(-1, 256).t()
    return seq_sum(xt * xt)

def _q45_k_torch(x: torch.Tensor, qw: torch.Tensor | None, nmax: int, prep=None) -> torch.Tensor:
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


def _q4_k_torch(x, qw, prep=None):
    return _q45_k_torch(x, qw, 15, prep)


def _q5_k_torch(x, qw, prep=None):
    return _q45_k_torch(x, qw, 31, prep)


def _q2_k_torch(x: torch.Tensor, qw: torch.Tensor | None, prep=None) -> torch.Tensor:
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


def _q3_k_torch(x: torch.Tensor, qw: torch.Tensor | None, prep=None) -> torch.Tensor:
    xb = x.reshape(-1, 256)
    nb = xb.shape[0]
    xg = _groups(xb, 16)  # [16, nb*16]
    if qw is None:
        scales, L = _make_q3_torch(xg)
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


def _q6_k_torch(x: torch.Tensor, qw: torch.Tensor | None, prep=None) -> torch.Tensor:
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

# ----------------------------------------------------------------- numba encoders

# ----------------------------------------------------------------- 256-wide K-quants


@njit(**JIT)
def _q45_k_numba(x2, qw, out, err, nmax, size):
    """Q4_K (nmax 15, 144 B) / Q5_K (nmax 31, 176 B): the _ref path, or _impl with qw."""
    rows, k = x2.shape
    nb = k // 256
    ng = 8 * nb  # sub-blocks of 32 per row: the lanes of the scale search
    use_w = qw.shape[0] > 0
    xt = np.empty((32, ng), np.float32)
    wt = np.empty((32, ng), np.float32)
    Lt = np.empty((32, ng), np.float32)
    scales = np.empty(ng, np.float32)
    mins = np.empty(ng, np.float32)
    sw = np.empty(8, np.float32)
    L = np.empty(256, np.int64)
    ls = np.empty(8, np.int64)
    lm = np.empty(8, np.int64)
    sc = np.empty(12, np.int64)
    rmin = F32(-1.0) if nmax == 15 else F32(-0.5)
    nstep = 20 if nmax == 15 else 15
    fnmax = F32(nmax)
    for r in range(rows):
        e = 0.0
        xr = x2[r]
        _lanes(xr, 32, xt)
        if use_w:  # quantize_row_q*_K_impl: sigma2 per super-block, imatrix weights
            for b in range(nb):
                sum_x2 = F32(0)
                for j in range(256):
                    sum_x2 += xr[256 * b + j] * xr[256 * b + j]
                sigma2 = F32(2) * sum_x2 / F32(256)
                for g in range(8 * b, 8 * b + 8):
                    for i in range(32):
                        wt[i, g] = qw[32 * g + i] * np.sqrt(sigma2 + xt[i, g] * xt[i, g])
            _make_qkx(xt, wt, nmax, F32(-0.9), F32(0.05), 36, scales, mins, Lt)
        else:  # quantize_row_q*_K_ref: w = sqrt(mean x^2) + |x| per sub-block
            for g in range(ng):
                s = F32(0)
                for i in range(32):
                    s += xt[i, g] * xt[i, g]
                av_x = np.sqrt(s / F32(32))
                for i in range(32):
                    wt[i, g] = av_x + abs(xt[i, g])
            _make_qkx(xt, wt, nmax, rmin, F32(0.1), nstep, scales, mins, Lt)
        for b in range(nb):
            xs = xr[256 * b:256 * b + 256]
            o = out[r, size * b:size * b + size]
            for j in range(8):
                for i in range(32):
                    L[32 * j + i] = int(Lt[i, 8 * b + j])
            bs = scales[8 * b:8 * b + 8]
            bm = mins[8 * b:8 * b + 8]
            if use_w:
                for j in range(8):
                    s = F32(0)
                    for i in range(32):
                        s += wt[i, 8 * b + j]
                    sw[j] = s
                d = _make_qp(bs, sw, 63, ls)
                dmin = _make_qp(bm, sw, 63, lm)
            else:
                max_scale = F32(0)
                max_min = F32(0)
                for j in range(8):
                    if bs[j] > max_scale:
                        max_scale = bs[j]
                    if bm[j] > max_min:
                        max_min = bm[j]
                inv_s = F32(63) / max_scale if max_scale > 0 else F32(0)
                inv_m = F32(63) / max_min if max_min > 0 else F32(0)
                for j in range(8):
                    ls[j] = min(63, int(_nint(inv_s * bs[j])) & 255)
                    lm[j] = min(63, int(_nint(inv_m * bm[j])) & 255)
                d = max_scale / F32(63)
                dmin = max_min / F32(63)
            for j in range(4):  # pack as the C does (uint8 stores), then read back
                sc[j] = ls[j] & 255
                sc[j + 4] = lm[j] & 255
            for j in range(4, 8):
                sc[j + 4] = ((ls[j] & 15) | ((lm[j] & 15) << 4)) & 255
                sc[j - 4] = (sc[j - 4] | ((ls[j] >> 4) << 6)) & 255
                sc[j] = (sc[j] | ((lm[j] >> 4) << 6)) & 255
            d16 = _put_f16(o, 0, d)
            dmin16 = _put_f16(o, 2, dmin)
            for j in range(12):
                o[4 + j] = sc[j]
            for j in range(8):
                if j < 4:
                    s6, m6 = sc[j] & 63, sc[j + 4] & 63
                else:
                    s6 = (sc[j + 4] & 15) | ((sc[j - 4] >> 6) << 4)
                    m6 = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4)
                dq = d16 * F32(s6)
                dm = dmin16 * F32(m6)
                if dq != 0:
                    for i in range(32):
                        q = _nint((xs[32 * j + i] + dm) / dq)
                        L[32 * j + i] = int(_clamp(q, F32(0), fnmax))
                for i in range(32):
                    e += _sq_diff(dq * F32(L[32 * j + i] & nmax) - dm, xs[32 * j + i])
            qs = 16
            if nmax == 31:
                for i in range(32):
                    o[16 + i] = 0
                qs = 48
            for c in range(4):
                for i in range(32):
                    lo, hi = L[64 * c + i], L[64 * c + 32 + i]
                    o[qs + 32 * c + i] = (lo & 15) | ((hi & 15) << 4)
                    if nmax == 31:
                        o[16 + i] |= ((lo >> 4) << (2 * c)) | ((hi >> 4) << (2 * c + 1))
        err[r] += e
    return out


@njit(**JIT)
def _q4_k_numba(x2, qw, out, err):
    return _q45_k_numba(x2, qw, out, err, 15, 144)


@njit(**JIT)
def _q5_k_numba(x2, qw, out, err):
    return _q45_k_numba(x2, qw, out, err, 31, 176)


@njit(**JIT)
def _q6_k_numba(x2, qw, out, err):
    rows, k = x2.shape
    nb = k // 256
    ng = 16 * nb  # sub-blocks of 16 per row: the lanes of make_qx
    use_w = qw.shape[0] > 0
    xt = np.empty((16, ng), np.float32)
    wt = np.empty((16, ng), np.float32)
    Lt = np.empty((16, ng), np.float32)
    scales = np.empty(ng, np.float32)
    if use_w:
        _lanes(qw, 16, wt)  # the imatrix is the same for every row
    L = np.empty(256, np.int64)
    sc = np.empty(16, np.int64)
    for r in range(rows):
        e = 0.0
        xr = x2[r]
        _lanes(xr, 16, xt)
        _make_qx(xt, wt, use_w, 32, scales, Lt)
        for b in range(nb):
            xs = xr[256 * b:256 * b + 256]
            o = out[r, 210 * b:210 * b + 210]
            max_scale = F32(0)
            max_abs = F32(0)
            for j in range(16):
                s = scales[16 * b + j]
                if abs(s) > max_abs:
                    max_abs = abs(s)
                    max_scale = s
            if max_abs < EPS:
                for j in range(210):
                    o[j] = 0
                for j in range(256):
                    e += _sq_diff(F32(0), xs[j])
                continue
            for j in range(16):
                for i in range(16):
                    L[16 * j + i] = int(Lt[i, 16 * b + j])
            iscale = F32(-128) / max_scale
            d16 = _put_f16(o, 208, F32(1) / iscale)
            for j in range(16):
                v = min(127, int(_nint(iscale * scales[16 * b + j])))
                sc[j] = ((v + 128) & 255) - 128  # int8_t store
                o[192 + j] = v & 255
            for j in range(16):
                dq = d16 * F32(sc[j])
                if dq != 0:
                    for i in range(16):
                        q = _clamp(_nint(xs[16 * j + i] / dq), F32(-32), F32(31))
                        L[16 * j + i] = int(q) + 32
                for i in range(16):
                    e += _sq_diff(dq * F32((L[16 * j + i] & 63) - 32), xs[16 * j + i])
            for h in range(2):
                v = L[128 * h:128 * h + 128]
                for i in range(32):
                    o[64 * h + i] = (v[i] & 15) | ((v[i + 64] & 15) << 4)
                    o[64 * h + 32 + i] = (v[i + 32] & 15) | ((v[i + 96] & 15) << 4)
                    o[128 + 32 * h + i] = ((v[i] >> 4) | ((v[i + 32] >> 4) << 2)
                                           | ((v[i + 64] >> 4) << 4) | ((v[i + 96] >> 4) << 6))
        err[r] += e
    return out

@njit(**JIT)
def _make_q3_numba(x, L, buf):
    """make_q3_quants(16, nmax 4, do_rmse): codes from -4/max, then up to 5 passes of
    coordinate descent weighted by x^2; L gets codes + 4 in [0, 8). Returns the scale."""
    n = x.shape[0]
    mx = F32(0)
    amax = F32(0)
    for i in range(n):
        ax = abs(x[i])
        if ax > amax:
            amax = ax
            mx = x[i]
    if amax < EPS:
        for i in range(n):
            L[i] = 0
        return F32(0)
    iscale = F32(-4) / mx
    sumlx = F32(0)
    suml2 = F32(0)
    for i in range(n):
        li = _clamp(_nint(iscale * x[i]), F32(-4), F32(3))
        L[i] = int(li)
        w = x[i] * x[i]
        sumlx += w * x[i] * li
        suml2 += w * li * li
    for _ in range(5):
        changed = 0
        for i in range(n):
            w = x[i] * x[i]
            fl = F32(L[i])
            slx = sumlx - w * x[i] * fl
            if slx > 0:
                sl2 = suml2 - w * fl * fl
                new_l = _clamp(_nint_c(x[i] * sl2 / slx, buf), F32(-4), F32(3))
                if new_l != fl:
                    slx += w * x[i] * new_l
                    sl2 += w * new_l * new_l
                    if sl2 > 0 and slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = int(new_l)
                        sumlx = slx
                        suml2 = sl2
                        changed += 1
        if changed == 0:
            break
    for i in range(n):
        L[i] += 4
    return sumlx / suml2 if suml2 > 0 else F32(0)


@njit(**JIT)
def _q3_k_numba(x2, qw, out, err):
    """Q3_K, 110 B / 256: | hmask[32] | qs[64] | scales[12] | d f16 |, x = d*(sc-32)*(q-4),
    16 sub-blocks of 16; the _ref path (make_q3_quants), or _impl with qw (make_qx_quants
    for the codes and, weighted by each sub-block's sum of weights, for the 6-bit scales)."""
    rows, k = x2.shape
    nb = k // 256
    ng = 16 * nb
    use_w = qw.shape[0] > 0
    xt = np.empty((16, ng), np.float32)
    wt = np.empty((16, ng), np.float32)
    Lt = np.empty((16, ng), np.float32)
    scales = np.empty(ng, np.float32)
    st = np.empty((16, nb), np.float32)  # sub-block scales as lanes of super-blocks
    swt = np.empty((16, nb), np.float32)
    lst = np.empty((16, nb), np.float32)
    dblk = np.empty(nb, np.float32)
    L = np.empty(256, np.int64)
    ls = np.empty(16, np.int64)
    sc = np.zeros(12, np.int64)
    buf = np.empty(1, np.float32)
    for r in range(rows):
        e = 0.0
        xr = x2[r]
        if use_w:
            _lanes(xr, 16, xt)
            for b in range(nb):
                sum_x2 = F32(0)
                for j in range(256):
                    sum_x2 += xr[256 * b + j] * xr[256 * b + j]
                sigma2 = F32(2) * sum_x2 / F32(256)
                for g in range(16 * b, 16 * b + 16):
                    s = F32(0)
                    for i in range(16):
                        wt[i, g] = qw[16 * g + i] * np.sqrt(sigma2 + xt[i, g] * xt[i, g])
                        s += wt[i, g]
                    swt[g - 16 * b, b] = s
            _make_qx(xt, wt, True, 4, scales, Lt)
            for b in range(nb):
                for j in range(16):
                    st[j, b] = scales[16 * b + j]
            _make_qx(st, swt, True, 32, dblk, lst)
        for b in range(nb):
            xs = xr[256 * b:256 * b + 256]
            o = out[r, 110 * b:110 * b + 110]
            if use_w:
                for j in range(16):
                    for i in range(16):
                        L[16 * j + i] = int(Lt[i, 16 * b + j])
                    ls[j] = int(lst[j, b])
                d = dblk[b]
            else:
                max_scale = F32(0)
                amax = F32(0)
                for j in range(16):
                    s = _make_q3_numba(xs[16 * j:16 * j + 16], L[16 * j:16 * j + 16], buf)
                    scales[j] = s
                    if abs(s) > amax:
                        amax = abs(s)
                        max_scale = s
                if max_scale != 0:
                    iscale = F32(-32) / max_scale
                    for j in range(16):
                        ls[j] = int(_clamp(_nint(iscale * scales[j]), F32(-32), F32(31))) + 32
                    d = F32(1) / iscale
                else:
                    for j in range(16):
                        ls[j] = 0  # the C leaves the packed scales zeroed
                    d = F32(0)
            for j in range(12):
                sc[j] = 0
            for j in range(16):
                if j < 8:
                    sc[j] = ls[j] & 15
                else:
                    sc[j - 8] |= (ls[j] & 15) << 4
                sc[8 + j % 4] |= ((ls[j] & 255) >> 4) << (2 * (j // 4))
            d16 = _put_f16(o, 108, d)
            for j in range(12):
                o[96 + j] = sc[j] & 255
            for j in range(16):
                dq = d16 * F32(ls[j] - 32)
                if dq != 0:
                    for i in range(16):
                        q = _clamp(_nint(xs[16 * j + i] / dq), F32(-4), F32(3))
                        L[16 * j + i] = int(q) + 4
                for i in range(16):
                    e += _sq_diff(dq * F32(L[16 * j + i] - 4), xs[16 * j + i])
            for m in range(32):
                h = 0
                for bit in range(8):
                    if L[32 * bit + m] > 3:
                        h |= 1 << bit
                o[m] = h
            for h in range(2):
                for i in range(32):
                    v = 0
                    for q4 in range(4):
                        v |= (L[128 * h + 32 * q4 + i] & 3) << (2 * q4)
                    o[32 + 32 * h + i] = v
        err[r] += e
    return out


@njit(**JIT)
def _q2_k_numba(x2, qw, out, err):
    """Q2_K, 84 B / 256: | scales[16] | qs[64] | d f16 | dmin f16 |, x = d*sc*q - dmin*m,
    16 sub-blocks of 16, 2-bit codes, 4-bit sc (low nibble) and m (high nibble); the _ref
    path (make_qkx2_quants with |x| weights and absolute errors), or _impl with qw
    (make_qkx3_quants, then make_qp_quants for the 4-bit scales and mins)."""
    rows, k = x2.shape
    nb = k // 256
    ng = 16 * nb
    use_w = qw.shape[0] > 0
    xt = np.empty((16, ng), np.float32)
    wt = np.empty((16, ng), np.float32)
    Lt = np.empty((16, ng), np.float32)
    scales = np.empty(ng, np.float32)
    mins = np.empty(ng, np.float32)
    sw = np.empty(16, np.float32)
    L = np.empty(256, np.int64)
    ls = np.empty(16, np.uint8)
    lm = np.empty(16, np.uint8)
    byte = np.empty(16, np.int64)
    for r in range(rows):
        e = 0.0
        xr = x2[r]
        _lanes(xr, 16, xt)
        if use_w:
            for b in range(nb):
                sum_x2 = F32(0)
                for j in range(256):
                    sum_x2 += xr[256 * b + j] * xr[256 * b + j]
                sigma2 = sum_x2 / F32(256)
                for g in range(16 * b, 16 * b + 16):
                    for i in range(16):
                        wt[i, g] = qw[16 * g + i] * np.sqrt(sigma2 + xt[i, g] * xt[i, g])
            _make_qkx(xt, wt, 3, F32(-0.9), F32(0.05), 36, scales, mins, Lt, False)
        else:
            for g in range(ng):
                for i in range(16):
                    wt[i, g] = abs(xt[i, g])
            _make_qkx(xt, wt, 3, F32(-0.5), F32(0.1), 15, scales, mins, Lt, True)
        for b in range(nb):
            xs = xr[256 * b:256 * b + 256]
            o = out[r, 84 * b:84 * b + 84]
            for j in range(16):
                for i in range(16):
                    L[16 * j + i] = int(Lt[i, 16 * b + j])
            bs = scales[16 * b:16 * b + 16]
            bm = mins[16 * b:16 * b + 16]
            if use_w:
                for j in range(16):
                    s = F32(0)
                    for i in range(16):
                        s += wt[i, 16 * b + j]
                    sw[j] = s
                d = _make_qp(bs, sw, 15, ls)
                dmin = _make_qp(bm, sw, 15, lm)
                for j in range(16):
                    byte[j] = (int(ls[j]) | (int(lm[j]) << 4)) & 255
            else:
                max_scale = F32(0)
                max_min = F32(0)
                for j in range(16):
                    if bs[j] > max_scale:
                        max_scale = bs[j]
                    if bm[j] > max_min:
                        max_min = bm[j]
                for j in range(16):
                    byte[j] = 0
                d = F32(0)
                dmin = F32(0)
                if max_scale > 0:
                    iscale = F32(15) / max_scale
                    for j in range(16):
                        byte[j] = int(_nint(iscale * bs[j])) & 255
                    d = max_scale / F32(15)
                if max_min > 0:
                    iscale = F32(15) / max_min
                    for j in range(16):
                        byte[j] = (byte[j] | (int(_nint(iscale * bm[j])) << 4)) & 255
                    dmin = max_min / F32(15)
            d16 = _put_f16(o, 80, d)
            dmin16 = _put_f16(o, 82, dmin)
            for j in range(16):
                o[j] = byte[j]
                dq = d16 * F32(byte[j] & 15)
                dm = dmin16 * F32(byte[j] >> 4)
                if dq != 0:
                    for i in range(16):
                        q = _clamp(_nint((xs[16 * j + i] + dm) / dq), F32(0), F32(3))
                        L[16 * j + i] = int(q)
                for i in range(16):
                    e += _sq_diff(dq * F32(L[16 * j + i] & 3) - dm, xs[16 * j + i])
            for h in range(2):
                for i in range(32):
                    v = 0
                    for q4 in range(4):
                        v |= (L[128 * h + 32 * q4 + i] & 3) << (2 * q4)
                    o[16 + 32 * h + i] = v
        err[r] += e
    return out

# ----------------------------------------------------------------- torch decoders

def _scale_min_k4_decode(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed bytes -> 8 six-bit scales and mins (get_scale_min_k4)."""
    s = s.to(torch.int32)
    sc = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)], 1)
    mn = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], 1)
    return sc, mn


def _qk45_decode(b: torch.Tensor, five: bool) -> torch.Tensor:
    nb = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_k4_decode(b[:, 4:16])
    qs = b[:, 48:176] if five else b[:, 16:144]
    lo, hi = _lo_hi(qs.reshape(nb, 4, 32))
    q = torch.stack([lo, hi], 2)  # [nb, chunk, half, lane] = sub-block 2c + half
    if five:
        qh = b[:, 16:48].to(torch.int32)  # bit 2c+half of qh[lane]
        shift = (2 * torch.arange(4, device=b.device))[:, None] + torch.arange(2, device=b.device)[None]
        q = q | (((qh[:, None, None, :] >> shift[None, :, :, None]) & 1) << 4)
    q = q.reshape(nb, 8, 32).float()
    dl = (d[:, None] * sc.float())[:, :, None]
    ml = (dmin[:, None] * mn.float())[:, :, None]
    return (dl * q - ml).reshape(nb, 256)


def _q2_k_decode(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    sc, qs = b[:, :16].to(torch.int32), b[:, 16:80].to(torch.int32)
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    q = (qs.reshape(nb, 2, 1, 32) >> (2 * torch.arange(4, device=b.device))[None, None, :, None]) & 3
    dl = (d[:, None] * (sc & 15).float()).repeat_interleave(16, 1)
    ml = (dmin[:, None] * (sc >> 4).float()).repeat_interleave(16, 1)
    return dl * q.reshape(nb, 256).float() - ml


def _q3_k_decode(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    hm, qs, s = (b[:, a:z].to(torch.int32) for a, z in ((0, 32), (32, 96), (96, 108)))
    d = _f16(b[:, 108:110])
    four = torch.arange(4, device=b.device)
    high = ((s[:, None, 8:12] >> (2 * four)[None, :, None]) & 3).reshape(nb, 16)  # j = 4c + k
    sc = torch.cat([s[:, 0:8] & 15, s[:, 0:8] >> 4], 1) | (high << 4)
    lo = (qs.reshape(nb, 2, 1, 32) >> (2 * four)[None, None, :, None]) & 3  # value 128h + 32k + l
    hi = (hm[:, None, :] >> torch.arange(8, device=b.device)[None, :, None]) & 1  # value 32b + m
    q = (lo.reshape(nb, 256) | (hi.reshape(nb, 256) << 2)) - 4
    dl = d[:, None] * (sc - 32).float()
    return dl.repeat_interleave(16, 1) * q.float()


def _q6_k_decode(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    ql = b[:, :128].to(torch.int32).reshape(nb, 2, 2, 32)  # half, (l | l+32), lane
    qh = b[:, 128:192].to(torch.int32).reshape(nb, 2, 1, 32)
    sc = b[:, 192:208].contiguous().view(torch.int8).float().reshape(nb, 2, 8)
    d = _f16(b[:, 208:210])
    lo, hi = ql & 15, ql >> 4  # quarters 0,1 from the low nibbles, 2,3 from the high ones
    nib = torch.cat([lo, hi], 2)  # [nb, half, quarter, lane]
    shift = (2 * torch.arange(4, device=b.device))[None, None, :, None]
    q = (nib | (((qh >> shift) & 3) << 4)) - 32
    # sub-block of value 128h + 32q + l is 8h + 2q + l // 16
    scale = d[:, None, None] * sc  # [nb, half, 8]
    scale = scale.reshape(nb, 2, 4, 2).repeat_interleave(16, dim=3)  # [nb, half, quarter, lane]
    return (scale * q.float()).reshape(nb, 256)


def _q4_k_decode(b: torch.Tensor) -> torch.Tensor:
    return _qk45_decode(b, False)


def _q5_k_decode(b: torch.Tensor) -> torch.Tensor:
    return _qk45_decode(b, True)

CODECS = (
    Codec(Q.Q2_K, torch_encoder=_q2_k_torch, compiled_encoder=_q2_k_numba,
          torch_decoder=_q2_k_decode, prep=_block_sum_x2_torch),
    Codec(Q.Q3_K, torch_encoder=_q3_k_torch, compiled_encoder=_q3_k_numba,
          torch_decoder=_q3_k_decode, prep=_block_sum_x2_torch),
    Codec(Q.Q4_K, torch_encoder=_q4_k_torch, compiled_encoder=_q4_k_numba,
          torch_decoder=_q4_k_decode, prep=_block_sum_x2_torch, chunk=1 << 17),
    Codec(Q.Q5_K, torch_encoder=_q5_k_torch, compiled_encoder=_q5_k_numba,
          torch_decoder=_q5_k_decode, prep=_block_sum_x2_torch),
    Codec(Q.Q6_K, torch_encoder=_q6_k_torch, compiled_encoder=_q6_k_numba,
          torch_decoder=_q6_k_decode),
)
