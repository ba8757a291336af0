"""The lattice tables llama.cpp's grid quantizers search (iq3xs_init_impl, iq2xs_init_impl),
and the numba search steps the IQ3 / IQ2 encoders share.

A group of values (4 for IQ3_XXS / IQ3_S, 8 for the IQ2 types) stores one index into a grid
of vectors whose coordinates are odd levels 2l+1 (l in 0..7 for IQ3, 0..2 for IQ2; grids of
256, 512 and 1024 points). The quantizer rounds a group to levels, looks the code
sum(l_i << bits*i) up in `kmap` and, when the code is not a grid point, searches its
precomputed neighbours: every grid point at one of the nwant smallest squared distances
(2 for IQ3_XXS, IQ2_XXS and IQ2_XS, 3 for IQ3_S and IQ1_S / IQ1_M, 1 for IQ2_S), ordered
by (distance, index) as the C qsort orders them. Only codes the quantizer can form get a list
(the IQ2 quantizers clamp levels to 0..2 and the IQ1 ones split values into 3 groups, though
the C lists every 2-bit code). IQ1_S and IQ1_M share one 2048-point grid of 8 values in
{-1, 0, 1} (iq1s_grid; levels 0..2 at positions 2l+1 for the distances, as for IQ2).

The grid itself is gguf-py's dequantization grid (same points, same order); its values map
back to the level l through the type's value table.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from quantkit.ggml.compiled import _nint_c, _nint_wide
from quantkit.ggml.jit import F32, JIT, njit

Q = GGMLQuantizationType

__all__ = ["grid_tables", "needs_qw"]


# type -> (gguf class name, bits per level, levels the quantizer forms, nwant)
_SPECS = {Q.IQ3_XXS: ("IQ3_XXS", 3, 8, 2), Q.IQ3_S: ("IQ3_S", 3, 8, 3), Q.IQ2_S: ("IQ2_S", 2, 3, 1),
          Q.IQ2_XXS: ("IQ2_XXS", 2, 3, 2), Q.IQ2_XS: ("IQ2_XS", 2, 3, 2), Q.IQ1_S: ("IQ1_S", 2, 3, 3)}


@functools.cache
def grid_tables(qtype: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(levels int32 [G, n], kmap int32 [2^(bits*n)], neighbours int32, values float32).

    kmap[code] is the grid index of an on-grid code, else -(offset + 1) where
    neighbours[offset] is the neighbour count c and neighbours[offset + 1: offset + 1 + c]
    the grid indices. values[l] is what the dequantizer multiplies for level l (IQ3_XXS's
    top level is 62, not 60, so it is read from gguf rather than derived).
    """
    if Q(qtype) == Q.IQ1_M:  # the same grid and lists as IQ1_S (iq2_data: one table each, equal)
        return grid_tables(Q.IQ1_S)
    name, bits, nlev, nwant = _SPECS[Q(qtype)]
    cls = getattr(gguf_quants, name)
    cls.init_grid()
    values = np.array(cls.grid_map, np.float32)
    grid = np.asarray(cls.grid, np.float32).reshape(cls.grid_shape)
    levels = np.searchsorted(values, grid).astype(np.int32)  # [G, n]
    assert np.array_equal(values[levels], grid)
    n = levels.shape[1]
    shifts = bits * np.arange(n)
    codes = (levels << shifts).sum(1)
    kmap = np.full(1 << (bits * n), -1, np.int32)
    kmap[codes] = np.arange(len(codes), dtype=np.int32)
    formable = np.array(list(itertools.product(range(nlev), repeat=n)))[:, ::-1]  # codes ascending
    fcodes = (formable << shifts).sum(1)
    off = kmap[fcodes] < 0
    fcodes, pos = fcodes[off], 2 * formable[off] + 1
    grid_pos = 2 * levels + 1
    d2 = (pos * pos).sum(1)[:, None] - 2 * pos @ grid_pos.T + (grid_pos * grid_pos).sum(1)[None, :]
    cut = d2.min(1)
    for _ in range(nwant - 1):  # the nwant-th smallest distinct distance
        cut = np.where(d2 > cut[:, None], d2, np.iinfo(d2.dtype).max).min(1)
    rows, cols = np.nonzero(d2 <= cut[:, None])
    order = np.lexsort((cols, d2[rows, cols], rows))  # per code: by distance, then index
    rows, cols = rows[order], cols[order]
    counts = np.bincount(rows, minlength=len(fcodes))
    starts = np.concatenate([[0], np.cumsum(counts + 1)[:-1]])
    neighbours = np.empty(int((counts + 1).sum()), np.int32)
    neighbours[starts] = counts
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    neighbours[starts[rows] + 1 + (np.arange(len(rows)) - first[rows])] = cols
    kmap[fcodes] = -(starts + 1)
    return levels, kmap, neighbours, values

@njit(inline="always", **JIT)
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


@njit(inline="always", **JIT)
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


@njit(inline="always", **JIT)
def _grid_fit(xval, weight, L, n):
    """sum w*x*q and sum w*q^2 for the odd levels q = 2L+1: the scale that fits is their ratio."""
    sumqx = F32(0)
    sumq2 = F32(0)
    for i in range(n):
        q = F32(2 * L[i] + 1)
        sumqx += weight[i] * xval[i] * q
        sumq2 += weight[i] * q * q
    return sumqx, sumq2


@njit(inline="always", **JIT)
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


@njit(inline="always", **JIT)
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


@njit(inline="always", **JIT)
def _parity_signs(s7):
    """The 8 sign bits of a stored 7 (ksigns_iq2xs): bit 7 is their parity."""
    parity = 0
    for b in range(7):
        parity ^= (s7 >> b) & 1
    return s7 | (parity << 7)

def needs_qw(name: str, qw: np.ndarray) -> None:
    """ggml_quantize_chunk asserts an imatrix for these types (ggml_quantize_requires_imatrix)."""
    if qw.shape[0] == 0:
        raise ValueError(f"{name} needs an importance matrix (llama.cpp's quantizer asserts one)")
