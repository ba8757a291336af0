"""Where a CPU AWQ run's time goes: wall time per phase, summed over all blocks.

  .venv/bin/python benchmarks/awq_cpu_phases.py [--model smollm2-135m] [--samples 64]
                                                 [--seqlen 512] [--threads 2] [--out DIR]

The demo's AWQ job (int4 g64 sym, `mixed`, 64 x 512 tokens, AutoAWQ GEMM export). Phases are
timed by wrapping the pipeline's and the method's own functions (no copy of their code): the
block forwards (`run_block`: the full-precision outputs, with the statistics hooked in when the
pipeline collects them in the same pass), a separate statistics pass (`_group_stats`, only
when one runs), AWQ's capture of the search inputs, the scale search of module groups
(`_module_loss` per candidate) and of single-Linear groups (`linear_scale_losses`), the
clipping search, the final rounding. Prints a table and the peak RSS.
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
    ap.add_argument("--out", type=Path, help="keep the artifact here (for an evaluation)")
    args = ap.parse_args()

    import torch

    import quantkit.methods.awq as awq
    import quantkit.pipeline.blocks as blocks
    import quantkit.pipeline.replay as replay
    from quantkit.formats import get_writer
    from quantkit.pipeline.quantize import QuantizeRequest, quantize
    from quantkit.types import QuantScheme

    torch.set_num_threads(args.threads)
    timer = PhaseTimer()
    timed, seconds, calls = timer.wrap, timer.seconds, timer.calls

    timed(blocks, "run_block", "block forwards (run_block)")
    timed(blocks, "_group_stats", "separate statistics pass")
    timed(awq.AWQQuantizer, "quantize_block", "awq quantize_block (all)")
    timed(replay.BlockReplay, "record", "  capture search inputs")
    timed(awq.AWQQuantizer, "_search", "  scale search (all groups)")
    timed(awq, "_module_loss", "    module-group losses")
    timed(awq, "module_scale_losses", "    module-group losses")
    timed(awq, "linear_scale_losses", "    single-Linear losses")
    timed(awq, "search_clip", "  clip search")
    timed(awq, "rtn_quantize_weight", "  final rounding")
    get_writer("awq")  # imported before the clock

    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        meta = quantize(QuantizeRequest(
            model=args.model, method="awq", format="awq", out=args.out or Path(tmp) / "out",
            scheme=QuantScheme(bits=4, group_size=64, symmetric=True),
            calib="mixed", calib_samples=args.samples, calib_seqlen=args.seqlen, seed=0,
            device="cpu"))
        total = time.perf_counter() - t
    print(f"{'total (load + quantize + save)':34s} {total:7.1f} s   (quantize(): {meta['seconds']})")
    for label, s in seconds.items():
        print(f"{label:34s} {s:7.2f} s  ({len(calls[label])} calls)")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
