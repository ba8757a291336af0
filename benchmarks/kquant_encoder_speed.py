"""Throughput of quantkit's bit-exact GGML encoders, per type, on the real SmolLM2 weights.

  .venv/bin/python benchmarks/kquant_encoder_speed.py [--threads 2] [--out FILE.json]

Every 2-D weight of the built-in model whose width the type accepts is encoded (no imatrix),
timed as a whole; prints millions of values per second per type. Context for the GGUF speed
goal (benchmarks/gguf_vs_llamacpp.py): llama.cpp's whole Q4_K_M run on this model takes ~1.1 s.
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

from quantkit.methods.kquants_encode import SUPPORTED, encode_rows  # noqa: E402
from quantkit.model_io import resolve_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "kquant_encoder_speed_cpu.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model("smollm2-135m").path
    weights = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as s:
            weights.update({k: s.get_tensor(k).float() for k in s.keys() if len(s.get_slice(k).get_shape()) == 2})
    rows = {}
    for qtype in SUPPORTED:
        block = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][0]
        todo = [w for w in weights.values() if w.shape[1] % block == 0]
        n = sum(w.numel() for w in todo)
        t = time.perf_counter()
        for w in todo:
            encode_rows(w, qtype)
        dt = time.perf_counter() - t
        rows[GGMLQuantizationType(qtype).name] = {"tensors": len(todo), "values_m": round(n / 1e6, 2),
                                                  "seconds": round(dt, 2), "m_values_per_s": round(n / dt / 1e6, 1)}
        print(f"{GGMLQuantizationType(qtype).name:6s} {len(todo):4d} tensors {n / 1e6:7.1f} M values "
              f"{dt:6.2f} s  {n / dt / 1e6:6.1f} M values/s", flush=True)
    res = {"model": "smollm2-135m", "threads": args.threads, "cpus": os.cpu_count(),
           "loadavg": os.getloadavg(), "torch": torch.__version__, "types": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
