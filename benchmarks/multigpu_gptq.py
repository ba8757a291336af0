"""GPTQ W4A16 g128 on one GPU vs data-parallel on several (torchrun + NCCL), in one run.

Synthetic model with Llama-3.1-8B layer shapes, or with `--moe` Qwen3-30B-A3B's (128 experts,
every one solved), random bf16 weights (seeded: every process builds the same model; fine for
time and memory, meaningless for accuracy), `--layers` blocks,
`--samples` x `--seqlen` random calibration tokens. Each worker runs quantkit's block loop
(`quantize_blocks`) twice from the same original weights:
  timed  `--batch` samples per forward (8: 16 batches, 8 per rank on 2 GPUs), the speed run;
  exact  `--samples/N` samples per forward (N batches, one per rank): the summed Hessians are
         the very float32 additions a single process makes, so the codes should be bitwise
         identical to the 1-GPU run's.
The 1-GPU worker is a plain process; the N-GPU one is `torchrun --nproc-per-node N`: each
rank solves its share of every group's Linears (quantkit.pipeline.distributed, "solves" in
each row: Linears and cost share per rank; method_solve_s is the rank's own solving). Rank 0
saves the QuantResults; the driver compares them and writes one JSON file.

Run on the multi-GPU machine from the repo root:
  python3 benchmarks/multigpu_gptq.py --gpus 2 --out $OUT/gptq_multigpu_h200x2.json
  python3 benchmarks/multigpu_gptq.py --gpus 4 --moe --out $OUT/gptq_multigpu_moe_h200x4.json
CPU smoke test (gloo): python3 benchmarks/multigpu_gptq.py --device cpu --tiny --layers 2
  --samples 16 --seqlen 64 --gpus 2 [--moe] --out /tmp/mg.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# NVLink multicast stays off (the machine's rule; set here too in case the env lacks them)
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}


def synthetic_llama_8b(n_layers: int, tiny: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    h, i, v = (256, 512, 1024) if tiny else (4096, 14336, 128256)  # tiny: CPU smoke test
    cfg = LlamaConfig(hidden_size=h, intermediate_size=i, num_attention_heads=32 if not tiny else 4,
                      num_key_value_heads=8 if not tiny else 2, num_hidden_layers=n_layers,
                      vocab_size=v,
                      max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)  # on CPU: quantkit moves blocks to the GPU
    return model.eval()


def synthetic_qwen3_moe(n_layers: int, tiny: bool = False):
    """Qwen3-30B-A3B's block shapes (hidden 2048, 128 experts of 768, top-8), per-expert
    Linears (what quantkit calibrates and solves)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from quantkit.arch import spec_for_config
    from quantkit.pipeline.experts import linearize_experts

    h, e, i, v = (128, 8, 128, 1024) if tiny else (2048, 128, 768, 151936)
    cfg = Qwen3MoeConfig(hidden_size=h, num_hidden_layers=n_layers, num_attention_heads=32 if not tiny else 4,
                         num_key_value_heads=4 if not tiny else 2, head_dim=128 if not tiny else 32,
                         intermediate_size=6144 if not tiny else 256, moe_intermediate_size=i,
                         num_experts=e, num_experts_per_tok=8 if not tiny else 2, vocab_size=v,
                         norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                         max_position_embeddings=8192, tie_word_embeddings=False,
                         architectures=["Qwen3MoeForCausalLM"])
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    return linearize_experts(model, spec_for_config(cfg)).eval()


