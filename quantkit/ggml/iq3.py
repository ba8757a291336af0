"""IQ3_XXS and IQ3_S: groups of 4 values on a 256- / 512-point grid of odd levels (numba
encoders only, bit-exact with ggml's quantize_iq3_xxs / quantize_iq3_s; decoding is gguf-py's).

Block layouts (little endian, byte offsets):

  IQ3_XXS 98 B / 256: | d f16 | grid index[64] | 8 x u32: 4 x 7 sign bits | ls << 28 |
  IQ3_S  110 B / 256: | d f16 | index low[64] | index bit 8 [8] | signs[32] | scales[4] |
        8 blocks of 32 in groups of 4 values, each a point of a 4-D grid (quantkit.ggml.grid);
        IQ3_XXS x = d*(0.5+ls)*0.5*grid*sign (the 8th sign of 8 is the parity of the 7 stored),
        IQ3_S x = d*(1+2*ls)*grid*sign.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

from quantkit.ggml.codec import Codec
from quantkit.ggml.compiled import _nint_c, _put_f16, _sq_diff
from quantkit.ggml.grid import _grid_scale_search, _parity_signs, _split_signs, grid_tables
from quantkit.ggml.jit import F32, JIT, njit

Q = GGMLQuantizationType

@njit(**JIT)
def _iq3(x2, qw, out, err, levels, kmap, neigh, values, xxs):
    """IQ3_XXS (xxs, 98 B / 256: | d f16 | grid idx[64] | 8 x u32 signs(4x7) | scale<<28 |)
    and IQ3_S (110 B / 256: | d f16 | idx lo[64] | idx bit 8 [8] | signs[32] | scales[4] |):
    quantize_row_iq3_xxs_impl / quantize_row_iq3_s_impl. Per 32 values: weights x^2 or
    qw * sqrt(sigma2 + x^2) (sigma2 = 2 * mean x^2 of the super-block), signs split off
    (IQ3_XXS flips the least important value to make each 8's sign count even, so 7 bits
    carry it), then the scale search over 31 (IQ3_XXS) / 19 (IQ3_S) trial inverse scales
    that snaps every group of 4 to the grid through kmap and its neighbour lists, keeping
    the best sumqx^2/sumq2; off-grid groups are re-snapped at the final scale. Sub-block
    scales are 4-bit odd multiples of d = max_scale/31 (stored times 1.0125 / 1.033).
    IQ3_S keeps the C's packing as is: a sub-block with max == 0 does not advance the
    index and sign write positions. The error decodes the written bytes (dequantize_row_*).
    """
    rows, k = x2.shape
    nbl = k // 256
    size = 98 if xxs else 110
    kmaxq = 8
    buf = np.empty(1, np.float32)
    weight = np.empty(32, np.float32)
    waux = np.empty(32, np.float32)
    xval = np.empty(32, np.float32)
    L = np.zeros(32, np.int64)
    Laux = np.zeros(32, np.int64)
    on = np.zeros(8, np.bool_)
    on_aux = np.zeros(8, np.bool_)
    signs = np.zeros(4, np.int64)
    scales = np.zeros(8, np.float32)
    nis = 15 if xxs else 9
    for r in range(rows):
        e = 0.0
        for ibl in range(nbl):
            xbl = x2[r, 256 * ibl:256 * ibl + 256]
            o = out[r, size * ibl:size * ibl + size]
            for j in range(size):
                o[j] = 0
            sumx2 = F32(0)
            for i in range(256):
                sumx2 += xbl[i] * xbl[i]
            sigma2 = F32(2) * sumx2 / F32(256)
            max_scale = F32(0)
            qs_at = 2  # IQ3_S: where the next sub-block's indices / signs go
            sg_at = 74
            for ib in range(8):
                xb = xbl[32 * ib:32 * ib + 32]
                for i in range(32):
                    if qw.shape[0] > 0:
                        weight[i] = qw[256 * ibl + 32 * ib + i] * np.sqrt(sigma2 + xb[i] * xb[i])
                    else:
                        weight[i] = xb[i] * xb[i]
                for i in range(32):
                    waux[i] = np.sqrt(weight[i])
                for g in range(4):
                    s = _split_signs(xb, weight, xval, 8 * g, xxs)
                    signs[g] = s & 127 if xxs else s
                mx = xval[0]
                for i in range(1, 32):
                    mx = mx if mx > xval[i] else xval[i]
                for i in range(32):
                    L[i] = 0
                if (xxs and mx < F32(1e-8)) or (not xxs and mx == 0):
                    scales[ib] = F32(0)
                    continue
                first = F32(2 * kmaxq - 1)
                scale = _grid_scale_search(xval, weight, waux, L, Laux, on, on_aux, kmap, levels, neigh, mx, 32, 4, 3, 7,
                                           first, F32(0.2), nis, xxs, xxs, buf, mx / first, False)
                if scale < 0:
                    scale = -scale
                    for g in range(4):
                        signs[g] = (~signs[g]) & (127 if xxs else 255)
                for g in range(8):
                    u = 0
                    for i in range(4):
                        u |= L[4 * g + i] << (3 * i)
                    gi = kmap[u]  # always on the grid here
                    if xxs:
                        o[2 + 8 * ib + g] = gi
                    else:
                        o[qs_at + g] = gi & 255
                        o[66 + ib] |= (gi >> 8) << g
                if xxs:
                    word = signs[0] | (signs[1] << 7) | (signs[2] << 14) | (signs[3] << 21)
                    for j in range(4):
                        o[66 + 4 * ib + j] = (word >> (8 * j)) & 255
                else:
                    qs_at += 8
                    for g in range(4):
                        o[sg_at + g] = signs[g]
                    sg_at += 4
                scales[ib] = scale
                max_scale = max(max_scale, scale)
            if max_scale == 0:
                if xxs:
                    for j in range(size):
                        o[j] = 0
                e += _iq3_block_err(o, xbl, F32(0), levels, values, xxs)
                continue
            d = max_scale / F32(31)
            d16 = _put_f16(o, 0, d * (F32(1.0125) if xxs else F32(1.033)))
            inv = F32(1) / d
            for ib in range(8):
                ls = min(max(int(_nint_c(F32(0.5) * (inv * scales[ib] - F32(1)), buf)), 0), 15)
                if xxs:
                    o[66 + 4 * ib + 3] |= ls << 4
                else:
                    o[106 + ib // 2] |= ls << (4 * (ib % 2))
            e += _iq3_block_err(o, xbl, d16, levels, values, xxs)
        err[r] += e
    return out


@njit(**JIT)
def _iq3_block_err(o, x, d, levels, values, xxs):
    """Sum of (decoded - x)^2 over one written block, decoded as dequantize_row_iq3_xxs /
    _iq3_s do: IQ3_XXS d * (0.5 + ls) * 0.5 * value, the 8th sign the parity of the 7 stored;
    IQ3_S d * (1 + 2 ls) * value, all 8 signs stored (d: the stored half's value)."""
    e = 0.0
    for ib in range(8):
        if xxs:
            word = o[66 + 4 * ib] | (o[67 + 4 * ib] << 8) | (o[68 + 4 * ib] << 16) | (o[69 + 4 * ib] << 24)
            db = d * (F32(0.5) + F32(word >> 28)) * F32(0.5)
        else:
            db = d * F32(1 + 2 * ((o[106 + ib // 2] >> (4 * (ib % 2))) & 15))
        for g in range(8):
            if xxs:
                gi = o[2 + 8 * ib + g]
                s = _parity_signs((word >> (7 * (g // 2))) & 127)
            else:
                gi = o[2 + 8 * ib + g] | (((o[66 + ib] >> g) & 1) << 8)
                s = o[74 + 4 * ib + g // 2]
            for i in range(4):
                j = 4 * (g % 2) + i
                v = db * values[levels[gi, i]]
                v = -v if (s >> j) & 1 else v
                e += _sq_diff(v, x[32 * ib + 4 * g + i])
    return e

def _iq3_xxs(x2, qw, out, err):
    levels, kmap, neigh, values = grid_tables(18)
    return _iq3(x2, qw, out, err, levels, kmap, neigh, values, True)


def _iq3_s(x2, qw, out, err):
    levels, kmap, neigh, values = grid_tables(21)
    return _iq3(x2, qw, out, err, levels, kmap, neigh, values, False)

CODECS = (
    Codec(Q.IQ3_XXS, compiled_encoder=_iq3_xxs),
    Codec(Q.IQ3_S, compiled_encoder=_iq3_s),
)
