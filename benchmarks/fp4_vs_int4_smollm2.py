"""NVFP4 / MXFP4 vs int4 RTN g64 on SmolLM2-135M, beside llm-compressor's artifacts of the same
presets, all scored in one `quantkit eval` pass (quantkit.eval.harness: KLD vs the bf16 model and
PPL on the held-out split of `mixed`, 32 x 512 tokens; W4A4 inputs rounded through NVFP4 as the
engine does).

    PYTHONPATH=. .venv/bin/python benchmarks/fp4_vs_int4_smollm2.py [--llmc-python PY]

Writes benchmarks/results/fp4_vs_int4_smollm2_cpu.json. llm-compressor runs in its own venv
(scripts/setup.sh builds $QK_CACHE/venvs/llmcompressor-0.14.0.1) on quantkit's calibration
windows (W4A4: 32 x 512 of `mixed`; the W4A16 presets need none).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from quantkit.calibration import load_calibration
from quantkit.eval.harness import evaluate
from quantkit.info import artifact_info
from quantkit.methods.fp4 import fp4_scheme
from quantkit.model_io import cache_dir, load_tokenizer, resolve_model
from quantkit.pipeline.quantize import QuantizeRequest, quantize
from quantkit.types import QuantScheme

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "fp4_vs_int4_smollm2_cpu.json"
MODEL = "smollm2-135m"
CALIB = {"calib_samples": 32, "calib_seqlen": 512, "seed": 0}
LLMC = {"llmc_nvfp4a16": "NVFP4A16", "llmc_mxfp4a16": "MXFP4A16", "llmc_nvfp4": "NVFP4"}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--llmc-python", default=str(cache_dir() / "venvs" / "llmcompressor-0.14.0.1"
                                                / "bin" / "python"))
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="fp4bench-"))
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
    ids = load_calibration("mixed", load_tokenizer(src), n_samples=CALIB["calib_samples"],
                           seqlen=CALIB["calib_seqlen"], seed=CALIB["seed"]).input_ids
    torch.save(ids, work / "ids.pt")
    ref_root = work / "llmc"
    ref_root.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    subprocess.run([args.llmc_python, str(HERE.parent / "tests" / "llmc_reference.py"), str(src),
                    str(work / "ids.pt"), str(ref_root), *LLMC.values()], check=True)
    seconds["llmc_all_three"] = round(time.perf_counter() - t0, 1)
    outcome = json.loads((ref_root / "outcome.json").read_text())
    for name, preset in LLMC.items():
        if outcome.get(preset) == "ok":
            arts[name] = ref_root / preset
            for f in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy2(src / f, arts[name] / f)
    t0 = time.perf_counter()
    records = evaluate([str(a) for a in arts.values()], MODEL)
    eval_s = round(time.perf_counter() - t0, 1)
    rows = {}
    for (name, art), rec in zip(arts.items(), records, strict=True):
        m, info = rec["metrics"], artifact_info(art)
        rows[name] = {"kld_mean": m["kld"]["mean"], "kld_stderr": m["kld"]["stderr"], "ppl": m["ppl"]["value"],
                      "top1_agreement": m["top1_agreement"]["value"],
                      "bits_per_weight_quantized": info.get("bits_per_weight_quantized"),
                      "quantize_s": seconds.get(name)}
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


if __name__ == "__main__":
    main()
