"""Throughput of quantkit's bit-exact GGML encoders, per type and backend, on SmolLM2's weights.

  .venv/bin/python benchmarks/kquant_encoder_speed.py [--threads 2] [--types Q3_K,Q2_K] [--out FILE.json]

Every 2-D weight of the built-in model whose width the type accepts is encoded, timed as a
whole, by both backends of encode_rows: "compiled" (numba, the CPU default) and "torch" (the
vectorised encoders that also run on a GPU), without and with an imatrix (a fixed random one:
the imatrix paths run other searches). Prints millions of values per second. Every backend's
bytes are checked equal to the compiled ones here (and to llama.cpp's in tests/test_kquants.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantkit.ggml.codec import BACKENDS, SUPPORTED, encode_rows  # noqa: E402
from quantkit.model_io import resolve_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--types", default=",".join(GGMLQuantizationType(t).name for t in SUPPORTED),
                    help="comma-separated GGML type names (default: every supported one)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "kquant_encoder_speed_cpu.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model("smollm2-135m").path
    weights = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as s:
            weights.update({k: s.get_tensor(k).float() for k in s.keys() if len(s.get_slice(k).get_shape()) == 2})
    rows: dict[str, dict] = {}
    for imatrix in (False, True):
        for qtype in [GGMLQuantizationType[t.strip().upper()] for t in args.types.split(",")]:
            name = GGMLQuantizationType(qtype).name + (" imatrix" if imatrix else "")
            block = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][0]
            todo = [w for w in weights.values() if w.shape[1] % block == 0]
            n = sum(w.numel() for w in todo)
            qws = [torch.rand(w.shape[1], generator=torch.Generator().manual_seed(0)) + 0.01
                   if imatrix else None for w in todo]
            row, first = {"tensors": len(todo), "values_m": round(n / 1e6, 2)}, None
            for backend in BACKENDS:
                encode_rows(todo[0][:8], qtype, qws[0], backend=backend)  # load / compile first
                t = time.perf_counter()
                outs = [encode_rows(w, qtype, qw, backend=backend) for w, qw in zip(todo, qws, strict=True)]
                dt = time.perf_counter() - t
                first = first or outs
                assert all(torch.equal(a, b) for a, b in zip(first, outs, strict=True)), name
                row[backend] = {"seconds": round(dt, 3), "m_values_per_s": round(n / dt / 1e6, 1)}
            row["speedup_compiled_vs_torch"] = round(row["torch"]["seconds"] / row["compiled"]["seconds"], 1)
            rows[name] = row
            print(f"{name:14s} {len(todo):4d} tensors {n / 1e6:7.1f} M values  "
                  + "  ".join(f"{b} {row[b]['m_values_per_s']:7.1f} M/s" for b in BACKENDS)
                  + f"  x{row['speedup_compiled_vs_torch']}", flush=True)
    res = {"model": "smollm2-135m", "threads": args.threads, "cpus": os.cpu_count(),
           "loadavg": os.getloadavg(), "torch": torch.__version__, "types": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
