"""Where a CPU GPTQ run's time goes: wall time per pipeline phase, summed over all blocks.

  .venv/bin/python benchmarks/gptq_cpu_phases.py [--model smollm2-135m] [--samples 64]
                                                  [--seqlen 512] [--threads 2]

Same scheme as gptq_vs_llmcompressor.py (int4 g64 sym, static act-order, damp 0.01, `mixed`).
Phases are timed by wrapping the pipeline's own functions (no copy of their code): the
one-pass block forwards (`StagedForward.advance` up to each sequential group, `finish` for
the rest), the Hessians (`_group_stats`), the GPTQ solves (`GPTQQuantizer.quantize_block`,
with the inverse factor and the compiled column loop inside it), the weight write-back.
Prints a table and the per-block forward times; the peak RSS at the end, CPU seconds
(user + sys: comparable on a shared machine where wall seconds are not), and with --rss the
resident memory per phase: VmRSS sampled every 10 ms by a thread (torch's allocations are
invisible to tracemalloc), the highest value seen inside each phase and the phase at the peak.
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import tempfile
import threading
import time
from pathlib import Path

from phase_timer import PhaseTimer


def _vm(key: str) -> int:
    """/proc/self/status's `key` (VmRSS, VmHWM) in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


class RssSampler:
    """The highest VmRSS seen while each phase label is the innermost one running."""

    def __init__(self) -> None:
        self.stack: list[str] = ["outside phases"]
        self.peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(0.01):
            rss, label = _vm("VmRSS"), self.stack[-1]
            if rss > self.peak.get(label, 0):
                self.peak[label] = rss

    def wrap(self, owner, attr: str, label: str) -> None:
        fn = getattr(owner, attr, None)
        if fn is None:
            return

        def wrapper(*a, **k):
            self.stack.append(label)
            try:
                return fn(*a, **k)
            finally:
                self.stack.pop()
        setattr(owner, attr, wrapper)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rss", action="store_true", help="sample VmRSS per phase (10 ms)")
    args = ap.parse_args()

    import torch

    import quantkit.methods.gptq as gptq
    import quantkit.methods.gptq_cpu as gptq_cpu
    import quantkit.pipeline.blocks as blocks
    import quantkit.pipeline.staged as staged
    from quantkit.formats import get_writer
    from quantkit.machine import huge_page_state
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
    sampler = RssSampler()
    if args.rss:
        import quantkit.formats.compressed_tensors as ct_writer
        import quantkit.pipeline.quantize as pipeline_quantize
        for owner, attr, label in (
                (pipeline_quantize, "_open_model", "open model"),
                (blocks, "capture_block_inputs", "capture inputs"),
                (staged.StagedForward, "advance", "forward: up to each group"),
                (staged.StagedForward, "finish", "forward: rest of the block"),
                (blocks, "_group_stats", "hessians"),
                (gptq.GPTQQuantizer, "quantize_block", "gptq solves"),
                (blocks, "block_dense", "block dense copy"),
                (pipeline_quantize, "_streamed_dense", "streamed dense"),
                (ct_writer.CompressedTensorsWriter, "write", "write artifact")):
            sampler.wrap(owner, attr, label)
    get_writer("compressed-tensors")  # imported before the clock, as in the benchmark

    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    with tempfile.TemporaryDirectory() as tmp, sampler if args.rss else contextlib.nullcontext():
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
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = usage.ru_utime + usage.ru_stime - usage0.ru_utime - usage0.ru_stime
    print(f"CPU seconds (user + sys) of the job: {cpu:.1f}")
    print(f"peak RSS {usage.ru_maxrss / 1024:.0f} MiB (VmHWM {_vm('VmHWM') / 1024:.0f} MiB)")
    hp = huge_page_state()
    print(f"malloc huge pages: {'on' if hp['on'] else 'off'} ({hp['why']}; the quantkit command "
          "sets GLIBC_TUNABLES itself, this script runs as started)")
    for label, kib in sampler.peak.items():
        print(f"  highest VmRSS in {label:28s} {kib / 1024:7.0f} MiB")


if __name__ == "__main__":
    main()
