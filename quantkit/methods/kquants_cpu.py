"""GGML block encoders compiled for the CPU (numba), bit-exact with ggml-quants.c.

The torch encoders (kquants_encode.py) vectorise across blocks and so run on a GPU, but on a
CPU each value goes through ~300 array passes. Here the loops are compiled once by numba
(cached on disk) and the same bytes come out 5-50x faster.

The scale searches (make_qkx / make_qx) walk each sub-block's 16 or 32 values with float32
sums whose order must stay the C order, so one sub-block is one serial chain. Different
sub-blocks are independent, so the searches take a whole row at once, transposed to
[element, sub-block]: the innermost loop runs across sub-blocks ("lanes") and compiles to
SIMD, while each lane still adds its values in element order.

Float rules that keep the bytes equal to llama.cpp's (the C is built without FMA):
* every value is float32 and every literal a float32 constant (an int or a Python float in
  an expression would promote it to float64 and change the rounding);
* sums run in element order, products left to right, as the C loops write them;
* `nearest_int` is C's float trick: round half to even, -2^22 for +-inf, 0 for NaN (`_nint`);
  Q8_0's `roundf` is half away from zero;
* C's uint8_t / int8_t stores wrap (`& 255`), which matters only in degenerate blocks.

Each encoder also adds every row's squared reconstruction error (decoded as
dequantize_row_* does) to `err`, so callers get the error without decoding the bytes again.
Block layouts are drawn in kquants_encode.py.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from quantkit.methods.kquants_grid import grid_tables
from quantkit.methods.kquants_math import IQ4NL_VALUES as IQ4NL_LEVELS

__all__ = ["ENCODERS", "SLICE_ENCODERS", "fp16_bits", "row_sigma2"]

F32 = np.float32
EPS = F32(1e-15)  # GROUP_MAX_EPS
_JIT = {"cache": True, "nogil": True, "error_model": "numpy", "boundscheck": False}


@njit(**_JIT)
def fp16_bits(v):
    """float32 -> (IEEE half bits, its float32 value), round to nearest even (as F16C)."""
    if v != v:
        return 0x7E00, F32(np.nan)
    a = abs(float(v))
    sign = 0x8000 if math.copysign(1.0, v) < 0 else 0
    if a >= 65520.0:
        bits = 0x7C00
    elif a < 6.103515625e-05:  # 2**-14: subnormal halves, steps of 2**-24
        bits = int(np.rint(a * 16777216.0))
    else:
        e = math.frexp(a)[1] - 1  # a = m * 2**e, 1 <= m < 2
        q = int(np.rint(math.ldexp(a, 10 - e)))  # 1024..2048 (2048 carries into e + 1)
        bits = ((e + 15) << 10) + q - 1024
    ex, mant = bits >> 10, bits & 1023
    if ex == 31:
        val = math.inf
    elif ex == 0:
        val = mant * 5.960464477539063e-08
    else:
        val = math.ldexp(1024 + mant, ex - 25)
    return bits | sign, F32(-val if sign else val)


@njit(**_JIT)
def _put_f16(o, at, v):
    """Write v as fp16 at o[at:at+2]; returns the float32 value of that half."""
    bits, val = fp16_bits(v)
    o[at] = bits & 255
    o[at + 1] = bits >> 8
    return val


@njit(**_JIT)
def _nint(v):
    """C's nearest_int as a float32: round half to even; -2^22 for +-inf, 0 for NaN.

    Selects, not branches, so the lane loops stay SIMD; |v| > 2^22 never occurs here.
    """
    r = np.rint(v)
    r = r if abs(v) <= F32(4194303) else F32(-4194304)
    return r if v == v else F32(0)


@njit(**_JIT)
def _clamp(v, lo, hi):
    return min(max(v, lo), hi)


@njit(**_JIT)
def _sq_diff(y, x):
    """(y - x)^2 in float64: one value's share of a row's squared reconstruction error."""
    e = float(y) - float(x)
    return e * e


@njit(**_JIT)
def _roundf(v):
    """C roundf: half away from zero (v - trunc(v) is exact in float32)."""
    t = np.trunc(v)
    return int(t) + (0 if abs(v - t) < F32(0.5) else (1 if v > 0 else -1))


@njit(**_JIT)
def _lanes(x, n, out):
    """out[i, g] = x[g*n + i]: a row's sub-blocks of n values as lanes."""
    for g in range(out.shape[1]):
        for i in range(n):
            out[i, g] = x[g * n + i]


# ----------------------------------------------------------------- scale searches, per lane


