"""`--gguf-type auto` at the size of llama.cpp's imatrix Q4_K_M vs that file, through llama.cpp's
logits, on the same model, imatrix data and held-out text.

  python benchmarks/gguf_auto_vs_llamacpp.py [--model smollm2-135m] [--calib-samples 64]
                                             [--windows 16] [--out FILE]

Files (all written in one run):
  base            the 16-bit GGUF (quantkit's converter): the reference of every KLD
  llamacpp_imat   llama.cpp's llama_model_quantize(base, imatrix) Q4_K_M
  quantkit_q4km   quantkit's own imatrix Q4_K_M (bit-exact with the above; it also writes the
                  imatrix file every other row uses)
  auto            quantkit --gguf-type auto --target-bpw B, B = llama.cpp's file's bits per
                  weight over its weight matrices (block Linears + token_embd/output), the same
                  imatrix file, block-output gains on the first 2 calibration batches
  auto_nogain     the same with the imatrix-weighted error alone (gain_batches 0)
Scores: PPL and mean KL(base || file) over the second half of 512-token windows
(gguf_vs_llamacpp._score), file sizes, the chosen type counts, quantkit's seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gguf_vs_llamacpp import _llama_cpp, _model_dir, _quantkit, _score  # noqa: E402

from quantkit.info import artifact_info  # noqa: E402
from quantkit.methods.imatrix import load_imatrix  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calib-samples", type=int, default=64)
    ap.add_argument("--calib-seqlen", type=int, default=512)
    ap.add_argument("--windows", type=int, default=16, help="512-token windows scored")
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).parent / "results" / "gguf_auto_vs_llamacpp.json")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    engine = _llama_cpp()
    if engine is None:
        sys.exit("error: llama-cpp-python is not installed\nhint: run in quantkit's .venv")
    llama_model, llama_quantize = engine
    work = Path(tempfile.mkdtemp(prefix="gguf-auto-bench-"))
    calib = {"calib_samples": args.calib_samples, "calib_seqlen": args.calib_seqlen}
    import subprocess

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent).stdout.strip()
    res: dict = {"code": f"quantkit commit {commit or '?'}", "model": args.model,
                 "threads": args.threads, "calibration_windows": calib,
                 "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                             "loadavg_start": os.getloadavg(), "torch": torch.__version__}}
    try:
        raw = json.loads((_model_dir(args.model) / "config.json").read_text())
        float_type = "f16" if raw.get("dtype", raw.get("torch_dtype")) == "float16" else "bf16"
        seconds = {}
        seconds["convert_16bit"], _ = _quantkit(args.model, work / "base.gguf", float_type)
        seconds["quantkit_q4km"], meta = _quantkit(
            args.model, work / "quantkit_q4km.gguf", "q4_k_m",
            options={"imatrix": "calib", "imatrix_out": str(work / "imatrix.gguf")}, **calib)
        res["calibration"] = meta["calibration"]
        values = {k: v.numpy() for k, v in load_imatrix(work / "imatrix.gguf").values.items()}
        llama_quantize(work / "base.gguf", work / "llamacpp_imat.gguf", "q4_k_m",
                       nthread=args.threads, imatrix=values)
        ref = artifact_info(work / "llamacpp_imat.gguf")
        target = ref["bits_per_weight_with_embeddings"]
        res["target_bpw"] = target
        autos = {}
        for name, gain in (("auto", 2), ("auto_nogain", 0)):
            seconds[name], autos[name] = _quantkit(
                args.model, work / f"{name}.gguf", "auto",
                options={"imatrix": str(work / "imatrix.gguf"), "target_bpw": target,
                         "gain_batches": gain}, **calib)
        res["seconds"] = {k: round(v, 1) for k, v in seconds.items()}
        res["auto_type_counts"] = {n: m["gguf_auto"]["type_counts"] for n, m in autos.items()}
        res["auto_types"] = {n: {t: v["type"] for t, v in m["gguf_auto"]["tensors"].items()}
                             for n, m in autos.items()}
        res["auto_gains"] = {t: v.get("block_gain") for t, v in autos["auto"]["gguf_auto"]["tensors"].items()}
        names = ("base", "llamacpp_imat", "quantkit_q4km", "auto", "auto_nogain")
        paths = {n: work / f"{n}.gguf" for n in names}
        res["sizes_bytes"] = {n: p.stat().st_size for n, p in paths.items()}
        res["bits_per_weight_matrices"] = {n: artifact_info(p).get("bits_per_weight_with_embeddings")
                                           for n, p in paths.items()}
        from quantkit.calibration import load_heldout_text

        text, prov = load_heldout_text("mixed")
        base = llama_model(paths["base"], n_ctx=512)
        ids = base.tokenize(text)
        base.close()
        res["quality"] = {**_score(llama_model, paths, ids, 512, args.windows), "heldout": prov}
        q = res["quality"]
        for name in ("auto", "auto_nogain", "quantkit_q4km"):
            res[f"kld_ratio_{name}_vs_llamacpp_imat"] = round(q[f"kld_{name}"] / q["kld_llamacpp_imat"], 3)
        res["size_ratio_auto_vs_llamacpp"] = round(
            res["sizes_bytes"]["auto"] / res["sizes_bytes"]["llamacpp_imat"], 4)
        res["machine"]["loadavg_end"] = os.getloadavg()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2, default=str) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k not in ("calibration", "auto_types", "auto_gains")},
                     indent=2, default=str))


if __name__ == "__main__":
    main()
