"""int8 W8A8 on SmolLM2-135M, quantkit beside llm-compressor 0.14 for the same recipes from the
same calibration windows, all scored in one `quantkit eval` pass (KLD vs the bf16 model and
PPL on the held-out split of `mixed`; every int8 Linear's input rounded to int8 per token as
vLLM does).

    PYTHONPATH=. .venv/bin/python benchmarks/int8_vs_llmcompressor_smollm2.py [--llmc-python PY]

Rows: W8A8 dynamic (llm-compressor's W8A8 preset), SmoothQuant 0.5 + W8A8 with
llm-compressor's default mappings (the two norm groups: `--smoothquant-pairs norms`), and
quantkit's default SmoothQuant (also up -> down); llm-compressor runs its W8A8 preset and
SmoothQuantModifier(0.5) + W8A8 (tests/llmc_reference.py, in the venv scripts/setup.sh builds).
Calibration: 64 x 512 tokens of `mixed` (seed 0) for both tools. Writes
benchmarks/results/int8_smollm2_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch
from llmc_peer import calibration_ids, default_llmc_python, llmc_artifacts, score

from quantkit.methods.int8 import int8_scheme
from quantkit.model_io import resolve_model
from quantkit.pipeline.quantize import QuantizeRequest, quantize

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "int8_smollm2_cpu.json"
MODEL = "smollm2-135m"
CALIB = {"calib_samples": 64, "calib_seqlen": 512, "seed": 0}
RUNS = {  # row -> quantkit's method options (--method int8)
    "quantkit_w8a8": {"scheme": "dynamic"},
    "quantkit_w8a8_sq0.5_norms": {"scheme": "dynamic", "smoothquant": 0.5,
                                  "smoothquant_pairs": "norms"},
    "quantkit_w8a8_sq0.5_all": {"scheme": "dynamic", "smoothquant": 0.5},
}
LLMC = {"llmc_w8a8": "W8A8", "llmc_w8a8_sq0.5": "W8A8+SQ0.5"}  # row -> reference recipe


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--llmc-python", default=default_llmc_python())
    p.add_argument("--max-windows", type=int, default=16)
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args()
    t_all = time.perf_counter()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="int8bench-"))
    src = resolve_model(MODEL).path
    arts: dict[str, Path] = {}
    seconds: dict[str, float] = {}
    commands: dict[str, str] = {}
    for name, opts in RUNS.items():
        arts[name] = work / name
        t0 = time.perf_counter()
        meta = quantize(QuantizeRequest(model=MODEL, method="int8",
                                        scheme=int8_scheme(opts["scheme"]), out=arts[name],
                                        method_options=opts, force=True, **CALIB))
        seconds[name] = round(time.perf_counter() - t0, 1)
        commands[name] = meta["command"]
    ids = calibration_ids(src, CALIB["calib_samples"], CALIB["calib_seqlen"], CALIB["seed"])
    llmc, outcome, seconds["llmc_both"] = llmc_artifacts(src, ids, work, LLMC, args.llmc_python)
    arts.update(llmc)
    rows, records, eval_s = score(arts, MODEL, max_windows=args.max_windows, seconds=seconds)
    for name in arts:
        rows[name]["command"] = commands.get(name) or f"llm-compressor 0.14.0.1 {LLMC[name]}"
    out = {"benchmark": "int8_smollm2_cpu", "model": MODEL,
           "heldout": f"mixed (heldout split), {args.max_windows} windows x 512 tokens, KLD vs "
                      "bf16, int8 inputs per token as vLLM rounds them",
           "calibration": {**CALIB, "set": "mixed",
                           "used_by": "SmoothQuant activation ranges (dynamic W8A8 needs none)"},
           "base_ppl": records[0]["metrics"]["base_ppl"]["value"], "results": rows,
           "llmc_outcome": outcome, "llmc_seconds_both": seconds["llmc_both"],
           "eval_s": eval_s, "total_s": round(time.perf_counter() - t_all, 1),
           "machine": {"cpu": platform.processor() or platform.machine(),
                       "threads": torch.get_num_threads()},
           "torch": torch.__version__,
           "command": "PYTHONPATH=. .venv/bin/python benchmarks/int8_vs_llmcompressor_smollm2.py",
           "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    for name, r in rows.items():
        print(f"{name:28s} KLD {r['kld_mean']:.5f} ± {r['kld_stderr'] or 0:.5f}  "
              f"PPL {r['ppl']:.3f}  top-1 {r['top1_agreement']:.4f}")
    print(f"base PPL {out['base_ppl']:.3f}; total {out['total_s']} s; wrote {RESULTS}")


if __name__ == "__main__":
    main()
