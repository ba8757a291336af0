"""The lattice tables llama.cpp's IQ3 quantizers search (iq3xs_init_impl in ggml-quants.c).

An IQ3 group of 4 values stores one index into a grid of 4-vectors whose coordinates are
odd levels 2l+1, l in 0..7 (IQ3_XXS: 256 points, IQ3_S: 512). The quantizer rounds a group
to levels, looks the 12-bit code sum(l_i << 3i) up in `kmap` and, when the code is not a
grid point, searches its precomputed neighbours: every grid point at one of the nwant
smallest squared distances (2 for IQ3_XXS, 3 for IQ3_S), ordered by (distance, index) as
the C qsort orders them.

The grid itself is gguf-py's dequantization grid (same points, same order); its values map
back to the level l through the type's value table.
"""

from __future__ import annotations

import functools

import numpy as np
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

__all__ = ["iq3_tables"]

Q = GGMLQuantizationType


@functools.cache
def iq3_tables(qtype: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(levels int32 [G, 4] in 0..7, kmap int32 [4096], neighbours int32, values float32 [8]).

    kmap[code] is the grid index of an on-grid code, else -(offset + 1) where
    neighbours[offset] is the neighbour count n and neighbours[offset + 1: offset + 1 + n]
    the grid indices. values[l] is what the dequantizer multiplies for level l (IQ3_XXS's
    top level is 62, not 60, so it is read from gguf rather than derived).
    """
    qtype = Q(qtype)
    cls = {Q.IQ3_XXS: gguf_quants.IQ3_XXS, Q.IQ3_S: gguf_quants.IQ3_S}[qtype]
    nwant = 2 if qtype == Q.IQ3_XXS else 3
    cls.init_grid()
    values = np.array(cls.grid_map, np.float32)
    grid = np.asarray(cls.grid, np.float32).reshape(cls.grid_shape)
    levels = np.searchsorted(values, grid).astype(np.int32)  # [G, 4]
    assert np.array_equal(values[levels], grid)
    codes = (levels << np.array([0, 3, 6, 9])).sum(1)
    kmap = np.full(4096, -1, np.int32)
    kmap[codes] = np.arange(len(codes), dtype=np.int32)
    pos = 2 * levels + 1
    neighbours: list[int] = []
    for code in range(4096):
        if kmap[code] >= 0:
            continue
        p = 2 * ((code >> np.array([0, 3, 6, 9])) & 7) + 1
        d2 = ((pos - p) ** 2).sum(1)
        order = np.argsort(d2, kind="stable")  # by distance, then index (the C comparator)
        cut = np.unique(d2)[nwant - 1]
        keep = order[d2[order] <= cut]
        kmap[code] = -(len(neighbours) + 1)
        neighbours.append(len(keep))
        neighbours.extend(int(j) for j in keep)
    return levels, kmap, np.array(neighbours, np.int32), values
