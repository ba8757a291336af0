"""The legacy 32-wide GGML types Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: torch and numba encoders,
torch decoders, bit-exact with ggml-quants.c (quantize_row_q*_ref / _impl, dequantize_row_q*).

Block layouts (little endian, byte offsets):

  Q8_0  34 B / 32:  | d f16 | qs[32] int8 |                         x = d*q
  Q4_0  18 B / 32:  | d f16 | qs[16] |                              x = d*(q-8)
  Q4_1  20 B / 32:  | d f16 | m f16 | qs[16] |                      x = d*q + m
  Q5_0  22 B / 32:  | d f16 | qh u32 | qs[16] |                     x = d*(q-16)
  Q5_1  24 B / 32:  | d f16 | m f16 | qh u32 | qs[16] |             x = d*q + m
        qs[j] = q[j] & 15 | (q[j+16] & 15) << 4; qh bit j = q[j] >> 4, bit j+16 = q[j+16] >> 4

With an imatrix the Q4_0/Q4_1/Q5_0/Q5_1 weights read sum(x^2)/K of the whole row (`prep`),
so a column slice of a row (GPTQ's column blocks) is encoded with the whole row's statistic.
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
    _bit4,
    _f16,
    _f16_bytes,
    _groups,
    _lo_hi,
    _nibbles,
    _qh32,
    _sq,
    _ungroup,
    divs,
    make_qkx,
    make_qx,
    rdiv,
    roundf,
    seq_sum,
    sqrt32,
)
from quantkit.ggml.compiled import _lanes, _make_qkx, _make_qx, _put_f16, _roundf, _sq_diff
from quantkit.ggml.jit import F32, JIT, njit

Q = GGMLQuantizationType

# ----------------------------------------------------------------- torch encoders

def _row_sigma2_torch(x: torch.Tensor) -> torch.Tensor:
    """sum(x^2)/K per row, summed in column order: the legacy types' imatrix weighting."""
    xt = x.t()
    return divs(seq_sum(xt * xt), float(x.shape[1]))


def _q8_0_torch(x: torch.Tensor, qw: torch.Tensor | None, prep=None) -> torch.Tensor:
    xb = x.reshape(-1, 32)
    d = divs(xb.abs().amax(1), 127.0)
    inv = torch.where(d != 0, rdiv(1.0, d), torch.zeros_like(d))
    q = roundf(xb * inv[:, None]).to(torch.int8).view(torch.uint8)
    return torch.cat([_f16_bytes(d), q], 1)


def _absmax_signed_torch(xb: torch.Tensor) -> torch.Tensor:
    idx = xb.abs().argmax(1, keepdim=True)
    return xb.gather(1, idx)[:, 0]


def _legacy_sym_torch(x: torch.Tensor, qw: torch.Tensor | None, nmax: int, sigma2=None) -> tuple:
    """Q4_0 (nmax 8) / Q5_0 (nmax 16): (d [B], q [B, 32] in [0, 2*nmax))."""
    xb = x.reshape(-1, 32)
    if qw is None:
        d = divs(_absmax_signed_torch(xb), float(-nmax))
        inv = torch.where(d != 0, rdiv(1.0, d), torch.zeros_like(d))
        q = torch.trunc(xb * inv[:, None] + (nmax + 0.5)).clamp_(max=2 * nmax - 1)
        return d, q
    w = qw.reshape(1, -1, 32) * sqrt32(sigma2[:, None, None] + _sq(x.reshape(x.shape[0], -1, 32)))
    d, q = make_qx(_groups(xb, 32), nmax, _groups(w.reshape(-1, 32), 32))
    return d, _ungroup(q, xb.shape[0])


def _q4_0_torch(x, qw, prep=None):
    d, q = _legacy_sym_torch(x, qw, 8, prep)
    return torch.cat([_f16_bytes(d), _nibbles(q[:, :16], q[:, 16:])], 1)


def _q5_0_torch(x, qw, prep=None):
    d, q = _legacy_sym_torch(x, qw, 16, prep)
    return torch.cat([_f16_bytes(d), _qh32(q), _nibbles(q[:, :16], q[:, 16:])], 1)


