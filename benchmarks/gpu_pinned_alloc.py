"""How long page-locked (pinned) host memory takes to get, by allocator setting: what the
offloaded GPU pipeline pays when it first holds a block's hidden states in host memory
(128 x 2048 tokens of Llama-3.1-8B: 32 batches of 4 x 2048 x 4096 bf16 = 64 MiB, 2 GiB).

Each setting runs in a fresh process (PYTORCH_CUDA_ALLOC_CONF is read when CUDA starts):
`torch.empty(..., pin_memory=True)` for 32 such batches (new pinned memory, what HostSink
does), then `.pin_memory()` of 32 pageable batches (a copy into new pinned memory, what the
capture's to_host does), each timed.

  python3 benchmarks/gpu_pinned_alloc.py [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SETTINGS = ["", "pinned_use_cuda_host_register:True,pinned_num_register_threads:4",
            "pinned_use_cuda_host_register:True,pinned_num_register_threads:8",
            "pinned_use_cuda_host_register:True,pinned_num_register_threads:16"]


def child() -> None:
    import torch

    torch.zeros(1, device="cuda")
    shape = (4, 2048, 4096)
    t0 = time.perf_counter()
    fresh = [torch.empty(shape, dtype=torch.bfloat16, pin_memory=True) for _ in range(32)]
    t1 = time.perf_counter()
    pageable = [torch.ones(shape, dtype=torch.bfloat16) for _ in range(32)]
    t2 = time.perf_counter()
    pinned = [p.pin_memory() for p in pageable]
    t3 = time.perf_counter()
    dev = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    t4 = time.perf_counter()
    for p in pinned:
        dev.copy_(p, non_blocking=True)
    torch.cuda.synchronize()
    t5 = time.perf_counter()
    print(json.dumps({"empty_pinned_2gib_s": round(t1 - t0, 3), "pin_memory_2gib_s": round(t3 - t2, 3),
                      "h2d_2gib_s": round(t5 - t4, 3), "n": len(fresh)}))


def main() -> None:
    if "--child" in sys.argv:
        child()
        return
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    for setting in SETTINGS:
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=setting)
        for _ in range(2):
            proc = subprocess.run([sys.executable, __file__, "--child"], env=env,
                                  capture_output=True, text=True)
            got = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else \
                {"error": proc.stderr[-500:]}
            row = {"PYTORCH_CUDA_ALLOC_CONF": setting, **got}
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
