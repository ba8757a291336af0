"""Cross-CPU determinism on one machine: the same `quantkit quantize` under other BLAS kernels.

  .venv/bin/python benchmarks/determinism_ab.py [--model tiny|smollm2-135m] [--samples 8]
        [--seqlen 64] [--variants default,mkl_avx2,openblas_haswell,threads1] [--reproducible]
        [--json out.json]

Different CPUs run different kernels (AVX2 / AVX-512 / AMX) with different summation orders;
here the libraries are made to pick those kernels on this one CPU through their own switches
(MKL_ENABLE_INSTRUCTIONS, OPENBLAS_CORETYPE, ATEN_CPU_CAPABILITY, thread counts), each run a
fresh `quantkit quantize` subprocess (the switches are read when the libraries load). Every
artifact is compared with the first variant's: byte identity of model.safetensors and the
share of 4-bit codes that differ. With --reproducible every run passes `--reproducible`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {
    "default": {},
    "mkl_avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "openblas_haswell": {"OPENBLAS_CORETYPE": "Haswell"},
    "aten_avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "threads1": {"OMP_NUM_THREADS": "1"},
    "threads2": {"OMP_NUM_THREADS": "2"},
    "avx2_machine": {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "OPENBLAS_CORETYPE": "Haswell",
                     "ATEN_CPU_CAPABILITY": "avx2", "OMP_NUM_THREADS": "1"},
}


def codes(path: Path) -> dict:
    """{tensor name: int tensor} of the artifact's packed int32 weights unpacked to codes."""
    import torch
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            if t.dtype == torch.int32 and name.endswith("weight_packed"):
                shifts = torch.arange(0, 32, 4, dtype=torch.int32)
                out[name] = ((t.unsqueeze(-1) >> shifts) & 0xF).flatten()
            elif t.is_floating_point():
                out[name] = t
    return out


def compare(ref: Path, other: Path) -> dict:
    """Byte identity and the share of differing codes / float tensors (scales) between two artifacts."""
    import torch

    a, b = codes(ref), codes(other)
    differ = total = 0
    float_differ = []
    for name, t in a.items():
        if t.is_floating_point():
            if not torch.equal(t, b[name]):
                float_differ.append(name)
        else:
            differ += int((t != b[name]).sum())
            total += t.numel()
    digest = [hashlib.sha256(p.read_bytes()).hexdigest() for p in (ref / "model.safetensors",
                                                                   other / "model.safetensors")]
    return {"identical": digest[0] == digest[1], "codes_differing": differ, "codes_total": total,
            "codes_differing_share": differ / max(total, 1),
            "float_tensors_differing": len(float_differ)}


def run(model: str, out: Path, env_extra: dict, args: argparse.Namespace) -> float:
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    for k in ("MKL_ENABLE_INSTRUCTIONS", "OPENBLAS_CORETYPE", "ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS",
              "MKL_CBWR", "QUANTKIT_REPRODUCIBLE"):
        env.pop(k, None)
    env.update(env_extra)
    cmd = [sys.executable, "-m", "quantkit.cli", "quantize", model, "--method", "gptq", "--bits", "4",
           "--group-size", "64", "--calib-samples", str(args.samples), "--calib-seqlen", str(args.seqlen),
           "--device", "cpu", "-o", str(out), "--force", *(["--act-order"] if args.act_order else []),
           *(["--reproducible"] if args.reproducible else [])]
    t = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"{cmd} failed:\n{p.stderr[-3000:]}")
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=64)
    ap.add_argument("--act-order", action="store_true")
    ap.add_argument("--variants", default="default,mkl_avx2,openblas_haswell,aten_avx2,threads1")
    ap.add_argument("--reproducible", action="store_true")
    ap.add_argument("--keep", type=Path, default=None, help="write the artifacts here")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        model = args.model
        if model == "tiny":
            sys.path.insert(0, str(REPO / "tests"))
            from tiny_models import make_tiny_model

            model = str(make_tiny_model(Path(tmp) / "tiny", "llama", layers=2))
        results = {}
        names = args.variants.split(",")
        for name in names:
            seconds = run(model, root / name, VARIANTS[name], args)
            results[name] = {"env": VARIANTS[name], "seconds": round(seconds, 1)}
            if name != names[0]:
                results[name].update(compare(root / names[0], root / name))
            print(name, json.dumps(results[name]), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "samples": args.samples,
                                         "seqlen": args.seqlen, "reproducible": args.reproducible,
                                         "results": results}, indent=1))


if __name__ == "__main__":
    main()
