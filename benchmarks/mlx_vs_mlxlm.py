"""quantkit GPTQ / AWQ written as MLX checkpoints vs mlx-lm's own conversion and its own GPTQ / AWQ,
SmolLM2-135M, 4 bits g64, all scored in one `quantkit eval --backend mlx` pass: every model
(the bf16 base too) runs in mlx-lm's decoder with its quantized layers mx.dequantize'd to bf16
(MLX's CPU quantized matmul is far slower; the weights are the same numbers).

    PYTHONPATH=. .venv/bin/python benchmarks/mlx_vs_mlxlm.py [--windows N] [--ctx T]
        [--calib-samples N] [--calib-seqlen T] [--rows a,b,...]
    PYTHONPATH=. .venv/bin/python benchmarks/mlx_vs_mlxlm.py --table   # README rows from the file

Peers, made in MLX's venv (scripts/setup_mlx.sh):
  mlxlm-rtn          `mlx_lm convert -q --q-bits 4 --q-group-size 64`: every Linear AND the tied
                     embedding (also the output head) quantized
  mlxlm-rtn-linears  the same call with a quant_predicate that quantizes the Linears only,
                     what quantkit quantizes (embedding / head kept bf16): the like-for-like row
  mlxlm-gptq         mlx_lm.quant.gptq's gptq_quantize, mlxlm-awq mlx_lm.quant.awq's
                     awq_quantize, on the same calibration tokens as quantkit, Linears only
                     (benchmarks/mlxlm_quant_peer.py says what it changes and why); a peer that
                     fails or runs past --peer-timeout is recorded with the reason (both ran
                     past 600 s with 8 x 512 tokens on the 2 shared cores, 2026-12-03)
quantkit: --format mlx on the format's default grid (asymmetric: symmetric_auto, as the CLI
without --sym / --asym; its zero points fitted floats, FormatRecord.float_zero, since MLX's
bias is a free float); rtn, gptq without act-order (--no-act-order), gptq with static-group
act-order (groups stay k // 64, what MLX stores; the mlx format's GPTQ default), the same with
--gptq-v-hessian attention, awq.
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

import numpy as np

from quantkit.engines.mlx import mlx_env, mlx_python
from quantkit.eval.harness import evaluate
from quantkit.eval.logits import PPLConvention
from quantkit.model_io import resolve_model
from quantkit.pipeline.quantize import QuantizeRequest, quantize
from quantkit.types import QuantScheme

OUT = Path(__file__).parent / "results" / "mlx_vs_mlxlm_smollm2_cpu.json"
PEER = Path(__file__).with_name("mlxlm_quant_peer.py")
BITS, GROUP = 4, 64
REF = "mlxlm-rtn-linears"
# name -> (method, act_order, method options)
QUANTKIT_ROWS = {
    "quantkit-rtn": ("rtn", False, {}),
    "quantkit-gptq": ("gptq", False, {}),
    "quantkit-gptq-actorder": ("gptq", True, {}),
    "quantkit-gptq-actorder-attnv": ("gptq", True, {"v_hessian": "attention"}),
    "quantkit-awq": ("awq", False, {}),
}
PEER_ROWS = ("mlxlm-rtn", "mlxlm-rtn-linears", "mlxlm-gptq", "mlxlm-awq")

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


def mlxlm_quant(method: str, src: Path, dst: Path, tokens: Path, timeout: float) -> dict:
    """mlx_lm.quant's GPTQ / AWQ in MLX's venv; the row, with the failure's reason if any."""
    t0 = time.perf_counter()
    cmd = [str(mlx_python()), str(PEER), method, str(src), str(dst), str(tokens), str(BITS),
           str(GROUP)]
    row = {"made_by": f"mlx_lm.quant.{method} (benchmarks/mlxlm_quant_peer.py)",
           "quantized": "Linears"}
    try:
        proc = subprocess.run(cmd, env=mlx_env(), timeout=timeout, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    except subprocess.TimeoutExpired as exc:  # where it had got to: its last progress bar
        out = exc.output.decode(errors="replace") if isinstance(exc.output, bytes) \
            else exc.output or ""
        bars = [b.strip() for b in out.replace("\r", "\n").splitlines() if "%|" in b]
        return {**row, "failed": f"ran past --peer-timeout {timeout:.0f} s on this CPU"
                + (f"; last progress: {bars[-1]}" if bars else ""),
                "seconds": round(time.perf_counter() - t0, 1)}
    row["seconds"] = round(time.perf_counter() - t0, 1)
    if proc.returncode != 0:
        tail = [ln for ln in proc.stdout.splitlines() if ln.strip()][-3:]
        return {**row, "failed": f"exit {proc.returncode}: " + " | ".join(tail)}
    return row


def calibration_tokens(base: Path, samples: int, seqlen: int, out: Path) -> Path:
    """quantkit's calibration windows (mixed, seed 0: what quantize reads) for the peers."""
    from quantkit.calibration import load_calibration
    from quantkit.model_io import load_tokenizer

    calib = load_calibration("mixed", load_tokenizer(base), n_samples=samples, seqlen=seqlen,
                             seed=0)
    np.save(out, calib.input_ids.numpy().astype(np.int32))
    return out


def table(result: dict) -> str:
    """The README / benchmarks rows of a results file."""
    lines = ["| row | made by | KLD (x mlx-lm RTN, Linears) | PPL | top-1 | seconds |",
             "|---|---|---|---|---|---|"]
    for name, row in result["rows"].items():
        row = {**row, "made_by": row["made_by"].split(" -o ")[0]}  # not the temporary dir
        if "failed" in row:
            lines.append(f"| {name} | {row['made_by']} | failed: {row['failed']} | | | "
                         f"{row.get('seconds', '')} |")
            continue
        lines.append(f"| {name} | {row['made_by']} | {row['kld']:.4f} "
                     f"({row['kld_vs_mlxlm_rtn_linears']:.3f}x) | {row['ppl']:.2f} | "
                     f"{row['top1']:.3f} | {row['seconds']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--calib-samples", type=int, default=16)
    ap.add_argument("--calib-seqlen", type=int, default=512)
    ap.add_argument("--peer-timeout", type=float, default=1800)
    ap.add_argument("--rows", default=None, help="comma-separated subset of the rows")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--table", action="store_true", help="print the rows of --out and stop")
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(args.out.read_text())))
        return
    wanted = args.rows.split(",") if args.rows else [*PEER_ROWS, *QUANTKIT_ROWS]
    if REF not in wanted:
        wanted.insert(0, REF)
    base = resolve_model("smollm2-135m").path
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="mlx-bench-") as tmp:
        paths = {}
        tokens = calibration_tokens(base, args.calib_samples, args.calib_seqlen,
                                    Path(tmp) / "calib.npy")
        for name in wanted:
            dst = Path(tmp) / name
            if name in ("mlxlm-rtn", "mlxlm-rtn-linears"):
                linears = name == "mlxlm-rtn-linears"
                rows[name] = {"made_by": "mlx_lm.convert", "seconds": round(
                    mlxlm_convert(base, dst, linears), 1),
                    "quantized": "Linears" if linears else "Linears + tied embedding/head"}
            elif name in ("mlxlm-gptq", "mlxlm-awq"):
                rows[name] = mlxlm_quant(name.split("-")[1], base, dst, tokens, args.peer_timeout)
                if "failed" in rows[name]:
                    print(f"{name}: {rows[name]['failed']}", flush=True)
                    continue
            else:
                method, act_order, options = QUANTKIT_ROWS[name]
                t0 = time.perf_counter()
                meta = quantize(QuantizeRequest(
                    model="smollm2-135m", method=method, out=dst, format="mlx",
                    scheme=QuantScheme(bits=BITS, group_size=GROUP, act_order=act_order),
                    symmetric_auto=True, method_options=options,
                    calib_samples=args.calib_samples, calib_seqlen=args.calib_seqlen))
                rows[name] = {"made_by": meta["command"],
                              "seconds": round(time.perf_counter() - t0, 1),
                              "quantized": "Linears",
                              "symmetric": meta["scheme"]["symmetric"]}
            paths[name] = dst
            print(f"{name}: made in {rows[name]['seconds']} s", flush=True)
        conv = PPLConvention(ctx=args.ctx, max_windows=args.windows, batch_size=2)
        names = list(paths)
        records = evaluate([str(paths[n]) for n in names], str(base), conv=conv, backend="mlx")
        for name, rec in zip(names, records, strict=True):
            m = rec["metrics"]
            rows[name].update(ppl=m["ppl"]["value"], kld=m["kld"]["mean"],
                              kld_stderr=m["kld"].get("stderr"),
                              top1=m["top1_agreement"]["value"],
                              size_bytes=rec["artifact"]["size_bytes"])
        ref = rows[REF]["kld"]
        for row in rows.values():
            if "kld" in row:
                row["kld_vs_mlxlm_rtn_linears"] = row["kld"] / ref
        result = {
            "what": __doc__.strip().splitlines()[0],
            "scheme": f"{BITS}-bit g{GROUP}, MLX affine; quantkit on the mlx format's default "
                      "grid (asymmetric)",
            "base_ppl": records[0]["metrics"]["base_ppl"]["value"],
            "engine": records[0]["engine"], "convention": records[0]["convention"],
            "calibration": {"samples": args.calib_samples, "seqlen": args.calib_seqlen,
                            "source": "mixed, seed 0; the same token windows for mlx_lm.quant"},
            "machine": platform.processor() or platform.machine(),
            "rows": rows,
            "command": "PYTHONPATH=. .venv/bin/python benchmarks/mlx_vs_mlxlm.py "
                       f"--windows {args.windows} --ctx {args.ctx} "
                       f"--calib-samples {args.calib_samples} --calib-seqlen {args.calib_seqlen}"
                       + (f" --rows {args.rows}" if args.rows else ""),
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()