@njit(**_JIT)
def _make_qkx(xt, wt, nmax, rmin, rdelta, nstep, scale, the_min, Lt, mad=False):
    """make_qkx2_quants / make_qkx3_quants (the same when weights are given), every lane.

    xt, wt [n, G]: values and weights of G sub-blocks. Writes scale[G], the_min[G] (= -min)
    and Lt [n, G] codes in [0, nmax]; mad: errors are w*|diff| (Q2_K's use_mad), else w*diff^2.
    A candidate inverse scale replaces the best only when
    its weighted error is strictly smaller, and the running min feeds the next candidate, as
    in C; the winner's codes are recomputed at the end from its (iscale, min).
    """
    n, G = xt.shape
    mn = np.empty(G, np.float32)
    mx = np.empty(G, np.float32)
    sum_w = np.empty(G, np.float32)
    sum_x = np.empty(G, np.float32)
    best = np.zeros(G, np.float32)
    iscale = np.empty(G, np.float32)
    best_is = np.empty(G, np.float32)
    best_mn = np.empty(G, np.float32)
    s_l = np.empty(G, np.float32)
    s_l2 = np.empty(G, np.float32)
    s_xl = np.empty(G, np.float32)
    t_scale = np.empty(G, np.float32)
    t_min = np.empty(G, np.float32)
    take = np.empty(G, np.bool_)
    flat = np.empty(G, np.bool_)
    laux = np.empty((n, G), np.float32)
    fnmax = F32(nmax)
    for g in range(G):
        mn[g] = xt[0, g]
        mx[g] = xt[0, g]
        sum_w[g] = wt[0, g]
        sum_x[g] = wt[0, g] * xt[0, g]
    for i in range(1, n):
        for g in range(G):
            v = xt[i, g]
            mn[g] = v if v < mn[g] else mn[g]
            mx[g] = v if v > mx[g] else mx[g]
            sum_w[g] += wt[i, g]
            sum_x[g] += wt[i, g] * v
    for g in range(G):
        mn[g] = F32(0) if mn[g] > 0 else mn[g]
        span = mx[g] - mn[g]
        flat[g] = not (span > 0)  # max == min: C returns scale 0, codes 0, -min at once
        iscale[g] = fnmax / (span if span > 0 else F32(1))
        scale[g] = F32(1) / iscale[g]
        best_is[g] = iscale[g]
        best_mn[g] = mn[g]
    for i in range(n):
        for g in range(G):
            li = _clamp(_nint(iscale[g] * (xt[i, g] - mn[g])), F32(0), fnmax)
            diff = scale[g] * li + mn[g] - xt[i, g]
            best[g] += wt[i, g] * (abs(diff) if mad else diff * diff)
    for step in range(nstep + 1):
        num = rmin + rdelta * F32(step) + fnmax
        for g in range(G):
            iscale[g] = num / (mx[g] - mn[g])
            s_l[g] = F32(0)
            s_l2[g] = F32(0)
            s_xl[g] = F32(0)
        for i in range(n):
            for g in range(G):
                li = _clamp(_nint(iscale[g] * (xt[i, g] - mn[g])), F32(0), fnmax)
                laux[i, g] = li
                wl = wt[i, g] * li
                s_l[g] += wl
                s_l2[g] += wl * li
                s_xl[g] += wl * xt[i, g]
        for g in range(G):
            D = sum_w[g] * s_l2[g] - s_l[g] * s_l[g]
            this_scale = (sum_w[g] * s_xl[g] - sum_x[g] * s_l[g]) / D
            this_min = (s_l2[g] * sum_x[g] - s_l[g] * s_xl[g]) / D
            pos = this_min > 0
            t_scale[g] = s_xl[g] / s_l2[g] if pos else this_scale
            t_min[g] = F32(0) if pos else this_min
            take[g] = D > 0
            s_l[g] = F32(0)  # reused as the candidate's error
        for i in range(n):
            for g in range(G):
                diff = t_scale[g] * laux[i, g] + t_min[g] - xt[i, g]
                s_l[g] += wt[i, g] * (abs(diff) if mad else diff * diff)
        for g in range(G):
            if take[g] and s_l[g] < best[g]:
                best[g] = s_l[g]
                scale[g] = t_scale[g]
                best_is[g] = iscale[g]
                best_mn[g] = mn[g]
                mn[g] = t_min[g]
    for i in range(n):
        for g in range(G):
            Lt[i, g] = _clamp(_nint(best_is[g] * (xt[i, g] - best_mn[g])), F32(0), fnmax)
    for g in range(G):
        the_min[g] = -(best_mn[g] if flat[g] else mn[g])
        if flat[g]:
            scale[g] = F32(0)
            for i in range(n):
                Lt[i, g] = F32(0)


