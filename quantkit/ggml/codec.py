"""Encode and decode GGML tensors of any type: the dispatch from a type to its codec.

`encode_rows(w, qtype, qw)` turns float32 rows [N, K] into the bytes llama.cpp writes,
[N, K / block * block_bytes] uint8, bit-exact with ggml-quants.c. `qw` is the imatrix row ([K],
shared by every row); without it the `_ref` algorithms run, with it the `_impl` ones (Q8_0
ignores it); IQ2_XXS, IQ2_XS and IQ1_S have no algorithm without it
(ggml_quantize_requires_imatrix), so qw is required (IQ1_M weights by x^2 without one, as ggml).
`decode_rows` mirrors `dequantize_row_*` in torch, on the tensor's device; `quantize_tensor` /
`dequantize_tensor` add the plain float types and gguf-py's numpy decoder for the rest.

Each type's encoders and decoders live in its family module (legacy, k_quants, iq4, iq3, iq2,
iq1, floats), which lists them in `CODECS`; the catalogue row of a type names that module, so
the dispatch here names no type. A family module imports numba (through quantkit.ggml.jit)
when it is first used, not when this module is imported. Block layouts are drawn in each
family module. The grid types (IQ3/IQ2/IQ1) have compiled (numba) encoders only: on a GPU
the rows are encoded on the CPU and the bytes moved back.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as _np_dequantize

from quantkit.ggml.catalogue import REQUIRES_IMATRIX, TYPES, block_size, type_size
from quantkit.ggml.jit import compiled_available

__all__ = ["Codec", "codec", "encode_rows", "encode_slice", "decode_rows", "quantize_tensor",
           "dequantize_tensor", "row_bytes", "preload_compiled", "SUPPORTED", "BACKENDS"]

Q = GGMLQuantizationType
# the GGML types encode_rows encodes: every catalogue type but the plain float copies
SUPPORTED = tuple(q for q in TYPES if q not in (Q.F32, Q.F16, Q.BF16))
BACKENDS = ("compiled", "torch")
# values per encoder call on a GPU; on CPU each codec says (Codec.chunk)
_CHUNK_GPU = 1 << 24
_SLAB = 1 << 23  # values per slab for the whole-row / super-block sums


@dataclass(frozen=True)
class Codec:
    """One GGML type's encoders and decoder, as its family module lists them in CODECS."""
    qtype: Q
    # vectorised torch encoder (x float32 [n, K], qw [K] or None, prep) -> uint8 blocks;
    # None: compiled only
    torch_encoder: Callable | None = None
    # numba encoder (x [rows, K] float32 C-contiguous, qw [K] float32 or empty,
    # out [rows, row_bytes] uint8, err [rows] float64 += sum over the row of (decoded - x)^2)
    compiled_encoder: Callable | None = None
    # the compiled encoder on a column slice of longer rows (GPTQ's column blocks):
    # (x, qw, sigma2 [rows] of the WHOLE rows, out, err)
    compiled_slice_encoder: Callable | None = None
    # torch decoder: blocks [B, type_size] uint8 -> float32 [B, block]; None: gguf-py's numpy one
    torch_decoder: Callable | None = None
    # the imatrix path's whole-row / whole-super-block sum of x^2, computed once per slab (a few
    # long sequential loops) instead of per chunk (many short ones)
    prep: Callable | None = None
    prep_reads_row: bool = False  # prep is of the whole row: a column slice reads it from there
    # values per torch encoder call on CPU: small enough that an encoder's temporaries stay in
    # cache, large enough to amortise the per-op cost of its long op chains
    # (benchmarks/kquant_encoder_speed.py)
    chunk: int = 1 << 16
    dtype: torch.dtype | None = None  # a plain little-endian copy of this dtype (F16/BF16/F32)


@functools.cache
def _family(module: str) -> dict[Q, Codec]:
    """The codecs a family module lists, imported at first use (numba loads with it)."""
    return {c.qtype: c for c in importlib.import_module(f"quantkit.ggml.{module}").CODECS}


def codec(qtype: int) -> Codec | None:
    """The codec of a GGML type, found through its catalogue row (None: not in the catalogue)."""
    row = TYPES.get(Q(qtype))
    return None if row is None else _family(row.codec).get(row.qtype)


def row_bytes(qtype: int, k: int) -> int:
    return k // block_size(qtype) * type_size(qtype)


