"""Where a SmolLM2-135M forward spends its time on this CPU (torch.profiler, float32).

  .venv/bin/python benchmarks/forward_profile_cpu.py [--results benchmarks/results/forward_profile_cpu.json]

Why: the demo and the test suite are mostly forwards of this model (calibration, held-out
scoring). If the matmuls already run near the CPU's peak, only less work makes them faster
(fewer tokens, fewer passes), not another kernel. Runs the decoder body (no lm_head) on
4 x 512 random token ids, once to warm up, then timed and profiled; records the share of each
op, the matmuls' GFLOP/s (2 x tokens x the body's Linear weights), the commit and the CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from vllm_dtype_cpu import _git_commit  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=ROOT / "results" / "forward_profile_cpu.json")
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM

    from quantkit.machine import cpu_info
    from quantkit.model_io import resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2-135m").path,
                                                 dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (4, 512), generator=torch.Generator().manual_seed(0))
    linear_weights = sum(m.weight.numel() for n, m in model.model.named_modules()
                         if isinstance(m, torch.nn.Linear))
    with torch.inference_mode():
        model.model(ids)  # warm-up
        t0 = time.perf_counter()
        model.model(ids)
        seconds = time.perf_counter() - t0
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model.model(ids)
    ops = sorted(((e.key, e.self_cpu_time_total / 1e6) for e in prof.key_averages()),
                 key=lambda kv: -kv[1])
    total = sum(t for _, t in ops)
    mm = sum(t for k, t in ops if k in ("aten::mm", "aten::addmm", "aten::bmm"))
    flop = 2 * ids.numel() * linear_weights
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "commit": _git_commit(),
        "cpu": cpu_info(), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "tokens": ids.numel(), "attention": model.config._attn_implementation,
        "forward_seconds": seconds, "matmul_seconds": mm, "matmul_share": mm / total,
        "matmul_gflop_per_s": flop / mm / 1e9,
        "ops": [{"op": k, "seconds": t, "share": t / total} for k, t in ops[:12]],
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=2))
    print(f"forward of {ids.numel()} tokens: {seconds:.2f} s; matmuls {100 * mm / total:.0f} % "
          f"at {result['matmul_gflop_per_s']:.0f} GFLOP/s; results: {args.results}")
    for op in result["ops"][:6]:
        print(f"  {op['op']:<55} {op['seconds']:.3f} s  {100 * op['share']:.1f} %")


if __name__ == "__main__":
    main()
