"""quantkit GPTQ / AWQ written as MLX checkpoints vs mlx-lm's own round-to-nearest conversion,
SmolLM2-135M, 4 bits g64, all scored in one `quantkit eval --backend mlx` pass: every model
(the bf16 base too) runs in mlx-lm's decoder with its quantized layers mx.dequantize'd to bf16
(MLX's CPU quantized matmul is far slower; the weights are the same numbers).

    PYTHONPATH=. .venv/bin/python benchmarks/mlx_vs_mlxlm.py [--windows N] [--ctx T]

Peers, made in MLX's venv (scripts/setup_mlx.sh) by mlx_lm.convert:
  mlxlm-rtn          `mlx_lm convert -q --q-bits 4 --q-group-size 64`: every Linear AND the tied
                     embedding (also the output head) quantized
  mlxlm-rtn-linears  the same call with a quant_predicate that quantizes the Linears only,
                     what quantkit quantizes (embedding / head kept bf16): the like-for-like row
quantkit: rtn, gptq, awq, 4-bit g64 symmetric (its default grid), --format mlx.
mlx_lm.quant's GPTQ / AWQ / DWQ were not run (not tried for lack of time; say so, not a claim).
Writes benchmarks/results/mlx_vs_mlxlm_smollm2_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import tempfile
import time
from pathlib import Path

from quantkit.engines.mlx import mlx_env, mlx_python
from quantkit.eval.harness import evaluate
from quantkit.eval.logits import PPLConvention
from quantkit.model_io import resolve_model
from quantkit.pipeline.quantize import QuantizeRequest, quantize
from quantkit.types import QuantScheme

OUT = Path(__file__).parent / "results" / "mlx_vs_mlxlm_smollm2_cpu.json"
SCHEME = QuantScheme(bits=4, group_size=64)

_CONVERT = """
import sys
import mlx.nn as nn
from mlx_lm import convert
src, dst, linears_only = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
pred = (lambda p, m, *a: isinstance(m, nn.Linear)) if linears_only else None
convert(src, dst, quantize=True, q_group_size=64, q_bits=4, quant_predicate=pred)
"""


def mlxlm_convert(src: Path, dst: Path, linears_only: bool) -> float:
    t0 = time.perf_counter()
    subprocess.run([str(mlx_python()), "-c", _CONVERT, str(src), str(dst),
                    "1" if linears_only else "0"], env=mlx_env(), check=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--calib-samples", type=int, default=16)
    ap.add_argument("--calib-seqlen", type=int, default=512)
    args = ap.parse_args()
    base = resolve_model("smollm2-135m").path
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="mlx-bench-") as tmp:
        paths = {}
        for name, linears in (("mlxlm-rtn", False), ("mlxlm-rtn-linears", True)):
            paths[name] = Path(tmp) / name
            rows[name] = {"made_by": "mlx_lm.convert", "seconds": round(
                mlxlm_convert(base, paths[name], linears), 1),
                "quantized": "Linears" if linears else "Linears + tied embedding/head"}
        for method in ("rtn", "gptq", "awq"):
            name = f"quantkit-{method}"
            paths[name] = Path(tmp) / name
            t0 = time.perf_counter()
            quantize(QuantizeRequest(model="smollm2-135m", method=method, scheme=SCHEME,
                                     out=paths[name], format="mlx",
                                     calib_samples=args.calib_samples,
                                     calib_seqlen=args.calib_seqlen))
            rows[name] = {"made_by": f"quantkit quantize --method {method} --format mlx",
                          "seconds": round(time.perf_counter() - t0, 1), "quantized": "Linears"}
        conv = PPLConvention(ctx=args.ctx, max_windows=args.windows, batch_size=2)
        names = list(paths)
        records = evaluate([str(paths[n]) for n in names], str(base), conv=conv, backend="mlx")
        for name, rec in zip(names, records, strict=True):
            m = rec["metrics"]
            rows[name].update(ppl=m["ppl"]["value"], kld=m["kld"]["mean"],
                              kld_stderr=m["kld"].get("stderr"),
                              top1=m["top1_agreement"]["value"],
                              size_bytes=rec["artifact"]["size_bytes"])
        ref = rows["mlxlm-rtn-linears"]["kld"]
        for row in rows.values():
            row["kld_vs_mlxlm_rtn_linears"] = row["kld"] / ref
        result = {
            "what": __doc__.strip().splitlines()[0],
            "scheme": "4-bit g64, MLX affine",
            "base_ppl": records[0]["metrics"]["base_ppl"]["value"],
            "engine": records[0]["engine"], "convention": records[0]["convention"],
            "calibration": {"samples": args.calib_samples, "seqlen": args.calib_seqlen},
            "machine": platform.processor() or platform.machine(),
            "rows": rows,
            "command": "PYTHONPATH=. .venv/bin/python benchmarks/mlx_vs_mlxlm.py "
                       f"--windows {args.windows} --ctx {args.ctx} "
                       f"--calib-samples {args.calib_samples} --calib-seqlen {args.calib_seqlen}",
        }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    for name, row in rows.items():
        print(f"{name:20s} KLD {row['kld']:.4f} ({row['kld_vs_mlxlm_rtn_linears']:.2f}x) "
              f"PPL {row['ppl']:.3f} top-1 {row['top1']:.3f}")


if __name__ == "__main__":
    main()