@njit(**_JIT)
def _make_qx(xt, wt, use_w, nmax, scale, Lt):
    """make_qx_quants, rmse_type 1 (weights wt when use_w, else x^2), every lane.

    Writes scale[G] and Lt [n, G] codes in [0, 2*nmax); an all-zero lane gets 0 and L = 0.
    The 19 candidates are independent; only the choice among them is sequential.
    """
    n, G = xt.shape
    amax = np.zeros(G, np.float32)
    mx = np.zeros(G, np.float32)
    iscale = np.empty(G, np.float32)
    best_is = np.empty(G, np.float32)
    best = np.empty(G, np.float32)
    sumlx = np.empty(G, np.float32)
    suml2 = np.empty(G, np.float32)
    fnmax = F32(nmax)
    for i in range(n):
        for g in range(G):
            ax = abs(xt[i, g])
            big = ax > amax[g]
            amax[g] = ax if big else amax[g]
            mx[g] = xt[i, g] if big else mx[g]
    for g in range(G):
        mx[g] = mx[g] if amax[g] >= EPS else F32(1)  # all-zero lanes: finished below
    for c in range(19):
        step = c - 10 if c <= 9 else c - 9  # c = 0: the plain -nmax/max; then -9..-1, 1..9
        for g in range(G):
            if c == 0:
                iscale[g] = -fnmax / mx[g]
            else:
                iscale[g] = -(fnmax + F32(0.1) * F32(step)) / mx[g]
            sumlx[g] = F32(0)
            suml2[g] = F32(0)
        for i in range(n):
            for g in range(G):
                x = xt[i, g]
                w = wt[i, g] if use_w else x * x
                li = _clamp(_nint(iscale[g] * x), -fnmax, fnmax - F32(1))
                sumlx[g] += w * x * li
                suml2[g] += w * li * li
        for g in range(G):
            if c == 0:
                scale[g] = sumlx[g] / suml2[g] if suml2[g] != 0 else F32(0)
                best[g] = scale[g] * sumlx[g]
                best_is[g] = iscale[g]
            elif suml2[g] > 0 and sumlx[g] * sumlx[g] > best[g] * suml2[g]:
                best_is[g] = iscale[g]
                scale[g] = sumlx[g] / suml2[g]
                best[g] = scale[g] * sumlx[g]
    for i in range(n):
        for g in range(G):
            li = _clamp(_nint(best_is[g] * xt[i, g]), -fnmax, fnmax - F32(1)) + fnmax
            Lt[i, g] = li if amax[g] >= EPS else F32(0)
    for g in range(G):
        scale[g] = scale[g] if amax[g] >= EPS else F32(0)


@njit(**_JIT)
def _make_qp(x, w, nmax, L):
    """make_qp_quants: non-negative x ~ scale * L, L a uint8 in [0, nmax]; returns the scale."""
    n = x.shape[0]
    mx = F32(0)
    for i in range(n):
        mx = max(mx, x[i])
    if mx < EPS:
        for i in range(n):
            L[i] = 0
        return F32(0)
    fnmax = F32(nmax)
    iscale = fnmax / mx
    for i in range(n):
        L[i] = int(_nint(iscale * x[i])) & 255
    scale = F32(1) / iscale
    best = F32(0)
    for i in range(n):
        diff = x[i] - scale * F32(L[i])
        best += w[i] * diff * diff
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_is = (F32(0.1) * F32(step) + fnmax) / mx
        scale_is = F32(1) / iscale_is
        mse = F32(0)
        for i in range(n):
            li = min(fnmax, _nint(iscale_is * x[i]))
            diff = x[i] - scale_is * li
            mse += w[i] * diff * diff
        if mse < best:
            best = mse
            iscale = iscale_is
    sumlx = F32(0)
    suml2 = F32(0)
    for i in range(n):
        li = min(fnmax, _nint(iscale * x[i]))
        L[i] = int(li) & 255  # uint8_t store; the sums use the int
        sumlx += w[i] * x[i] * li
        suml2 += w[i] * li * li
    for _ in range(5):
        changed = 0
        for i in range(n):
            fl = F32(L[i])
            slx = sumlx - w[i] * x[i] * fl
            sl2 = suml2 - w[i] * fl * fl
            if slx > 0 and sl2 > 0:
                new_l = min(fnmax, _nint(x[i] * sl2 / slx))
                if new_l != fl:
                    slx += w[i] * x[i] * new_l
                    sl2 += w[i] * new_l * new_l
                    if slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = int(new_l) & 255
                        sumlx = slx
                        suml2 = sl2
                        changed += 1
        if changed == 0:
            break
    return sumlx / suml2 if suml2 > 0 else F32(0)


