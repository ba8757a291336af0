"""mlx-lm's own GPTQ / AWQ (mlx_lm.quant.gptq.gptq_quantize, mlx_lm.quant.awq.awq_quantize,
mlx-lm 0.32.2) on given calibration tokens, the Linears only: run with MLX's Python (the venv
scripts/setup_mlx.sh builds) by benchmarks/mlx_vs_mlxlm.py.

    PY benchmarks/mlxlm_quant_peer.py {gptq,awq} SRC DST TOKENS.npy BITS GROUP

What differs from `python -m mlx_lm.quant.{gptq,awq}`, and why (each changes what is
quantized or how fast, not the algorithm):
  * calibration: TOKENS.npy (int [n, seqlen], quantkit's calibration windows) instead of
    load_data's download of calibration_data_v5_rc.txt (this machine is offline); the same
    tokens for both tools.
  * the tied embedding (SmolLM2's output head too) stays bf16, as quantkit keeps it: GPTQ's
    fallback quantizes every other module that has to_quantized at --fallback-bits (so
    Embedding loses the method here), and AWQ quantizes the embedding at --embed-bits (so its
    to_quantized returns the layer itself).
  * AWQ's block losses run QuantizedLinear through mx.dequantize + matmul instead of MLX's
    CPU quantized_matmul (the same weights, far faster on this CPU; the eval does the same).
"""

from __future__ import annotations

import sys
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.utils import load, save


def _dense_embedding(self, *args, **kwargs):
    return self


def _dequantized_call(self, x):
    w = mx.dequantize(self["weight"], self["scales"], self.get("biases"),
                      group_size=self.group_size, bits=self.bits, mode=self.mode)
    y = x @ w.T
    return y + self["bias"] if "bias" in self else y


def main() -> None:
    method, src, dst, tokens_file = sys.argv[1:5]
    bits, group = int(sys.argv[5]), int(sys.argv[6])
    if method == "gptq":
        del nn.Embedding.to_quantized
    else:
        nn.Embedding.to_quantized = _dense_embedding
    model, tokenizer, config = load(src, lazy=True, return_config=True)
    data = mx.array(np.load(tokens_file).astype(np.int32))
    t0 = time.perf_counter()
    if method == "gptq":
        from mlx_lm.quant.gptq import gptq_quantize

        model, config["quantization"] = gptq_quantize(model, data, bits, group, bits, group)
    elif method == "awq":
        from mlx_lm.quant.awq import AWQ_MODEL_CONFIGS, awq_quantize, update_config

        nn.QuantizedLinear.__call__ = _dequantized_call
        awq_quantize(model, data, AWQ_MODEL_CONFIGS[config["model_type"]], group_size=group,
                     bits=bits)
        config = update_config(model, config)
    else:
        raise SystemExit(f"unknown method {method!r}")
    config["quantization_config"] = config["quantization"]
    print(f"mlx_lm.quant {method}: {time.perf_counter() - t0:.1f} s", flush=True)
    save(dst, src, model, tokenizer, config)


if __name__ == "__main__":
    main()
