"""Record what llm-compressor 0.14 writes for an FP8 KV cache, for tests/test_kv_cache.py.

llm-compressor is not in quantkit's venv (it pins another compressed-tensors), so its output
is recorded once here and checked in: tests/data/llmc_kv_fp8_reference.json holds its
kv_cache_scheme, the k/v scale tensors' names, dtypes, shapes and values, for the seeded tiny
Llama of tests/tiny_models.py quantized FP8_DYNAMIC + kv_cache_scheme (tensor, static, symmetric)
on the calibration tokens `quantkit quantize --calib mixed --calib-samples 4 --calib-seqlen 64`
draws (the test runs quantkit on the very same tokens).

    .venv/bin/python benchmarks/kv_cache_llmc_reference.py --llmc-python /tmp/venv-llmc/bin/python

The llm-compressor venv: `python -m venv V; V/bin/pip install llmcompressor==0.14.0.1`
(or, to reuse .venv's CPU torch: a .pth file naming .venv's site-packages and
`pip install --no-deps llmcompressor==0.14.0.1 compressed-tensors==0.19.0`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "llmc_kv_fp8_reference.json"
SAMPLES, SEQLEN = 4, 64


def worker(model_dir: str, ids_file: str, out_dir: str) -> None:
    """Runs in llm-compressor's venv."""
    import llmcompressor
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = torch.load(ids_file)
    n, seqlen = ids.shape
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * seqlen] * n})
    kv = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    recipe = QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"],
                                  kv_cache_scheme=kv)
    oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=seqlen,
            num_calibration_samples=n, shuffle_calibration_samples=False, batch_size=1,
            processor=AutoTokenizer.from_pretrained(model_dir))
    model.save_pretrained(out_dir, save_compressed=True)
    qcfg = json.loads((Path(out_dir) / "config.json").read_text())["quantization_config"]
    tensors = {}
    for f in sorted(Path(out_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                if k.endswith(("k_scale", "v_scale")):
                    t = sf.get_tensor(k)
                    tensors[k] = {"dtype": sf.get_slice(k).get_dtype(), "shape": list(t.shape),
                                  "value": t.float().reshape(-1).tolist()}
    print("RESULT " + json.dumps({"llmcompressor": llmcompressor.__version__,
                                  "kv_cache_scheme": qcfg["kv_cache_scheme"],
                                  "version": qcfg.get("version"), "tensors": tensors}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--llmc-python", required=True)
    p.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(*a.worker)
        return
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import make_tiny_model

    from quantkit.calibration import load_calibration
    from quantkit.model_io import load_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "tiny", "llama")
        calib = load_calibration("mixed", load_tokenizer(model), n_samples=SAMPLES,
                                 seqlen=SEQLEN, seed=0)
        torch.save(calib.input_ids, Path(tmp) / "ids.pt")
        proc = subprocess.run([a.llmc_python, __file__, "--llmc-python", a.llmc_python, "--worker",
                               str(model), str(Path(tmp) / "ids.pt"), str(Path(tmp) / "llmc")],
                              capture_output=True, text=True, env={"PATH": "/usr/bin:/bin",
                                                                   "HF_HUB_OFFLINE": "1"})
        if proc.returncode:
            raise SystemExit(proc.stderr[-3000:])
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    res = json.loads(line[len("RESULT "):])
    res["recipe"] = ("QuantizationModifier(targets=Linear, scheme=FP8_DYNAMIC, ignore=[lm_head], "
                     "kv_cache_scheme={num_bits 8, float, tensor, static, symmetric})")
    res["model"] = "tests/tiny_models.py make_tiny_model(llama), bf16"
    res["calibration"] = f"quantkit load_calibration('mixed', n_samples={SAMPLES}, seqlen={SEQLEN}, seed=0)"
    OUT.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
