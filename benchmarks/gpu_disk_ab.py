"""Disk-to-disk GPU A/B of two quantkit trees: the same checkpoint, `quantkit quantize` run by
each tree's code in its own process, the artifacts' tensor files compared byte for byte; and
the NaN/Inf refusal on the GPU path (a NaN in block 1 refused by name, nothing written).

  python3 benchmarks/gpu_disk_ab.py --old-root .main --new-root . --out $OUT/ab.json

Synthetic Llama-3.1-8B-shaped blocks (`--layers`), GPTQ W4A16 g128 and AWQ, few calibration
tokens: what is compared is the artifact's bytes, not the time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_quantkit_vs_llmcompressor import (  # noqa: E402
    git_commit,
    quantkit_cli_args,
    synthetic_llama,
    write_checkpoint,
)


def _hashes(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())
            if p.suffix == ".safetensors" or p.name == "config.json"}


def _quantize(root: Path, cli: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(root.resolve()), os.environ.get("PYTHONPATH", "")]), HF_HUB_OFFLINE="1")
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "quantkit.cli", *cli], env=env,
                         capture_output=True, text=True)
    return res, round(time.perf_counter() - t0, 2)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--old-root", required=True)
    p.add_argument("--new-root", default=".")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--shape", default="llama-3.1-8b", help="tiny: a CPU dry run")
    p.add_argument("--methods", default="gptq,awq")
    p.add_argument("--workdir", default="/tmp/quantkit-disk-ab")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    work = Path(a.workdir)
    shutil.rmtree(work, ignore_errors=True)
    args = argparse.Namespace(samples=32, seqlen=512)
    ckpt = write_checkpoint(synthetic_llama(a.layers, a.shape), work / "checkpoint", args.samples,
                            args.seqlen)
    rows = []
    for method in a.methods.split(","):
        hashes = {}
        for label, root in (("old", Path(a.old_root)), ("new", Path(a.new_root))):
            out = work / f"artifact-{label}"
            res, dt = _quantize(root, quantkit_cli_args(method, ckpt, args, out))
            if res.returncode:
                print(res.stdout[-3000:], res.stderr[-3000:])
            hashes[label] = _hashes(out) if res.returncode == 0 else {}
            rows.append({"method": method, "tree": label, "rc": res.returncode, "seconds": dt,
                         "seconds_inside": json.loads((out / "quantkit.json").read_text())[
                             "seconds"] if res.returncode == 0 else None})
            shutil.rmtree(out, ignore_errors=True)
        same = bool(hashes["old"]) and hashes["old"] == hashes["new"]
        rows.append({"method": method, "check": "artifact_bytes_identical", "passed": same,
                     "files": len(hashes["new"])})
        print(f"{method}: artifacts identical: {same}", flush=True)
    # NaN in block 1: refused by name on the GPU path, nothing written
    from safetensors.torch import load_file, save_file

    shard = Path(ckpt["checkpoint"]) / "model-block-00001.safetensors"
    tensors = load_file(str(shard))
    bad = "model.layers.1.mlp.down_proj.weight"
    tensors[bad][7, 3] = float("nan")
    save_file(tensors, str(shard), metadata={"format": "pt"})
    out = work / "artifact-nan"
    res, dt = _quantize(Path(a.new_root), quantkit_cli_args("gptq", ckpt, args, out))
    text = res.stdout + res.stderr
    # the finished block 0 may stay in the resume checkpoint (.artifact-nan.partial), by design
    refused = res.returncode == 2 and f"{bad} contains 1 NaN/Inf" in text and not out.exists()
    rows.append({"check": "nan_in_block_refused_on_gpu", "passed": refused, "rc": res.returncode,
                 "seconds": dt, "message": [ln for ln in text.splitlines() if "NaN" in ln][:2],
                 "partial_dir_left": (work / ".artifact-nan.partial").exists()})
    print(f"NaN in block 1 refused, nothing written: {refused}", flush=True)
    Path(a.out).write_text(json.dumps({"commit": git_commit(), "checkpoint": ckpt,
                                       "rows": rows}, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    sys.exit(0 if all(r.get("passed", True) for r in rows) else 1)


if __name__ == "__main__":
    main()
