"""One `quantkit quantize` run, timed and with its peak GPU memory, for the disk-to-disk scope
of gpu_quantkit_vs_llmcompressor.py (which starts this in a fresh process per run).

usage: python3 benchmarks/quantkit_disk_run.py [--force-offload] [--sample-stacks JSON] -- quantize CKPT ... -o OUT

Runs the CLI in this process (click, `standalone_mode=False`) so that the timer and
`torch.cuda.max_memory_allocated` see exactly what the command does. The timer starts after
the imports and the CUDA context, as llmcompressor_gpu_peer.py's does; the parent times the
whole process too. `--force-offload` makes quantize() keep the calibration activations in host
memory, as it does by itself when `quantkit plan`'s on-GPU peak does not fit the free GPU memory
(an 80 GB card fits 8B shapes, so the choice is forced here to measure that path). Prints one
`RESULT {json}` line: seconds, peak GPU memory, and the artifact's own quantkit.json timings.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    argv = sys.argv[1:]
    ours = argv[: argv.index("--")] if "--" in argv else []
    force_offload = "--force-offload" in ours
    stacks = Path(ours[ours.index("--sample-stacks") + 1]) if "--sample-stacks" in ours else None
    cli = argv[argv.index("--") + 1:] if "--" in argv else argv
    # the libraries the command imports on its way, imported before the timer as the peer's
    # are (llm-compressor imports transformers and compressed-tensors when it is imported)
    import transformers.modeling_utils  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    import quantkit.calibration.loader  # noqa: F401
    import quantkit.formats.compressed_tensors  # noqa: F401
    import quantkit.pipeline.quantize as qk_quantize
    import quantkit.pipeline.streaming  # noqa: F401
    from quantkit.cli import main as quantkit_main

    if force_offload:
        qk_quantize.offload_activations = lambda plan, free_bytes: True
    cuda = torch.cuda.is_available()
    if cuda:
        torch.zeros(1, device="cuda")  # the CUDA context, outside the timer (as for the peer)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    sys.argv = ["quantkit", *cli]  # quantkit.json records the command as typed
    sampler = None
    if stacks is not None:  # benchmarks/gpu_where_time_goes.py: the main thread's stack sampled
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from stack_sampler import StackSampler

        sampler = StackSampler().__enter__()
    t0 = time.perf_counter()
    quantkit_main(cli, standalone_mode=False)
    if sampler is not None:
        sampler.__exit__(None, None, None)
        stacks.write_text(json.dumps(sampler.report(top=40), indent=1))
        sampler.print(top=40)
    if cuda:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    out = Path(cli[cli.index("-o") + 1])
    meta = json.loads((out / "quantkit.json").read_text())
    row = {"seconds": round(dt, 2),
           "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else 0.0,
           "peak_gpu_reserved_gib":
               round(torch.cuda.max_memory_reserved() / 2**30, 2) if cuda else 0.0,
           "activations": "offload" if meta.get("offload_activations") else "gpu",
           "activations_forced": force_offload,
           "quantkit_seconds": meta.get("seconds"),  # quantize (blocks) and total, as recorded
           "device": meta.get("device"),
           "gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}
    print("RESULT " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