def encode_slice(x: torch.Tensor, qtype: int, qw: torch.Tensor | None,
                 row_context: torch.Tensor) -> torch.Tensor:
    """Encode x [N, b], a column slice of rows [N, K], as `encode_rows` would encode it inside
    the whole rows: the legacy types' imatrix weights read sum(x^2)/K of the WHOLE row
    (`row_context`, the rows [N, K] that statistic is taken from); the K-quants' super-block
    statistics are local, so there the slice alone decides. Torch encoders (same bytes)."""
    qtype = Q(qtype)
    c = codec(qtype)
    if qw is None or c is None or not c.prep_reads_row:
        return encode_rows(x, qtype, qw)
    sigma2 = c.prep(row_context.float())
    out = c.torch_encoder(x.float().contiguous(), qw.float().reshape(-1), sigma2)
    return out.reshape(x.shape[0], -1)


def encode_rows(w: torch.Tensor, qtype: int, qw: torch.Tensor | None = None,
                backend: str | None = None, errors: bool = False):
    """Encode float rows [N, K] (any float dtype, taken as float32) into GGML blocks.

    Returns uint8 [N, row_bytes(qtype, K)] on w's device; with errors=True the pair
    (bytes, float64 [N] sum over each row of (decoded - w)^2). K must be a multiple of the
    type's block size; qw, when given, is a float32 [K] importance vector.
    backend: "compiled" (numba loops, CPU tensors only; the default there) or "torch" (the
    vectorised encoders here; the default on a GPU). Both give the same bytes.
    """
    qtype = Q(qtype)
    c = codec(qtype)
    if c is None or (c.torch_encoder is None and c.compiled_encoder is None):
        raise ValueError(f"no encoder for GGML type {qtype.name}")
    if qw is None and qtype in REQUIRES_IMATRIX:
        raise ValueError(f"{qtype.name} needs an importance matrix (qw): llama.cpp's quantizer has no "
                         f"{qtype.name} without one (ggml_quantize_requires_imatrix)")
    n, k = w.shape
    block = block_size(qtype)
    if k % block:
        raise ValueError(f"row width {k} is not a multiple of {block} ({qtype.name})")
    cpu = w.device.type == "cpu"
    backend = backend or ("compiled" if cpu and compiled_available() else "torch")
    if backend not in BACKENDS or (backend == "compiled" and not cpu):
        raise ValueError(f"encoder backend {backend!r} is not available for {w.device.type} "
                         f"tensors (choose from {BACKENDS}; 'compiled' runs on the CPU)")
    if c.torch_encoder is None:  # compiled only
        return _encode_on_cpu(w, c, qw, errors)
    w = w.to(torch.float32)
    if qw is not None:
        qw = qw.to(device=w.device, dtype=torch.float32).reshape(k)
    out = torch.empty(n, row_bytes(qtype, k), dtype=torch.uint8, device=w.device)
    if backend == "compiled":
        sq_err = _encode_compiled(w, c, qw, out)
    else:
        if n:
            _encode_torch(w, c, qw, out)
        sq_err = None
        if errors:
            sq_err = (decode_rows(out, qtype).double() - w.double()).square().sum(1)
    return (out, sq_err) if errors else out


def _encode_on_cpu(w: torch.Tensor, c: Codec, qw: torch.Tensor | None, errors: bool):
    """The compiled-only types on any device: CPU float32 copies in, bytes back on w's device."""
    if not compiled_available():
        raise ValueError(f"{c.qtype.name} needs the compiled (numba) encoders, and numba cannot be "
                         f"imported here; install numba or choose another GGUF type")
    x = w.detach().to("cpu", torch.float32).contiguous()
    q = None if qw is None else qw.detach().to("cpu", torch.float32).reshape(w.shape[1]).contiguous()
    out = torch.empty(w.shape[0], row_bytes(c.qtype, w.shape[1]), dtype=torch.uint8)
    sq_err = _encode_compiled(x, c, q, out)
    out = out.to(w.device)
    return (out, sq_err.to(w.device)) if errors else out


