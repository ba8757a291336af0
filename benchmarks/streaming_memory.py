"""Peak RSS of streaming `quantkit quantize` on a synthetic multi-GB llama, against `quantkit plan`.

Builds a random bf16 llama (written tensor by tensor, never whole in RAM), then runs
`quantkit quantize --method rtn` in a subprocess whose data segment is capped at the model's
bf16 size (RLIMIT_DATA), measures its VmHWM, and compares with the plan's prediction. The
in-memory path (--no-stream) is run under the same cap to show that the cap bites.

    python benchmarks/streaming_memory.py [--hidden 2048 --intermediate 8192 --layers 24]
        [--workdir /tmp/qk-stream-bench] [--skip-in-memory]
Writes benchmarks/results/streaming_memory_cpu.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from test_streaming import _plan, make_wide_llama, run_measured  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/qk-stream-bench"))
    ap.add_argument("--skip-in-memory", action="store_true")
    args = ap.parse_args()

    model = args.workdir / f"llama-h{args.hidden}-i{args.intermediate}-l{args.layers}"
    if not (model / "model.safetensors.index.json").is_file():
        shutil.rmtree(model, ignore_errors=True)
        make_wide_llama(model, hidden=args.hidden, intermediate=args.intermediate,
                        layers=args.layers, vocab=args.vocab)
    size = json.loads((model / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    plan = _plan(model, "--method", "rtn")
    runs = {}
    for name, flags in (("streaming", []), ("in_memory", ["--no-stream"])):
        if name == "in_memory" and args.skip_in_memory:
            continue
        out = args.workdir / f"out-{name}"
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.perf_counter()
        proc, peak = run_measured(["quantize", str(model), "--method", "rtn", "-o", str(out),
                                   "--no-memory-check", *flags], data_cap=size)
        runs[name] = {"ok": proc.returncode == 0, "returncode": proc.returncode,
                      "peak_rss_bytes": peak, "seconds": round(time.perf_counter() - t0, 1),
                      "error_tail": None if proc.returncode == 0 else proc.stderr[-400:]}
        shutil.rmtree(out, ignore_errors=True)
    s = runs["streaming"]
    record = {
        "model": {"hidden": args.hidden, "intermediate": args.intermediate, "layers": args.layers,
                  "vocab": args.vocab, "bf16_bytes": size, "params": plan["total_params"]},
        "cap": {"kind": "RLIMIT_DATA", "bytes": size},
        "method": "rtn W4A16 g128 sym, compressed-tensors",
        "plan_peak_ram_bytes": plan["peak_ram_bytes"],
        "plan_phase_bytes": plan["phase_bytes"],
        "runs": runs,
        "plan_error": (plan["peak_ram_bytes"] - s["peak_rss_bytes"]) / s["peak_rss_bytes"]
        if s["peak_rss_bytes"] else None,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "loadavg": os.getloadavg()},
    }
    dest = REPO / "benchmarks" / "results" / "streaming_memory_cpu.json"
    dest.write_text(json.dumps(record, indent=2) + "\n")
    gib = 2**30
    print(f"{'model bf16':>12} {'cap':>10} {'path':>10} {'ok':>4} {'peak RSS':>10} "
          f"{'plan':>8} {'time':>7}")
    for name, r in runs.items():
        peak = f"{r['peak_rss_bytes'] / gib:.2f}" if r["peak_rss_bytes"] else "-"
        pred = f"{plan['peak_ram_bytes'] / gib:.2f}" if name == "streaming" else "-"
        print(f"{size / gib:>10.2f}Gi {size / gib:>8.2f}Gi {name:>10} {'yes' if r['ok'] else 'no':>4} "
              f"{peak:>8}Gi {pred:>6}Gi {r['seconds']:>6.0f}s")
    print(f"wrote {dest.relative_to(REPO)}")


if __name__ == "__main__":
    main()
