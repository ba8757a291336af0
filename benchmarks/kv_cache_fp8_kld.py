"""What an FP8 KV cache costs on SmolLM2-135M: KLD vs base with and without --kv-cache fp8.

    PYTHONPATH=. .venv/bin/python benchmarks/kv_cache_fp8_kld.py [--llmc-python V/bin/python]

Quantizes smollm2-135m with FP8_DYNAMIC weights (no calibration of its own), once as it is and
once with `--kv-cache fp8` (per-layer k/v scales from the default 128 x 512 `mixed`
calibration tokens), then scores both with `quantkit eval`'s convention (held-out `mixed`,
32 x 512 tokens, quantkit's loader: weights dequantized, Linear inputs rounded to E4M3 per
token, and for the KV artifact every cached key/value rounded through E4M3 with its stored
scale, as vLLM's FP8 cache stores it). With --llm-compressor's python, llm-compressor 0.14
writes the same recipe (FP8_DYNAMIC + kv_cache_scheme, its default observer) from the same
calibration tokens, scored the same way. Writes benchmarks/results/kv_cache_fp8_smollm2.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "kv_cache_fp8_smollm2.json"
LLMC_WORKER = r'''
import json, sys, torch
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from transformers import AutoModelForCausalLM, AutoTokenizer
src, ids_file, out = sys.argv[1:4]
ids = torch.load(ids_file); n, seqlen = ids.shape
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * seqlen] * n})
kv = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
recipe = QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"],
                              kv_cache_scheme=kv)
oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=seqlen, num_calibration_samples=n,
        shuffle_calibration_samples=False, batch_size=1, processor=AutoTokenizer.from_pretrained(src))
model.save_pretrained(out, save_compressed=True)
'''


def _quantize(out: Path, kv: bool) -> dict:
    from quantkit.methods.fp8 import fp8_scheme
    from quantkit.pipeline.quantize import QuantizeRequest, quantize

    t0 = time.perf_counter()
    meta = quantize(QuantizeRequest(model="smollm2-135m", method="fp8", scheme=fp8_scheme("dynamic"),
                                    out=out, method_options={"scheme": "dynamic"},
                                    kv_cache="fp8" if kv else None, force=True))
    return {"seconds": round(time.perf_counter() - t0, 1), "command": meta["command"],
            "kv_cache": meta.get("kv_cache")}


def _llmc(python: str, work: Path) -> Path:
    import shutil

    import torch

    from quantkit.calibration import load_calibration
    from quantkit.model_io import TOKENIZER_FILES, load_tokenizer, resolve_model

    src = resolve_model("smollm2-135m").path
    calib = load_calibration("mixed", load_tokenizer(src), n_samples=128, seqlen=512, seed=0)
    torch.save(calib.input_ids, work / "ids.pt")
    (work / "llmc_worker.py").write_text(LLMC_WORKER)
    out = work / "llmc_fp8_kv"
    proc = subprocess.run([python, str(work / "llmc_worker.py"), str(src), str(work / "ids.pt"),
                           str(out)], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    for name in TOKENIZER_FILES:
        if (src / name).is_file() and not (out / name).is_file():
            shutil.copy2(src / name, out / name)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--llmc-python", default=None, help="python of a venv with llmcompressor 0.14")
    p.add_argument("--max-windows", type=int, default=32)
    a = p.parse_args()
    import torch

    from quantkit.eval.harness import evaluate
    from quantkit.eval.logits import PPLConvention
    from quantkit.formats.kv_cache import read_kv_scales

    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory(prefix="kvbench-") as tmp:
        work = Path(tmp)
        runs = {"fp8_dynamic": _quantize(work / "fp8", kv=False),
                "fp8_dynamic_kv_fp8": _quantize(work / "fp8_kv", kv=True)}
        arts = {"fp8_dynamic": work / "fp8", "fp8_dynamic_kv_fp8": work / "fp8_kv"}
        if a.llmc_python:
            t0 = time.perf_counter()
            arts["llmcompressor_fp8_dynamic_kv_fp8"] = _llmc(a.llmc_python, work)
            runs["llmcompressor_fp8_dynamic_kv_fp8"] = {"seconds": round(time.perf_counter() - t0, 1)}
        conv = PPLConvention(max_windows=a.max_windows)
        records = evaluate([str(p) for p in arts.values()], "smollm2-135m", conv=conv)
        rows = {}
        for (name, path), rec in zip(arts.items(), records, strict=True):
            m = rec["metrics"]
            scales = read_kv_scales(path)
            rows[name] = {**runs[name], "ppl": m["ppl"]["value"],
                          "base_ppl": m["base_ppl"]["value"],
                          "kld_mean": m["kld"]["mean"], "kld_stderr": m["kld"]["stderr"],
                          "top1_agreement": m["top1_agreement"]["value"],
                          "kv_scales": {n: list(s) for n, s in scales.items()} or None}
            rows[name].pop("kv_cache", None)
        convention = records[0].get("convention")
    out = {"what": __doc__.split("\n")[0], "model": "smollm2-135m", "rows": rows,
           "convention": convention, "machine": {"cpu": platform.processor() or platform.machine(),
                                                 "python": sys.version.split()[0],
                                                 "torch": torch.__version__},
           "command": "PYTHONPATH=. .venv/bin/python benchmarks/kv_cache_fp8_kld.py"
                      + (" --llmc-python PY" if a.llmc_python else ""),
           "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    for name, r in rows.items():
        print(f"{name:36s} KLD {r['kld_mean']:.4f} ± {r['kld_stderr'] or 0:.4f}  PPL {r['ppl']:.3f}"
              f"  (base {r['base_ppl']:.3f})")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
