"""Artifact fingerprints: what `quantkit quantize` writes, tensor by tensor, so that two trees
(before and after a restructuring) can be shown to write the very same artifacts.

  python benchmarks/artifact_fingerprints.py build-models DIR
  python benchmarks/artifact_fingerprints.py run --models DIR --out FILE.json [--only PATTERN]
        [--jobs N] [--keep DIR]
  python benchmarks/artifact_fingerprints.py compare A.json B.json

`build-models` saves the tiny models once (seeded, from transformers' own config classes, with
the builders of tests/tiny_models.py of this script's tree; widths multiples of 256 so the GGUF
K-quants apply) and copies the built-in SmolLM2-135M bf16 checkpoint; every later `run` reads
these same files, whichever tree it runs (their digests are recorded in the JSON, and
`compare` reports inputs that differ).

`run` quantizes every (model, case) of CASES with `sys.executable -m quantkit.cli quantize`:
the interpreter that runs this script decides which tree's quantkit runs (its .venv's
editable install; the subprocess runs in a scratch directory, so the current directory's
checkout is not imported instead, and PYTHONPATH is removed). The flags are the public CLI,
the same on every tree. Calibration is small (CALIB) so that one run takes minutes. Per
artifact it records:
  - every tensor: name, dtype, shape, sha256 of its bytes (safetensors: the header's dtype and
    shape and the raw bytes between its data offsets; GGUF, read with the gguf package: tensor
    name, GGML type, shape, sha256 of its data),
  - config.json in full (so its quantization_config), hf_quant_config.json, quantkit.json,
    quantkit_stats.json and the safetensors header metadata, normalised as below; every other
    file by its sha256; GGUF: every KV pair by the sha256 of its raw bytes (key, type, value)
    plus its value where short, and quantkit.metadata / quantkit.stats parsed and normalised,
  - the exit status and the `error:` / `hint:` / `warning:` lines of the CLI. A case that a
    model refuses (a format without MoE, a type whose widths do not fit) is recorded as that
    refusal, which must be the same on both trees too.

What is ignored, and why (IGNORED_KEYS, applied at any depth of the JSON files named above and
of GGUF quantkit.metadata / quantkit.stats; the `quantkit.version` GGUF key):
  created            wall-clock time of the run
  seconds            durations (per phase; per Linear in quantkit_stats.json)
  quantkit_version   the package version: a restructuring may bump it, bytes must not move
and these path prefixes are replaced by placeholders in every string (command, source path,
calibration provenance, messages): the models directory (<MODELS>), the scratch output
directory (<OUT>), the root of the tree that ran (<TREE>), the interpreter's prefix
(<PREFIX>). `command` itself is kept (it is sys.argv: the same public flags on both trees).
Lists under UNORDERED_KEYS (`blas`: threadpoolctl's list of the loaded OpenBLAS copies, in
load order, which varies run to run) are sorted. `kernels` (CPU, BLAS, thread counts) is kept:
on one machine with the same environment it is the same, and a difference means the runs are
not comparable. Safetensors files are compared tensor by tensor (plus their header metadata),
not as whole files.

Determinism: every subprocess gets THREAD_ENV (one thread for OpenMP, MKL, OpenBLAS and numba,
so no sum depends on the split of work between threads or on how many cores are free) and
`--jobs` processes run side by side instead. Run to run on one tree the fingerprints are
identical (see the commands below).

`compare` prints every difference (inputs, cases, tensors, files, messages), exit 1 if any.

Measured (benchmarks/results/artifact_fingerprints_03b10b4.json, a 2-core machine shared with
other jobs, load ~13): one full `run` took 2124 s (35 min), 3 cases at a time; the cases' own
CPU time is a fraction of that, alone on the machine it is far shorter. 43 cases write an
artifact, 9 are refusals (gptq and modelopt formats, and gguf auto, on the three MoE models).
Run to run on 03b10b4 (the 13 qwen3_moe cases twice) and 03b10b4's .venv against an identical
checkout's .venv (7 cases) the fingerprints were identical, once the BLAS list was sorted
(UNORDERED_KEYS).

Commands (this machine; the baseline is the tree at 03b10b4):
  .venv/bin/python benchmarks/artifact_fingerprints.py build-models /work/wt/fp-models
  /work/wt/base/.venv/bin/python benchmarks/artifact_fingerprints.py run \\
      --models /work/wt/fp-models --out benchmarks/results/artifact_fingerprints_03b10b4.json
  # check a tree (from its root, with its own .venv) against the baseline:
  .venv/bin/python benchmarks/artifact_fingerprints.py run --models /work/wt/fp-models \\
      --out /tmp/fp_tree.json
  .venv/bin/python benchmarks/artifact_fingerprints.py compare \\
      benchmarks/results/artifact_fingerprints_03b10b4.json /tmp/fp_tree.json
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# one thread per library: sums do not depend on the thread split (see the module docstring)
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
              "NUMBA_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
# removed from the subprocess's environment: they would change the kernels or the imported tree
CLEARED_ENV = ("PYTHONPATH", "QUANTKIT_REPRODUCIBLE", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS",
               "OPENBLAS_CORETYPE", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
               "DNNL_MAX_CPU_ISA", "QUANTKIT_MEMORY_LIMIT_BYTES")

IGNORED_KEYS = {"created": "wall-clock time of the run",
                "seconds": "durations",
                "quantkit_version": "package version (may be bumped; bytes must not move)"}
# lists whose order is not the tree's doing: sorted when recorded and again when compared
UNORDERED_KEYS = {"blas": "threadpoolctl lists the loaded OpenBLAS copies (numpy's, scipy's) in "
                          "the order they were loaded, which varies run to run on one tree"}
IGNORED_GGUF_KEYS = {"quantkit.version": "package version, as quantkit_version"}
# GGUF string keys holding JSON (what quantkit.json / quantkit_stats.json hold for directories)
GGUF_JSON_KEYS = ("quantkit.metadata", "quantkit.stats")

CALIB = ["--calib", "mixed", "--calib-samples", "4", "--calib-seqlen", "64"]
# (case id, flags after MODEL): the methods and formats of the acceptance line
CASES: list[tuple[str, list[str]]] = [
    ("rtn", ["--method", "rtn"]),
    ("gptq-act-order", ["--method", "gptq", "--act-order", *CALIB]),
    ("gptq-act-order-gptqv1", ["--method", "gptq", "--act-order", "--format", "gptq", *CALIB]),
    ("awq-autoawq", ["--method", "awq", "--format", "awq", *CALIB]),
    ("fp8-dynamic", ["--method", "fp8", "--scheme", "dynamic"]),
    ("int8-smoothquant", ["--method", "int8", "--smoothquant", "0.5", *CALIB]),
    ("nvfp4", ["--method", "nvfp4"]),
    ("mxfp4", ["--method", "mxfp4"]),
    ("modelopt-fp8", ["--method", "fp8", "--scheme", "static", "--format", "modelopt", *CALIB]),
    ("gguf-q4_k_m", ["--method", "gguf", "--gguf-type", "q4_k_m"]),
    ("gguf-iq4_xs", ["--method", "gguf", "--gguf-type", "iq4_xs"]),
    ("gguf-q2_k", ["--method", "gguf", "--gguf-type", "q2_k"]),
    ("gguf-auto", ["--method", "gguf", "--gguf-type", "auto", "--target-bpw", "4.5",
                   "--calib-samples", "4", "--calib-seqlen", "64"]),
]
COMMON_FLAGS = ["--device", "cpu", "--no-resume"]
MODELS = ("smollm2", "qwen3_moe", "deepseek_v3", "gpt_oss")
MESSAGE = re.compile(r"^(error|hint|warning|interrupted):")
SHORT_VALUE = 200  # GGUF KV values up to this many JSON characters are stored as they are


# ----------------------------------------------------------------------------- build-models

def build_models(target: Path) -> None:
    """The tiny models (seeded) and a link to the built-in SmolLM2 bf16 checkpoint."""
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    from tiny_models import make_tiny_model

    from quantkit.builtin_models import ensure_builtin

    target.mkdir(parents=True, exist_ok=True)
    smollm = target / "smollm2"  # a copy: a later rebuild of the cache cannot change the input
    if smollm.is_symlink():
        smollm.unlink()
    if not smollm.exists():
        shutil.copytree(ensure_builtin("smollm2-135m"), smollm)
    builders = {
        "qwen3_moe": dict(arch="qwen3_moe"),  # hidden 256, 8 experts of 256
        "deepseek_v3": dict(arch="deepseek_v3", hidden=256, intermediate=256, heads=2, kv_heads=2),
        "gpt_oss": dict(arch="gpt_oss", hidden=256, intermediate=256),
    }
    for name, kw in builders.items():
        out = target / name
        if out.exists():
            shutil.rmtree(out)
        make_tiny_model(out, seed=0, **kw)
        if name == "deepseek_v3":  # as tests/test_deepseek.py: sigmoid routing and YaRN keys
            config = json.loads((out / "config.json").read_text())
            yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                    "mscale_all_dim": 1.0, "original_max_position_embeddings": 256,
                    "beta_fast": 32, "beta_slow": 1}
            (out / "config.json").write_text(json.dumps(
                {**config, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
                 "rope_parameters": yarn}))
    for name in MODELS:
        print(f"{name}: {(target / name).resolve()}")


# ------------------------------------------------------------------------------ fingerprints

def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Normaliser:
    """Replaces the run's path prefixes by placeholders and drops IGNORED_KEYS."""

    def __init__(self, prefixes: dict[str, str]):
        # longest first: a prefix inside another one must not be replaced first
        self.prefixes = sorted(((p, n) for p, n in prefixes.items() if p), key=lambda x: -len(x[0]))

    def text(self, s: str) -> str:
        for prefix, name in self.prefixes:
            s = s.replace(prefix, name)
        return s

    def json(self, value):
        if isinstance(value, dict):
            return canonical({self.text(k): self.json(v) for k, v in value.items()
                              if k not in IGNORED_KEYS})
        if isinstance(value, list):
            return [self.json(v) for v in value]
        if isinstance(value, str):
            return self.text(value)
        return value


