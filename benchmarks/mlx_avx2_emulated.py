"""Does `mlx[cpu]` run on an AVX2-only CPU? Checked by running MLX under QEMU's user-mode
emulator with `-cpu Haswell` (AVX2, FMA, no AVX-512): QEMU 7.2's TCG executes AVX2 but has no
AVX-512 at all, so any AVX-512 instruction MLX (or the OpenBLAS / runtime it loads) ran without
asking CPUID would end the process with SIGILL.

The check first proves that it can fail: a one-line AVX-512 program (gcc -mavx512f) must die
with SIGILL under the same emulator, and its AVX2 twin must run. Then, under emulation:
mx.quantize / mx.quantized_matmul / mx.dequantize on random matrices (the result against
the dequantized matmul), and mlx-lm's load + generate of a quantkit `--format mlx` artifact
(2-layer SmolLM2, RTN 4-bit g64; the words are meaningless, generation must run).

Not covered: the real machine's speed, and instructions that QEMU emulates but a real Haswell
lacks (none known for this CPU model). Needs `qemu-user` (Debian) and gcc.
  .venv/bin/python benchmarks/mlx_avx2_emulated.py --out benchmarks/results/mlx_avx2_emulated.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

CPU = "Haswell"
AVX512 = """#include <stdio.h>
#include <immintrin.h>
int main(int argc, char **argv) { volatile int v = argc; __m512i a = _mm512_set1_epi32(v);
  a = _mm512_add_epi32(a, a); printf("%d\\n", _mm512_reduce_add_epi32(a)); return 0; }
"""
AVX2 = """#include <stdio.h>
#include <immintrin.h>
int main(int argc, char **argv) { volatile int v = argc; __m256i a = _mm256_set1_epi32(v);
  a = _mm256_add_epi32(a, a); printf("%d\\n", _mm256_extract_epi32(a, 0)); return 0; }
"""
KERNELS = """
import mlx.core as mx
a = mx.random.normal((256, 256)); w = mx.random.normal((512, 256))
q, s, b = mx.quantize(w, group_size=64, bits=4)
y = mx.quantized_matmul(a, q, s, b, transpose=True, group_size=64, bits=4)
ref = a @ mx.dequantize(q, s, b, group_size=64, bits=4).T
print("max|quantized_matmul - dequantized matmul|", mx.abs(y - ref).max().item())
"""
GENERATE = """
import sys
from mlx_lm import generate, load
model, tok = load(sys.argv[1])
print(repr(generate(model, tok, prompt="The capital of France is", max_tokens=4)))
"""


def emulated(cmd: list[str], timeout: int) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run(["qemu-x86_64", "-cpu", CPU, *cmd], capture_output=True, text=True,
                          timeout=timeout)
    err = [ln for ln in proc.stderr.splitlines() if "TCG doesn't support" not in ln]
    return {"rc": proc.returncode, "sigill": proc.returncode in (-4, 132),
            "stdout_tail": proc.stdout.strip().splitlines()[-2:], "stderr_tail": err[-3:],
            "seconds": round(time.perf_counter() - t0, 1)}


def control(tmp: Path, name: str, source: str, flag: str) -> dict:
    (tmp / f"{name}.c").write_text(source)
    subprocess.run(["gcc", flag, "-O1", str(tmp / f"{name}.c"), "-o", str(tmp / name)], check=True)
    return emulated([str(tmp / name)], 60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mlx-python", default=str(Path.home() / ".cache/quantkit/venvs/mlx-0.32.4/bin/python"))
    p.add_argument("--out", default="")
    args = p.parse_args()
    if shutil.which("qemu-x86_64") is None:
        sys.exit("qemu-x86_64 not found: apt-get install qemu-user")
    from tiny_models import smollm_truncated

    qemu = subprocess.run(["qemu-x86_64", "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    mlx_version = subprocess.run([args.mlx_python, "-c", "import mlx.core as mx, mlx_lm; print(mx.__version__, mlx_lm.__version__)"],
                                 capture_output=True, text=True, check=True).stdout.split()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        rows = {"control_avx512_program": control(tmp, "avx512", AVX512, "-mavx512f"),
                "control_avx2_program": control(tmp, "avx2", AVX2, "-mavx2")}
        src = smollm_truncated(tmp / "smollm2-2layers", layers=2)
        subprocess.run([sys.executable, "-m", "quantkit.cli", "quantize", str(src), "--method", "rtn",
                        "--bits", "4", "--group-size", "64", "--format", "mlx", "-o", str(tmp / "mlx")],
                       check=True, capture_output=True, env={**os.environ, "PYTHONPATH": ""})
        rows["mlx_quantize_and_quantized_matmul"] = emulated([args.mlx_python, "-c", KERNELS], 600)
        rows["mlx_lm_load_and_generate"] = emulated([args.mlx_python, "-c", GENERATE, str(tmp / "mlx")], 1200)
    valid = rows["control_avx512_program"]["sigill"] and rows["control_avx2_program"]["rc"] == 0
    runs = all(rows[k]["rc"] == 0 for k in ("mlx_quantize_and_quantized_matmul", "mlx_lm_load_and_generate"))
    doc = {"benchmark": "mlx[cpu] on an emulated AVX2-only CPU (qemu-x86_64 -cpu Haswell)",
           "qemu": qemu, "cpu_model": CPU, "mlx": mlx_version[0], "mlx_lm": mlx_version[1],
           "host_cpu": next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                             if ln.startswith("model name")), ""),
           "check_can_fail": valid, "mlx_runs_on_avx2_only": valid and runs,
           "command": "python " + " ".join(sys.argv), "rows": rows}
    print(json.dumps(doc, indent=1))
    if args.out:
        Path(args.out + ".tmp").write_text(json.dumps(doc, indent=1) + "\n")
        Path(args.out + ".tmp").rename(args.out)
    sys.exit(0 if valid and runs else 1)


if __name__ == "__main__":
    main()