def _encode_compiled(w: torch.Tensor, c: Codec, qw: torch.Tensor | None,
                     out: torch.Tensor) -> torch.Tensor:
    """The codec's numba encoder over row ranges in torch.get_num_threads() threads.

    Returns each row's squared reconstruction error, which the encoders add up as they go.
    """
    enc = c.compiled_encoder
    x = w.contiguous().numpy()
    q = np.empty(0, np.float32) if qw is None else qw.contiguous().numpy()
    o = out.numpy()
    err = np.zeros(x.shape[0], np.float64)
    n = x.shape[0]
    threads = min(torch.get_num_threads(), n)
    if threads <= 1 or x.size < (1 << 16):
        if n:
            enc(x, q, o, err)
        return torch.from_numpy(err)
    step = -(-n // (threads * 4))  # a few ranges per thread evens out uneven rows
    list(_pool(threads).map(lambda r: enc(x[r:r + step], q, o[r:r + step], err[r:r + step]),
                            range(0, n, step)))
    return torch.from_numpy(err)


def preload_compiled(qtypes) -> None:
    """Load the compiled encoders of `qtypes` in a background thread (no waiting).

    numba loads an encoder's cached machine code at its first call (~0.5 s in a fresh
    process, more when it compiles); done while the caller reads the tokenizer and the
    model, the first tensor does not wait for it. An encoder called before its load has
    finished waits on numba's compile lock, so nothing runs twice.
    """
    import threading

    ids = sorted({int(Q(t)) for t in qtypes if Q(t) in SUPPORTED})

    def load() -> None:
        for t in ids:  # an imatrix row: same compiled code, and IQ2_XXS / IQ2_XS / IQ1_S require one
            enc = codec(t).compiled_encoder  # its family module (and numba) loads here
            if enc is None:
                continue
            x = np.zeros((1, 256), np.float32)
            enc(x, np.ones(256, np.float32), np.zeros((1, row_bytes(t, 256)), np.uint8),
                np.zeros(1))

    if ids and compiled_available():
        threading.Thread(target=load, name="quantkit-kquant-preload", daemon=True).start()


_POOLS: dict[int, ThreadPoolExecutor] = {}


def _pool(threads: int) -> ThreadPoolExecutor:
    """One long-lived pool per thread count: starting threads per tensor cost ~2 ms each."""
    if threads not in _POOLS:
        _POOLS[threads] = ThreadPoolExecutor(threads, thread_name_prefix="quantkit-kquant")
    return _POOLS[threads]


def _encode_torch(w: torch.Tensor, c: Codec, qw: torch.Tensor | None,
                  out: torch.Tensor) -> torch.Tensor:
    """The vectorised torch encoders. They are long chains of small element-wise ops, so on
    CPU chunks of ~64K values run in parallel Python threads with one intra-op thread each
    (torch releases the GIL): intra-op threading of such small ops mostly spins.
    """
    n, k = w.shape
    cpu = w.device.type == "cpu"
    rows = max(1, (c.chunk if cpu else _CHUNK_GPU) // k)
    slab = max(rows, _SLAB // k // rows * rows)
    prep_fn = c.prep if qw is not None else None
    threads = torch.get_num_threads() if cpu else 1
    pool = ThreadPoolExecutor(threads) if threads > 1 else None
    if pool is not None:
        torch.set_num_threads(1)
    try:
        for s0 in range(0, n, slab):
            ws = w[s0:s0 + slab]
            prep = prep_fn(ws) if prep_fn is not None else None
            per_row = None if prep is None else prep.reshape(ws.shape[0], -1)

            def run(r: int, ws=ws, per_row=per_row, s0=s0) -> None:
                p = None if per_row is None else per_row[r:r + rows].reshape(-1)
                enc_out = c.torch_encoder(ws[r:r + rows].contiguous(), qw, p)
                out[s0 + r:s0 + r + rows] = enc_out.reshape(-1, out.shape[1])

            starts = range(0, ws.shape[0], rows)
            if pool is None:
                for r in starts:
                    run(r)
            else:
                list(pool.map(run, starts))
    finally:
        if pool is not None:
            pool.shutdown()
            torch.set_num_threads(threads)
    return out


def decode_rows(data: torch.Tensor, qtype: int) -> torch.Tensor:
    """GGML bytes [N, row_bytes] (uint8, any device) -> float32 [N, K] on the same device."""
    c = codec(qtype)
    if c is None or c.torch_decoder is None:
        raise ValueError(f"no torch decoder for GGML type {Q(qtype).name}")
    block, size = block_size(qtype), type_size(qtype)
    n = data.shape[0]
    k = data.shape[1] // size * block
    return c.torch_decoder(data.reshape(-1, size)).reshape(n, k)


def quantize_tensor(w: torch.Tensor, qtype: int, imatrix: torch.Tensor | None = None,
                    errors: bool = False):
    """Rows [N, K] -> GGML bytes [N, row_bytes] (F16/BF16/F32 are plain little-endian copies).

    errors=True returns (bytes, float64 [N] squared reconstruction error per row).
    """
    qtype = Q(qtype)
    c = codec(qtype)
    if c is not None and c.dtype is not None:
        data = w.to(c.dtype).contiguous().view(torch.uint8)
        if not errors:
            return data
        return data, (w.to(c.dtype).double() - w.double()).square().sum(-1)
    return encode_rows(w, qtype, imatrix, errors=errors)


def dequantize_tensor(data: torch.Tensor, qtype: int) -> torch.Tensor:
    """GGML bytes [N, row_bytes] -> float32 [N, K], on data's device for the types we write."""
    qtype = Q(qtype)
    c = codec(qtype)
    if c is not None and c.dtype is not None:
        return data.contiguous().view(c.dtype).float()
    if c is not None and c.torch_decoder is not None:
        return decode_rows(data, qtype)
    arr = _np_dequantize(data.cpu().numpy(), qtype)  # gguf's reference, every other type
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))