def _legacy_asym_torch(x: torch.Tensor, qw: torch.Tensor | None, nmax: int, sigma2=None) -> tuple:
    """Q4_1 (nmax 15) / Q5_1 (nmax 31): (d [B], m [B], q [B, 32] in [0, nmax]), x = d*q + m."""
    xb = x.reshape(-1, 32)
    if qw is None:
        mn, mx = xb.amin(1), xb.amax(1)
        d = divs(mx - mn, float(nmax))
        inv = torch.where(d != 0, rdiv(1.0, d), torch.zeros_like(d))
        q = torch.trunc((xb - mn[:, None]) * inv[:, None] + 0.5)
        if nmax == 15:
            q = q.clamp_(max=15)  # Q4_1 clamps; Q5_1 keeps the low 5 bits
        return d, mn, q
    w = qw.reshape(1, -1, 32) * sqrt32(sigma2[:, None, None] + _sq(x.reshape(x.shape[0], -1, 32)))
    d, the_min, q = make_qkx(_groups(xb, 32), _groups(w.reshape(-1, 32), 32), nmax, -0.9, 0.05, 36)
    return d, -the_min, _ungroup(q, xb.shape[0])


def _q4_1_torch(x: torch.Tensor, qw: torch.Tensor | None, sigma2=None) -> torch.Tensor:
    d, m, q = _legacy_asym_torch(x, qw, 15, sigma2)
    return torch.cat([_f16_bytes(d), _f16_bytes(m), _nibbles(q[:, :16], q[:, 16:])], 1)


def _q5_1_torch(x: torch.Tensor, qw: torch.Tensor | None, sigma2=None) -> torch.Tensor:
    d, m, q = _legacy_asym_torch(x, qw, 31, sigma2)
    return torch.cat([_f16_bytes(d), _f16_bytes(m), _qh32(q), _nibbles(q[:, :16], q[:, 16:])], 1)

# ----------------------------------------------------------------- numba encoders

@njit(**JIT)
def _row_sigma2_numba(x):
    """sum(x^2) / K of one row, in column order (the legacy types' imatrix weighting)."""
    s = F32(0)
    for j in range(x.shape[0]):
        s += x[j] * x[j]
    return s / F32(x.shape[0])


@njit(**JIT)
def _imatrix_lanes_numba(xt, qw, sigma2, wt):
    """wt[i, g] = qw[g*n + i] * sqrt(sigma2 + x^2): the legacy types' imatrix weights."""
    n, G = xt.shape
    for g in range(G):
        for i in range(n):
            wt[i, g] = qw[g * n + i] * np.sqrt(sigma2 + xt[i, g] * xt[i, g])


@njit(**JIT)
def _put_qh_qs_numba(o, at, L):
    """Q5_0/Q5_1 tail: qh (bit 4 of 32 codes, little-endian u32) then 16 nibble bytes."""
    qh = 0
    for j in range(16):
        a, b = L[j] & 255, L[j + 16] & 255
        o[at + 4 + j] = (a & 15) | ((b & 15) << 4)
        qh |= ((a & 16) >> 4) << j
        qh |= ((b & 16) >> 4) << (j + 16)
    for k in range(4):
        o[at + k] = (qh >> (8 * k)) & 255



@njit(**JIT)
def _q8_0_numba(x2, qw, out, err):
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


@njit(**JIT)
def _legacy_sym_numba(x2, qw, out, err, nmax, size, sigma2):
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
            _imatrix_lanes_numba(xt, qw, sigma2[r] if sigma2.shape[0] else _row_sigma2_numba(xr), wt)
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
                _put_qh_qs_numba(o, 2, L)
        err[r] += e
    return out


@njit(**JIT)
def _q4_0_numba(x2, qw, out, err):
    return _legacy_sym_numba(x2, qw, out, err, 8, 18, np.empty(0, np.float32))


@njit(**JIT)
def _q4_0_slice_numba(x2, qw, sigma2, out, err):
    return _legacy_sym_numba(x2, qw, out, err, 8, 18, sigma2)


@njit(**JIT)
def _q5_0_numba(x2, qw, out, err):
    return _legacy_sym_numba(x2, qw, out, err, 16, 22, np.empty(0, np.float32))


@njit(**JIT)
def _q5_0_slice_numba(x2, qw, sigma2, out, err):
    return _legacy_sym_numba(x2, qw, out, err, 16, 22, sigma2)


