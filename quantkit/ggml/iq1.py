"""IQ1_S and IQ1_M: groups of 8 values on the 2048-point grid of {-1, 0, 1}, shifted by +-1/8
(numba encoders only, bit-exact with ggml's quantize_iq1_s / quantize_iq1_m; decoding is
gguf-py's). IQ1_S exists only with an imatrix; IQ1_M weights by x^2 without one, as ggml.

Block layouts (little endian, byte offsets):

  IQ1_S   50 B / 256: | d f16 | index low[32] | 8 x u16: 4 x 3 index bits | ls << 12 | sign << 15 |
  IQ1_M   56 B / 256: | index low[32] | qh[16]: 2 x (3 index bits | sign << 3) | 4 x u16 scales |
        groups of 8 on the 2048-point grid of {-1, 0, 1} (iq1s_grid), x = d*(2ls+1)*(grid+delta),
        delta = -1/8 where the sign bit is set, else 1/8. IQ1_S: 8 blocks of 32, one delta
        each; IQ1_M: 16 blocks of 16 (3-bit ls, 4 per u16), a delta per 8, and the fp16 d in
        the top nibbles of the 4 scale words (bits 0-3 of d in word 0, ..., 12-15 in word 3).
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

from quantkit.ggml.codec import Codec
from quantkit.ggml.compiled import _half_value, _nint_c, _put_f16, _sq_diff, fp16_bits
from quantkit.ggml.grid import grid_tables, needs_qw
from quantkit.ggml.jit import F32, JIT, njit

Q = GGMLQuantizationType

FLT_MAX = F32(3.4028234663852886e38)
IQ1_DELTA = F32(0.125)  # IQ1S_DELTA = IQ1M_DELTA: the grid's shift, +-1/8 of a step


@njit(inline="always", **JIT)
def _iq1_shifted(sign):
    """The three values a {-1, 0, 1} level decodes to with the grid shifted by sign * 1/8."""
    xx = np.empty(3, np.float32)
    xx[0] = F32(-1) + F32(sign) * IQ1_DELTA
    xx[1] = F32(sign) * IQ1_DELTA
    xx[2] = F32(1) + F32(sign) * IQ1_DELTA
    return xx


@njit(inline="always", **JIT)
def _sort_index(xb, n, idx):
    """idx[:n] = the indices of xb[:n] by ascending value, equal values in index order: the C
    qsorts (value, index) pairs comparing the value only, and glibc's qsort is a stable merge
    sort on arrays this small."""
    for j in range(n):
        v = xb[j]
        p = j
        while p > 0 and xb[idx[p - 1]] > v:
            idx[p] = idx[p - 1]
            p -= 1
        idx[p] = j


@njit(inline="always", **JIT)
def _iq1_split(n, idx, L, i1, i2):
    """Levels of a 3-group split of the sorted values: 0 below i1, 1 up to i2, 2 above."""
    for j in range(n):
        L[idx[j]] = 0 if j < i1 else (1 if j < i2 else 2)


@njit(inline="always", **JIT)
def _iq1_snap(xb, weight, L, base, scale, xx, kmap, levels, neigh):
    """Grid index of the 8 levels L[base:base+8]; off the grid, the listed neighbour of least
    weighted error with the levels decoded through xx at `scale` (iq1_find_best_neighbour2,
    the first on ties), whose levels replace L's. Returns (index, whether it was on the grid)."""
    u = 0
    for j in range(8):
        u |= L[base + j] << (2 * j)
    gi = kmap[u]
    if gi >= 0:
        return gi, True
    at = -gi - 1
    best_d2 = FLT_MAX
    for j in range(at + 1, at + 1 + neigh[at]):
        g = neigh[j]
        d2 = F32(0)
        for i in range(8):
            diff = scale * xx[levels[g, i]] - xb[base + i]
            d2 += weight[base + i] * diff * diff
        if d2 < best_d2:
            best_d2 = d2
            gi = g
    for i in range(8):
        L[base + i] = levels[gi, i]
    return gi, False


