"""int8 W8A8 on SmolLM2-135M, quantkit beside llm-compressor 0.14 for the same recipes from the
same calibration windows, all scored in one `quantkit eval` pass (KLD vs the bf16 model and
PPL on the held-out split of `mixed`; every int8 Linear's input rounded to int8 per token as
vLLM does).

    PYTHONPATH=. .venv/bin/python benchmarks/int8_vs_llmcompressor_smollm2.py [--llmc-python PY]

Rows: W8A8 dynamic (llm-compressor's W8A8 preset) and SmoothQuant 0.5 + W8A8 with
llm-compressor's default mappings (the two norm groups: `--smoothquant-pairs norms`);
llm-compressor runs its W8A8 preset and SmoothQuantModifier(0.5) + W8A8 (tests/llmc_reference.py,
in the venv scripts/setup.sh builds). Calibration: 16 x 512 tokens of `mixed` (seed 0) for both
tools' SmoothQuant; dynamic W8A8 reads no calibration data, so llm-compressor's W8A8 run is
given the first window only (its oneshot always runs the data through the model).
`--with-default-pairs` adds quantkit's default SmoothQuant (also up -> down). `--reuse` keeps
quantkit artifacts already in --workdir made by the same command (their seconds are the ones
quantkit.json recorded), and llm-compressor's made from the same windows. Writes benchmarks/results/int8_smollm2_cpu.json.
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
from llmc_peer import calibration_ids, default_llmc_python, llmc_artifacts, score

from quantkit.methods.int8 import int8_scheme
from quantkit.model_io import resolve_model
from quantkit.pipeline.quantize import QuantizeRequest, quantize

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "int8_smollm2_cpu.json"
MODEL = "smollm2-135m"
CALIB = {"calib_samples": 16, "calib_seqlen": 512, "seed": 0}
RUNS = {  # row -> quantkit's method options (--method int8)
    "quantkit_w8a8": {"scheme": "dynamic"},
    "quantkit_w8a8_sq0.5_norms": {"scheme": "dynamic", "smoothquant": 0.5,
                                  "smoothquant_pairs": "norms"},
}
DEFAULT_PAIRS = {"quantkit_w8a8_sq0.5_all": {"scheme": "dynamic", "smoothquant": 0.5}}
LLMC = {"llmc_w8a8": "W8A8", "llmc_w8a8_sq0.5": "W8A8+SQ0.5"}  # row -> reference recipe


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--llmc-python", default=default_llmc_python())
    p.add_argument("--max-windows", type=int, default=8)
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--with-default-pairs", action="store_true")
    p.add_argument("--reuse", action="store_true")
    args = p.parse_args()
    t_all = time.perf_counter()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="int8bench-"))
    src = resolve_model(MODEL).path
    arts: dict[str, Path] = {}
    seconds: dict[str, float] = {}
    commands: dict[str, str] = {}
    runs = {**RUNS, **(DEFAULT_PAIRS if args.with_default_pairs else {})}
    reused = []
    for name, opts in runs.items():
        arts[name] = work / name
        req = QuantizeRequest(model=MODEL, method="int8", scheme=int8_scheme(opts["scheme"]),
                              out=arts[name], method_options=opts, force=True, **CALIB)
        meta_file = arts[name] / "quantkit.json"
        if args.reuse and meta_file.is_file():
            meta = json.loads(meta_file.read_text())
            if meta["command"] == req.cli_equivalent():
                seconds[name], commands[name] = meta["seconds"]["total"], meta["command"]
                reused.append(name)
                continue
        t0 = time.perf_counter()
        meta = quantize(req)
        seconds[name] = round(time.perf_counter() - t0, 1)
        commands[name] = meta["command"]
    ids = calibration_ids(src, CALIB["calib_samples"], CALIB["calib_seqlen"], CALIB["seed"])
    llmc_s = {}
    outcome = {}
    for name, preset in LLMC.items():  # W8A8 dynamic reads no calibration data
        run_ids = ids if "+SQ" in preset else ids[:1]
        done = work / name / "llmc" / preset
        if args.reuse and (done / "config.json").is_file() and torch.equal(
                torch.load(work / name / "ids.pt"), run_ids):
            arts[name], outcome[preset], llmc_s[name] = done, "ok", None
            reused.append(name)
            continue
        got, out_, llmc_s[name] = llmc_artifacts(src, run_ids, work / name, {name: preset},
                                                 args.llmc_python)
        arts.update(got)
        outcome.update(out_)
    seconds.update(llmc_s)
    rows, records, eval_s = score(arts, MODEL, max_windows=args.max_windows, seconds=seconds)
    for name in arts:
        rows[name]["command"] = commands.get(name) or f"llm-compressor 0.14.0.1 {LLMC[name]}"
    out = {"benchmark": "int8_smollm2_cpu", "model": MODEL,
           "heldout": f"mixed (heldout split), {args.max_windows} windows x 512 tokens, KLD vs "
                      "bf16, int8 inputs per token as vLLM rounds them",
           "calibration": {**CALIB, "set": "mixed",
                           "used_by": "SmoothQuant activation ranges (dynamic W8A8 needs none)"},
           "base_ppl": records[0]["metrics"]["base_ppl"]["value"], "results": rows,
           "llmc_outcome": outcome, "reused_artifacts": reused,
           "llmc_calibration": {"W8A8": "first window only (reads none)",
                                "W8A8+SQ0.5": "the same windows as quantkit's"},
           "eval_s": eval_s, "total_s": round(time.perf_counter() - t_all, 1),
           "machine": {"cpu": platform.processor() or platform.machine(),
                       "threads": torch.get_num_threads(), "cores": os.cpu_count(),
                       # other helpers' jobs shared the 2 cores: seconds are upper bounds
                       "load_avg_at_end": list(os.getloadavg())},
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
