"""quantkit vs llm-compressor, GPTQ and AWQ W4A16 g128, on one GPU, in one run.

Synthetic model with Llama-3.1-8B layer shapes (random bf16 weights: fine for time and memory,
meaningless for accuracy), `--layers` decoder blocks, `--samples` x `--seqlen` random calibration
tokens, the same for both tools. The peer side is benchmarks/llmcompressor_gpu_peer.py (the project's verified recipe)
(run as a subprocess so neither tool's memory pool affects the other).

Run on the GPU machine from the repo root (wheels for llm-compressor carried in .whl/):
  python3 benchmarks/gpu_quantkit_vs_llmcompressor.py --out $OUT/gpu.json
Writes one JSON file (both tools' rows) and prints a table.
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


# Llama-3.x layer shapes (hidden, intermediate, heads, kv heads); the peer script knows only 8b.
SHAPES = {"llama-3.1-8b": (4096, 14336, 32, 8), "llama-3.2-3b": (3072, 8192, 24, 8),
          "llama-2-13b": (5120, 13824, 40, 40)}


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


def run_quantkit(method: str, args) -> dict:
    from quantkit.arch import spec_for_config
    from quantkit.methods import get_quantizer
    from quantkit.pipeline.blocks import quantize_blocks
    from quantkit.types import QuantScheme

    model = synthetic_llama(args.layers, args.shape)
    spec = spec_for_config(model.config)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128000, (args.samples, args.seqlen), generator=g)
    batches = list(ids.split(args.batch))
    # "gptq-layer-sequential": GPTQ with --no-true-sequential (llm-compressor's order)
    base, _, mode = method.partition("-")
    sym = base == "gptq"  # the peer's recipes: GPTQ W4A16 (sym), AWQ W4A16_ASYM
    scheme = QuantScheme(bits=4, group_size=128, symmetric=sym)
    quantizer = get_quantizer(base, **({"true_sequential": False} if mode else {}))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    per_block = []

    def progress(stage, done, total):
        torch.cuda.synchronize()
        per_block.append(time.perf_counter())

    t0 = time.perf_counter()
    results = quantize_blocks(model, spec, quantizer, scheme, batches, device="cuda",
                              compute_dtype=torch.bfloat16, on_progress=progress)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    blocks = [b - a for a, b in zip([t0] + per_block[:-1], per_block, strict=True)]
    errs = [r.loss for r in results.values() if r.loss is not None]
    row = {"tool": "quantkit", "method": method, "shape": args.shape, "layers": args.layers,
           "samples": args.samples,
           "seqlen": args.seqlen, "seconds": round(dt, 2),
           "seconds_per_layer": round(dt / args.layers, 2),
           "seconds_per_layer_after_first": round(sum(blocks[1:]) / max(len(blocks) - 1, 1), 2),
           "seconds_per_block": [round(b, 2) for b in blocks],  # the first holds input capture
           "projected_32_layers_s": round(dt / args.layers * 32, 1),
           "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
           "mean_rel_error": round(sum(errs) / max(len(errs), 1), 5),
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    print("RESULT " + json.dumps(row), flush=True)
    del model, results
    torch.cuda.empty_cache()
    return row


def run_peer(methods: list[str], args) -> list[dict]:
    peer = Path(args.peer_script)
    cmd = [sys.executable, str(peer), "--layers", str(args.layers), "--samples", str(args.samples),
           "--seqlen", str(args.seqlen), "--methods", ",".join(methods)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
    rows = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 and not rows:
        print(proc.stdout[-3000:], proc.stderr[-3000:], flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8, help="calibration samples per forward")
    p.add_argument("--methods", default="gptq,awq",
                   help="gptq, gptq-layer-sequential (quantkit only), awq")
    p.add_argument("--tools", default="quantkit,llm-compressor")
    p.add_argument("--peer-script", default=str(Path(__file__).with_name("llmcompressor_gpu_peer.py")))
    p.add_argument("--out", default="benchmarks/results/gpu_quantkit_vs_llmcompressor.json")
    args = p.parse_args()
    methods = args.methods.split(",")
    if "llm-compressor" in args.tools and args.shape != "llama-3.1-8b":
        p.error("the peer script builds Llama-3.1-8B shapes only")
    rows: list[dict] = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(new: list[dict]) -> None:  # after every row: a run cut at its time limit keeps them
        for r in new:
            r.setdefault("tool", r.get("peer", "llm-compressor"))
        rows.extend(new)
        out.write_text(json.dumps({"setup": vars(args), "rows": rows}, indent=2))

    if "quantkit" in args.tools:
        for m in methods:
            save([run_quantkit(m, args)])
    if "llm-compressor" in args.tools:
        save(run_peer(sorted({m.partition("-")[0] for m in methods}), args))
    print(f"{'tool':15s} {'method':6s} {'s/layer':>8s} {'peak GiB':>9s}")
    for r in rows:
        print(f"{r['tool']:15s} {r['method']:6s} {r['seconds_per_layer']:8.2f} {r['peak_gpu_gib']:9.2f}")


if __name__ == "__main__":
    main()
