"""quantkit GPTQ vs llm-compressor GPTQ, side by side, on the same CPU and the same samples.

    /tmp/venv-main/bin/python benchmarks/gptq_vs_llmcompressor.py            # full run
    ... --llmc-python /path/to/venv/bin/python  --threads 2  --skip-eval

What it does, in one run:
  1. draws the calibration windows once with quantkit's loader (built-in set, seed 0) and saves
     them to WORKDIR/calib_ids.safetensors; BOTH sides read exactly these token ids;
  2. quantizes the model with quantkit GPTQ, quantkit RTN (the baseline) and llm-compressor
     GPTQ (its own venv, created if missing), each in a fresh subprocess, recording wall time of
     the quantization call, wall time of the whole process (load + quantize + save) and peak RSS;
  3. scores the three artifacts against the base model on held-out text with quantkit's eval
     (quantkit.eval.harness.evaluate: same loader, same windows, PPL / KLD / top-1);
  4. writes benchmarks/results/gptq_vs_llmcompressor_cpu.json and prints a table.

Same settings on both sides: int4, symmetric, group 64, damp 0.01, block 128, static
act-order (llm-compressor 0.14's default `actorder: static`; quantkit --act-order, whose
default is static groups), identical calibration ids in the same order. Compute dtype: quantkit
runs its calibration forwards in the checkpoint's bf16 where torch has native bf16 GEMMs
(AMX / AVX512-BF16), else float32 (recorded per run as `compute_dtype`); llm-compressor runs
in the dtype the model is loaded in, once per `--llmc-dtypes` entry (default both float32, its
usual CPU setting, and bfloat16), so the ratio is shown against each setting.
This file also runs as the worker of each side (--worker quantkit|llmc); the llm-compressor
worker imports nothing from quantkit, since it runs in the other venv.

Process environment: quantkit's worker runs in the environment the `quantkit` command gives
itself (quantkit.machine.huge_page_env: glibc's malloc asks for transparent huge pages
where the kernel's THP mode is madvise), the peer in the environment it is started with, as its
users run it. `--llmc-huge-pages` adds a control run of each peer setting under quantkit's
environment (keys `..._huge_pages`), so the effect of that setting on the peer is measured too.
Every run records the GLIBC_TUNABLES it ran with.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "gptq_vs_llmcompressor_cpu.json"
LLMC_VENV = Path("/tmp/venv-llmc")
LLMC_PINS = ["torch==2.13.0", "llmcompressor==0.14.0.1"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja")


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _set_threads(n: int | None) -> None:
    if n:
        import torch

        torch.set_num_threads(n)


# ----------------------------------------------------------------------------- workers


def worker_quantkit(a: argparse.Namespace) -> dict:
    """quantkit's public quantize(), with a check that it drew exactly the saved ids."""
    t_proc = time.perf_counter()
    import torch
    from safetensors.torch import load_file

    from quantkit.calibration import load_calibration
    from quantkit.formats import get_writer
    from quantkit.methods import get_quantizer
    from quantkit.model_io import load_tokenizer, resolve_model
    from quantkit.pipeline.quantize import QuantizeRequest, quantize
    from quantkit.transformers_lean import causal_lm_class
    from quantkit.types import QuantScheme

    _set_threads(a.threads)
    ids = load_file(a.calib_file)["input_ids"]
    tok = load_tokenizer(resolve_model(a.model).path)
    again = load_calibration(a.calib, tok, n_samples=ids.shape[0], seqlen=ids.shape[1], seed=0)
    assert torch.equal(again.input_ids, ids), "quantkit's loader drew different windows"
    scheme = QuantScheme(bits=a.bits, group_size=a.group_size, symmetric=True,
                         act_order=a.method == "gptq" and a.act_order)
    opts = {"damp": a.damp} if a.method == "gptq" else {}
    get_writer("compressed-tensors"), get_quantizer(a.method)  # imports, as the peer's are done
    # transformers' model classes too, as the peer imports AutoModelForCausalLM before its timer
    causal_lm_class()  # as quantkit imports it (transformers_lean.trim_transformers_extras first)
    # and the compressed-tensors library, which the peer's `import llmcompressor` loads before
    # its timer and quantkit's writer loads when it packs (~2 s on 2 AVX2 cores: its quant_args
    # module applies torch.compile, which imports torch._dynamo)
    import compressed_tensors  # noqa: F401
    t0 = time.perf_counter()
    meta = quantize(QuantizeRequest(model=a.model, method=a.method, scheme=scheme, out=Path(a.out),
                                    format="compressed-tensors", force=True, calib=a.calib,
                                    calib_samples=ids.shape[0], calib_seqlen=ids.shape[1], seed=0,
                                    method_options=opts))
    job = time.perf_counter() - t0
    return {"job_s": job, "quantize_call_s": job, "block_loop_s": meta["seconds"]["quantize"],
            "process_s": time.perf_counter() - t_proc, "peak_rss_mib": _peak_rss_mib(),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "compute_dtype": meta.get("compute_dtype", "float32")}


