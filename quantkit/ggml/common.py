"""The torch math every GGML family shares: llama.cpp's scale searches, vectorised across
groups, bit for bit, and the byte packing helpers of the torch encoders and decoders.

Every function works on a group-major-last layout: `x[i, g]` is element i of group g, so a
loop over the (16 or 32) elements of a group is a Python loop over rows, each op covering
all groups at once. That is how we keep the C rounding behaviour while vectorising:

* sums are accumulated in element order with a float32 rounding after every add
  (`seq_sum`), never with torch.sum (which reorders and accumulates in double on CPU);
* `a*b*c` is evaluated as `(a*b)*c`, never fused (the C reference is built without FMA);
* `nearest_int` is round-half-to-even (`torch.round`);
* `scalar / tensor` and `sqrt` go through float64 and are rounded once to float32: torch's
  CPU kernels compute them as `reciprocal * scalar` and with a 0.5-ulp Sleef sqrt, both of
  which differ from IEEE float32 in the last bit. Double rounding via float64 is exact for
  +, -, *, / and sqrt of float32 operands (53 >= 2*24 + 2).

Scalar constants are float32 values (`_f32`), as the C `0.1f` literals are.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["seq_sum", "rdiv", "divs", "sqrt32", "roundf", "nint_c", "make_qkx", "make_qx", "make_qp",
           "f32", "GROUP_MAX_EPS"]

GROUP_MAX_EPS = float(np.float32(1e-15))


def f32(v: float) -> float:
    """The float32 value of a C float literal, as a Python float."""
    return float(np.float32(v))


def seq_sum(p: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0 in index order, rounding to float32 after every add (the C loop).

    On CPU the adds run through numpy on the same memory: each is a tiny op and numpy's
    per-call overhead is about half of torch's (both are plain IEEE float32 adds).
    """
    if p.device.type == "cpu":
        a = p.detach().numpy()
        acc = a[0].copy()
        for i in range(1, a.shape[0]):
            np.add(acc, a[i], out=acc)
        return torch.from_numpy(acc)
    views = p.unbind(0)
    acc = views[0].clone()
    for v in views[1:]:
        acc.add_(v)
    return acc


