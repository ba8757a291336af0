"""Where a GPU block's time goes: torch.profiler over quantkit's block loop (2 blocks of
Llama-3.1-8B shapes, 128 x 2048 random tokens), top ops by CUDA and by CPU time.

  python3 benchmarks/profile_gpu_block.py --method gptq
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_quantkit_vs_llmcompressor import synthetic_llama  # noqa: E402

from quantkit.arch import spec_for_config  # noqa: E402
from quantkit.methods import get_quantizer  # noqa: E402
from quantkit.pipeline.blocks import quantize_blocks  # noqa: E402
from quantkit.types import QuantScheme  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--method", default="gptq")
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args()
    model = synthetic_llama(args.layers)
    spec = spec_for_config(model.config)
    ids = torch.randint(0, 128000, (128, 2048), generator=torch.Generator().manual_seed(0))
    scheme = QuantScheme(bits=4, group_size=128, symmetric=args.method == "gptq")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        quantize_blocks(model, spec, get_quantizer(args.method), scheme, list(ids.split(8)),
                        device="cuda", compute_dtype=torch.bfloat16)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