@njit(**_JIT)
def _row_sigma2(x):
    """sum(x^2) / K of one row, in column order (the legacy types' imatrix weighting)."""
    s = F32(0)
    for j in range(x.shape[0]):
        s += x[j] * x[j]
    return s / F32(x.shape[0])


@njit(**_JIT)
def _imatrix_lanes(xt, qw, sigma2, wt):
    """wt[i, g] = qw[g*n + i] * sqrt(sigma2 + x^2): the legacy types' imatrix weights."""
    n, G = xt.shape
    for g in range(G):
        for i in range(n):
            wt[i, g] = qw[g * n + i] * np.sqrt(sigma2 + xt[i, g] * xt[i, g])


@njit(**_JIT)
def _put_qh_qs(o, at, L):
    """Q5_0/Q5_1 tail: qh (bit 4 of 32 codes, little-endian u32) then 16 nibble bytes."""
    qh = 0
    for j in range(16):
        a, b = L[j] & 255, L[j + 16] & 255
        o[at + 4 + j] = (a & 15) | ((b & 15) << 4)
        qh |= ((a & 16) >> 4) << j
        qh |= ((b & 16) >> 4) << (j + 16)
    for k in range(4):
        o[at + k] = (qh >> (8 * k)) & 255


# ----------------------------------------------------------------- 32-wide blocks


