"""quantkit's compiled IQ3_XXS / IQ3_S / IQ2_S / IQ2_XS / IQ2_XXS / IQ1_S / IQ1_M encoders (and
Q4_K for scale) vs llama.cpp's.

  PYTHONPATH=. .venv/bin/python benchmarks/iq_encoder_vs_ggml.py [--rows 49152]

Rows [rows, 256] of N(0, 0.02) with a fixed imatrix, encoded by encode_rows (the numba
encoders, torch.get_num_threads() threads) and by ggml_quantize_chunk from llama-cpp-python's
libggml-base (one thread, as one llama-quantize worker runs it); the bytes must be equal.
"""

from __future__ import annotations

import argparse
import ctypes
import time
from pathlib import Path

import llama_cpp
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from quantkit.ggml.codec import encode_rows, row_bytes


def ggml_quantize(w: np.ndarray, qtype: Q, qw: np.ndarray) -> np.ndarray:
    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so.0"))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    out = np.zeros((w.shape[0], row_bytes(qtype, w.shape[1])), np.uint8)
    lib.ggml_quantize_init(int(qtype))
    lib.ggml_quantize_chunk(int(qtype), w.ctypes.data, out.ctypes.data, 0, w.shape[0], w.shape[1], qw.ctypes.data)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=49152)
    ap.add_argument("--types", default="IQ3_XXS,IQ3_S,IQ2_S,IQ2_XS,IQ2_XXS,IQ1_S,IQ1_M,Q4_K",
                    help="comma-separated GGML type names")
    args = ap.parse_args()
    torch.manual_seed(0)
    w = torch.randn(args.rows, 256) * 0.02
    qw = torch.rand(256) ** 3 * 40
    x, q = w.numpy(), qw.numpy()
    for qt in (Q[t.strip().upper()] for t in args.types.split(",")):
        encode_rows(w[:64], qt, qw)  # load the compiled code and ggml's grid tables first
        t = time.perf_counter()
        ggml_quantize(x[:64], qt, q)
        init = time.perf_counter() - t
        t = time.perf_counter()
        ours = encode_rows(w, qt, qw).numpy()
        a = time.perf_counter() - t
        t = time.perf_counter()
        ref = ggml_quantize(x, qt, q)
        b = time.perf_counter() - t
        assert np.array_equal(ours, ref), qt.name
        print(f"{qt.name}: quantkit {a:.2f} s ({torch.get_num_threads()} threads), ggml {b:.2f} s "
              f"(1 thread), {w.numel() / 1e6:.1f} M values, bytes equal (ggml's table init and 64 rows: "
              f"{init:.2f} s)")


if __name__ == "__main__":
    main()
