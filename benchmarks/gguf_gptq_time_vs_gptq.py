"""Time of GPTQ error feedback onto GGUF grids vs quantkit's own GPTQ, same calibration data.

    .venv/bin/python benchmarks/gguf_gptq_time_vs_gptq.py [--model smollm2-135m]
        [--samples 64] [--seqlen 512] [--repeats 2] [--gguf-type q4_k_m] [--out FILE]

Issue 19's time goal: `quantkit quantize MODEL --method gptq --format gguf --gguf-type q4_k_m`
<= `quantkit quantize MODEL --method gptq` (the int4 default scheme) + 20 %, on the same
calibration windows. Both are the real CLI in fresh processes (what a user runs: imports,
model load, calibration, block loop, write), interleaved `--repeats` times so that load from
other processes falls on both alike; wall, user and sys seconds come from the child's rusage,
the phase split from the artifact's own `seconds` record. The ratio is of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _commit() -> str:
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "quantkit"],
                               capture_output=True, text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _phases(out: Path) -> dict:
    """The artifact's own `seconds` record (quantkit.json, or the GGUF's quantkit.metadata)."""
    if out.is_dir():
        return json.loads((out / "quantkit.json").read_text()).get("seconds", {})
    from gguf import GGUFReader

    field = GGUFReader(out).fields["quantkit.metadata"]
    return json.loads(bytes(field.parts[field.data[0]]).decode()).get("seconds", {})


def _run(cmd: list[str]) -> dict:
    print(f"[{time.strftime('%H:%M:%S')}] {' '.join(cmd[2:])}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    err = proc.stderr.read()
    proc.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed ({os.waitstatus_to_exitcode(status)}): {' '.join(cmd)}\n{err[-3000:]}")
    res = {"wall_s": round(wall, 2), "user_s": round(usage.ru_utime, 2),
           "sys_s": round(usage.ru_stime, 2), "peak_rss_mib": round(usage.ru_maxrss / 1024),
           "loadavg_after": [round(x, 2) for x in os.getloadavg()]}
    print(f"    wall {res['wall_s']} s, cpu {res['user_s'] + res['sys_s']:.1f} s", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--gguf-type", default="q4_k_m")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "gguf_gptq_time_vs_gptq.json")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gguf-gptq-time-"))
    cli = [sys.executable, "-m", "quantkit.cli", "quantize", args.model, "--method", "gptq",
           "--calib-samples", str(args.samples), "--calib-seqlen", str(args.seqlen), "--force"]
    commit = _commit()  # before the runs: what they run
    jobs = {"gguf_gptq": cli + ["--format", "gguf", "--gguf-type", args.gguf_type,
                                "--output", str(work / "out.gguf")],
            "gptq_int4": cli + ["--output", str(work / "out_int4")]}
    outs = {"gguf_gptq": work / "out.gguf", "gptq_int4": work / "out_int4"}
    runs: dict[str, list[dict]] = {k: [] for k in jobs}
    load_start = os.getloadavg()
    try:
        for i in range(args.repeats):
            order = list(jobs) if i % 2 == 0 else list(jobs)[::-1]
            for name in order:
                res = _run(jobs[name])
                res["phases"] = _phases(outs[name])
                runs[name].append(res)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: {m: round(statistics.median(r[m] for r in v), 2) for m in ("wall_s", "user_s", "sys_s")}
           for k, v in runs.items()}
    wall = med["gguf_gptq"]["wall_s"] / med["gptq_int4"]["wall_s"]
    cpu = ((med["gguf_gptq"]["user_s"] + med["gguf_gptq"]["sys_s"])
           / (med["gptq_int4"]["user_s"] + med["gptq_int4"]["sys_s"]))
    res = {"benchmark": "gguf_gptq_time_vs_gptq", "commit": commit,
           "command": "python " + " ".join([str(Path(sys.argv[0]).relative_to(ROOT)
                                                if Path(sys.argv[0]).is_absolute() else sys.argv[0])]
                                           + sys.argv[1:]),
           "jobs": {k: " ".join(["quantkit"] + v[3:]).replace(str(work), "OUT") for k, v in jobs.items()},
           "calibration": f"mixed, {args.samples} x {args.seqlen} (both)",
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                       "loadavg_start": [round(x, 2) for x in load_start],
                       "loadavg_end": [round(x, 2) for x in os.getloadavg()]},
           "runs": runs, "median": med, "ratio_wall": round(wall, 3), "ratio_cpu": round(cpu, 3),
           "goal": "ratio <= 1.20 (issue 19)", "met": wall <= 1.2}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({k: res[k] for k in ("median", "ratio_wall", "ratio_cpu", "met")}, indent=2))


if __name__ == "__main__":
    main()
