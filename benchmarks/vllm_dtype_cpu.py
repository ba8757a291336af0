"""vLLM on this CPU in bfloat16 vs float32: the same SmolLM2 checkpoints, the same work.

  .venv/bin/python benchmarks/vllm_dtype_cpu.py [--results benchmarks/results/vllm_dtype_cpu.json]

Why: where vLLM's torch has no native bf16 GEMM (AVX2, AVX512 without BF16) it emulates
bf16, and quantkit then runs vLLM in float32 for the checkpoints whose kernels take it
(quantkit.engines.capabilities.vllm_dtype). This measures that choice. For the dense model,
int8 W8A8 (dynamic) and FP8 (channel weights, dynamic inputs) artifacts, each run loads
the checkpoint in a fresh vLLM worker, greedy-generates 32 tokens and scores 16 x 512 random
token ids (prompt log-probs, the work of `quantkit eval` through vLLM), in both dtypes; the
pairs alternate so a machine that slows down hurts both alike. Records wall seconds per run
(start-up included), the generated text, vLLM's answer whether bf16 is native here, the
commit, the command and the CPU.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = ROOT / "COMMIT"
        return commit.read_text().strip() if commit.is_file() else "unknown"


def _artifacts(tmp: Path) -> dict[str, Path]:
    from quantkit.model_io import resolve_model
    from quantkit.pipeline.quantize import QuantizeRequest, quantize
    from quantkit.types import QuantScheme

    out = {"dense (bf16 checkpoint)": resolve_model("smollm2-135m").path}
    for name, method, scheme in (
            ("int8 W8A8 dynamic", "int8", QuantScheme(kind="int", bits=8, group_size=-1,
                                                      activations="dynamic")),
            ("FP8 dynamic", "fp8", QuantScheme(kind="fp8", bits=8, group_size=-1))):
        out[name] = tmp / method
        quantize(QuantizeRequest(model="smollm2-135m", method=method, scheme=scheme,
                                 out=out[name]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path,
                   default=ROOT / "benchmarks" / "results" / "vllm_dtype_cpu.json")
    p.add_argument("--sequences", type=int, default=16)
    p.add_argument("--seqlen", type=int, default=512)
    args = p.parse_args()

    from quantkit.engines.capabilities import vllm_capabilities, vllm_dtype
    from quantkit.engines.vllm import run_vllm
    from quantkit.machine import cpu_info

    caps = vllm_capabilities()
    rng = random.Random(0)
    seqs = [[rng.randrange(100, 40000) for _ in range(args.seqlen)] for _ in range(args.sequences)]
    prompt = [{"prompt": "The capital of France is", "max_tokens": 32}]
    rows = []
    with tempfile.TemporaryDirectory(prefix="vllm-dtype-") as tmp:
        for name, path in _artifacts(Path(tmp)).items():
            row = {"checkpoint": name, "quantkit_picks": vllm_dtype(path)}
            for dtype in ("bfloat16", "float32"):
                t0 = time.perf_counter()
                res = run_vllm(path, generate=prompt, score=seqs, dtype=dtype)
                row[dtype] = {"seconds": round(time.perf_counter() - t0, 2),
                              "load_seconds": round(res["load_seconds"], 2),
                              "text": res["generate"][0]}
                print(f"{name:24s} {dtype:9s} {row[dtype]['seconds']:7.1f} s", flush=True)
            row["bf16_over_float32"] = round(row["bfloat16"]["seconds"] / row["float32"]["seconds"], 2)
            rows.append(row)
    result = {"commit": _git_commit(), "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "cpu": cpu_info(), "vllm_version": caps.version,
              "vllm_kernel_library": caps.kernel_library, "vllm_bf16_native": caps.bf16_native,
              "work": f"load + generate 32 tokens + score {args.sequences} x {args.seqlen} tokens",
              "rows": rows}
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=2) + "\n")
    print("\n| checkpoint | bf16 s | float32 s | bf16 / float32 | quantkit picks |\n"
          "| --- | ---: | ---: | ---: | --- |")
    for r in rows:
        print(f"| {r['checkpoint']} | {r['bfloat16']['seconds']:.1f} | {r['float32']['seconds']:.1f} "
              f"| {r['bf16_over_float32']:.2f}x | {r['quantkit_picks']} |")
    print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