def worker(args) -> None:
    from quantkit.arch import spec_for_config
    from quantkit.methods import get_quantizer
    from quantkit.pipeline.blocks import get_blocks, quantize_blocks
    from quantkit.pipeline.distributed import from_env
    from quantkit.types import QuantScheme

    dp, device = from_env(args.device)
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rank, world = (dp.rank, dp.world) if dp else (0, 1)
    t_build = time.perf_counter()
    model = (synthetic_qwen3_moe if args.moe else synthetic_llama_8b)(args.layers, args.tiny)
    spec = spec_for_config(model.config)
    blocks = get_blocks(model, spec)
    original = [{k: v.clone() for k, v in b.state_dict().items()} for b in blocks]
    build_s = time.perf_counter() - t_build
    ids = torch.randint(0, model.config.vocab_size, (args.samples, args.seqlen),
                        generator=torch.Generator().manual_seed(0))
    # exact: one batch per rank of the N-GPU run (the 1-GPU worker uses the same batches)
    configs = [("gptq", "timed", args.batch), ("gptq", "exact", args.samples // args.gpus)]
    if args.awq:
        configs.append(("awq", "timed", args.batch))
    for method, tag, batch in configs:
        tag = f"{method}_{tag}"
        # the peer recipes of gpu_quantkit_vs_llmcompressor.py: GPTQ W4A16 sym, AWQ asym
        scheme = QuantScheme(bits=4, group_size=128, symmetric=method == "gptq")
        for b, sd in zip(blocks, original, strict=True):
            b.load_state_dict(sd)
        batches = list(ids.split(batch))
        mine = dp.shard(batches) if dp else batches
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        if dp:
            torch.distributed.barrier()
        marks: list[float] = []

        def progress(stage, done, total, marks=marks):
            sync()
            marks.append(time.perf_counter())

        quantizer = get_quantizer(method)
        solve = [0.0]
        inner = quantizer.quantize_block

        def timed_solve(ctx, inner=inner, solve=solve):  # the method's work (this rank's share)
            sync()
            t = time.perf_counter()
            out = inner(ctx)
            sync()
            solve[0] += time.perf_counter() - t
            return out

        quantizer.quantize_block = timed_solve
        run_dp = dp.fresh() if dp else None  # this configuration's split only
        t0 = time.perf_counter()
        results = quantize_blocks(model, spec, quantizer, scheme, mine,
                                  device=device,
                                  compute_dtype=torch.bfloat16 if cuda else torch.float32,
                                  on_progress=progress, dp=run_dp)
        sync()
        dt = time.perf_counter() - t0
        per_block = [b - a for a, b in zip([t0] + marks[:-1], marks, strict=True)]
        row = {"run": f"{world}gpu", "config": tag, "rank": rank, "world_size": world,
               "layers": args.layers, "samples": args.samples, "seqlen": args.seqlen,
               "batch": batch, "batches_this_rank": len(mine), "seconds": round(dt, 3),
               "method_solve_s": round(solve[0], 3),
               "seconds_per_block": [round(x, 3) for x in per_block],
               "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else 0,
               "model_build_s": round(build_s, 1),
               "gpu": torch.cuda.get_device_name() if cuda else "cpu",
               "torch": torch.__version__, "model": "qwen3-30b-a3b" if args.moe else "llama-3.1-8b",
               "commit": _commit()}
        if run_dp:
            solves = dict(run_dp.describe().get("solves") or {})
            solves.pop("linears_by_rank", None)
            row["solves"] = solves
        if rank == 0:
            errs = [r.loss for r in results.values() if r.loss is not None]
            row["mean_rel_error"] = round(sum(errs) / max(len(errs), 1), 6)
            torch.save({n: {"codes": r.codes, "scale": r.scale, "zero": r.zero,
                            "loss": r.loss} for n, r in results.items()},
                       Path(args.save_dir) / f"{world}gpu_{tag}.pt")
        print("RESULT " + json.dumps(row), flush=True)
        del results
        if cuda:
            torch.cuda.empty_cache()
    if dp:
        dp.close()


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    except OSError:
        return ""


def compare(a_path: Path, b_path: Path) -> dict:
    a, b = torch.load(a_path), torch.load(b_path)
    assert a.keys() == b.keys()
    n_codes = diff_codes = 0
    max_code = 0
    scale_rel = 0.0
    loss_rel = 0.0
    identical = True
    for name in a:
        x, y = a[name], b[name]
        same = all(torch.equal(x[k], y[k]) for k in ("codes", "scale", "zero"))
        identical &= same
        d = x["codes"].int() - y["codes"].int()
        n_codes += d.numel()
        diff_codes += int((d != 0).sum())
        max_code = max(max_code, int(d.abs().max()))
        scale_rel = max(scale_rel, float(((x["scale"] - y["scale"]).abs().max())
                                         / x["scale"].abs().max()))
        loss_rel = max(loss_rel, abs(x["loss"] - y["loss"]) / x["loss"])
    return {"bitwise_identical": identical, "codes_differ_fraction": diff_codes / n_codes,
            "max_code_difference": max_code, "max_scale_rel_difference": scale_rel,
            "max_layer_rel_error_rel_difference": loss_rel}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8, help="calibration samples per forward")
    p.add_argument("--save-dir", default="/tmp/quantkit_multigpu")
    p.add_argument("--device", default="cuda", help="cpu (gloo) for a smoke test")
    p.add_argument("--awq", action="store_true", help="also time AWQ (W4A16 g128 asym)")
    p.add_argument("--tiny", action="store_true", help="small widths: a CPU smoke test")
    p.add_argument("--moe", action="store_true", help="Qwen3-30B-A3B shapes (128 experts)")
    p.add_argument("--threads", type=int, default=None,
                   help="OMP threads per rank (default: cores / gpus; torchrun would say 1)")
    p.add_argument("--out", default="benchmarks/results/gptq_multigpu_h200x2.json")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    Path(args.save_dir).mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **SAFE_ENV, "PYTHONUNBUFFERED": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    common = ["--worker", "--gpus", str(args.gpus), "--layers", str(args.layers), "--samples", str(args.samples),
              "--seqlen", str(args.seqlen), "--batch", str(args.batch),
              "--save-dir", args.save_dir, "--device", args.device] + (
                  ["--tiny"] if args.tiny else []) + (["--awq"] if args.awq else []) + (
                  ["--moe"] if args.moe else [])
    me = str(Path(__file__).resolve())
    threads = args.threads or max((os.cpu_count() or 2) // args.gpus, 1)
    runs = {"1gpu": [sys.executable, me, *common],
            f"{args.gpus}gpu": [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                "--nproc-per-node", str(args.gpus), me, *common]}
    rows, wall = [], {}
    for name, cmd in runs.items():
        t0 = time.perf_counter()
        run_env = env if name == "1gpu" else {**env, "OMP_NUM_THREADS": str(threads)}
        proc = subprocess.run(cmd, env=run_env, capture_output=True, text=True)
        wall[name] = round(time.perf_counter() - t0, 1)
        print(f"=== {name}: rc={proc.returncode} wall={wall[name]} s", flush=True)
        print(proc.stdout[-6000:], proc.stderr[-6000:], flush=True)
        rows += [json.loads(line[7:]) for line in proc.stdout.splitlines()
                 if line.startswith("RESULT ")]
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"partial": True, "rows": rows}, indent=2))
    summary = {}
    multi = f"{args.gpus}gpu"
    for tag in ("gptq_timed", "gptq_exact", "awq_timed"):
        one = [r for r in rows if r["run"] == "1gpu" and r["config"] == tag]
        many = [r for r in rows if r["run"] == multi and r["config"] == tag]
        if not one or not many:
            continue
        r0 = next(r for r in many if r["rank"] == 0)
        s = {"seconds_1gpu": one[0]["seconds"], f"seconds_{multi}": r0["seconds"],
             "speedup": round(one[0]["seconds"] / r0["seconds"], 3),
             "method_solve_s_1gpu": one[0]["method_solve_s"],
             f"method_solve_s_{multi}": r0["method_solve_s"],
             f"method_solve_s_{multi}_per_rank": [r["method_solve_s"] for r in
                                                  sorted(many, key=lambda r: r["rank"])],
             "solves": r0.get("solves"),
             "s_per_block_after_first_1gpu": round(
                 sum(one[0]["seconds_per_block"][1:]) / max(args.layers - 1, 1), 3),
             f"s_per_block_after_first_{multi}": round(
                 sum(r0["seconds_per_block"][1:]) / max(args.layers - 1, 1), 3),
             "peak_gpu_gib_1gpu": one[0]["peak_gpu_gib"],
             f"peak_gpu_gib_{multi}_per_rank": [r["peak_gpu_gib"] for r in
                                                sorted(many, key=lambda r: r["rank"])]}
        a = Path(args.save_dir) / f"1gpu_{tag}.pt"
        b = Path(args.save_dir) / f"{multi}_{tag}.pt"
        if a.is_file() and b.is_file():
            s["artifact_match"] = compare(a, b)
        summary[tag] = s
    record = {"setup": {k: v for k, v in vars(args).items() if k != "worker"},
              "what": "quantkit GPTQ W4A16 g128 sym (AWQ: asym), synthetic "
                      + ("Qwen3-30B-A3B" if args.moe else "Llama-3.1-8B") + "-shaped blocks; "
                      "quantize_blocks only (calibration capture + all blocks), not model "
                      "build or artifact writing",
              "process_wall_s": wall, "summary": summary, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
