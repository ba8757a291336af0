"""Bit-for-bit check of two quantkit checkouts on the GPU: run each with `--root`, compare the
two JSON files with `--compare A B`.

For GPTQ and AWQ (W4A16 g128) on `--layers` synthetic Llama-3.1-8B-shaped blocks, it records a
SHA-256 of every result tensor (codes, scale, zero, g_idx, bias, extra) and of every tensor the
model holds afterwards (quantize_blocks writes dequantized weights back), so two checkouts give
equal files exactly when their GPU artifacts are identical.

  python3 benchmarks/gpu_equivalence_check.py --root OLD --out old.json
  python3 benchmarks/gpu_equivalence_check.py --root NEW --out new.json
  python3 benchmarks/gpu_equivalence_check.py --compare old.json new.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch


def _sha(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous()
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16] + \
        f":{t.dtype}:{tuple(t.shape)}"


def run(root: str, layers: int, samples: int, seqlen: int) -> dict:
    root_dir = Path(root).resolve()
    for m in [m for m in sys.modules if m.split(".")[0] == "quantkit"]:
        del sys.modules[m]
    sys.path.insert(0, str(root_dir))
    sys.path.insert(1, str(Path(__file__).resolve().parent))
    import quantkit

    if not Path(quantkit.__file__).resolve().is_relative_to(root_dir):
        sys.exit(f"quantkit came from {quantkit.__file__}, not {root_dir}: the comparison "
                 f"would not test the code under --root (sys.path[:4]: {sys.path[:4]})")
    from quantkit.arch import spec_for_config
    from quantkit.methods import get_quantizer
    from quantkit.pipeline.blocks import quantize_blocks
    from quantkit.types import QuantScheme

    # only after quantkit: that module puts its own checkout first on sys.path (importing it
    # first made both sides of the 2026-11-23 H100 comparison load the same, new code)
    synthetic_llama = __import__("gpu_quantkit_vs_llmcompressor").synthetic_llama

    out = {"quantkit_file": quantkit.__file__}
    for method in ("gptq", "awq"):
        model = synthetic_llama(layers)
        spec = spec_for_config(model.config)
        ids = torch.randint(0, 128000, (samples, seqlen), generator=torch.Generator().manual_seed(0))
        scheme = QuantScheme(bits=4, group_size=128, symmetric=method == "gptq")
        results = quantize_blocks(model, spec, get_quantizer(method), scheme, list(ids.split(8)),
                                  device="cuda", compute_dtype=torch.bfloat16)
        rec = {}
        for name, r in sorted(results.items()):
            for attr in ("codes", "scale", "zero", "g_idx", "bias"):
                t = getattr(r, attr)
                if t is not None:
                    rec[f"{name}.{attr}"] = _sha(t) + f":{t.device.type}"
            for k, t in r.extra.items():
                rec[f"{name}.extra.{k}"] = _sha(t) + f":{t.device.type}"
            rec[f"{name}.loss"] = r.loss
        for name, t in model.state_dict().items():
            rec[f"model.{name}"] = _sha(t) + f":{t.device.type}"
        out[method] = rec
        del model, results
        torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", default=".")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--out")
    p.add_argument("--compare", nargs=2)
    args = p.parse_args()
    if args.compare:
        a, b = (json.loads(Path(f).read_text()) for f in args.compare)
        for method in ("gptq", "awq"):
            keys = sorted(set(a[method]) | set(b[method]))
            diff = [k for k in keys if a[method].get(k) != b[method].get(k)]
            print(f"EQUIV {method}: {len(keys) - len(diff)}/{len(keys)} entries identical"
                  + (f"; differ: {diff[:8]}" if diff else ""))
        return
    res = run(args.root, args.layers, args.samples, args.seqlen)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {args.out} ({res['quantkit_file']})")


if __name__ == "__main__":
    main()
