"""GPTQ error feedback onto llama.cpp's grids vs llama.cpp's own imatrix quantization, through
llama.cpp's logits, on the same model, imatrix data and held-out text.

  python benchmarks/gguf_gptq_vs_llamacpp.py [--model smollm2-135m] [--gguf-type q4_k_m]
                                             [--calib-samples 64] [--windows 16] [--out FILE]
                                             [--attention-v] [--skip-diagh]

Files (all written in one run):
  base            the 16-bit GGUF (quantkit's converter): the reference of every KLD
  llamacpp_imat   llama.cpp's llama_model_quantize(base, imatrix): its own imatrix Q4_K_M
  gptq_imat       quantkit --method gguf --rounding gptq with the SAME imatrix file (scale
                  search weighted by it) and the same calibration windows for the Hessians
  gptq_diagh      the same with no imatrix: the scale search weighted by diag(H)
                  (left out with --skip-diagh)
  gptq_imat_attnv with --attention-v: gptq_imat with v_proj's attention-weighted Hessian
                  (--gptq-v-hessian attention), same imatrix file and windows
The imatrix is collected by quantkit's calibration loop (bit-exact with llama-imatrix's sums,
see gguf_vs_llamacpp.py) and saved as a GGUF imatrix, which llama.cpp reads. Scores: PPL and
mean KL(base || file) over the second half of 512-token windows (gguf_vs_llamacpp._score),
file sizes, and quantkit's seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gguf_vs_llamacpp import _llama_cpp, _model_dir, _quantkit, _score  # noqa: E402

from quantkit.methods.imatrix import load_imatrix  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--gguf-type", default="q4_k_m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calib-samples", type=int, default=64)
    ap.add_argument("--calib-seqlen", type=int, default=512)
    ap.add_argument("--windows", type=int, default=16, help="512-token windows scored")
    ap.add_argument("--attention-v", action="store_true",
                    help="also gptq_imat with v_hessian='attention' (--gptq-v-hessian attention)")
    ap.add_argument("--skip-diagh", action="store_true", help="leave out gptq_diagh")
    ap.add_argument("--out", type=Path, default=None,
                    help="default results/gguf_gptq_vs_llamacpp.json, with --attention-v "
                         "results/gguf_gptq_vs_llamacpp_attention_v.json")
    args = ap.parse_args()
    if args.out is None:
        args.out = Path(__file__).parent / "results" / (
            "gguf_gptq_vs_llamacpp_attention_v.json" if args.attention_v else "gguf_gptq_vs_llamacpp.json")

    import torch

    torch.set_num_threads(args.threads)
    engine = _llama_cpp()
    if engine is None:
        sys.exit("error: llama-cpp-python is not installed\nhint: run in quantkit's .venv")
    llama_model, llama_quantize = engine
    work = Path(tempfile.mkdtemp(prefix="gguf-gptq-bench-"))
    calib = {"calib_samples": args.calib_samples, "calib_seqlen": args.calib_seqlen}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    res: dict = {"command": "python " + " ".join(sys.argv), "commit": commit,
                 "model": args.model, "gguf_type": args.gguf_type, "threads": args.threads,
                 "calibration_windows": calib,
                 "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                             "loadavg_start": os.getloadavg(), "torch": torch.__version__}}
    try:
        raw = json.loads((_model_dir(args.model) / "config.json").read_text())
        float_type = "f16" if raw.get("dtype", raw.get("torch_dtype")) == "float16" else "bf16"
        seconds = {}
        seconds["convert_16bit"], _ = _quantkit(args.model, work / "base.gguf", float_type)
        seconds["imatrix_collection_and_rtn"], meta = _quantkit(
            args.model, work / "quantkit_rtn_imat.gguf", args.gguf_type,
            options={"imatrix": "calib", "imatrix_out": str(work / "imatrix.gguf")}, **calib)
        res["calibration"] = meta["calibration"]
        values = {k: v.numpy() for k, v in load_imatrix(work / "imatrix.gguf").values.items()}
        llama_quantize(work / "base.gguf", work / "llamacpp_imat.gguf", args.gguf_type,
                       nthread=args.threads, imatrix=values)
        seconds["gptq_imat"], meta_g = _quantkit(
            args.model, work / "gptq_imat.gguf", args.gguf_type,
            options={"rounding": "gptq", "imatrix": str(work / "imatrix.gguf")}, **calib)
        if args.attention_v:
            seconds["gptq_imat_attnv"], meta_a = _quantkit(
                args.model, work / "gptq_imat_attnv.gguf", args.gguf_type,
                options={"rounding": "gptq", "imatrix": str(work / "imatrix.gguf"),
                         "v_hessian": "attention"}, **calib)
            res["gptq_attnv_fallbacks"] = meta_a.get("fallbacks", {})
        if not args.skip_diagh:
            seconds["gptq_diagh"], _ = _quantkit(args.model, work / "gptq_diagh.gguf",
                                                 args.gguf_type, options={"rounding": "gptq"}, **calib)
        res["seconds"] = {k: round(v, 1) for k, v in seconds.items()}
        res["gptq_fallbacks"] = meta_g.get("fallbacks", {})
        names = ("base", "llamacpp_imat", "quantkit_rtn_imat", "gptq_imat",
                 *(("gptq_imat_attnv",) if args.attention_v else ()),
                 *(() if args.skip_diagh else ("gptq_diagh",)))
        paths = {n: work / f"{n}.gguf" for n in names}
        res["sizes_bytes"] = {n: p.stat().st_size for n, p in paths.items()}
        from quantkit.calibration import load_heldout_text

        text, prov = load_heldout_text("mixed")
        base = llama_model(paths["base"], n_ctx=512)
        ids = base.tokenize(text)
        base.close()
        res["quality"] = {**_score(llama_model, paths, ids, 512, args.windows), "heldout": prov}
        q = res["quality"]
        res["kld_ratio_gptq_imat_vs_llamacpp_imat"] = round(q["kld_gptq_imat"] / q["kld_llamacpp_imat"], 3)
        for name in names[4:]:
            res[f"kld_ratio_{name}_vs_llamacpp_imat"] = round(q[f"kld_{name}"] / q["kld_llamacpp_imat"], 3)
        res["size_ratio_gptq_vs_llamacpp"] = round(
            res["sizes_bytes"]["gptq_imat"] / res["sizes_bytes"]["llamacpp_imat"], 4)
        res["machine"]["loadavg_end"] = os.getloadavg()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2, default=str) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "calibration"}, indent=2, default=str))


if __name__ == "__main__":
    main()
