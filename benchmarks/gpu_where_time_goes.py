"""Where quantkit's GPU GPTQ seconds go, block by block and outside the blocks: the memory
scope of gpu_quantkit_vs_llmcompressor.py (Llama-3.1-8B shapes, 128 x 2048 random tokens,
activations offloaded or on the GPU) with the main thread's stack sampled
(benchmarks/stack_sampler.py), each block's samples apart; then, with `--disk`, one
`quantkit quantize` from a checkpoint on disk (page cache dropped) with its stack sampled.

  python3 benchmarks/gpu_where_time_goes.py --layers 8 --methods gptq --placements offload --disk
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_quantkit_vs_llmcompressor as bench  # noqa: E402
from stack_sampler import StackSampler  # noqa: E402


def memory_run(method: str, layers: int, offload: bool, batch: int) -> dict:
    model = bench.synthetic_llama(layers)
    ids = torch.randint(0, 128000, (128, 2048), generator=torch.Generator().manual_seed(0))
    batches = list(ids.split(batch))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    marks = []
    sampler = StackSampler()
    sampler.label = "block 0"

    def progress(stage, done, total):
        torch.cuda.synchronize()
        marks.append(time.perf_counter())
        sampler.label = f"block {done}"

    t0 = time.perf_counter()
    with sampler:
        bench._quantize(model, method, batches, offload, progress)
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    per_block = [round(b - a, 3) for a, b in zip([t0] + marks[:-1], marks, strict=True)]
    row = {"method": method, "offload": offload, "batch": batch, "layers": layers,
           "seconds": round(dt, 2), "seconds_per_block": per_block,
           "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
           "stacks": sampler.report(top=14)}
    print(f"=== memory {method} offload={offload}: {dt:.2f} s, blocks {per_block}, "
          f"peak {row['peak_gpu_gib']} GiB", flush=True)
    sampler.print(top=14)
    del model
    torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--methods", default="gptq")
    p.add_argument("--placements", default="offload")
    p.add_argument("--disk", action="store_true")
    p.add_argument("--disk-variants", default="offload")
    p.add_argument("--out", default="benchmarks/results/gpu_where_time_goes.json")
    args = p.parse_args()
    from quantkit.pipeline.plan import OFFLOAD_BATCH

    rows = []
    for method in args.methods.split(","):
        for placement in args.placements.split(","):
            off = placement == "offload"
            rows.append(memory_run(method, args.layers, off, OFFLOAD_BATCH if off else 8))
    if args.disk:
        work = Path("/tmp/quantkit-where")
        model = bench.synthetic_llama(args.layers)
        ckpt = bench.write_checkpoint(model, work / "checkpoint", 128, 2048)
        del model
        bench_args = argparse.Namespace(samples=128, seqlen=2048)
        for method in args.methods.split(","):
            for variant in args.disk_variants.split(","):
                out_dir = work / "artifact"
                cli = bench.quantkit_cli_args(method, ckpt, bench_args, out_dir)
                if variant == "no-resume":
                    cli.append("--no-resume")
                stacks = work / "stacks.json"
                print("page cache:", bench.drop_page_cache(), flush=True)
                from quantkit.machine import huge_page_env

                cmd = [sys.executable, str(Path(__file__).with_name("quantkit_disk_run.py")),
                       *(["--force-offload"] if variant == "offload" else []),
                       "--sample-stacks", str(stacks), "--", *cli]
                proc = subprocess.run(cmd, capture_output=True, text=True,
                                      env=huge_page_env(dict(os.environ)))
                print(proc.stdout[-8000:], proc.stderr[-3000:], flush=True)
                got = [json.loads(x[7:]) for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
                rows.append({"disk": variant, "method": method, "result": got[0] if got else None,
                             "stacks": json.loads(stacks.read_text()) if stacks.is_file() else None})
                shutil.rmtree(out_dir, ignore_errors=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"commit": bench.git_commit(), "command": " ".join(sys.argv),
                               "gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