def worker_llmc(a: argparse.Namespace) -> dict:
    """llm-compressor oneshot GPTQ (runs in llm-compressor's venv; no quantkit imports)."""
    t_proc = time.perf_counter()
    import llmcompressor
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _set_threads(a.threads)
    ids = load_file(a.calib_file)["input_ids"]
    n, seqlen = ids.shape
    t_job = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(a.model_path, dtype=getattr(torch, a.llmc_dtype))
    tok = AutoTokenizer.from_pretrained(a.model_path)
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * seqlen] * n})
    weights = {"num_bits": a.bits, "type": "int", "symmetric": True, "strategy": "group",
               "group_size": a.group_size}
    recipe = GPTQModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": weights}},
                          ignore=["lm_head"], dampening_frac=a.damp, block_size=128,
                          actorder="static" if a.act_order else None)
    t0 = time.perf_counter()
    oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=seqlen, num_calibration_samples=n,
            shuffle_calibration_samples=False, batch_size=a.llmc_batch_size, processor=tok)
    quant_s = time.perf_counter() - t0
    model.save_pretrained(a.out, save_compressed=True)
    for f in TOKENIZER_FILES:
        if (Path(a.model_path) / f).is_file():
            shutil.copy2(Path(a.model_path) / f, Path(a.out) / f)
    job = time.perf_counter() - t_job
    return {"job_s": job, "quantize_call_s": quant_s, "process_s": time.perf_counter() - t_proc,
            "peak_rss_mib": _peak_rss_mib(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "llmcompressor": llmcompressor.__version__,
            "batch_size": a.llmc_batch_size, "compute_dtype": a.llmc_dtype}


# ----------------------------------------------------------------------------- driver


def ensure_llmc_python(path: str | None) -> Path:
    """The llm-compressor venv's python; builds /tmp/venv-llmc when nothing is given or found."""
    if path:
        return Path(path)
    py = LLMC_VENV / "bin" / "python"
    if not py.is_file():
        print(f"creating {LLMC_VENV} ({' '.join(LLMC_PINS)}) ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(LLMC_VENV)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", *LLMC_PINS], check=True)
        # torchvision does not import beside the CPU torch and transformers would pick it up
        subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio",
                        "torchcodec"], check=False)
    return py