@njit(**JIT)
def _legacy_asym_numba(x2, qw, out, err, nmax, size, sigma2):
    """Q4_1 (nmax 15, 20 B) / Q5_1 (nmax 31, 24 B): x = d*q + m, codes in [0, nmax].
    `sigma2` as in _legacy_sym_numba."""
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
            _imatrix_lanes_numba(xt, qw, sigma2[r] if sigma2.shape[0] else _row_sigma2_numba(xr), wt)
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
                _put_qh_qs_numba(o, 4, L)
            for j in range(32):
                e += _sq_diff(F32(L[j] & nmax) * d16 + m16, x[j])
        err[r] += e
    return out


@njit(**JIT)
def _q4_1_numba(x2, qw, out, err):
    return _legacy_asym_numba(x2, qw, out, err, 15, 20, np.empty(0, np.float32))


@njit(**JIT)
def _q4_1_slice_numba(x2, qw, sigma2, out, err):
    return _legacy_asym_numba(x2, qw, out, err, 15, 20, sigma2)


@njit(**JIT)
def _q5_1_numba(x2, qw, out, err):
    return _legacy_asym_numba(x2, qw, out, err, 31, 24, np.empty(0, np.float32))


@njit(**JIT)
def _q5_1_slice_numba(x2, qw, sigma2, out, err):
    return _legacy_asym_numba(x2, qw, out, err, 31, 24, sigma2)

@njit(**JIT)
def row_sigma2_numba(x2, out):
    """out[r] = sum(x2[r]^2) / K, in column order (what the legacy encoders compute per row)."""
    for r in range(x2.shape[0]):
        out[r] = _row_sigma2_numba(x2[r])

# ----------------------------------------------------------------- torch decoders

def _q8_0_decode(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2])[:, None] * b[:, 2:].contiguous().view(torch.int8).float()


def _q4_0_decode(b: torch.Tensor) -> torch.Tensor:
    lo, hi = _lo_hi(b[:, 2:])
    return torch.cat([lo, hi], 1).sub(8).float() * _f16(b[:, :2])[:, None]


def _q4_1_decode(b: torch.Tensor) -> torch.Tensor:
    lo, hi = _lo_hi(b[:, 4:])
    return torch.cat([lo, hi], 1).float() * _f16(b[:, :2])[:, None] + _f16(b[:, 2:4])[:, None]


def _q5_decode(b: torch.Tensor, off: int) -> torch.Tensor:
    lo, hi = _lo_hi(b[:, off + 4:])
    return torch.cat([lo, hi], 1) | (_bit4(b[:, off:off + 4]) << 4)


def _q5_0_decode(b: torch.Tensor) -> torch.Tensor:
    return (_q5_decode(b, 2) - 16).float() * _f16(b[:, :2])[:, None]


def _q5_1_decode(b: torch.Tensor) -> torch.Tensor:
    return _q5_decode(b, 4).float() * _f16(b[:, :2])[:, None] + _f16(b[:, 2:4])[:, None]

CODECS = (
    Codec(Q.Q8_0, torch_encoder=_q8_0_torch, compiled_encoder=_q8_0_numba,
          torch_decoder=_q8_0_decode, chunk=1 << 18),
    Codec(Q.Q4_0, torch_encoder=_q4_0_torch, compiled_encoder=_q4_0_numba,
          compiled_slice_encoder=_q4_0_slice_numba, torch_decoder=_q4_0_decode,
          prep=_row_sigma2_torch, prep_reads_row=True, chunk=1 << 18),
    Codec(Q.Q4_1, torch_encoder=_q4_1_torch, compiled_encoder=_q4_1_numba,
          compiled_slice_encoder=_q4_1_slice_numba, torch_decoder=_q4_1_decode,
          prep=_row_sigma2_torch, prep_reads_row=True, chunk=1 << 18),
    Codec(Q.Q5_0, torch_encoder=_q5_0_torch, compiled_encoder=_q5_0_numba,
          compiled_slice_encoder=_q5_0_slice_numba, torch_decoder=_q5_0_decode,
          prep=_row_sigma2_torch, prep_reads_row=True, chunk=1 << 18),
    Codec(Q.Q5_1, torch_encoder=_q5_1_torch, compiled_encoder=_q5_1_numba,
          compiled_slice_encoder=_q5_1_slice_numba, torch_decoder=_q5_1_decode,
          prep=_row_sigma2_torch, prep_reads_row=True, chunk=1 << 18),
)
