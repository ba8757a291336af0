"""NVFP4 / MXFP4 vs int4 RTN g64 on SmolLM2-135M, beside llm-compressor's artifacts of the same
presets, all scored in one `quantkit eval` pass (quantkit.eval.harness: KLD vs the bf16 model and
PPL on the held-out split of `mixed`, 32 x 512 tokens; W4A4 inputs rounded through NVFP4 as the
engine does).

    PYTHONPATH=. .venv/bin/python benchmarks/fp4_vs_int4_smollm2.py [--llmc-python PY]

Writes benchmarks/results/fp4_vs_int4_smollm2_cpu.json. llm-compressor runs in its own venv
(scripts/setup.sh builds $QK_CACHE/venvs/llmcompressor-0.14.0.1) on quantkit's calibration
windows (W4A4: 32 x 512 of `mixed`; the W4A16 presets need none).

    PYTHONPATH=. .venv/bin/python benchmarks/fp4_vs_int4_smollm2.py --rounding-compare

instead compares the rounding alone: NVFP4 W4A16 and MXFP4, each with `--rounding rtn` and
`--rounding gptq` (same scales; GPTQ on 64 x 512 tokens of `mixed`, seed 0), scored in one
eval pass; writes benchmarks/results/fp4_gptq_vs_rtn_smollm2_cpu.json (no llm-compressor).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch
from llmc_peer import calibration_ids, llmc_artifacts, score

from quantkit.machine import cache_dir
from quantkit.methods.fp4 import fp4_scheme
from quantkit.model_io import resolve_model
from quantkit.pipeline.quantize import QuantizeRequest, quantize
from quantkit.types import QuantScheme

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "fp4_vs_int4_smollm2_cpu.json"
ROUNDING_RESULTS = HERE / "results" / "fp4_gptq_vs_rtn_smollm2_cpu.json"
ROUNDING_CALIB = {"calib_samples": 64, "calib_seqlen": 512, "seed": 0}
MODEL = "smollm2-135m"
CALIB = {"calib_samples": 32, "calib_seqlen": 512, "seed": 0}
LLMC = {"llmc_nvfp4a16": "NVFP4A16", "llmc_mxfp4a16": "MXFP4A16", "llmc_nvfp4": "NVFP4"}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--llmc-python", default=str(cache_dir() / "venvs" / "llmcompressor-0.14.0.1"
                                                / "bin" / "python"))
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--rounding-compare", action="store_true",
                   help="RTN vs GPTQ rounding of NVFP4 W4A16 and MXFP4 (no llm-compressor)")
    args = p.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="fp4bench-"))
    if args.rounding_compare:
        rounding_compare(work)
        return
    src = resolve_model(MODEL).path
    arts: dict[str, Path] = {}
    seconds: dict[str, float] = {}
    runs = {
        "quantkit_int4_rtn_g64": dict(method="rtn", scheme=QuantScheme(bits=4, group_size=64)),
        "quantkit_nvfp4_w4a16": dict(method="nvfp4", scheme=fp4_scheme("nvfp4"),
                                     method_options={"scheme": "w4a16"}),
        "quantkit_mxfp4_w4a16": dict(method="mxfp4", scheme=fp4_scheme("mxfp4")),
        "quantkit_nvfp4_w4a4": dict(method="nvfp4", scheme=fp4_scheme("nvfp4", "w4a4"),
                                    method_options={"scheme": "w4a4"}),
    }
    for name, kw in runs.items():
        arts[name] = work / name
        t0 = time.perf_counter()
        quantize(QuantizeRequest(model=MODEL, out=arts[name], force=True, **kw, **CALIB))
        seconds[name] = round(time.perf_counter() - t0, 1)
    ids = calibration_ids(src, CALIB["calib_samples"], CALIB["calib_seqlen"], CALIB["seed"])
    ref_arts, outcome, seconds["llmc_all_three"] = llmc_artifacts(src, ids, work / "llmc", LLMC,
                                                                  python=args.llmc_python)
    arts.update(ref_arts)
    rows, records, eval_s = score(arts, MODEL, seconds=seconds)
    out = {"benchmark": "fp4_vs_int4_smollm2_cpu", "model": MODEL,
           "heldout": "mixed (heldout split), 32 windows x 512 tokens, KLD vs bf16",
           "calibration": {**CALIB, "set": "mixed", "used_by": "W4A4 input scales only"},
           "base_ppl": records[0]["metrics"]["base_ppl"]["value"], "results": rows,
           "llmc_outcome": outcome, "llmc_seconds_all_three": seconds["llmc_all_three"],
           "eval_s": eval_s, "machine": {"cpu": platform.processor() or platform.machine(),
                                         "threads": torch.get_num_threads()},
           "torch": torch.__version__,
           "command": "PYTHONPATH=. .venv/bin/python benchmarks/fp4_vs_int4_smollm2.py"}
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    for name, r in rows.items():
        print(f"{name:24s} KLD {r['kld_mean']:.5f}  PPL {r['ppl']:.3f}  "
              f"bpw {r['bits_per_weight_quantized'] or float('nan'):.3f}")


def rounding_compare(work: Path) -> None:
    """GPTQ vs round-to-nearest onto the same FP4 grids and scales, one eval pass."""
    runs = {}
    for method in ("nvfp4", "mxfp4"):
        for rounding in ("rtn", "gptq"):
            opts = {"rounding": rounding, **({"scheme": "w4a16"} if method == "nvfp4" else {})}
            runs[f"quantkit_{method}_w4a16_{rounding}"] = dict(
                method=method, scheme=fp4_scheme(method), method_options=opts)
    arts, seconds, commands = {}, {}, {}
    for name, kw in runs.items():
        arts[name] = work / name
        t0 = time.perf_counter()
        meta = quantize(QuantizeRequest(model=MODEL, out=arts[name], force=True, **kw,
                                        **ROUNDING_CALIB))
        seconds[name] = round(time.perf_counter() - t0, 1)
        commands[name] = meta["command"].replace(str(arts[name]), f"<out>/{name}")
    rows, records, eval_s = score(arts, MODEL, seconds=seconds)
    for name, row in rows.items():
        row["command"] = commands[name]
    ratios = {m: rows[f"quantkit_{m}_w4a16_gptq"]["kld_mean"] / rows[f"quantkit_{m}_w4a16_rtn"]["kld_mean"]
              for m in ("nvfp4", "mxfp4")}
    out = {"benchmark": "fp4_gptq_vs_rtn_smollm2_cpu", "model": MODEL,
           "heldout": "mixed (heldout split), 32 windows x 512 tokens, KLD vs bf16",
           "calibration": {**ROUNDING_CALIB, "set": "mixed",
                           "used_by": "GPTQ Hessians (RTN W4A16 reads none: its scales and "
                                      "codes come from the weights alone)"},
           "note": "GPTQ keeps RTN's scales (global, per-16 E4M3 / per-32 E8M0 from the original "
                   "weights) and changes only the E2M1 codes",
           "base_ppl": records[0]["metrics"]["base_ppl"]["value"], "results": rows,
           "kld_ratio_gptq_over_rtn": ratios, "eval_s": eval_s,
           "machine": {"cpu": platform.processor() or platform.machine(),
                       "threads": torch.get_num_threads(), "cores": os.cpu_count(),
                       # other jobs share the cores: seconds are upper bounds
                       "load_avg_at_end": list(os.getloadavg())},
           "torch": torch.__version__,
           "command": "PYTHONPATH=. .venv/bin/python benchmarks/fp4_vs_int4_smollm2.py "
                      "--rounding-compare"}
    ROUNDING_RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    for name, r in rows.items():
        print(f"{name:28s} KLD {r['kld_mean']:.5f} +- {r['kld_stderr']:.5f}  PPL {r['ppl']:.3f}  "
              f"quantize {r['quantize_s']:.0f} s")
    print(f"eval {eval_s:.0f} s; KLD GPTQ / RTN: {ratios}")


if __name__ == "__main__":
    main()