@njit(inline="always", **JIT)
def _iq1_refit(xb, weight, L, xx0, xx1, n):
    """sum w*x*q, sum w*q^2 over n values whose levels are L, groups of 8 decoded through xx0
    (the first 8) and xx1 (the rest): the scale refitted after snapping to the grid."""
    sumqx = F32(0)
    sumq2 = F32(0)
    for i in range(n):
        q = xx0[L[i]] if i < 8 else xx1[L[i]]
        sumqx += weight[i] * q * xb[i]
        sumq2 += weight[i] * q * q
    return sumqx, sumq2


@njit(**JIT)
def _iq1_s(x2, qw, out, err, levels, kmap, neigh, values):
    """IQ1_S (50 B / 256: | d f16 | grid index low[32] | 8 x u16 qh: 4 x 3 index bits |
    ls << 12 | delta sign << 15 |): quantize_row_iq1_s_impl, imatrix required. Per 32 values:
    weights qw * sqrt(sigma2 + x^2) (sigma2 = 2 * mean x^2 of the super-block); the values,
    sorted, are split every possible way into 3 groups decoded as -1, 0, 1 shifted by +1/8 or
    -1/8, keeping the split of the best sumqx^2 / sumq2; each 8 is snapped to the 2048-point
    grid (neighbour lists: the nearest 3 distances) and the scale refitted when one moved.
    3-bit scales of d = max_scale/15, stored as d * 1.125. x = d*(2ls+1)*(grid + delta)."""
    rows, k = x2.shape
    nbl = k // 256
    buf = np.empty(1, np.float32)
    xp = _iq1_shifted(1)
    xm = _iq1_shifted(-1)
    weight = np.empty(32, np.float32)
    sumx = np.zeros(33, np.float32)
    sumw = np.zeros(33, np.float32)
    idx = np.zeros(32, np.int64)
    L = np.zeros(32, np.int64)
    index = np.zeros(4, np.int64)
    scales = np.zeros(8, np.float32)
    shifts = np.zeros(8, np.int64)
    for r in range(rows):
        e = 0.0
        for ibl in range(nbl):
            xbl = x2[r, 256 * ibl:256 * ibl + 256]
            o = out[r, 50 * ibl:50 * ibl + 50]
            for j in range(50):
                o[j] = 0
            sumx2 = F32(0)
            for i in range(256):
                sumx2 += xbl[i] * xbl[i]
            sigma2 = F32(2) * sumx2 / F32(256)
            max_scale = F32(0)
            for ib in range(8):
                xb = xbl[32 * ib:32 * ib + 32]
                for i in range(32):
                    weight[i] = qw[256 * ibl + 32 * ib + i] * np.sqrt(sigma2 + xb[i] * xb[i])
                mx = abs(xb[0])
                for i in range(1, 32):
                    mx = mx if mx > abs(xb[i]) else abs(xb[i])
                scales[ib] = F32(0)
                shifts[ib] = 1
                if mx < F32(1e-12):  # GROUP_MAX_EPS_IQ1_S
                    continue
                _sort_index(xb, 32, idx)
                for j in range(32):
                    i = idx[j]
                    sumx[j + 1] = sumx[j] + weight[i] * xb[i]
                    sumw[j + 1] = sumw[j] + weight[i]
                best = -FLT_MAX
                scale = mx
                b1 = -1
                b2 = -1
                bshift = 0
                for i1 in range(33):
                    for i2 in range(i1, 33):
                        a = sumx[i1] - sumx[0]
                        b = sumx[i2] - sumx[i1]
                        c = sumx[32] - sumx[i2]
                        aw = sumw[i1] - sumw[0]
                        bw = sumw[i2] - sumw[i1]
                        cw = sumw[32] - sumw[i2]
                        sumqx = a * xp[0] + b * xp[1] + c * xp[2]
                        sumq2 = aw * xp[0] * xp[0] + bw * xp[1] * xp[1] + cw * xp[2] * xp[2]
                        if sumq2 > 0 and sumqx * sumqx > best * sumq2:
                            scale = sumqx / sumq2
                            best = scale * sumqx
                            b1, b2, bshift = i1, i2, 1
                        sumqx = a * xm[0] + b * xm[1] + c * xm[2]
                        sumq2 = aw * xm[0] * xm[0] + bw * xm[1] * xm[1] + cw * xm[2] * xm[2]
                        if sumq2 > 0 and sumqx * sumqx > best * sumq2:
                            scale = sumqx / sumq2
                            best = scale * sumqx
                            b1, b2, bshift = i1, i2, -1
                if b1 < 0 or b2 < 0 or bshift == 0:
                    continue
                _iq1_split(32, idx, L, b1, b2)
                if scale < 0:
                    for j in range(32):
                        L[j] = 2 - L[j]
                    scale = -scale
                    bshift = -bshift
                xx = xp if bshift == 1 else xm
                on = True
                for g in range(4):
                    gi, on_g = _iq1_snap(xb, weight, L, 8 * g, scale, xx, kmap, levels, neigh)
                    index[g] = gi
                    on = on and on_g
                if not on:
                    sumqx, sumq2 = _iq1_refit(xb, weight, L, xx, xx, 32)
                    if sumqx > 0 and sumq2 > 0:
                        scale = sumqx / sumq2
                h = 0
                for g in range(4):
                    o[2 + 4 * ib + g] = index[g] & 255
                    h |= (index[g] >> 8) << (3 * g)
                o[34 + 2 * ib] = h & 255
                o[35 + 2 * ib] = h >> 8
                scales[ib] = scale
                shifts[ib] = bshift
                max_scale = max_scale if max_scale > scale else scale
            d16 = F32(0)
            if max_scale != 0:
                d = max_scale / F32(15)
                d16 = _put_f16(o, 0, d * F32(1.125))
                inv = F32(1) / d
                for ib in range(8):
                    ls = min(max(int(_nint_c(F32(0.5) * (inv * scales[ib] - F32(1)), buf)), 0), 7)
                    if shifts[ib] == -1:
                        ls |= 8
                    o[35 + 2 * ib] |= ls << 4
            for ib in range(8):  # the error, from the written bytes (dequantize_row_iq1_s)
                qh = o[34 + 2 * ib] | (o[35 + 2 * ib] << 8)
                dl = d16 * F32(2 * ((qh >> 12) & 7) + 1)
                delta = -IQ1_DELTA if qh & 0x8000 else IQ1_DELTA
                for g in range(4):
                    gi = o[2 + 4 * ib + g] | (((qh >> (3 * g)) & 7) << 8)
                    for i in range(8):
                        e += _sq_diff(dl * (values[levels[gi, i]] + delta), xbl[32 * ib + 8 * g + i])
        err[r] += e
    return out


