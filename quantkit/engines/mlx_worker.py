"""Runs inside MLX's own virtualenv (it imports nothing from quantkit).

Usage:
  python mlx_worker.py generate REQUEST.json RESPONSE.json
      Request: {"model": dir, "dequantize": bool, "generate": [{"prompt": str, "max_tokens": n}]}
      Response: {"mlx_version", "mlx_lm_version", "quantized_layers", "load_seconds",
                 "generate": [text]}   (greedy, the prompt as it is: no chat template)
  python mlx_worker.py dequantize MODEL OUT.npz
      Every stored quantized tensor `<name>.weight` (with `.scales` / `.biases`) through
      mx.dequantize, bits and group size as config.json's `quantization` names them, in the
      scales' dtype and saved as float32 (exact: bf16 / fp16 widen without rounding).
  python mlx_worker.py serve MODEL DEQUANTIZE(0|1)
      Prints one JSON line {"mlx_version", "mlx_lm_version", "quantized_layers", "dtype"} once
      loaded, then for every stdin line "IDS.npy OUT.npy" (int32 [B, T] token ids) writes the
      float32 logits [B, T, vocab] to OUT.npy and prints "ok"; exits when stdin closes.
`dequantize`: every quantized layer replaced by its mx.dequantize'd weight in the model's
dtype (mlx_lm.utils.dequantize_model, what `mlx_lm convert -d` does): MLX's CPU quantized
matmul is far slower than its float one, and dequantized weights give the same numbers the
stored codes stand for.
"""

import json
import os
import sys
import time
from importlib.metadata import version

# this folder holds quantkit/engines/mlx.py; keep it from shadowing the real mlx package
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]


def _load(model: str, dequantize: bool):
    from mlx_lm import load
    from mlx_lm.utils import dequantize_model

    t0 = time.perf_counter()
    m, tok = load(model)
    quantized = sum(1 for _, mod in m.named_modules() if hasattr(mod, "scales"))
    if dequantize and quantized:
        m = dequantize_model(m)
    dtype = next((str(p.dtype) for _, p in _leaves(m.parameters())), "")
    info = {"mlx_version": version("mlx"), "mlx_lm_version": version("mlx-lm"),
            "quantized_layers": quantized, "dtype": dtype.removeprefix("mlx.core."),
            "load_seconds": time.perf_counter() - t0}
    return m, tok, info


def _leaves(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}{k}.")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _leaves(v, f"{prefix}{i}.")
    else:
        yield prefix, tree


def generate(req_path: str, resp_path: str) -> None:
    from mlx_lm import generate as mlx_generate

    req = json.load(open(req_path))
    m, tok, info = _load(req["model"], bool(req.get("dequantize")))
    texts = [mlx_generate(m, tok, prompt=g["prompt"], max_tokens=int(g.get("max_tokens", 8)))
             for g in req.get("generate", [])]
    json.dump({**info, "generate": texts}, open(resp_path, "w"))


def serve(model: str, dequantize: str) -> None:
    import mlx.core as mx
    import numpy as np

    m, _tok, info = _load(model, dequantize == "1")
    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        ids_path, out_path = line.split()
        ids = mx.array(np.load(ids_path))
        logits = m(ids).astype(mx.float32)
        mx.eval(logits)
        np.save(out_path, np.array(logits))
        print("ok", flush=True)


def dequantize(model: str, out_path: str) -> None:
    import glob

    import mlx.core as mx
    import numpy as np

    quant = json.load(open(os.path.join(model, "config.json")))["quantization"]
    weights = {}
    for f in sorted(glob.glob(os.path.join(model, "model*.safetensors"))):
        weights.update(mx.load(f))
    out = {}
    for key in weights:
        if not key.endswith(".scales"):
            continue
        base = key[: -len(".scales")]
        layer = quant.get(base) if isinstance(quant.get(base), dict) else quant
        w = mx.dequantize(weights[base + ".weight"], weights[key], weights.get(base + ".biases"),
                          group_size=int(layer["group_size"]), bits=int(layer["bits"]),
                          mode=layer.get("mode", "affine"))
        out[base + ".weight"] = np.array(w.astype(mx.float32))
    np.savez(out_path, **out)


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    {"generate": generate, "serve": serve, "dequantize": dequantize}[cmd](*args)
