"""GPU self-test of quantkit.pipeline.transfer (needs CUDA): fetch_to_cpu returns exactly what
`.cpu()` does for every dtype/shape (chunk boundaries crossed, non-contiguous, empty, 0-dim),
and any_finite_problem flags exactly the tensors holding NaN/Inf. Exits 1 on a mismatch."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantkit.pipeline import transfer  # noqa: E402


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    dev = "cuda"
    ts = [torch.randn(4096, 14336, device=dev, generator=g).to(torch.bfloat16),  # 112 MiB
          torch.randn(3000, 30011, device=dev, generator=g),  # 343 MiB: crosses both buffers
          torch.randint(0, 16, (28672, 4096), device=dev, generator=g, dtype=torch.int32).to(torch.uint8),
          torch.randint(-5, 5, (77, 33), device=dev, generator=g, dtype=torch.int32),
          torch.randn(64, 32, device=dev, generator=g).T,  # non-contiguous
          torch.empty(0, 5, device=dev), torch.tensor(3.5, device=dev),
          torch.rand(1000, device=dev, generator=g) > 0.5, torch.randn(7, 9)]  # last one on CPU
    ok = True
    for _ in range(2):  # second round reuses the cached pinned buffers
        got = transfer.fetch_to_cpu(ts)
        for i, (a, b) in enumerate(zip(ts, got, strict=True)):
            want = a.cpu()
            same = (b.device.type == "cpu" and b.dtype == want.dtype and b.shape == want.shape
                    and torch.equal(b, want))
            ok &= same
            if not same:
                print(f"FAIL fetch_to_cpu tensor {i} {tuple(a.shape)} {a.dtype}")
    bad = torch.randn(100, 100, device=dev)
    bad[3, 7] = float("nan")
    inf = torch.randn(10, device=dev).to(torch.bfloat16)
    inf[0] = float("inf")
    flags = transfer.any_finite_problem([ts[0], bad, ts[2], inf, torch.randn(3), ts[3]])
    ok &= flags == [False, True, False, True, False, False]
    print("SELFTEST transfer", "ok" if ok else f"FAILED {flags}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
