"""GPU check of quantkit's GPTQ (Triton column loop, warm-up thread, H^-1 factor) against a
textbook float64 GPTQ, for sym/asym, act-order off/static/dynamic, groups 64/128.

  python3 benchmarks/gpu_gptq_check.py      (on the GPU machine; exits 1 on a failed check)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from reference_gptq import naive_gptq  # noqa: E402

from quantkit.methods import gptq_triton  # noqa: E402
from quantkit.methods.gptq import GPTQQuantizer, gptq_quantize  # noqa: E402
from quantkit.types import QuantScheme  # noqa: E402


def main() -> int:
    dev = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(4096, 512, generator=g) * torch.linspace(0.2, 3, 512)
    w = (torch.randn(256, 512, generator=g) * 0.05).to(dev)
    h = (x.T @ x).to(dev)
    ok = True
    first = GPTQQuantizer()
    t = time.perf_counter()
    first.warm_up(QuantScheme(bits=4, group_size=64), dev)
    print(f"warm-up started in {time.perf_counter() - t:.3f} s; Triton available: {gptq_triton.available(dev)}")
    for sym in (True, False):
        for gs in (64, 128):
            scheme = QuantScheme(bits=4, group_size=gs, symmetric=sym)
            out = gptq_quantize(w, h, scheme)
            agree = (out.codes.double() == naive_gptq(w, h, scheme)).double().mean().item()
            good = agree > 0.99
            ok &= good
            print(f"sym={sym} g={gs}: codes agree with textbook float64 GPTQ {agree:.4f} {'ok' if good else 'FAIL'}")
            for static in (True, False):
                ao = QuantScheme(bits=4, group_size=gs, symmetric=sym, act_order=True)
                res = gptq_quantize(w, h, ao, static_groups=static)
                finite = bool(torch.isfinite(res.scale).all())
                ok &= finite
                print(f"  act-order static={static}: finite scales {finite}")
    print("ALL OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