def canonical(value):
    """`value` with the lists under UNORDERED_KEYS sorted, at any depth."""
    if isinstance(value, dict):
        return {k: sorted(map(canonical, v), key=json.dumps) if k in UNORDERED_KEYS
                and isinstance(v, list) else canonical(v) for k, v in value.items()}
    if isinstance(value, list):
        return [canonical(v) for v in value]
    return value


def safetensors_fingerprint(path: Path) -> dict:
    """{tensors: {name: [dtype, shape, sha256]}, metadata} of one .safetensors file."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        base = 8 + n
        tensors = {}
        for name, info in sorted(header.items()):
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            f.seek(base + start)
            tensors[name] = [info["dtype"], info["shape"], _sha(f.read(end - start))]
    return {"tensors": tensors, "metadata": header.get("__metadata__")}


JSON_FILES = ("config.json", "hf_quant_config.json", "quantkit.json", "quantkit_stats.json",
              "generation_config.json")


def directory_fingerprint(path: Path, norm: Normaliser) -> dict:
    out: dict = {"tensors": {}, "files": {}}
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        rel = str(f.relative_to(path))
        if f.suffix == ".safetensors":
            fp = safetensors_fingerprint(f)
            for name, entry in fp["tensors"].items():
                out["tensors"][name] = entry + [rel]
            out["files"][rel] = {"safetensors_metadata": fp["metadata"]}
        elif f.name in JSON_FILES:
            out["files"][rel] = norm.json(json.loads(f.read_text()))
        else:
            out["files"][rel] = {"sha256": _sha(f.read_bytes())}
    return out


def gguf_fingerprint(path: Path, norm: Normaliser) -> dict:
    import numpy as np
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    tensors = {t.name: [t.tensor_type.name, [int(x) for x in t.shape],
                        _sha(np.ascontiguousarray(t.data).tobytes())] for t in reader.tensors}
    kv = {}
    for name, field in reader.fields.items():
        if name in IGNORED_GGUF_KEYS:
            continue
        if name in GGUF_JSON_KEYS:  # quantkit's JSON provenance: parsed, normalised
            kv[name] = {"value": norm.json(json.loads(field.contents()))}
            continue
        entry = {"types": [t.name for t in field.types],
                 "sha256": _sha(b"".join(bytes(p.tobytes()) for p in field.parts))}
        try:
            value = field.contents()
        except Exception as exc:  # noqa: BLE001 (undecodable: its sha256 still compares)
            value = f"<undecodable: {type(exc).__name__}>"
        text = json.dumps(value, default=str)
        if len(text) <= SHORT_VALUE:
            entry["value"] = value
        else:
            entry["value_chars"] = len(text)
        kv[name] = entry
    return {"tensors": tensors, "gguf_kv": kv}


def artifact_fingerprint(path: Path, norm: Normaliser) -> dict:
    if path.is_dir():
        return directory_fingerprint(path, norm)
    return gguf_fingerprint(path, norm)


def input_digests(models: Path) -> dict:
    """sha256 of every file of every model: two runs compare only on the same inputs."""
    out = {}
    for name in MODELS:
        base = (models / name).resolve()
        if base.exists():
            out[name] = {str(f.relative_to(base)): _sha(f.read_bytes())
                         for f in sorted(base.rglob("*")) if f.is_file()}
    return out


# ------------------------------------------------------------------------------------- run

def _tree_of(python: str, cwd: Path, env: dict) -> dict:
    """Which quantkit the interpreter imports (from a neutral directory), and its commit."""
    probe = subprocess.run([python, "-c", "import sys, quantkit; print(quantkit.__file__); "
                            "print(sys.prefix)"], cwd=cwd, env=env, capture_output=True,
                           text=True, check=True)
    init, prefix = probe.stdout.split("\n")[:2]
    root = Path(init).resolve().parents[1]
    git = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                         text=True)
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "quantkit"],
                           capture_output=True, text=True)
    return {"root": str(root), "prefix": prefix, "commit": git.stdout.strip(),
            "quantkit_dirty": bool(dirty.stdout.strip())}


def run_case(model_dir: Path, case: str, flags: list[str], work: Path, env: dict,
             norm: Normaliser, keep: Path | None) -> dict:
    model = model_dir.name
    suffix = ".gguf" if "gguf" in flags else ""
    out = work / f"{model}__{case}{suffix}"
    cmd = [sys.executable, "-m", "quantkit.cli", "quantize", str(model_dir), *flags,
           *COMMON_FLAGS, "-o", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - t0
    lines = (proc.stderr + "\n" + proc.stdout).splitlines()
    record: dict = {"flags": flags, "rc": proc.returncode,
                    "messages": [norm.text(ln.rstrip()) for ln in lines if MESSAGE.match(ln)]}
    if proc.returncode == 0:
        record["artifact"] = artifact_fingerprint(out, norm)
    elif not record["messages"]:  # a crash, not a refusal: its last lines say what broke
        record["crash"] = [norm.text(ln) for ln in lines[-5:]]
    if keep is not None and out.exists():
        shutil.move(str(out), str(keep / out.name))
    elif out.is_dir():
        shutil.rmtree(out)
    elif out.exists():
        out.unlink()
    status = "ok" if proc.returncode == 0 else f"rc {proc.returncode}"
    print(f"  {model}/{case}: {status} ({seconds:.0f} s)", flush=True)
    return {"seconds": round(seconds, 1), **record}


def run(models: Path, out_file: Path, only: str | None, jobs: int, keep: Path | None) -> None:
    models = models.resolve()
    selected = [(m, c, f) for m in MODELS for c, f in CASES
                if only is None or fnmatch.fnmatch(f"{m}/{c}", only)]
    # cheapest first, so that a stopped run has recorded the most cases (its file is written
    # after every case): GGUF compiles numba kernels in every process, SmolLM2 has 30 blocks,
    # auto measures every tensor under several types
    selected.sort(key=lambda x: ("gguf" in x[1], x[0] == "smollm2", x[1] == "gguf-auto"))
    env = {k: v for k, v in os.environ.items() if k not in CLEARED_ENV}
    env.update(THREAD_ENV)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fingerprints-") as tmp:
        work = Path(tmp)
        tree = _tree_of(sys.executable, work, env)
        norm = Normaliser({str(models): "<MODELS>", str(work): "<OUT>",
                           tree["root"]: "<TREE>", tree["prefix"]: "<PREFIX>"})
        print(f"quantkit from {tree['root']} ({tree['commit'][:10]}"
              f"{', quantkit/ modified' if tree['quantkit_dirty'] else ''}); "
              f"{len(selected)} cases, {jobs} at a time", flush=True)
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
        header = {"tree": tree, "python": sys.executable, "thread_env": THREAD_ENV,
                  "ignored_keys": IGNORED_KEYS, "ignored_gguf_keys": IGNORED_GGUF_KEYS,
                  "inputs": input_digests(models)}
        cases: dict = {}

        def write(complete: bool) -> dict:  # after every case: a stopped run keeps what it did
            result = {**header, "complete": complete, "cases": dict(sorted(cases.items())),
                      "total_seconds": round(time.perf_counter() - t0, 1)}
            out_file.parent.mkdir(parents=True, exist_ok=True)
            out_file.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
            return result

        with ThreadPoolExecutor(jobs) as pool:
            futures = {pool.submit(run_case, models / m, c, f, work, env, norm, keep): f"{m}/{c}"
                       for m, c, f in selected}
            for fut in as_completed(futures):
                cases[futures[fut]] = fut.result()
                write(complete=False)
        result = write(complete=True)
    print(f"wrote {out_file} in {result['total_seconds']:.0f} s")


# --------------------------------------------------------------------------------- compare

def _diff(a, b, where: str, out: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in b:
                out.append(f"{where}/{k}: only in A")
            elif k not in a:
                out.append(f"{where}/{k}: only in B")
            else:
                _diff(a[k], b[k], f"{where}/{k}", out)
    elif a != b:
        out.append(f"{where}: A {json.dumps(a)[:300]} != B {json.dumps(b)[:300]}")


def compare(file_a: Path, file_b: Path, common_only: bool = False) -> int:
    a, b = (canonical(json.loads(f.read_text())) for f in (file_a, file_b))
    diffs: list[str] = []
    for name, run_ in (("A", a), ("B", b)):
        if not run_.get("complete", True):
            print(f"note: {name} is an unfinished run; " + (
                "only the cases both hold are compared" if common_only
                else "its missing cases count as differences"))
    _diff(a["inputs"], b["inputs"], "inputs", diffs)
    for case in sorted(set(a["cases"]) | set(b["cases"])):
        if case not in a["cases"] or case not in b["cases"]:
            if common_only:
                continue
            diffs.append(f"{case}: only in {'A' if case in a['cases'] else 'B'}")
            continue
        ca, cb = ({k: v for k, v in c.items() if k != "seconds"}
                  for c in (a["cases"][case], b["cases"][case]))
        _diff(ca, cb, case, diffs)
    print(f"A: {file_a} (tree {a['tree']['commit'][:10]})\nB: {file_b} (tree "
          f"{b['tree']['commit'][:10]})")
    for line in diffs:
        print(line)
    both = [c for c in a["cases"] if c in b["cases"]]
    same = sum(1 for c in both if not any(d.startswith((c + "/", c + ":")) for d in diffs))
    print(f"{len(diffs)} differences; {same} of the {len(both)} cases both hold are identical "
          f"(A {len(a['cases'])}, B {len(b['cases'])} cases)")
    return 1 if diffs else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("build-models", help="build the tiny models once into DIR")
    p.add_argument("dir", type=Path)
    p = sub.add_parser("run", help="quantize every case and write the fingerprints")
    p.add_argument("--models", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--only", default=None, help="fnmatch pattern on MODEL/CASE, e.g. 'gpt_oss/*'")
    p.add_argument("--jobs", type=int, default=3, help="cases quantized side by side")
    p.add_argument("--keep", type=Path, default=None, help="move the artifacts here")
    p = sub.add_parser("compare", help="print every difference; exit 1 if any")
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--common-only", action="store_true",
                   help="compare only the cases both files hold (a partial run against a full one)")
    args = parser.parse_args()
    if args.command == "build-models":
        build_models(args.dir)
    elif args.command == "run":
        run(args.models, args.out, args.only, args.jobs, args.keep)
    else:
        sys.exit(compare(args.a, args.b, args.common_only))


if __name__ == "__main__":
    main()