@njit(**_JIT)
def _q8_0(x2, qw, out, err):
    rows, k = x2.shape
    for r in range(rows):
        e = 0.0  # the row's squared error, summed in a register (not through err[r])
        for b in range(k // 32):
            x = x2[r, 32 * b:32 * b + 32]
            o = out[r, 34 * b:34 * b + 34]
            amax = F32(0)
            for j in range(32):
                amax = max(amax, abs(x[j]))
            d = amax / F32(127)
            inv = F32(1) / d if d != 0 else F32(0)
            d16 = _put_f16(o, 0, d)
            for j in range(32):
                o[2 + j] = _roundf(x[j] * inv) & 255
            for j in range(32):  # its own loop: fused with the one above, neither is SIMD
                e += _sq_diff(F32(np.int8(o[2 + j])) * d16, x[j])
        err[r] += e
    return out


@njit(**_JIT)
def _legacy_sym(x2, qw, out, err, nmax, size, sigma2):
    """Q4_0 (nmax 8, 18 B) / Q5_0 (nmax 16, 22 B): d = max / -nmax, codes in [0, 2*nmax).
    `sigma2` [rows] (or empty: each row's own) is the imatrix weighting's sum(x^2)/K."""
    rows, k = x2.shape
    nb = k // 32
    use_w = qw.shape[0] > 0
    L = np.empty(32, np.int64)
    xt = np.empty((32, nb), np.float32)
    wt = np.empty((32, nb), np.float32)
    Lt = np.empty((32, nb), np.float32)
    ds = np.empty(nb, np.float32)
    fnmax = F32(nmax)
    half = fnmax + F32(0.5)
    for r in range(rows):
        e = 0.0
        xr = x2[r]
        if use_w:  # quantize_row_q*_0_impl: make_qx_quants per block, weighted
            _lanes(xr, 32, xt)
            _imatrix_lanes(xt, qw, sigma2[r] if sigma2.shape[0] else _row_sigma2(xr), wt)
            _make_qx(xt, wt, True, nmax, ds, Lt)
        for b in range(nb):
            x = xr[32 * b:32 * b + 32]
            o = out[r, size * b:size * b + size]
            if use_w:
                d = ds[b]
                for j in range(32):
                    L[j] = int(Lt[j, b])
            else:
                amax = F32(0)
                mx = F32(0)
                for j in range(32):
                    if amax < abs(x[j]):
                        amax = abs(x[j])
                        mx = x[j]
                d = mx / -fnmax
                inv = F32(1) / d if d != 0 else F32(0)
                for j in range(32):
                    L[j] = min(2 * nmax - 1, int(x[j] * inv + half))  # (int8_t) truncates
            d16 = _put_f16(o, 0, d)
            for j in range(32):
                e += _sq_diff(F32(L[j] - nmax) * d16, x[j])
            if nmax == 8:
                for j in range(16):
                    o[2 + j] = (L[j] & 15) | ((L[j + 16] & 15) << 4)
            else:
                _put_qh_qs(o, 2, L)
        err[r] += e
    return out


@njit(**_JIT)
def _q4_0(x2, qw, out, err):
    return _legacy_sym(x2, qw, out, err, 8, 18, np.empty(0, np.float32))


@njit(**_JIT)
def _q4_0_slice(x2, qw, sigma2, out, err):
    return _legacy_sym(x2, qw, out, err, 8, 18, sigma2)


@njit(**_JIT)
def _q5_0(x2, qw, out, err):
    return _legacy_sym(x2, qw, out, err, 16, 22, np.empty(0, np.float32))


@njit(**_JIT)
def _q5_0_slice(x2, qw, sigma2, out, err):
    return _legacy_sym(x2, qw, out, err, 16, 22, sigma2)


@njit(**_JIT)
def _legacy_asym(x2, qw, out, err, nmax, size, sigma2):
    """Q4_1 (nmax 15, 20 B) / Q5_1 (nmax 31, 24 B): x = d*q + m, codes in [0, nmax].
    `sigma2` as in _legacy_sym."""
    rows, k = x2.shape
    nb = k // 32
    use_w = qw.shape[0] > 0
    L = np.empty(32, np.int64)
    xt = np.empty((32, nb), np.float32)
    wt = np.empty((32, nb), np.float32)
    Lt = np.empty((32, nb), np.float32)
    ds = np.empty(nb, np.float32)
    mins = np.empty(nb, np.float32)
    for r in range(rows):
        e = 0.0
        xr = x2[r]
        if use_w:  # quantize_row_q*_1_impl: make_qkx3_quants(-0.9, 0.05, 36) per block
            _lanes(xr, 32, xt)
            _imatrix_lanes(xt, qw, sigma2[r] if sigma2.shape[0] else _row_sigma2(xr), wt)
            _make_qkx(xt, wt, nmax, F32(-0.9), F32(0.05), 36, ds, mins, Lt)
        for b in range(nb):
            x = xr[32 * b:32 * b + 32]
            o = out[r, size * b:size * b + size]
            if use_w:
                d, m = ds[b], -mins[b]
                for j in range(32):
                    L[j] = int(Lt[j, b])
            else:
                mn = F32(np.inf)
                mx = F32(-np.inf)
                for j in range(32):
                    if x[j] < mn:
                        mn = x[j]
                    if x[j] > mx:
                        mx = x[j]
                d = (mx - mn) / F32(nmax)
                inv = F32(1) / d if d != 0 else F32(0)
                for j in range(32):
                    v = int((x[j] - mn) * inv + F32(0.5))  # the C casts truncate
                    L[j] = min(15, v) if nmax == 15 else v  # Q4_1 clamps, Q5_1 masks
                m = mn
            d16 = _put_f16(o, 0, d)
            m16 = _put_f16(o, 2, m)
            if nmax == 15:
                for j in range(16):
                    o[4 + j] = (L[j] & 15) | ((L[j + 16] & 15) << 4)
            else:
                _put_qh_qs(o, 4, L)
            for j in range(32):
                e += _sq_diff(F32(L[j] & nmax) * d16 + m16, x[j])
        err[r] += e
    return out


@njit(**_JIT)
def _q4_1(x2, qw, out, err):
    return _legacy_asym(x2, qw, out, err, 15, 20, np.empty(0, np.float32))


@njit(**_JIT)
def _q4_1_slice(x2, qw, sigma2, out, err):
    return _legacy_asym(x2, qw, out, err, 15, 20, sigma2)


@njit(**_JIT)
def _q5_1(x2, qw, out, err):
    return _legacy_asym(x2, qw, out, err, 31, 24, np.empty(0, np.float32))


@njit(**_JIT)
def _q5_1_slice(x2, qw, sigma2, out, err):
    return _legacy_asym(x2, qw, out, err, 31, 24, sigma2)


# ----------------------------------------------------------------- 256-wide K-quants


@njit(**_JIT)
def _q45_k(x2, qw, out, err, nmax, size):
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


@njit(**_JIT)
def _q4_k(x2, qw, out, err):
    return _q45_k(x2, qw, out, err, 15, 144)


@njit(**_JIT)
def _q5_k(x2, qw, out, err):
    return _q45_k(x2, qw, out, err, 31, 176)


@njit(**_JIT)
def _q6_k(x2, qw, out, err):
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


@njit(inline="always", **_JIT)
def _nint_wide(v):
    """C's nearest_int for any float32 without a scratch array (_nint_c's bits, computed):
    round half to even below 2^22; above, the mantissa field of y = v + 1.5 * 2^23 minus 2^22
    (-2^22 for y = 0 or +-inf, 0 for NaN). A predictable branch in the scalar grid loops,
    where IQ2_XXS's trial scales (from make_qp_quants) put no bound on |v|."""
    if abs(v) <= F32(4194303):
        return np.rint(v)
    y = v + F32(12582912)
    if y != y:
        return F32(0)
    if y == 0 or abs(y) == np.inf:
        return F32(-4194304)
    f, _ = math.frexp(abs(float(y)))
    return F32(int(f * 16777216.0) - 8388608 - 4194304)


@njit(**_JIT)
def _nint_c(v, buf):
    """C's nearest_int for any float32, huge and non-finite values included: the bits of
    v + 1.5 * 2^23 (buf: a 1-element float32 scratch array)."""
    buf[0] = v + F32(12582912)
    return F32((buf.view(np.int32)[0] & 0x007FFFFF) - 0x00400000)


@njit(**_JIT)
def _make_q3(x, L, buf):
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


@njit(**_JIT)
def _q3_k(x2, qw, out, err):
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
                    s = _make_q3(xs[16 * j:16 * j + 16], L[16 * j:16 * j + 16], buf)
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


@njit(**_JIT)
def _q2_k(x2, qw, out, err):
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


IQ4NL_VALUES = np.array(IQ4NL_LEVELS, np.float32)  # numba reads a global array as a constant


@njit(**_JIT)
def _best_index_iq4nl(v, x):
    """best_index_int8(16, kvalues_iq4nl, x): the nearest level, ties to the lower one."""
    mu = 1  # the C binary search's end: the first level above x (counted without branches)
    for i in range(1, 15):
        mu += 1 if x >= v[i] else 0
    idx = mu - 1 if x - v[mu - 1] < v[mu] - x else mu
    idx = 0 if x <= v[0] else idx
    return 15 if x >= v[15] else idx


@njit(**_JIT)
def _iq4nl_search(xt, wt, scales):
    """The block-scale search of quantize_row_iq4_nl_impl (ntry 7) on every lane of xt, wt
    [32, G]: the least-squares scale of the nearest-level codes for d = max/127, then 15
    inverse scales (itry - 127)/max, kept when sumqx^2/sumq2 grows; scales[G] (0 where
    max |x| < GROUP_MAX_EPS)."""
    v = IQ4NL_VALUES
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
                q = v[_best_index_iq4nl(v, inv[g] * xt[i, g])]
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


@njit(**_JIT)
def _iq4(x2, qw, out, err, sbs, size):
    """IQ4_NL (sbs 32, 18 B: | d f16 | qs[16] |) and IQ4_XS (sbs 256, 136 B: | d f16 |
    scales_h u16 | scales_l[4] | qs[128] |): quantize_row_iq4_nl_impl with ntry 7, as
    ggml_quantize_chunk calls it (weights x^2, or qw * sqrt(sigma2 + x^2) with an imatrix).
    Each 32-value block searches its float scale over the nearest-level codes; IQ4_XS then
    stores 6-bit block scales l of d = -max_scale/32 and re-picks the codes from d*l."""
    v = IQ4NL_VALUES
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
        _iq4nl_search(xt, wt, row_scales)
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
                        L[32 * ib + j] = _best_index_iq4nl(v, idl * x[32 * ib + j])
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
                    L[j] = _best_index_iq4nl(v, inv * x[j])
                    e += _sq_diff(d16 * v[L[j]], x[j])
                qs = 2
            for i in range(nblk):
                for j in range(16):
                    o[qs + 16 * i + j] = L[32 * i + j] | (L[32 * i + 16 + j] << 4)
        err[r] += e
    return out


@njit(**_JIT)
def _iq4_nl(x2, qw, out, err):
    return _iq4(x2, qw, out, err, 32, 18)


@njit(**_JIT)
def _iq4_xs(x2, qw, out, err):
    return _iq4(x2, qw, out, err, 256, 136)



@njit(inline="always", **_JIT)
def _grid_neighbour(levels, neigh, at, xv, wv, scale, L, base, n):
    """iq3_find_best_neighbour / iq2_find_best_neighbour: the listed grid point of least
    weighted error at `scale` (the first on ties); its levels go to L[base:base+n]; returns
    its grid index (n: the group width, a constant at each inlined call)."""
    best_d2 = F32(3.4028234663852886e38)  # FLT_MAX, as the C starts
    best = -1
    for j in range(at + 1, at + 1 + neigh[at]):
        g = neigh[j]
        d2 = F32(0)
        for i in range(n):
            diff = scale * F32(2 * levels[g, i] + 1) - xv[base + i]
            d2 += wv[base + i] * diff * diff
        if d2 < best_d2:
            best_d2 = d2
            best = g
    for i in range(n):
        L[base + i] = levels[best, i]
    return best


@njit(inline="always", **_JIT)
def _grid_code(xv, L, base, n, bits, top, inv, buf):
    """The code of a group of n values rounded to levels 0..top at inverse scale inv
    (levels stored in L[base:base+n], `bits` per level in the code). buf: None in the trial
    loops, which round with _nint_wide (no array view per value: its reference counting made
    the search 4x slower); else C's bit trick for any value (_nint_c)."""
    u = 0
    for i in range(n):
        v = F32(0.5) * (inv * xv[base + i] - F32(1))
        v = int(_nint_wide(v) if buf is None else _nint_c(v, buf))
        L[base + i] = min(max(v, 0), top)
        u |= L[base + i] << (bits * i)
    return u


@njit(inline="always", **_JIT)
def _grid_fit(xval, weight, L, n):
    """sum w*x*q and sum w*q^2 for the odd levels q = 2L+1: the scale that fits is their ratio."""
    sumqx = F32(0)
    sumq2 = F32(0)
    for i in range(n):
        q = F32(2 * L[i] + 1)
        sumqx += weight[i] * xval[i] * q
        sumq2 += weight[i] * q * q
    return sumqx, sumq2


@njit(inline="always", **_JIT)
def _grid_scale_search(xval, weight, waux, L, Laux, on, on_aux, kmap, levels, neigh, mx, n, gw, bits,
                       top, first, step, nis, init_on, skip_on, buf, scale0, always):
    """The scale search the grid quantizers share (quantize_row_iq3_xxs/iq3_s/iq2_*_impl) over n
    values in groups of gw: trial inverse scales (first + it * step) / mx, it in -nis..nis, snap
    every group to the grid (kmap, else its nearest listed neighbour) and keep the levels of the
    best sumqx^2 / sumq2; groups left off the grid are re-snapped at the winning scale (only the
    ones off it where skip_on) and the scale refitted. Levels end in L; returns the scale
    (negative: the caller flips the signs). scale0: the scale kept when no trial wins (mx /
    first, IQ2_XXS make_qp_quants'). init_on: what `on` starts as (IQ3_S: False, so with no
    winning trial every group is re-snapped, as the C does). always: re-snap every group and
    refit whenever the scale is positive, on the grid or not (IQ2_XXS)."""
    ng = n // gw
    best = F32(0)
    scale = scale0
    for g in range(ng):
        on[g] = init_on
    for it in range(-nis, nis + 1):
        inv = (first + F32(it) * step) / mx
        this_scale = F32(1) / inv
        for g in range(ng):
            u = _grid_code(xval, Laux, gw * g, gw, bits, top, inv, None)
            on_aux[g] = kmap[u] >= 0
            if kmap[u] < 0:
                _grid_neighbour(levels, neigh, -kmap[u] - 1, xval, waux, this_scale, Laux, gw * g, gw)
        sumqx, sumq2 = _grid_fit(xval, weight, Laux, n)
        if sumq2 > 0 and sumqx * sumqx > best * sumq2:
            scale = sumqx / sumq2
            best = scale * sumqx
            for i in range(n):
                L[i] = Laux[i]
            for g in range(ng):
                on[g] = on_aux[g]
    n_off = 0
    for g in range(ng):
        n_off += 0 if on[g] else 1
    if (always or n_off > 0) and scale > 0:
        inv = F32(1) / scale
        for g in range(ng):
            if skip_on and on[g]:
                continue
            u = _grid_code(xval, L, gw * g, gw, bits, top, inv, buf)
            if kmap[u] < 0:  # an on-grid code's levels are already in L
                _grid_neighbour(levels, neigh, -kmap[u] - 1, xval, waux, scale, L, gw * g, gw)
        sumqx, sumq2 = _grid_fit(xval, weight, L, n)
        if sumq2 > 0:
            scale = sumqx / sumq2
    return scale


@njit(inline="always", **_JIT)
def _split_signs(xb, weight, xval, base, even):
    """|x| of 8 values into xval[base:base+8]; returns their sign bits (bit i: x_i < 0). even:
    an odd count of negatives flips the value of least weight*x^2 (its |x| goes negative), so
    the 8th sign is the parity of the 7 stored (IQ3_XXS, IQ2_XXS, IQ2_XS: ksigns_iq2xs)."""
    nflip = 0
    s = 0
    for i in range(8):
        if xb[base + i] >= 0:
            xval[base + i] = xb[base + i]
        else:
            xval[base + i] = -xb[base + i]
            nflip += 1
            s |= 1 << i
    if even and nflip % 2:
        imin = 0
        mn = weight[base] * xb[base] * xb[base]
        for i in range(1, 8):
            ax = weight[base + i] * xb[base + i] * xb[base + i]
            if ax < mn:
                mn = ax
                imin = i
        xval[base + imin] = -xval[base + imin]
        s ^= 1 << imin
    return s


@njit(inline="always", **_JIT)
def _parity_signs(s7):
    """The 8 sign bits of a stored 7 (ksigns_iq2xs): bit 7 is their parity."""
    parity = 0
    for b in range(7):
        parity ^= (s7 >> b) & 1
    return s7 | (parity << 7)


@njit(**_JIT)
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


@njit(**_JIT)
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

@njit(**_JIT)
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


@njit(**_JIT)
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


FLT_MAX = F32(3.4028234663852886e38)
IQ1_DELTA = F32(0.125)  # IQ1S_DELTA = IQ1M_DELTA: the grid's shift, +-1/8 of a step


@njit(inline="always", **_JIT)
def _iq1_shifted(sign):
    """The three values a {-1, 0, 1} level decodes to with the grid shifted by sign * 1/8."""
    xx = np.empty(3, np.float32)
    xx[0] = F32(-1) + F32(sign) * IQ1_DELTA
    xx[1] = F32(sign) * IQ1_DELTA
    xx[2] = F32(1) + F32(sign) * IQ1_DELTA
    return xx


@njit(inline="always", **_JIT)
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


@njit(inline="always", **_JIT)
def _iq1_split(n, idx, L, i1, i2):
    """Levels of a 3-group split of the sorted values: 0 below i1, 1 up to i2, 2 above."""
    for j in range(n):
        L[idx[j]] = 0 if j < i1 else (1 if j < i2 else 2)


@njit(inline="always", **_JIT)
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


@njit(inline="always", **_JIT)
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


@njit(**_JIT)
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


@njit(**_JIT)
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


@njit(**_JIT)
def _half_value(bits):
    """The float32 value of IEEE half bits (GGML_FP16_TO_FP32)."""
    ex, mant = (bits >> 10) & 31, bits & 1023
    if ex == 31:
        val = math.inf if mant == 0 else math.nan
    elif ex == 0:
        val = mant * 5.960464477539063e-08
    else:
        val = math.ldexp(1024 + mant, ex - 25)
    return F32(-val if bits & 0x8000 else val)


def _iq3_xxs(x2, qw, out, err):
    levels, kmap, neigh, values = grid_tables(18)
    return _iq3(x2, qw, out, err, levels, kmap, neigh, values, True)


def _iq3_s(x2, qw, out, err):
    levels, kmap, neigh, values = grid_tables(21)
    return _iq3(x2, qw, out, err, levels, kmap, neigh, values, False)


def _iq2_s_tables(x2, qw, out, err):
    return _iq2_16(x2, qw, out, err, *grid_tables(22), False)


def _needs_qw(name: str, qw: np.ndarray) -> None:
    """ggml_quantize_chunk asserts an imatrix for these types (ggml_quantize_requires_imatrix)."""
    if qw.shape[0] == 0:
        raise ValueError(f"{name} needs an importance matrix (llama.cpp's quantizer asserts one)")


def _iq2_xs_tables(x2, qw, out, err):
    _needs_qw("IQ2_XS", qw)
    return _iq2_16(x2, qw, out, err, *grid_tables(17), True)


def _iq2_xxs_tables(x2, qw, out, err):
    _needs_qw("IQ2_XXS", qw)
    return _iq2_xxs(x2, qw, out, err, *grid_tables(16))


def _iq1_s_tables(x2, qw, out, err):
    _needs_qw("IQ1_S", qw)
    return _iq1_s(x2, qw, out, err, *grid_tables(19))


def _iq1_m_tables(x2, qw, out, err):  # ggml's IQ1_M runs without an imatrix (weights x^2)
    return _iq1_m(x2, qw, out, err, *grid_tables(29))


# GGML type id -> encoder(x [rows, K] float32 C-contiguous, qw [K] float32 or empty,
# out [rows, row_bytes] uint8, err [rows] float64 += sum over the row of (decoded - x)^2)
ENCODERS = {8: _q8_0, 2: _q4_0, 3: _q4_1, 6: _q5_0, 7: _q5_1, 10: _q2_k, 11: _q3_k, 12: _q4_k, 13: _q5_k, 14: _q6_k,
            20: _iq4_nl, 23: _iq4_xs, 18: _iq3_xxs, 21: _iq3_s, 22: _iq2_s_tables, 16: _iq2_xxs_tables,
            17: _iq2_xs_tables, 19: _iq1_s_tables, 29: _iq1_m_tables}
# the legacy types on a column slice of longer rows (GPTQ's column blocks): their imatrix
# weights read the WHOLE rows' sum(x^2)/K, given as sigma2 [rows] float32
SLICE_ENCODERS = {2: _q4_0_slice, 3: _q4_1_slice, 6: _q5_0_slice, 7: _q5_1_slice}


@njit(**_JIT)
def row_sigma2(x2, out):
    """out[r] = sum(x2[r]^2) / K, in column order (what the legacy encoders compute per row)."""
    for r in range(x2.shape[0]):
        out[r] = _row_sigma2(x2[r])
