"""IQ2_XXS, IQ2_XS and IQ2_S: groups of 8 values on a 256- / 512- / 1024-point grid (numba
encoders only, bit-exact with ggml's quantize_iq2_xxs / _xs / _s; decoding is gguf-py's).
IQ2_XXS and IQ2_XS exist only with an imatrix (ggml_quantize_requires_imatrix).

Block layouts (little endian, byte offsets):

  IQ2_S   82 B / 256: | d f16 | index low[32] | signs[32] | index bits 8-9 [8] | scales[8] |
        16 blocks of 16 in groups of 8 on a 1024-point grid; x = d*(0.5+ls)*0.25*grid*sign
  IQ2_XS  74 B / 256: | d f16 | 32 x u16: grid index (9 bits) | 7 sign bits << 9 | scales[8] |
        as IQ2_S on a 512-point grid, the 8th sign of 8 the parity of the 7 stored
  IQ2_XXS 66 B / 256: | d f16 | 8 x (grid index[4] | u32: 4 x 7 sign bits | ls << 28) |
        8 blocks of 32 in groups of 8 on a 256-point grid; x = d*(0.5+ls)*0.25*grid*sign
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

from quantkit.ggml.codec import Codec
from quantkit.ggml.compiled import _make_qp, _nint_c, _put_f16, _sq_diff
from quantkit.ggml.grid import (
    _grid_scale_search,
    _parity_signs,
    _split_signs,
    grid_tables,
    needs_qw,
)
from quantkit.ggml.jit import EPS, F32, JIT, njit

Q = GGMLQuantizationType

@njit(**JIT)
def _iq2_16(x2, qw, out, err, levels, kmap, neigh, values, xs):
    """IQ2_S (82 B / 256: | d f16 | index low[32] | signs[32] | index bits 8-9 [8] |
    scales[8] |, quantize_row_iq2_s_impl) and IQ2_XS (xs, 74 B / 256: | d f16 | 32 x u16
    index(9 bits) | 7 sign bits << 9 | scales[8] |, quantize_row_iq2_xs_impl). Per 16
    values: weights qw * sqrt(sigma2 + x^2) (sigma2: IQ2_S 2 *, IQ2_XS 1 * mean x^2 of the
    super-block; IQ2_S without an imatrix 0.25*sigma2 + x^2, IQ2_XS needs one); IQ2_S stores
    all 8 signs of each 8, IQ2_XS 7 (the least important value flipped to make the count
    even); 19 trial inverse scales (5 + 0.1 i)/max snap each 8 to the 1024- / 512-point grid
    of levels 0..2 (neighbour lists: the nearest 1 / 2 distances); 4-bit scales of d =
    max_scale/31 (IQ2_S stored times 0.9875). Decoded x = d*(0.5+ls)*0.25*grid*sign."""
    rows, k = x2.shape
    nbl = k // 256
    size = 74 if xs else 82
    sc_at = 66 if xs else 74
    buf = np.empty(1, np.float32)
    weight = np.empty(16, np.float32)
    waux = np.empty(16, np.float32)
    xval = np.empty(16, np.float32)
    L = np.zeros(16, np.int64)
    Laux = np.zeros(16, np.int64)
    on = np.zeros(2, np.bool_)
    on_aux = np.zeros(2, np.bool_)
    signs = np.zeros(2, np.int64)
    scales = np.zeros(16, np.float32)
    smask = 127 if xs else 255
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
            sigma2 = sumx2 / F32(256) if xs else F32(2) * sumx2 / F32(256)
            max_scale = F32(0)
            for ib in range(16):
                xb = xbl[16 * ib:16 * ib + 16]
                for i in range(16):
                    if qw.shape[0] > 0:
                        weight[i] = qw[256 * ibl + 16 * ib + i] * np.sqrt(sigma2 + xb[i] * xb[i])
                    else:
                        weight[i] = F32(0.25) * sigma2 + xb[i] * xb[i]
                for i in range(16):
                    waux[i] = np.sqrt(weight[i])
                for g in range(2):
                    signs[g] = _split_signs(xb, weight, xval, 8 * g, xs) & smask
                mx = xval[0]
                for i in range(1, 16):
                    mx = mx if mx > xval[i] else xval[i]
                for i in range(16):
                    L[i] = 0
                if mx < (EPS if xs else F32(1e-8)):  # GROUP_MAX_EPS / GROUP_MAX_EPS_IQ2_S
                    scales[ib] = F32(0)
                    continue
                scale = _grid_scale_search(xval, weight, waux, L, Laux, on, on_aux, kmap, levels, neigh, mx, 16, 8, 2, 2,
                                           F32(5), F32(0.1), 9, True, True, buf, mx / F32(5), False)
                if scale < 0:
                    scale = -scale
                    signs[0] = (~signs[0]) & smask
                    signs[1] = (~signs[1]) & smask
                for g in range(2):
                    u = 0
                    for i in range(8):
                        u |= L[8 * g + i] << (2 * i)
                    gi = kmap[u]  # always on the grid here
                    i8 = 2 * ib + g
                    if xs:
                        v16 = gi | (signs[g] << 9)
                        o[2 + 2 * i8] = v16 & 255
                        o[3 + 2 * i8] = v16 >> 8
                    else:
                        o[2 + i8] = gi & 255
                        o[66 + i8 // 4] |= (gi >> 8) << (2 * (i8 % 4))
                        o[34 + i8] = signs[g]
                scales[ib] = scale
                max_scale = max(max_scale, scale)
            d16 = F32(0)
            if max_scale != 0:
                d = max_scale / F32(31)
                d16 = _put_f16(o, 0, d if xs else d * F32(0.9875))
                inv = F32(1) / d
                for ib in range(16):
                    ls = min(max(int(_nint_c(F32(0.5) * (inv * scales[ib] - F32(1)), buf)), 0), 15)
                    o[sc_at + ib // 2] |= ls << (4 * (ib % 2))
            elif xs:  # the C writes no indices or signs for an all-zero-scale block
                for j in range(size):
                    o[j] = 0
            for ib in range(16):  # the error, from the written bytes (dequantize_row_iq2_s / _xs)
                db = d16 * (F32(0.5) + F32((o[sc_at + ib // 2] >> (4 * (ib % 2))) & 15)) * F32(0.25)
                for g in range(2):
                    i8 = 2 * ib + g
                    if xs:
                        v16 = o[2 + 2 * i8] | (o[3 + 2 * i8] << 8)
                        gi = v16 & 511
                        sg = _parity_signs(v16 >> 9)
                    else:
                        gi = o[2 + i8] | (((o[66 + i8 // 4] >> (2 * (i8 % 4))) & 3) << 8)
                        sg = o[34 + i8]
                    for i in range(8):
                        v = db * values[levels[gi, i]]
                        v = -v if (sg >> i) & 1 else v
                        e += _sq_diff(v, xbl[16 * ib + 8 * g + i])
        err[r] += e
    return out


@njit(**JIT)
def _iq2_xxs(x2, qw, out, err, levels, kmap, neigh, values):
    """IQ2_XXS (66 B / 256: | d f16 | 8 x (4 grid index bytes | u32: 4 x 7 sign bits |
    ls << 28) |): quantize_row_iq2_xxs_impl, imatrix required. Per 32 values: weights
    qw * sqrt(sigma2 + x^2) (sigma2 = mean x^2 of the super-block), 7 signs per 8 (the
    least important value flipped to make the count even); the scale search starts from
    make_qp_quants(nmax 4)'s scale s: 13 trial inverse scales (5 + 0.1 i)/(3 s) snap each 8
    to the 256-point grid of levels 0..2 (neighbour lists: the nearest 2 distances), then
    every group is re-snapped at the winning scale and the scale refitted. 4-bit scales of
    d = max_scale/31. Decoded x = d*(0.5+ls)*0.25*grid*sign."""
    rows, k = x2.shape
    nbl = k // 256
    buf = np.empty(1, np.float32)
    weight = np.empty(32, np.float32)
    waux = np.empty(32, np.float32)
    xval = np.empty(32, np.float32)
    L = np.zeros(32, np.int64)
    Laux = np.zeros(32, np.int64)
    Lqp = np.zeros(32, np.int64)  # make_qp_quants' levels: only its scale is used
    on = np.zeros(4, np.bool_)
    on_aux = np.zeros(4, np.bool_)
    signs = np.zeros(4, np.int64)
    scales = np.zeros(8, np.float32)
    for r in range(rows):
        e = 0.0
        for ibl in range(nbl):
            xbl = x2[r, 256 * ibl:256 * ibl + 256]
            o = out[r, 66 * ibl:66 * ibl + 66]
            for j in range(66):
                o[j] = 0
            sumx2 = F32(0)
            for i in range(256):
                sumx2 += xbl[i] * xbl[i]
            sigma2 = sumx2 / F32(256)
            max_scale = F32(0)
            for ib in range(8):
                xb = xbl[32 * ib:32 * ib + 32]
                for i in range(32):
                    weight[i] = qw[256 * ibl + 32 * ib + i] * np.sqrt(sigma2 + xb[i] * xb[i])
                for i in range(32):
                    waux[i] = np.sqrt(weight[i])
                for g in range(4):
                    signs[g] = _split_signs(xb, weight, xval, 8 * g, True) & 127
                mx = xval[0]
                for i in range(1, 32):
                    mx = mx if mx > xval[i] else xval[i]
                scales[ib] = F32(0)
                if mx < EPS:  # GROUP_MAX_EPS
                    continue
                scale = _make_qp(xval, weight, 4, Lqp)
                eff_max = scale * F32(3)
                if eff_max <= 0:
                    continue
                scale = _grid_scale_search(xval, weight, waux, L, Laux, on, on_aux, kmap, levels, neigh, eff_max, 32, 8,
                                           2, 2, F32(5), F32(0.1), 6, True, False, buf, scale, True)
                if scale < 0:
                    scale = -scale
                    for g in range(4):
                        signs[g] = (~signs[g]) & 127
                for g in range(4):
                    u = 0
                    for i in range(8):
                        u |= L[8 * g + i] << (2 * i)
                    o[2 + 8 * ib + g] = kmap[u]  # always on the grid here
                word = signs[0] | (signs[1] << 7) | (signs[2] << 14) | (signs[3] << 21)
                for j in range(4):
                    o[6 + 8 * ib + j] = (word >> (8 * j)) & 255
                scales[ib] = scale
                max_scale = max(max_scale, scale)
            if max_scale == 0:  # the C zeroes the block
                for j in range(66):
                    o[j] = 0
                d16 = F32(0)
            else:
                d = max_scale / F32(31)
                d16 = _put_f16(o, 0, d)
                inv = F32(1) / d
                for ib in range(8):
                    ls = min(max(int(_nint_c(F32(0.5) * (inv * scales[ib] - F32(1)), buf)), 0), 15)
                    o[9 + 8 * ib] |= ls << 4
            for ib in range(8):  # the error, from the written bytes (dequantize_row_iq2_xxs)
                word = o[6 + 8 * ib] | (o[7 + 8 * ib] << 8) | (o[8 + 8 * ib] << 16) | (o[9 + 8 * ib] << 24)
                db = d16 * (F32(0.5) + F32(word >> 28)) * F32(0.25)
                for g in range(4):
                    gi = o[2 + 8 * ib + g]
                    sg = _parity_signs((word >> (7 * g)) & 127)
                    for i in range(8):
                        v = db * values[levels[gi, i]]
                        v = -v if (sg >> i) & 1 else v
                        e += _sq_diff(v, xbl[32 * ib + 8 * g + i])
        err[r] += e
    return out

def _iq2_s_tables(x2, qw, out, err):
    return _iq2_16(x2, qw, out, err, *grid_tables(22), False)

def _iq2_xs_tables(x2, qw, out, err):
    needs_qw("IQ2_XS", qw)
    return _iq2_16(x2, qw, out, err, *grid_tables(17), True)


def _iq2_xxs_tables(x2, qw, out, err):
    needs_qw("IQ2_XXS", qw)
    return _iq2_xxs(x2, qw, out, err, *grid_tables(16))

CODECS = (
    Codec(Q.IQ2_XXS, compiled_encoder=_iq2_xxs_tables),
    Codec(Q.IQ2_XS, compiled_encoder=_iq2_xs_tables),
    Codec(Q.IQ2_S, compiled_encoder=_iq2_s_tables),
)
