"""quantkit vs llm-compressor, GPTQ and AWQ W4A16 g128, on one GPU, in one run.

Synthetic model with Llama-3.1-8B layer shapes (random bf16 weights: fine for time and memory,
meaningless for accuracy), `--layers` decoder blocks, `--samples` x `--seqlen` random calibration
tokens, the same for both tools. The peer side is benchmarks/llmcompressor_gpu_peer.py (the project's verified recipe)
(run as a subprocess so neither tool's memory pool affects the other).

Placement, like for like: both tools start from the model in CPU memory and move one decoder
block at a time to the GPU (llm-compressor's sequential pipeline with the model on the CPU,
`--model-device cpu`). `--placements` picks where quantkit keeps the calibration activations
between block forwards: `gpu` (on the GPU) and/or `offload` (pinned host memory, as
llm-compressor's intermediates cache does; quantkit.pipeline.offload), at
`--offload-batch` samples per forward (quantkit.pipeline.plan.OFFLOAD_BATCH, what quantize()
uses when it offloads).
Timed scope, the same for both tools: from the model in CPU memory and the calibration token
ids to the quantized weights in memory (quantkit: input capture + every block + results back
on the CPU; llm-compressor: `oneshot`, its dataset preparation included). Loading the
checkpoint and writing the artifact are outside it for both.
Every row records the commit (`git rev-parse HEAD`, or the file COMMIT beside benchmarks/ where
the tree was copied without .git) and the exact command; quantkit rows also hold `quantkit
plan`'s prediction of their peak (plus the 0.5 GiB CUDA context that the allocator's peak does
not see). `--check` first compares the offloaded and on-GPU paths on a small run (identical
codes, scales and zeros for GPTQ and AWQ).

Run on the GPU machine from the repo root (wheels for llm-compressor carried in .whl/):
  python3 benchmarks/gpu_quantkit_vs_llmcompressor.py --out $OUT/gpu.json
Writes one JSON file (both tools' rows) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


TIMED_SCOPE = ("model in CPU memory + calibration token ids -> quantized weights in memory "
               "(checkpoint load and artifact write excluded, for both tools)")

# Llama-3.x layer shapes (hidden, intermediate, heads, kv heads); the peer script knows only 8b.
SHAPES = {"llama-3.1-8b": (4096, 14336, 32, 8), "llama-3.2-3b": (3072, 8192, 24, 8),
          "llama-2-13b": (5120, 13824, 40, 40), "tiny": (128, 256, 4, 2)}  # tiny: CPU dry runs
DEVICE = "cuda"  # --device cpu: a dry run of this script without a GPU (nothing is offloaded)


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else 0.0


def synthetic_llama(n_layers: int, shape: str = "llama-3.1-8b"):
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, heads, kv = SHAPES[shape]
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                      num_key_value_heads=kv, num_hidden_layers=n_layers, vocab_size=128256,
                      max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # 32 blocks of 8B in fp32 would be 32 GB to init
    try:
        # random init is minutes for 8B on the CPU, seconds on the GPU
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    model = model.to("cpu")  # quantkit streams blocks to the GPU
    torch.cuda.empty_cache()
    model.eval()
    return model


def git_commit() -> str:
    """HEAD of this checkout; for a copy without .git, the COMMIT file written beside
    benchmarks/ when it was copied (never the HEAD of a repository that merely holds the copy)."""
    root = Path(__file__).resolve().parents[1]
    stamp = root / "COMMIT"
    if stamp.is_file():
        return stamp.read_text().strip()
    try:
        top, head = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=root,
                                   capture_output=True, text=True, check=True).stdout.split()
    except (OSError, ValueError, subprocess.CalledProcessError):
        return "unknown"
    return head if Path(top).resolve() == root else "unknown"


def _quantizer_and_scheme(method: str):
    from quantkit.methods import get_quantizer
    from quantkit.types import QuantScheme

    # "gptq-layer-sequential": GPTQ with --no-true-sequential (llm-compressor's order)
    base, _, mode = method.partition("-")
    sym = base == "gptq"  # the peer's recipes: GPTQ W4A16 (sym), AWQ W4A16_ASYM
    scheme = QuantScheme(bits=4, group_size=128, symmetric=sym)
    return get_quantizer(base, **({"true_sequential": False} if mode else {})), scheme, base, mode


def _quantize(model, method: str, batches, offload: bool, on_progress=None):
    from quantkit.arch import spec_for_config
    from quantkit.pipeline.blocks import quantize_blocks

    quantizer, scheme, _, _ = _quantizer_and_scheme(method)
    return quantize_blocks(model, spec_for_config(model.config), quantizer, scheme, batches,
                           device=DEVICE, compute_dtype=torch.bfloat16, on_progress=on_progress,
                           offload_activations=offload)


def planned_peak_gib(method: str, args, batch: int, offload: bool) -> float:
    """`quantkit plan`'s GPU peak for this run (context included)."""
    from transformers import LlamaConfig

    from quantkit.arch import spec_for_config
    from quantkit.pipeline.plan import estimate

    hidden, inter, heads, kv = SHAPES[args.shape]
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                      num_key_value_heads=kv, num_hidden_layers=args.layers, vocab_size=128256,
                      tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    _, scheme, base, mode = _quantizer_and_scheme(method)
    plan = estimate(cfg, spec_for_config(cfg), method=base, scheme=scheme,
                    calib_samples=args.samples, calib_seqlen=args.seqlen, calibrated=True,
                    device="cuda", calib_batch=batch, true_sequential=not mode)
    return (plan.peak_gpu_offloaded_bytes if offload else plan.peak_gpu_bytes) / 2**30


