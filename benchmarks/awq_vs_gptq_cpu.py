"""quantkit AWQ vs quantkit GPTQ on the CPU, back to back in one run, plus their held-out KLD.

    .venv/bin/python benchmarks/awq_vs_gptq_cpu.py [--repeats 2] [--threads 2]
        [--baseline-awq DIR | --baseline-kld K] [--baseline-commit HASH --baseline-job-s S]

The demo's jobs (scripts/demo.sh): smollm2-135m, int4 group 64, `mixed` calibration 64 x 512
tokens, seed 0; GPTQ with --act-order (compressed-tensors), AWQ symmetric (AutoAWQ GEMM).
Each job runs in a fresh subprocess (load + calibrate + quantize + save timed inside it,
imports before the clock), GPTQ and AWQ interleaved `--repeats` times so that load from
other processes falls on both alike. Then the last artifacts of both (and `--baseline-awq`,
an AWQ artifact made by an earlier commit with the same settings) are scored against the
base model on held-out `mixed` text (32 x 512 tokens: PPL, KLD, top-1), and
benchmarks/results/awq_vs_gptq_cpu.json records commit, command, CPU flags, times and KLDs.
The file is also its own worker (--worker gptq|awq).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "awq_vs_gptq_cpu.json"


def worker(a: argparse.Namespace) -> dict:
    t_proc = time.perf_counter()
    import torch

    from quantkit.formats import get_writer
    from quantkit.methods import get_quantizer
    from quantkit.pipeline.quantize import QuantizeRequest, quantize
    from quantkit.types import QuantScheme

    torch.set_num_threads(a.threads)
    gptq = a.worker == "gptq"
    fmt = a.gptq_format if gptq else "awq"
    opts = json.loads(a.options) if a.options else {}
    get_writer(fmt), get_quantizer(a.worker, **opts)  # imports before the clock
    t0 = time.perf_counter()
    meta = quantize(QuantizeRequest(
        model=a.model, method=a.worker, format=fmt, out=Path(a.out), force=True,
        scheme=QuantScheme(bits=4, group_size=64, symmetric=True, act_order=gptq),
        calib="mixed", calib_samples=a.samples, calib_seqlen=a.seqlen, seed=0, device="cpu",
        method_options=opts))
    return {"job_s": time.perf_counter() - t0, "block_loop_s": meta["seconds"]["quantize"],
            "process_s": time.perf_counter() - t_proc,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "threads": torch.get_num_threads(), "options": opts}


def run_worker(method: str, out: Path, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", method, "--out", str(out),
           "--model", args.model, "--samples", str(args.samples), "--seqlen", str(args.seqlen),
           "--threads", str(args.threads), "--gptq-format", args.gptq_format]
    if method == "awq" and args.awq_options:
        cmd += ["--options", args.awq_options]
    print(f"[{time.strftime('%H:%M:%S')}] {method} -> {out}", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if proc.returncode != 0:
        raise SystemExit(f"{method} worker failed (exit {proc.returncode}):\n" + proc.stderr[-4000:])
    res = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    res["load_avg_after"] = os.getloadavg()
    print(f"    job {res['job_s']:.1f} s (block loop {res['block_loop_s']}), "
          f"peak RSS {res['peak_rss_mib']:.0f} MiB", flush=True)
    return res


def _git_commit() -> str:
    try:
        head = subprocess.run(["git", "-C", str(HERE), "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(HERE), "status", "--porcelain", "--", "../quantkit"],
                               capture_output=True, text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _cpu() -> dict:
    name, flags = platform.processor(), []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                break
    except OSError:
        pass
    simd = [f for f in flags if f.startswith(("avx", "amx", "fma", "f16c"))]
    return {"cpu": name, "cores_visible": os.cpu_count(),
            "affinity": sorted(os.sched_getaffinity(0)), "simd_flags": simd}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=["gptq", "awq"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--options", help=argparse.SUPPRESS)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--gptq-format", default="compressed-tensors",
                   help="GPTQ's artifact format (the demo's: compressed-tensors; gptq where "
                        "compressed-tensors is not installed)")
    p.add_argument("--repeats", type=int, default=2, help="GPTQ, AWQ pairs, interleaved")
    p.add_argument("--awq-options", default="", help="JSON of AWQ method options (default: none)")
    p.add_argument("--baseline-awq", type=Path, help="AWQ artifact of an earlier commit, same settings")
    p.add_argument("--baseline-commit", default="")
    p.add_argument("--baseline-kld", type=float,
                   help="that commit's AWQ KLD from an earlier run of this eval (no --baseline-awq)")
    p.add_argument("--baseline-job-s", type=float, help="that commit's AWQ job time, if measured")
    p.add_argument("--baseline-wait-s", type=int, default=0,
                   help="wait this long for --baseline-awq to appear (made alongside)")
    p.add_argument("--commit", default=None, help="commit of the code measured (default: git)")
    p.add_argument("--eval-windows", type=int, default=32)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/quantkit-bench-awq"))
    p.add_argument("--results", type=Path, default=RESULTS)
    args = p.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return

    args.workdir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {"gptq": [], "awq": []}
    for _ in range(args.repeats):
        for method in ("gptq", "awq"):
            runs[method].append(run_worker(method, args.workdir / method, args))
    best = {m: min(r["job_s"] for r in rs) for m, rs in runs.items()}
    pairs = [a["job_s"] / g["job_s"] for g, a in zip(runs["gptq"], runs["awq"], strict=True)]

    from quantkit.eval.harness import evaluate
    from quantkit.eval.logits import PPLConvention
    from quantkit.model_io import resolve_model

    arts = {"gptq": args.workdir / "gptq", "awq": args.workdir / "awq"}
    if args.baseline_awq:
        arts["awq_baseline"] = args.baseline_awq
        for _ in range(args.baseline_wait_s):  # a baseline quantized alongside, on other cores
            if (args.baseline_awq / "config.json").is_file():
                break
            time.sleep(1)
    print(f"[{time.strftime('%H:%M:%S')}] eval: base + {len(arts)} artifacts", flush=True)
    recs = evaluate([str(v) for v in arts.values()], base=str(resolve_model(args.model).path),
                    heldout="mixed", conv=PPLConvention(ctx=512, max_windows=args.eval_windows))
    metrics = {}
    for k, rec in zip(arts, recs, strict=True):
        m = rec["metrics"]
        metrics[k] = {"ppl": m["ppl"]["value"], "kld_mean": m["kld"]["mean"],
                      "kld_stderr": m["kld"]["stderr"], "top1": m["top1_agreement"]["value"],
                      "base_ppl": m["base_ppl"]["value"]}
    acceptance = {"awq_over_gptq_per_pair": pairs, "awq_over_gptq_worst_pair": max(pairs),
                  "awq_over_gptq_best_times": best["awq"] / best["gptq"], "time_goal": "<= 1.5"}
    if args.baseline_kld is not None and "awq_baseline" not in metrics:
        metrics["awq_baseline"] = {"kld_mean": args.baseline_kld, "measured": "earlier, same eval"}
    if "awq_baseline" in metrics:
        rel = metrics["awq"]["kld_mean"] / metrics["awq_baseline"]["kld_mean"] - 1
        acceptance.update(awq_kld_change_vs_baseline=rel, kld_goal="<= +0.02 (relative)")
    result = {
        "benchmark": "awq_vs_gptq_cpu",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "commit": args.commit or _git_commit(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {**_cpu(), "torch_threads": args.threads, "load_avg_at_end": os.getloadavg(),
                    "python": platform.python_version()},
        "settings": {"model": args.model, "calib": "mixed", "calib_samples": args.samples,
                     "calib_seqlen": args.seqlen, "seed": 0, "bits": 4, "group_size": 64,
                     "gptq": f"act-order static, {args.gptq_format}", "awq": "sym, AutoAWQ GEMM",
                     "awq_options": json.loads(args.awq_options) if args.awq_options else {},
                     "heldout": f"mixed, {args.eval_windows} x 512 tokens"},
        "time_note": "job_s: load + calibrate + quantize + save in a fresh process, imports "
                     "before the clock; GPTQ and AWQ interleaved on the same cores",
        "runs": runs, "metrics": metrics, "acceptance": acceptance,
        "baseline": {"commit": args.baseline_commit, "artifact": str(args.baseline_awq or ""),
                     "awq_job_s": args.baseline_job_s},
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(json.dumps({"best_job_s": best, "pairs": pairs, "metrics": metrics,
                      "acceptance": acceptance}, indent=1, default=str))
    print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
