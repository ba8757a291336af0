"""Which tensor kinds carry GPTQ-on-GGUF's end-to-end gain, through llama.cpp's logits.

    python benchmarks/gguf_gptq_by_tensor_kind.py [--model smollm2-135m] [--gguf-type q4_k_m]
        [--calib-samples 64] [--windows 16] [--only KIND,...] [--without KIND,...] [--out FILE]

Files: the 16-bit GGUF (the KLD reference), llama.cpp's rounding with quantkit's imatrix of the
calibration windows (`rtn`: llama.cpp's bytes, see gguf_vs_llamacpp.py) and GPTQ error feedback
with the same imatrix (`gptq`). Both hold the same types at the same offsets, so hybrids are
byte copies: `only_KIND` = rtn with KIND's tensors taken from gptq (what GPTQ on that kind
alone gains), `without_KIND` = gptq with KIND's tensors taken from rtn. A KIND is a tensor
name (attn_v) or name:TYPE (attn_v:Q5_0); `--only all` lists every kind in the file.
KLD(base || file) over the second half of each 512-token held-out window, one file at a time.
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
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from gguf import GGUFReader  # noqa: E402
from gguf_vs_llamacpp import _llama_cpp, _quantkit  # noqa: E402


def _kind(tensor) -> str | None:
    parts = tensor.name.split(".")
    if len(parts) < 3 or tensor.tensor_type.name in ("F32", "F16", "BF16"):
        return None
    return f"{parts[2]}:{tensor.tensor_type.name}"


def _matches(tensor, kinds: list[str]) -> bool:
    k = _kind(tensor)
    return k is not None and (k in kinds or k.split(":")[0] in kinds)


def _hybrid(into: Path, frm: Path, out: Path, kinds: list[str]) -> int:
    """Copy of `into` whose tensors of `kinds` hold `frm`'s bytes; returns how many."""
    a, b = GGUFReader(into), {t.name: t for t in GGUFReader(frm).tensors}
    shutil.copy(into, out)
    n = 0
    with open(out, "r+b") as f:
        for t in a.tensors:
            if _matches(t, kinds):
                src = b[t.name]
                if src.tensor_type != t.tensor_type or src.n_bytes != t.n_bytes:
                    raise SystemExit(f"{t.name}: the two files differ in type or size")
                f.seek(t.data_offset)
                f.write(np.asarray(src.data).view(np.uint8).tobytes())
                n += 1
    return n


def _log_probs(model_cls, path: Path, windows: list[list[int]]) -> list[np.ndarray]:
    llm = model_cls(path, n_ctx=512, logits_all=True)
    out = []
    try:
        for w in windows:
            lg = np.asarray(llm.logits(w)[255:-1], dtype=np.float64)
            lg -= lg.max(-1, keepdims=True)
            out.append(lg - np.log(np.exp(lg).sum(-1, keepdims=True)))
    finally:
        llm.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--gguf-type", default="q4_k_m")
    ap.add_argument("--calib-samples", type=int, default=64)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--only", default="", help="kinds to score GPTQ on alone (or 'all')")
    ap.add_argument("--without", default="attn_v", help="kinds to leave to llama.cpp's rounding")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--keep", type=Path, help="keep the files in this directory (reused if present)")
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).parent / "results" / "gguf_gptq_by_tensor_kind_smollm2.json")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    engine = _llama_cpp()
    if engine is None:
        sys.exit("error: llama-cpp-python is not installed\nhint: run in quantkit's .venv")
    model_cls, _ = engine
    work = args.keep or Path(tempfile.mkdtemp(prefix="gguf-gptq-kinds-"))
    work.mkdir(parents=True, exist_ok=True)
    calib = {"calib_samples": args.calib_samples, "calib_seqlen": 512}
    reused = sorted(n for n in ("base.gguf", "rtn.gguf", "gptq.gguf") if (work / n).exists())
    t0, load_start = time.perf_counter(), os.getloadavg()
    try:
        if not (work / "base.gguf").exists():
            _quantkit(args.model, work / "base.gguf", "bf16")
        if not (work / "rtn.gguf").exists():
            _quantkit(args.model, work / "rtn.gguf", args.gguf_type,
                      options={"imatrix": "calib", "imatrix_out": str(work / "imatrix.gguf")}, **calib)
        if not (work / "gptq.gguf").exists():
            _quantkit(args.model, work / "gptq.gguf", args.gguf_type,
                      options={"rounding": "gptq", "imatrix": str(work / "imatrix.gguf")}, **calib)
        kinds = sorted({k for t in GGUFReader(work / "rtn.gguf").tensors if (k := _kind(t))})
        only = kinds if args.only == "all" else [k for k in args.only.split(",") if k]
        files = {"rtn": work / "rtn.gguf", "gptq": work / "gptq.gguf"}
        counts = {}
        for k in only:
            files[f"only_{k}"] = work / f"only_{k.replace(':', '_')}.gguf"
            counts[f"only_{k}"] = _hybrid(work / "rtn.gguf", work / "gptq.gguf", files[f"only_{k}"], [k])
        without = [k for k in args.without.split(",") if k]
        if without:
            name = "without_" + "+".join(without)
            files[name] = work / f"{name.replace(':', '_')}.gguf"
            counts[name] = _hybrid(work / "gptq.gguf", work / "rtn.gguf", files[name], without)
        from quantkit.calibration import load_heldout_text

        text, _ = load_heldout_text("mixed")
        probe = model_cls(work / "base.gguf", n_ctx=512)
        ids = probe.tokenize(text)
        probe.close()
        windows = [ids[i:i + 512] for i in range(0, len(ids) - 511, 512)][:args.windows]
        base = _log_probs(model_cls, work / "base.gguf", windows)
        kld = {}
        for name, path in files.items():
            q = _log_probs(model_cls, path, windows)
            kld[name] = float(np.mean(np.concatenate(
                [(np.exp(b) * (b - p)).sum(-1) for b, p in zip(base, q, strict=True)])))
            print(f"{name:28s} KLD {kld[name]:.5f}  x rtn {kld[name] / kld['rtn']:.3f}", flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    res = {"benchmark": "gguf_gptq_by_tensor_kind", "model": args.model, "gguf_type": args.gguf_type,
           "commit": commit, "command": "python " + " ".join(sys.argv),
           "calibration_windows": [args.calib_samples, 512], "heldout_windows": [len(windows), 512],
           "files_reused_from_keep": reused, "tensors_swapped": counts, "kld": kld,
           "x_rtn": {k: round(v / kld["rtn"], 3) for k, v in kld.items()},
           "seconds": round(time.perf_counter() - t0, 1),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                       "loadavg_start": load_start, "loadavg_end": os.getloadavg()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
