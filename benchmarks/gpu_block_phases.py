"""Where a GPU block's seconds go, phase by phase (synchronised wall clock, no profiler
overhead): quantkit's block loop on `--layers` blocks of Llama-3.1-8B shapes, 128 x 2048
random tokens, with each phase function of quantkit.pipeline.blocks wrapped in a timer.

  python3 benchmarks/gpu_block_phases.py --methods gptq,gptq-layer-sequential
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_quantkit_vs_llmcompressor import synthetic_llama  # noqa: E402

import quantkit.methods.gptq as gptq  # noqa: E402
import quantkit.pipeline.blocks as blocks  # noqa: E402
from quantkit.arch import spec_for_config  # noqa: E402
from quantkit.methods import get_quantizer  # noqa: E402
from quantkit.types import QuantScheme  # noqa: E402

PHASES = ("capture_block_inputs", "_check_block_finite", "_group_stats", "run_block",
          "_block_and_results_to_cpu", "block_dense")


def timed(fn, name, totals):
    def wrapper(*a, **k):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn(*a, **k)
        torch.cuda.synchronize()
        totals[name] += time.perf_counter() - t0
        return out
    return wrapper


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--methods", default="gptq,gptq-layer-sequential")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    report = {}
    for method in args.methods.split(","):
        base, _, mode = method.partition("-")
        quantizer = get_quantizer(base, **({"true_sequential": False} if mode else {}))
        totals: dict[str, float] = collections.defaultdict(float)
        saved = {n: getattr(blocks, n) for n in PHASES}
        for n in PHASES:
            setattr(blocks, n, timed(saved[n], n, totals))
        quantizer.quantize_block = timed(quantizer.quantize_block, "method.quantize_block", totals)
        inner = {n: getattr(gptq, n) for n in ("inverse_hessian_factor", "gptq_quantize")}
        for n, fn in inner.items():  # inside quantize_block (not added to "other")
            setattr(gptq, n, timed(fn, "  of which gptq." + n, totals))
        model = synthetic_llama(args.layers)
        ids = torch.randint(0, 128000, (128, 2048), generator=torch.Generator().manual_seed(0))
        scheme = QuantScheme(bits=4, group_size=128, symmetric=base == "gptq")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        blocks.quantize_blocks(model, spec_for_config(model.config), quantizer, scheme,
                               list(ids.split(8)), device="cuda", compute_dtype=torch.bfloat16)
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
        for n in PHASES:
            setattr(blocks, n, saved[n])
        for n, fn in inner.items():
            setattr(gptq, n, fn)
        totals["other"] = total - sum(v for k, v in totals.items() if not k.startswith(" "))
        report[method] = {"layers": args.layers, "total_s": round(total, 3),
                          "phases_s": {k: round(v, 3) for k, v in totals.items()}}
        print(method, json.dumps(report[method], indent=1), flush=True)
        del model
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
