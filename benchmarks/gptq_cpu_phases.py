"""Where a CPU GPTQ run's time goes: wall time per pipeline phase, summed over all blocks.

  .venv/bin/python benchmarks/gptq_cpu_phases.py [--model smollm2-135m] [--samples 64]
                                                  [--seqlen 512] [--threads 2]

Same scheme as gptq_vs_llmcompressor.py (int4 g64 sym, static act-order, damp 0.01, `mixed`).
Phases are timed by wrapping the pipeline's own functions (no copy of their code): the
one-pass block forwards (`StagedForward.advance` up to each sequential group, `finish` for
the rest), the Hessians (`_group_stats`), the GPTQ solves (`GPTQQuantizer.quantize_block`,
with the inverse factor and the compiled column loop inside it), the weight write-back.
Prints a table and the per-block forward times; the peak RSS at the end.
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

from phase_timer import PhaseTimer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch

    import quantkit.methods.gptq as gptq
    import quantkit.methods.gptq_cpu as gptq_cpu
    import quantkit.pipeline.blocks as blocks
    import quantkit.pipeline.staged as staged
    from quantkit.formats import get_writer
    from quantkit.pipeline.quantize import QuantizeRequest, quantize
    from quantkit.types import QuantScheme

    torch.set_num_threads(args.threads)
    timer = PhaseTimer()
    timed, seconds, calls = timer.wrap, timer.seconds, timer.calls

    timed(staged.StagedForward, "advance", "forward: up to each group")
    timed(staged.StagedForward, "finish", "forward: rest of the block")
    timed(blocks, "_group_stats", "hessians")
    timed(gptq.GPTQQuantizer, "quantize_block", "gptq solves (all)")
    timed(gptq, "inverse_hessian_factor", "  inverse factor")
    timed(gptq_cpu, "gptq_block", "  column loop")
    timed(blocks, "_set_weight", "weight write-back")
    get_writer("compressed-tensors")  # imported before the clock, as in the benchmark

    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        meta = quantize(QuantizeRequest(
            model=args.model, method="gptq", format="compressed-tensors", out=Path(tmp) / "out",
            scheme=QuantScheme(bits=4, group_size=64, symmetric=True, act_order=True),
            calib="mixed", calib_samples=args.samples, calib_seqlen=args.seqlen, seed=0,
            method_options={"damp": 0.01}))
        total = time.perf_counter() - t
    print(f"{'total (load + quantize + save)':32s} {total:7.1f} s   (quantize(): {meta['seconds']})")
    for label, s in seconds.items():
        print(f"{label:32s} {s:7.2f} s")
    per_block = [round(x, 3) for x in calls["forward: rest of the block"]]
    print("forward after the last group, per block:", per_block)
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
