"""FP8 vs bf16 Linear speed on one GPU (issue 3): quantkit's ScaledMMLinear (torch._scaled_mm,
E4M3 weights, inputs quantized on the fly) against bf16 F.linear, on Llama-3.1-8B Linear
shapes with random weights, timed with CUDA events after warm-up.

Run on the GPU machine from the repo root:
  python3 benchmarks/fp8_scaled_mm_gpu.py --out $OUT/fp8_scaled_mm_h100.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    from quantkit.methods.fp8 import benchmark_scaled_mm

    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default="benchmarks/results/fp8_scaled_mm.json")
    args = p.parse_args()
    rows = benchmark_scaled_mm(iters=args.iters)
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    base = {(r["layer"], r["tokens"]): r["ms"] for r in rows if r["variant"] == "bf16"}
    print(f"{'layer':13s} {'tokens':>6s} {'variant':22s} {'ms':>8s} {'x bf16':>7s} {'rel err':>8s}")
    for r in rows:
        print(f"{r['layer']:13s} {r['tokens']:6d} {r['variant']:22s} {r['ms']:8.4f} "
              f"{base[(r['layer'], r['tokens'])] / r['ms']:7.2f} {r['rel_err_vs_bf16']:8.4f}")


if __name__ == "__main__":
    main()