def check_offload(methods: list[str], shape: str) -> list[dict]:
    """Offloaded vs on-GPU activations on 2 blocks, 16 x 512 tokens: identical results?"""
    rows = []
    g = torch.Generator().manual_seed(1)
    batches = list(torch.randint(0, 128000, (16, 512), generator=g).split(4))
    for method in methods:
        got = {}
        for offload in (False, True):
            got[offload] = _quantize(synthetic_llama(2, shape), method, batches, offload)
        ref, off = got[False], got[True]
        same = all(torch.equal(getattr(ref[k], a), getattr(off[k], a))
                   for k in ref for a in ("codes", "scale", "zero"))
        row = {"check": "offload_vs_gpu", "method": method, "layers": 2, "tokens": "16 x 512",
               "tensors": len(ref), "identical": same and ref.keys() == off.keys()}
        print("CHECK " + json.dumps(row), flush=True)
        rows.append(row)
    return rows


def run_quantkit(method: str, args, offload: bool) -> dict:
    model = synthetic_llama(args.layers, args.shape)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128000, (args.samples, args.seqlen), generator=g)
    batch = args.offload_batch if offload else args.batch
    batches = list(ids.split(batch))
    _sync()
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    per_block = []

    def progress(stage, done, total):
        _sync()
        per_block.append(time.perf_counter())

    t0 = time.perf_counter()
    results = _quantize(model, method, batches, offload, progress)
    _sync()
    dt = time.perf_counter() - t0
    blocks = [b - a for a, b in zip([t0] + per_block[:-1], per_block, strict=True)]
    errs = [r.loss for r in results.values() if r.loss is not None]
    peak = _peak_gib()
    planned = planned_peak_gib(method, args, batch, offload)
    row = {"tool": "quantkit", "method": method, "shape": args.shape, "layers": args.layers,
           "activations": "offload" if offload else "gpu", "batch": batch,
           "samples": args.samples,
           "seqlen": args.seqlen, "seconds": round(dt, 2),
           "seconds_per_layer": round(dt / args.layers, 2),
           "seconds_per_layer_after_first": round(sum(blocks[1:]) / max(len(blocks) - 1, 1), 2),
           "seconds_per_block": [round(b, 2) for b in blocks],  # the first holds input capture
           "projected_32_layers_s": round(dt / args.layers * 32, 1),
           "peak_gpu_gib": round(peak, 2),
           "plan_peak_gpu_gib": round(planned, 2),  # context included
           "plan_vs_measured_plus_context": round(planned / (peak + 0.5) - 1, 3),
           "mean_rel_error": round(sum(errs) / max(len(errs), 1), 5),
           "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
           "torch": torch.__version__}
    print("RESULT " + json.dumps(row), flush=True)
    del model, results
    torch.cuda.empty_cache()
    return row


