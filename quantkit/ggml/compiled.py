"""The numba kernels every GGML family shares: float helpers and llama.cpp's scale searches.

The torch encoders (quantkit.ggml.common) vectorise across blocks and so run on a GPU, but on a
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
Block layouts are drawn in each family module.
"""

from __future__ import annotations

import math

import numpy as np

from quantkit.ggml.jit import EPS, F32, JIT, njit

__all__ = ["fp16_bits"]

@njit(**JIT)
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


@njit(**JIT)
def _put_f16(o, at, v):
    """Write v as fp16 at o[at:at+2]; returns the float32 value of that half."""
    bits, val = fp16_bits(v)
    o[at] = bits & 255
    o[at + 1] = bits >> 8
    return val


@njit(**JIT)
def _nint(v):
    """C's nearest_int as a float32: round half to even; -2^22 for +-inf, 0 for NaN.

    Selects, not branches, so the lane loops stay SIMD; |v| > 2^22 never occurs here.
    """
    r = np.rint(v)
    r = r if abs(v) <= F32(4194303) else F32(-4194304)
    return r if v == v else F32(0)


@njit(**JIT)
def _clamp(v, lo, hi):
    return min(max(v, lo), hi)


@njit(**JIT)
def _sq_diff(y, x):
    """(y - x)^2 in float64: one value's share of a row's squared reconstruction error."""
    e = float(y) - float(x)
    return e * e


@njit(**JIT)
def _roundf(v):
    """C roundf: half away from zero (v - trunc(v) is exact in float32)."""
    t = np.trunc(v)
    return int(t) + (0 if abs(v - t) < F32(0.5) else (1 if v > 0 else -1))


@njit(**JIT)
def _lanes(x, n, out):
    """out[i, g] = x[g*n + i]: a row's sub-blocks of n values as lanes."""
    for g in range(out.shape[1]):
        for i in range(n):
            out[i, g] = x[g * n + i]


# ----------------------------------------------------------------- scale searches, per lane


@njit(**JIT)
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


@njit(**JIT)
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


@njit(**JIT)
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

@njit(inline="always", **JIT)
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


@njit(**JIT)
def _nint_c(v, buf):
    """C's nearest_int for any float32, huge and non-finite values included: the bits of
    v + 1.5 * 2^23 (buf: a 1-element float32 scratch array)."""
    buf[0] = v + F32(12582912)
    return F32((buf.view(np.int32)[0] & 0x007FFFFF) - 0x00400000)

@njit(**JIT)
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
