"""What one `quantkit verify` costs against one `quantkit eval` of the same SmolLM2 artifact.

Issue 45's acceptance: "A verify run on SmolLM2 costs less than one `quantkit eval` of the same
artifact." Quantizes SmolLM2-135M with RTN int4 g64 (compressed-tensors) once, then runs, each
as the CLI a user runs, in a fresh process:
  quantkit eval ARTIFACT --json FILE      (its defaults: 32 windows of 512 tokens, PPL / KLD
                                           against the recorded base; base logits not cached:
                                           --fresh-base, as a first eval computes them)
  quantkit verify ARTIFACT --engine vllm --json   (coverage, fidelity, vLLM load, parity on
                                           4 windows of 128 tokens)
and records each one's wall time (the measure) and CPU time (user + system of the process
and every child it waited for; vLLM's runs fork from quantkit's fork server and are not all
counted there), with the load average (a shared machine).
Usage: python benchmarks/verify_vs_eval.py [WORKDIR] [--repeats N] [--engine vllm|llamacpp]
  --engine llamacpp quantizes a GGUF Q4_K_M instead and verifies it in llama.cpp.
Writes benchmarks/results/verify_vs_eval_<engine>.json.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _timed(args: list[str]) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "quantkit.cli", *args], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"args": args, "exit": proc.returncode, "wall_s": round(wall, 2),
            "cpu_s": round(cpu, 2), "stdout": proc.stdout,
            "stderr_tail": proc.stderr[-1500:] if proc.returncode not in (0,) else ""}


def main() -> None:
    args = sys.argv[1:]
    repeats = int(args[args.index("--repeats") + 1]) if "--repeats" in args else 1
    engine = args[args.index("--engine") + 1] if "--engine" in args else "vllm"
    rest = [a for i, a in enumerate(args) if not a.startswith("--")
            and (i == 0 or args[i - 1] not in ("--repeats", "--engine"))]
    work = Path(rest[0]) if rest else Path(tempfile.mkdtemp(prefix="verify-vs-eval-"))
    work.mkdir(parents=True, exist_ok=True)
    if engine == "vllm":
        art = work / "smollm2-rtn-w4g64"
        quantize = ["quantize", "smollm2-135m", "--method", "rtn", "--bits", "4",
                    "--group-size", "64", "-o", str(art)]
    else:
        art = work / "smollm2-q4_k_m.gguf"
        quantize = ["quantize", "smollm2-135m", "--method", "gguf", "--gguf-type", "q4_k_m",
                    "-o", str(art)]
    if not art.exists():
        q = _timed(quantize)
        assert q["exit"] == 0, q
    runs = []
    for r in range(repeats):
        ev = _timed(["eval", str(art), "--fresh-base", "--json", str(work / f"eval{r}.json")])
        ve = _timed(["verify", str(art), "--engine", engine, "--json"])
        assert ev["exit"] == 0, ev
        assert ve["exit"] == 0, ve
        report = json.loads(ve.pop("stdout"))  # verify --json: the whole report
        ev["stdout_tail"] = ev.pop("stdout")[-1500:]
        runs.append({"eval": ev, "verify": ve, "verify_verdict": report["verdict"],
                     "verify_checks": {n: c["status"] for n, c in report["checks"].items()},
                     "verify_parity": report["checks"]["parity"]["measured"],
                     "verify_over_eval_wall": round(ve["wall_s"] / ev["wall_s"], 3),
                     "verify_over_eval_cpu": round(ve["cpu_s"] / ev["cpu_s"], 3)})
        print(json.dumps({k: v for k, v in runs[-1].items() if k not in ("eval", "verify")}
                         | {"eval_wall_s": ev["wall_s"], "verify_wall_s": ve["wall_s"],
                            "eval_cpu_s": ev["cpu_s"], "verify_cpu_s": ve["cpu_s"]}))
    out = ROOT / "benchmarks" / "results" / f"verify_vs_eval_{engine}.json"
    out.write_text(json.dumps({
        "command": "python benchmarks/verify_vs_eval.py " + " ".join(sys.argv[1:]),
        "artifact": str(art), "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(), "load_average_end": os.getloadavg(), "runs": runs,
    }, indent=2))
    print(out)


if __name__ == "__main__":
    main()
