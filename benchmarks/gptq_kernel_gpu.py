"""GPTQ column loop on the GPU: the Triton kernel vs the reference torch loop, same inputs.

For Llama-3.1-8B Linear shapes and a real-looking Hessian (X^T X of random correlated
activations), runs `gptq_quantize` twice (QUANTKIT_GPTQ_TRITON=1 / 0) and reports time, the
share of identical integer codes, and the relative reconstruction error of each. The kernel
does the reference arithmetic, so the codes should agree except where float summation order
flips a rounding, and the errors should be equal to ~3 digits.

  python3 benchmarks/gptq_kernel_gpu.py --out $OUT/gptq_kernel_h100.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantkit.methods.gptq import gptq_quantize  # noqa: E402
from quantkit.methods.intquant import relative_error  # noqa: E402
from quantkit.types import QuantScheme  # noqa: E402

SHAPES = {"q_k_v_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096),
          "down_proj": (4096, 14336)}
SCHEMES = {"w4g128_sym": dict(bits=4, group_size=128, symmetric=True),
           "w4g128_asym": dict(bits=4, group_size=128, symmetric=False),
           "w4g64_asym_actorder": dict(bits=4, group_size=64, symmetric=False, act_order=True),
           "w8_channel_sym": dict(bits=8, group_size=-1, symmetric=True)}


def dequant(out, scheme: QuantScheme, n: int, k: int) -> torch.Tensor:
    g = scheme.effective_group(k)
    gi = out.g_idx.long() if out.g_idx is not None else torch.arange(k, device=out.codes.device) // g
    return (out.codes.float() - out.zero[:, gi].float()) * out.scale[:, gi]


def run(name: str, shape: tuple[int, int], scheme_name: str, static_groups: bool = True) -> dict:
    n, k = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    x = torch.randn(8192, k, device="cuda", generator=gen) @ (
        torch.eye(k, device="cuda") + 0.05 * torch.randn(k, k, device="cuda", generator=gen))
    h = x.T @ x
    scheme = QuantScheme(**SCHEMES[scheme_name])
    row = {"layer": name, "shape": [n, k], "scheme": scheme_name}
    outs = {}
    for impl, flag in (("triton", "1"), ("torch", "0")):
        os.environ["QUANTKIT_GPTQ_TRITON"] = flag
        gptq_quantize(w, h, scheme, static_groups=static_groups)  # warm-up / compile
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = gptq_quantize(w, h, scheme, static_groups=static_groups)
        torch.cuda.synchronize()
        row[f"{impl}_s"] = round(time.perf_counter() - t0, 4)
        row[f"{impl}_rel_error"] = round(relative_error(w, dequant(out, scheme, n, k)), 6)
        outs[impl] = out
    row["identical_codes"] = round(float((outs["triton"].codes == outs["torch"].codes).float().mean()), 6)
    row["speedup"] = round(row["torch_s"] / row["triton_s"], 1)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results/gptq_kernel_gpu.json")
    args = p.parse_args()
    rows = [run(layer, shape, "w4g128_sym") for layer, shape in SHAPES.items()]
    rows += [run("o_proj", SHAPES["o_proj"], s) for s in SCHEMES if s != "w4g128_sym"]
    rows.append(run("o_proj", SHAPES["o_proj"], "w4g64_asym_actorder", static_groups=False))
    rows[-1]["scheme"] += "_dynamic_groups"
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"{'layer':14s} {'scheme':34s} {'torch s':>8s} {'triton s':>9s} {'x':>6s} "
          f"{'same codes':>10s} {'err torch':>10s} {'err triton':>10s}")
    for r in rows:
        print(f"{r['layer']:14s} {r['scheme']:34s} {r['torch_s']:8.3f} {r['triton_s']:9.3f} "
              f"{r['speedup']:6.1f} {r['identical_codes']:10.4f} {r['torch_rel_error']:10.5f} "
              f"{r['triton_rel_error']:10.5f}")


if __name__ == "__main__":
    main()