def run_worker(python: Path, side: str, args: argparse.Namespace, out: Path,
               huge_pages: bool = False, **extra) -> dict:
    cmd = [str(python), str(Path(__file__).resolve()), "--worker", side, "--out", str(out),
           "--calib-file", str(args.workdir / "calib_ids.safetensors"), "--model", args.model,
           "--model-path", str(args.model_path), "--calib", args.calib, "--bits", str(args.bits),
           "--group-size", str(args.group_size), "--damp", str(args.damp),
           "--llmc-batch-size", str(args.llmc_batch_size)]
    if args.act_order:
        cmd.append("--act-order")
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    for k, v in extra.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}
    if side == "llmc" and not args.llmc_keep_pythonpath:
        env.pop("PYTHONPATH", None)
    if side == "quantkit" or huge_pages:  # as the `quantkit` command starts itself
        from quantkit.machine import huge_page_env

        env = huge_page_env(env) or env
    print(f"[{time.strftime('%H:%M:%S')}] {side} {extra.get('method', '')}: {out}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    (args.workdir / f"{out.name}.log").write_text(proc.stdout + "\n" + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{side} worker failed (exit {proc.returncode}):\n" + proc.stderr[-4000:])
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    res = json.loads(line[len("RESULT "):])
    res["subprocess_wall_s"] = wall
    res["glibc_tunables"] = env.get("GLIBC_TUNABLES")
    print(f"    {json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in res.items()})}",
          flush=True)
    return res


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", choices=["quantkit", "llmc"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--calib-file", help=argparse.SUPPRESS)
    p.add_argument("--model-path", help=argparse.SUPPRESS)
    p.add_argument("--method", default="gptq", help=argparse.SUPPRESS)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--damp", type=float, default=0.01)
    p.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=True,
                   help="static act-order on both sides (llm-compressor's default)")
    p.add_argument("--calib", default="mixed", help="quantkit calibration source (built-in set)")
    p.add_argument("--heldout", default="mixed", help="held-out split for PPL/KLD")
    p.add_argument("--eval-windows", type=int, default=32, help="512-token held-out windows")
    p.add_argument("--threads", type=int, default=None, help="torch threads on both sides")
    p.add_argument("--llmc-python", default=None, help="python of a venv with llmcompressor")
    p.add_argument("--llmc-batch-size", type=int, default=1, help="oneshot batch_size (its default 1)")
    p.add_argument("--llmc-dtypes", default="float32,bfloat16",
                   help="dtypes llm-compressor loads the model in, one peer run each "
                        "(\"\": none, quantkit's side alone)")
    p.add_argument("--llmc-dtype", default="float32", help=argparse.SUPPRESS)  # worker's own
    p.add_argument("--llmc-huge-pages", action="store_true",
                   help="also run each peer setting under quantkit's malloc environment (control)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/quantkit-bench-gptq"))
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--skip-eval", action="store_true")
    p.add_argument("--llmc-keep-pythonpath", action="store_true",
                   help="the peer's packages are on PYTHONPATH, not in a venv (the GPU machine's "
                        "host CPU: wheels installed with --target); by default the peer's "
                        "environment drops PYTHONPATH so quantkit's tree cannot shadow its imports")
    args = p.parse_args(argv)

    if args.worker:
        fn = worker_quantkit if args.worker == "quantkit" else worker_llmc
        print("RESULT " + json.dumps(fn(args)), flush=True)
        return

    from safetensors.torch import save_file

    from quantkit.calibration import load_calibration
    from quantkit.machine import cpu_info
    from quantkit.model_io import load_tokenizer, resolve_model

    args.workdir.mkdir(parents=True, exist_ok=True)
    args.model_path = resolve_model(args.model).path
    tok = load_tokenizer(args.model_path)
    calib = load_calibration(args.calib, tok, n_samples=args.samples, seqlen=args.seqlen, seed=0)
    save_file({"input_ids": calib.input_ids.contiguous()}, str(args.workdir / "calib_ids.safetensors"))
    llmc_python = ensure_llmc_python(args.llmc_python)

    # --llmc-dtypes "": quantkit's side alone (compare with an earlier run's peer numbers)
    peers = {_peer_key(d): d for d in args.llmc_dtypes.split(",") if d}
    runs = {"quantkit_gptq": run_worker(Path(sys.executable), "quantkit", args,
                                        args.workdir / "quantkit_gptq", method="gptq")}
    for key, dtype in peers.items():
        runs[key] = run_worker(llmc_python, "llmc", args, args.workdir / key, llmc_dtype=dtype)
        if args.llmc_huge_pages:
            runs[key + "_huge_pages"] = run_worker(llmc_python, "llmc", args,
                                                   args.workdir / (key + "_huge_pages"),
                                                   huge_pages=True, llmc_dtype=dtype)
    runs["quantkit_rtn"] = run_worker(Path(sys.executable), "quantkit", args,
                                      args.workdir / "quantkit_rtn", method="rtn")
    metrics: dict[str, dict] = {}
    if not args.skip_eval:
        from quantkit.eval.harness import evaluate
        from quantkit.eval.logits import PPLConvention

        print(f"[{time.strftime('%H:%M:%S')}] eval: base + {len(runs)} artifacts", flush=True)
        names = list(runs)
        records = evaluate([str(args.workdir / n) for n in names],
                           base=str(args.model_path), heldout=args.heldout,
                           conv=PPLConvention(ctx=512, max_windows=args.eval_windows))
        for n, rec in zip(names, records, strict=True):
            m = rec["metrics"]
            metrics[n] = {"ppl": m["ppl"]["value"], "kld_mean": m["kld"]["mean"],
                          "kld_stderr": m["kld"]["stderr"], "top1": m["top1_agreement"]["value"],
                          "base_ppl": m["base_ppl"]["value"]}
        convention = records[0]["convention"]
    else:
        convention = None

    qk, rtn = runs["quantkit_gptq"]["job_s"], runs["quantkit_rtn"]["job_s"]
    acceptance: dict = {"time_goal": "<= 0.5"}
    for key, dtype in peers.items():
        acceptance[f"time_ratio_quantkit_over_llmc_{dtype}"] = qk / runs[key]["job_s"]
        acceptance[f"time_ratio_quantkit_job_over_llmc_{dtype}_oneshot_only"] = \
            qk / runs[key]["quantize_call_s"]
        acceptance[f"peak_rss_quantkit_le_llmc_{dtype}"] = \
            runs["quantkit_gptq"]["peak_rss_mib"] <= runs[key]["peak_rss_mib"]
        if key + "_huge_pages" in runs:  # the control: the peer under quantkit's environment
            acceptance[f"time_ratio_quantkit_over_llmc_{dtype}_huge_pages"] = \
                qk / runs[key + "_huge_pages"]["job_s"]
    if metrics:
        kq, kr = metrics["quantkit_gptq"]["kld_mean"], metrics["quantkit_rtn"]["kld_mean"]
        acceptance.update(kld_ratio_quantkit_over_rtn=kq / kr, kld_goal_vs_rtn="<= 0.9")
        for key, dtype in peers.items():
            acceptance[f"kld_quantkit_le_llmc_{dtype}"] = kq <= metrics[key]["kld_mean"]
    result = {
        "benchmark": "gptq_vs_llmcompressor_cpu",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": args.model, "model_path": str(args.model_path),
        "scheme": {"bits": args.bits, "group_size": args.group_size, "symmetric": True,
                   "act_order": "static" if args.act_order else None, "damp": args.damp,
                   "block_size": 128,
                   "compute_dtype": {k: r.get("compute_dtype") for k, r in runs.items()}},
        "calibration": {**calib.provenance, "file": str(args.workdir / "calib_ids.safetensors"),
                        "shared_by_both_sides": True},
        "machine": {"cpu": cpu_info()["model"], "cores": os.cpu_count(),
                    "cores_usable": len(os.sched_getaffinity(0)),
                    "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                    "torch_threads": args.threads or "default",
                    "load_avg_at_end": os.getloadavg(), "python": platform.python_version()},
        "time_note": "job_s (the compared time): load the model + calibrate + quantize + save the "
                     "artifact, imports done before the timer on both sides (quantkit quantize(); "
                     "llm-compressor from_pretrained + oneshot + save_pretrained). quantize_call_s: "
                     "llm-compressor oneshot() alone (the model already loaded, not saved); "
                     "process_s: the whole subprocess",
        "runs": runs, "metrics": metrics, "eval_convention": convention, "acceptance": acceptance,
        "rtn_job_s": rtn, "git_commit": _git_commit(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print_table(result)
    print(f"wrote {args.results}")


def _peer_key(dtype: str) -> str:
    return "llmcompressor_gptq" if dtype == "float32" else f"llmcompressor_gptq_{dtype}"


def _git_commit() -> str:
    from gpu_quantkit_vs_llmcompressor import git_commit  # one rule: COMMIT of a copy, else HEAD

    return git_commit()


def print_table(r: dict) -> None:
    rows = [(f"quantkit GPTQ ({r['runs']['quantkit_gptq'].get('compute_dtype', 'float32')})",
             "quantkit_gptq")]
    rows += [(f"llm-compressor GPTQ ({r['runs'][k].get('compute_dtype', 'float32')}"
              + (", huge pages)" if k.endswith("_huge_pages") else ")"), k)
             for k in r["runs"] if k.startswith("llmcompressor_gptq")]
    rows.append(("quantkit RTN", "quantkit_rtn"))
    print(f"\n{'':32s} {'job s':>9s} {'process s':>10s} {'peak RSS MiB':>13s} {'PPL':>8s} "
          f"{'KLD':>8s} {'top-1':>7s}")
    for label, key in rows:
        run, m = r["runs"][key], r["metrics"].get(key, {})
        ppl = f"{m['ppl']:8.3f}" if m else f"{'-':>8s}"
        kld = f"{m['kld_mean']:8.4f}" if m else f"{'-':>8s}"
        top1 = f"{m['top1'] * 100:6.2f}%" if m else f"{'-':>7s}"
        print(f"{label:32s} {run['job_s']:9.1f} {run['process_s']:10.1f} "
              f"{run['peak_rss_mib']:13.0f} {ppl} {kld} {top1}")
    if r["metrics"]:
        print(f"{'base (bf16 -> fp32)':32s} {'':9s} {'':10s} {'':13s} "
              f"{r['metrics']['quantkit_gptq']['base_ppl']:8.3f}")
    print("acceptance:", json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                     for k, v in r["acceptance"].items()}))


if __name__ == "__main__":
    main()