def rdiv(num: float, t: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 `num / t` (torch computes scalar/tensor as num * (1/t))."""
    return (num / t.double()).float()


def divs(t: torch.Tensor, s: float) -> torch.Tensor:
    """Correctly rounded float32 `t / s` (CUDA computes tensor/scalar as t * (1/s))."""
    return (t.double() / s).float()


def sqrt32(t: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 sqrt."""
    return torch.sqrt(t.double()).float()


def roundf(v: torch.Tensor) -> torch.Tensor:
    """C `roundf`: half away from zero (Q8_0 uses it instead of nearest_int)."""
    r = torch.trunc(v)
    frac = (v - r).abs()  # exact in float32
    return r + torch.where(frac >= 0.5, torch.sign(v), torch.zeros_like(v))


def nint_c(v: torch.Tensor) -> torch.Tensor:
    """C's nearest_int bit trick, also for the huge and non-finite values torch.round keeps:
    the low mantissa bits of v + 1.5 * 2^23, as float32."""
    s = (v + 12582912.0).view(torch.int32)
    return ((s & 0x007FFFFF) - 0x00400000).float()

def make_qkx(x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float,
             nstep: int, mad: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """make_qkx2_quants / make_qkx3_quants (identical when weights are given): x = scale*L - the_min.

    x, w: [n, G]. Returns (scale [G], the_min [G], L [n, G] float codes in [0, nmax]).
    mad: errors are w*|diff| (Q2_K's use_mad), else w*diff^2.
    A weighted least-squares fit of (scale, min) is tried for nstep+1 candidate inverse
    scales; a candidate replaces the best only when its weighted error is strictly smaller.
    The running `min` feeds the next candidate's inverse scale, as in the C loop. Codes are
    not carried through the loop: the winning (iscale, min) pair is kept and L recomputed
    once at the end with the same float ops, which gives the same codes.
    """
    n, g = x.shape
    mn = x.amin(0).clamp(max=0.0)
    mx = x.amax(0)
    sum_w = seq_sum(w)
    sum_x = seq_sum(w * x)
    degenerate = mx <= mn
    iscale = rdiv(float(nmax), mx - mn)
    scale = rdiv(1.0, iscale)
    best_is, best_mn = iscale, mn
    laux = torch.empty_like(x)
    prod = torch.empty(n, 3, g, dtype=x.dtype, device=x.device)
    diff = torch.empty_like(x)

    def codes(isc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        torch.sub(x, m, out=laux)
        laux.mul_(isc).round_().clamp_(0, nmax)
        return laux

    def error(s: torch.Tensor, m: torch.Tensor, l_: torch.Tensor) -> torch.Tensor:
        torch.mul(l_, s, out=diff)
        diff.add_(m).sub_(x)
        if mad:
            diff.abs_()
        else:
            diff.mul_(diff)
        diff.mul_(w)
        return seq_sum(diff)

    best = error(scale, mn, codes(iscale, mn))
    for step in range(nstep + 1):
        num = float(np.float32(np.float32(rmin) + np.float32(rdelta) * np.float32(step)) + np.float32(nmax))
        iscale = rdiv(num, mx - mn)
        laux = codes(iscale, mn)
        torch.mul(w, laux, out=prod[:, 0])
        torch.mul(prod[:, 0], laux, out=prod[:, 1])
        torch.mul(prod[:, 0], x, out=prod[:, 2])
        sums = seq_sum(prod)
        sum_l, sum_l2, sum_xl = sums[0], sums[1], sums[2]
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
        pos = this_min > 0
        this_min = torch.where(pos, torch.zeros_like(this_min), this_min)
        this_scale = torch.where(pos, sum_xl / sum_l2, this_scale)
        cur = error(this_scale, this_min, laux)
        take = (D > 0) & (cur < best)
        best_is = torch.where(take, iscale, best_is)
        best_mn = torch.where(take, mn, best_mn)
        best = torch.where(take, cur, best)
        scale = torch.where(take, this_scale, scale)
        mn = torch.where(take, this_min, mn)
    L = codes(best_is, best_mn).clone()
    scale = torch.where(degenerate, torch.zeros_like(scale), scale)
    L[:, degenerate] = 0
    return scale, -mn, L


def make_qx(x: torch.Tensor, nmax: int, qw: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """make_qx_quants with rmse_type 1: symmetric codes L in [0, 2*nmax), x ~ scale*(L - nmax).

    x, qw: [n, G]; weights are qw when given, else x^2. Returns (scale [G], L [n, G]).
    The sign of the scale follows the first element of largest |x| (so the extreme value
    maps to -nmax); 18 perturbed inverse scales are tried, kept when sumlx^2/suml2 grows.
    The 19 candidates do not depend on each other, so their sums are computed in one batch
    ([n, 19, G]); only the choice among them is a sequential scan, as in C. The codes are
    recomputed from the winning inverse scale, as the C code does.
    """
    ax = x.abs()
    idx = ax.argmax(0, keepdim=True)  # first occurrence, as the C strict '>'
    amax = ax.gather(0, idx)[0]
    mx = x.gather(0, idx)[0]
    zero_group = amax < GROUP_MAX_EPS
    mx = torch.where(zero_group, torch.ones_like(mx), mx)
    w = qw if qw is not None else x * x
    nums = [float(-nmax)] + [-float(np.float32(nmax) + np.float32(0.1) * np.float32(s))
                             for s in range(-9, 10) if s != 0]
    iscales = torch.stack([rdiv(v, mx) for v in nums])  # [19, G]
    l_ = (x[:, None, :] * iscales[None]).round_().clamp_(-nmax, nmax - 1)  # [n, 19, G]
    prod = torch.empty((x.shape[0], 2) + tuple(l_.shape[1:]), dtype=x.dtype, device=x.device)
    torch.mul((w * x)[:, None, :], l_, out=prod[:, 0])
    torch.mul(w[:, None, :], l_, out=prod[:, 1])
    prod[:, 1].mul_(l_)
    sums = seq_sum(prod)  # [2, 19, G]
    sumlx, suml2 = sums[0], sums[1]
    nz = suml2[0] != 0
    scale = torch.where(nz, sumlx[0] / torch.where(nz, suml2[0], torch.ones_like(mx)),
                        torch.zeros_like(mx))
    best = scale * sumlx[0]
    best_is = iscales[0]
    for c in range(1, len(nums)):
        take = (suml2[c] > 0) & (sumlx[c] * sumlx[c] > best * suml2[c])
        new_scale = sumlx[c] / suml2[c]
        best_is = torch.where(take, iscales[c], best_is)
        scale = torch.where(take, new_scale, scale)
        best = torch.where(take, new_scale * sumlx[c], best)
    L = (x * best_is).round_().clamp_(-nmax, nmax - 1).add_(nmax)
    scale = torch.where(zero_group, torch.zeros_like(scale), scale)
    L[:, zero_group] = 0
    return scale, L


def make_qp(x: torch.Tensor, nmax: int, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """make_qp_quants: non-negative x (sub-block scales or mins) ~ scale*L, L in [0, nmax].

    x, w: [n, G]. Used with n = 8, nmax = 63 to code the 6-bit K-quant scales under an
    imatrix. Picks the best of 9 inverse scales, then up to 5 passes of coordinate descent,
    each element updated in order (so the passes stay sequential over n).
    """
    mx = x.amax(0).clamp(min=0.0)
    zero_group = mx < GROUP_MAX_EPS
    mx = torch.where(zero_group, torch.ones_like(mx), mx)
    iscale = rdiv(float(nmax), mx)
    scale = rdiv(1.0, iscale)
    L = torch.round(iscale * x)
    diff = x - scale * L
    best = seq_sum((w * diff) * diff)
    for step in range(-4, 5):
        if step == 0:
            continue
        num = float(np.float32(np.float32(0.1) * np.float32(step)) + np.float32(nmax))
        iscale_is = rdiv(num, mx)
        scale_is = rdiv(1.0, iscale_is)
        l_ = torch.round(iscale_is * x).clamp_(max=nmax)
        diff = x - scale_is * l_
        mse = seq_sum((w * diff) * diff)
        take = mse < best
        best = torch.where(take, mse, best)
        iscale = torch.where(take, iscale_is, iscale)
    L = torch.round(iscale * x).clamp_(max=nmax)
    wx = w * x
    sumlx = seq_sum(wx * L)
    suml2 = seq_sum((w * L) * L)
    for _ in range(5):
        changed = torch.zeros_like(zero_group)
        for i in range(x.shape[0]):
            li = L[i]
            slx = sumlx - wx[i] * li
            sl2 = suml2 - (w[i] * li) * li
            ok = (slx > 0) & (sl2 > 0)
            new_l = torch.round((x[i] * sl2) / slx).clamp_(max=nmax)
            ok &= new_l != li
            slx = slx + wx[i] * new_l
            sl2 = sl2 + (w[i] * new_l) * new_l
            ok &= (slx * slx) * suml2 > (sumlx * sumlx) * sl2
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
    L = torch.where(zero_group, torch.zeros_like(L), L)
    return scale, L

# ----------------------------------------------------------------- bytes

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

def _f16(b: torch.Tensor) -> torch.Tensor:
    """[B, 2] little-endian fp16 bytes -> float32 [B]."""
    return b.contiguous().view(torch.float16).reshape(-1).float()


def _lo_hi(qs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q = qs.to(torch.int32)
    return q & 15, q >> 4


def _bit4(qh: torch.Tensor) -> torch.Tensor:
    """[B, 4] bytes of a little-endian uint32 -> [B, 32] bit values."""
    word = (qh.to(torch.int64) << (8 * torch.arange(4, device=qh.device))).sum(1, keepdim=True)
    return ((word >> torch.arange(32, device=qh.device)) & 1).to(torch.int32)