@njit(**JIT)
def _iq1_m(x2, qw, out, err, levels, kmap, neigh, values):
    """IQ1_M (56 B / 256: | grid index low[32] | qh[16]: per 8 values 3 index bits | delta
    sign << 3 | scales: 4 x u16 of 4 x 3-bit ls, the fp16 d in their top nibbles |):
    quantize_row_iq1_m_impl. As IQ1_S per 16 values, except that each 8 of a 16 has its own
    delta sign (4 sign pairs searched per split), the weights without an imatrix are x^2, and
    d is refitted over the whole super-block after the 3-bit scales are fixed (stored as
    d * 1.1125). x = d*(2ls+1)*(grid + delta)."""
    rows, k = x2.shape
    nbl = k // 256
    buf = np.empty(1, np.float32)
    xp = _iq1_shifted(1)
    xm = _iq1_shifted(-1)
    p2 = xp[2]
    m2 = xm[2]
    cp1 = xp[0] * xp[0] - xp[1] * xp[1]
    cp2 = xp[1] * xp[1] - xp[2] * xp[2]
    cm1 = xm[0] * xm[0] - xm[1] * xm[1]
    cm2 = xm[1] * xm[1] - xm[2] * xm[2]
    weight = np.empty(16, np.float32)
    px = np.zeros((2, 17), np.float32)
    pw = np.zeros((2, 17), np.float32)
    idx = np.zeros(16, np.int64)
    L = np.zeros(16, np.int64)
    index = np.zeros(2, np.int64)
    scales = np.zeros(16, np.float32)
    shifts = np.zeros(16, np.int64)
    sc = np.zeros(4, np.int64)
    for r in range(rows):
        e = 0.0
        for ibl in range(nbl):
            xbl = x2[r, 256 * ibl:256 * ibl + 256]
            o = out[r, 56 * ibl:56 * ibl + 56]
            for j in range(56):
                o[j] = 0
            sumx2 = F32(0)
            for i in range(256):
                sumx2 += xbl[i] * xbl[i]
            sigma2 = F32(2) * sumx2 / F32(256)
            max_scale = F32(0)
            for ib in range(16):
                xb = xbl[16 * ib:16 * ib + 16]
                for i in range(16):
                    if qw.shape[0] > 0:
                        weight[i] = qw[256 * ibl + 16 * ib + i] * np.sqrt(sigma2 + xb[i] * xb[i])
                    else:
                        weight[i] = xb[i] * xb[i]
                mx = abs(xb[0])
                for i in range(1, 16):
                    mx = mx if mx > abs(xb[i]) else abs(xb[i])
                scales[ib] = F32(0)
                shifts[ib] = 0
                if mx < F32(1e-7):  # GROUP_MAX_EPS_IQ1_M
                    continue
                _sort_index(xb, 16, idx)
                for j in range(16):  # prefix sums per half: each half has its own shift
                    i = idx[j]
                    h = 0 if i < 8 else 1
                    px[h, j + 1] = px[h, j] + weight[i] * xb[i]
                    px[1 - h, j + 1] = px[1 - h, j]
                    pw[h, j + 1] = pw[h, j] + weight[i]
                    pw[1 - h, j + 1] = pw[1 - h, j]
                tx0, tx1, tw0, tw1 = px[0, 16], px[1, 16], pw[0, 16], pw[1, 16]
                best = -FLT_MAX
                scale = mx
                b1 = -1
                b2 = -1
                bk = -1
                for i1 in range(17):
                    for i2 in range(i1, 17):
                        sx0 = px[0, i1] + px[0, i2]
                        sx1 = px[1, i1] + px[1, i2]
                        qxp0 = tx0 * p2 - sx0
                        qxm0 = tx0 * m2 - sx0
                        qxp1 = tx1 * p2 - sx1
                        qxm1 = tx1 * m2 - sx1
                        q2p0 = tw0 * p2 * p2 + pw[0, i1] * cp1 + pw[0, i2] * cp2
                        q2m0 = tw0 * m2 * m2 + pw[0, i1] * cm1 + pw[0, i2] * cm2
                        q2p1 = tw1 * p2 * p2 + pw[1, i1] * cp1 + pw[1, i2] * cp2
                        q2m1 = tw1 * m2 * m2 + pw[1, i1] * cm1 + pw[1, i2] * cm2
                        for kk in range(4):  # first half +/-, second half +/-
                            sumqx = (qxp0 if kk < 2 else qxm0) + (qxp1 if kk % 2 == 0 else qxm1)
                            sumq2 = (q2p0 if kk < 2 else q2m0) + (q2p1 if kk % 2 == 0 else q2m1)
                            if sumq2 > 0 and sumqx * sumqx > best * sumq2:
                                scale = sumqx / sumq2
                                best = scale * sumqx
                                b1, b2, bk = i1, i2, kk
                if b1 < 0 or b2 < 0 or bk < 0:
                    continue
                _iq1_split(16, idx, L, b1, b2)
                if scale < 0:
                    for j in range(16):
                        L[j] = 2 - L[j]
                    scale = -scale
                    bk = 3 - bk
                xx0 = xp if bk < 2 else xm
                xx1 = xp if bk % 2 == 0 else xm
                on = True
                for g in range(2):
                    gi, on_g = _iq1_snap(xb, weight, L, 8 * g, scale, xx0 if g == 0 else xx1, kmap, levels, neigh)
                    index[g] = gi
                    on = on and on_g
                if not on:
                    sumqx, sumq2 = _iq1_refit(xb, weight, L, xx0, xx1, 16)
                    if sumqx > 0 and sumq2 > 0:
                        scale = sumqx / sumq2
                o[2 * ib] = index[0] & 255
                o[2 * ib + 1] = index[1] & 255
                o[32 + ib] = (index[0] >> 8) | ((index[1] >> 8) << 4)
                scales[ib] = scale
                shifts[ib] = bk
                max_scale = max_scale if max_scale > scale else scale
            if max_scale == 0:
                continue  # all zero: the C leaves the block as it cleared it
            d = max_scale / F32(15)
            inv = F32(1) / d
            sumqx = F32(0)
            sumq2 = F32(0)
            for j in range(4):
                sc[j] = 0
            for ib in range(16):
                ls = min(max(int(_nint_c(F32(0.5) * (inv * scales[ib] - F32(1)), buf)), 0), 7)
                sc[ib // 4] |= ls << (3 * (ib % 4))
                o[32 + ib] |= (0x80 if shifts[ib] % 2 else 0) | (0x08 if shifts[ib] >= 2 else 0)
                xb = xbl[16 * ib:16 * ib + 16]
                for g in range(2):
                    xx = xp if ((shifts[ib] < 2) if g == 0 else (shifts[ib] % 2 == 0)) else xm
                    gi = o[2 * ib + g] + ((o[32 + ib] << (8 - 4 * g)) & 0x700)
                    for i in range(8):
                        j = 8 * g + i
                        w = qw[256 * ibl + 16 * ib + j] * np.sqrt(sigma2 + xb[j] * xb[j]) if qw.shape[0] > 0 \
                            else xb[j] * xb[j]
                        q = xx[levels[gi, i]] * F32(2 * ls + 1)
                        sumqx += w * q * xb[j]
                        sumq2 += w * q * q
            if sumq2 > 0:
                d = sumqx / sumq2
            bits, _ = fp16_bits(d * F32(1.1125))
            for j in range(4):
                sc[j] |= ((bits >> (4 * j)) & 15) << 12
                o[48 + 2 * j] = sc[j] & 255
                o[49 + 2 * j] = sc[j] >> 8
        for ibl in range(nbl):  # the error, from the written bytes (dequantize_row_iq1_m)
            o = out[r, 56 * ibl:56 * ibl + 56]
            u16 = 0
            for j in range(4):
                u16 |= ((o[49 + 2 * j] >> 4) & 15) << (4 * j)
            dh = _half_value(u16)
            for ib in range(16):
                w16 = o[48 + 2 * (ib // 4)] | (o[49 + 2 * (ib // 4)] << 8)
                dl = dh * F32(2 * ((w16 >> (3 * (ib % 4))) & 7) + 1)
                for g in range(2):
                    qh = o[32 + ib] >> (4 * g)
                    delta = -IQ1_DELTA if qh & 8 else IQ1_DELTA
                    gi = o[2 * ib + g] | ((qh & 7) << 8)
                    for i in range(8):
                        e += _sq_diff(dl * (values[levels[gi, i]] + delta), x2[r, 256 * ibl + 16 * ib + 8 * g + i])
        err[r] += e
    return out

def _iq1_s_tables(x2, qw, out, err):
    needs_qw("IQ1_S", qw)
    return _iq1_s(x2, qw, out, err, *grid_tables(19))


def _iq1_m_tables(x2, qw, out, err):  # ggml's IQ1_M runs without an imatrix (weights x^2)
    return _iq1_m(x2, qw, out, err, *grid_tables(29))

CODECS = (
    Codec(Q.IQ1_S, compiled_encoder=_iq1_s_tables),
    Codec(Q.IQ1_M, compiled_encoder=_iq1_m_tables),
)