def run_peer(methods: list[str], args) -> list[dict]:
    peer = Path(args.peer_script)
    cmd = [sys.executable, str(peer), "--layers", str(args.layers), "--samples", str(args.samples),
           "--seqlen", str(args.seqlen), "--methods", ",".join(methods), "--model-device", "cpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
    rows = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    for r in rows:
        r["command"] = shlex.join(cmd)
    if proc.returncode != 0 and not rows:
        print(proc.stdout[-3000:], proc.stderr[-3000:], flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8,
                   help="calibration samples per forward, activations on the GPU")
    p.add_argument("--offload-batch", type=int, default=None,
                   help="samples per forward with offloaded activations (default: the plan's "
                        "OFFLOAD_BATCH, what quantize() uses)")
    p.add_argument("--placements", default="gpu,offload",
                   help="where quantkit keeps the activations: gpu, offload or both")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--check", action="store_true",
                   help="first compare offloaded and on-GPU results on a small run")
    p.add_argument("--methods", default="gptq,awq",
                   help="gptq, gptq-layer-sequential (quantkit only), awq")
    p.add_argument("--tools", default="quantkit,llm-compressor")
    p.add_argument("--peer-script", default=str(Path(__file__).with_name("llmcompressor_gpu_peer.py")))
    p.add_argument("--out", default="benchmarks/results/gpu_quantkit_vs_llmcompressor.json")
    args = p.parse_args()
    global DEVICE
    DEVICE = args.device
    if args.offload_batch is None:
        from quantkit.pipeline.plan import OFFLOAD_BATCH

        args.offload_batch = min(args.batch, OFFLOAD_BATCH)
    methods = args.methods.split(",")
    command = shlex.join([sys.executable, *sys.argv])
    commit = git_commit()
    if "llm-compressor" in args.tools and args.shape != "llama-3.1-8b":
        p.error("the peer script builds Llama-3.1-8B shapes only")
    rows: list[dict] = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(new: list[dict]) -> None:  # after every row: a run cut at its time limit keeps them
        for r in new:
            r.setdefault("tool", r.get("peer", "quantkit"))
            r.setdefault("command", command)
            r["commit"] = commit
        rows.extend(new)
        out.write_text(json.dumps({"setup": vars(args), "command": command, "commit": commit,
                                   "timed_scope": TIMED_SCOPE, "rows": rows}, indent=2))

    if args.check:
        save(check_offload(methods, args.shape))
    if "quantkit" in args.tools:
        for m in methods:
            for placement in args.placements.split(","):
                save([run_quantkit(m, args, placement == "offload")])
    if "llm-compressor" in args.tools:
        save(run_peer(sorted({m.partition("-")[0] for m in methods}), args))
    print(f"{'tool':15s} {'method':6s} {'activations':11s} {'seconds':>8s} {'s/layer':>8s} "
          f"{'peak GiB':>9s} {'plan GiB':>9s}")
    for r in rows:
        if "seconds" not in r:
            continue
        print(f"{r['tool']:15s} {r['method']:6s} {r.get('activations', 'peer'):11s} "
              f"{r['seconds']:8.2f} {r['seconds_per_layer']:8.2f} {r['peak_gpu_gib']:9.2f} "
              f"{r.get('plan_peak_gpu_gib', float('nan')):9.2f}")


if __name__ == "__main__":
    main()
