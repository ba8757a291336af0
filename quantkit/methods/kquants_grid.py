"""The lattice tables llama.cpp's grid quantizers search (iq3xs_init_impl, iq2xs_init_impl).

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

__all__ = ["grid_tables"]

Q = GGMLQuantizationType

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
