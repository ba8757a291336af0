"""quantkit vs llm-compressor 0.14, GPTQ or AWQ W4A16 g128 (`--method`), on a synthetic
Qwen3-30B-A3B-shaped MoE (or Qwen3.5-35B-A3B-shaped: `--family qwen3_5_moe`, Gated DeltaNet
and full-attention blocks with 256 experts and a shared expert), one GPU, one run (issue 18's
GPU benchmark; issue 44's for Qwen3.5-MoE).

The model: transformers 5's Qwen3MoeForCausalLM with Qwen3-30B-A3B layer shapes (hidden 2048,
128 experts, 8 active, moe_intermediate 768, 32 / 4 heads, head_dim 128), `--layers` decoder
blocks, random bf16 weights (fine for time and memory, meaningless for accuracy), `--samples` x
`--seqlen` random calibration tokens, the same for both tools
(benchmarks/llmcompressor_moe_gpu_peer.py builds it; seed 0 for both).

quantkit: the model in CPU memory, its fused experts linearized into per-expert Linears
(quantkit.pipeline.experts), every block moved to the GPU in turn by the one pipeline
(quantize_blocks; GPTQ true-sequential, 8 samples per forward; AWQ with its defaults: the
shared post_attention_layernorm scale searched on the whole MoE block, the router compensated,
each expert's up -> down on its routed tokens, clipping, 1 sample per forward). Timed from the model in CPU
memory to the quantized weights back on the CPU, linearization and input capture included.
Variants: `routed` (each expert's Hessian from the tokens the router sends it: quantkit's default)
and `all` (every token through every expert for statistics: --moe-calibrate-all-experts).
Each row holds `quantkit plan`'s GPU peak for the run (quantkit.pipeline.plan.estimate, what the
CLI prints; it counts the 0.5 GiB CUDA context, which the allocator's peak does not see) and the
tokens each expert Linear was calibrated on.

llm-compressor: the peer script in a child process (its own memory pool), the model whole on the
GPU as the shared peer script has it, `oneshot` timed (AWQ: its AWQModifier with the
Qwen3-MoE default mappings + QuantizationModifier W4A16; the row says which mappings it
resolved and whether the experts' weights were really smoothed). Its default `moe_calibrate_all_experts`
is True: the `all` row is its default, `routed` passes False. The row counts the expert Linears
that carry a weight_scale afterwards (did it really quantize the fused experts).

Run on the GPU machine from the repo root, with llm-compressor's wheels installed (see
benchmarks/README.md):  python3 benchmarks/moe_gpu_vs_llmcompressor.py --out $OUT/moe.json
AWQ: --method awq --variants routed,all (results/moe_awq_2_layers_h100_vs_llmcompressor.json).
A dry run on the CPU (tiny shapes, no GPU): --device cpu --tiny (AWQ with --tools quantkit:
llm-compressor 0.14's AWQModifier pins its cache and fails without an accelerator).
`--peer-from FILE`: compare with the llm-compressor rows of an earlier results JSON (same
shapes, tokens and GPU kind) instead of running the peer again; the document says so.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from gpu_quantkit_vs_llmcompressor import git_commit  # noqa: E402
from llmcompressor_moe_gpu_peer import FAMILIES, MODEL_NAMES, synthetic_moe  # noqa: E402

# hidden 256, 8 experts, top-2: a CPU dry run of the whole script in seconds
TINY = {"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 256, "num_experts": 8,
        "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
TINY_FAMILY = {"qwen3_moe": TINY,
               "qwen3_5_moe": {**TINY, "shared_expert_intermediate_size": 256, "linear_num_key_heads": 2,
                               "linear_num_value_heads": 4, "linear_key_head_dim": 64,
                               "linear_value_head_dim": 64}}
# quantkit variant -> (calibrate all experts, true-sequential GPTQ). `-layerwise`: every Linear
# of a block calibrated on the unquantized block (--no-true-sequential), llm-compressor's order:
# one statistics forward per block instead of one per sequential group. The peer runs each
# experts setting once (`routed`, `all`); a `-layerwise` row is compared with the same setting.
VARIANTS = {"routed": (False, True), "all": (True, True),
            "routed-layerwise": (False, False), "all-layerwise": (True, False)}
# AWQ searches every group of a block on the unmodified block: no true-sequential order
AWQ_VARIANTS = ("routed", "all")
PHASES = None  # --phases: a PhaseTimer around the pipeline's steps (synchronized on the GPU)


def time_phases(device: str):
    """Wrap the pipeline's own steps (no copy of their code) with a synchronizing timer."""
    from phase_timer import PhaseTimer

    from quantkit.methods import awq, gptq
    from quantkit.pipeline import blocks, experts, replay

    timer = PhaseTimer(sync=torch.cuda.synchronize if device == "cuda" else None)
    timer.wrap(experts, "linearize_experts", "linearize experts")
    timer.wrap(blocks, "capture_block_inputs", "capture inputs")
    timer.wrap(blocks, "_check_block_finite", "block to device + finite check")
    timer.wrap(blocks, "_group_stats", "statistics forwards")
    timer.wrap(blocks, "run_block", "output forwards")
    timer.wrap(gptq.GPTQQuantizer, "quantize_block", "GPTQ (all)")
    timer.wrap(gptq, "shared_input_sets", "GPTQ: shared-input sets")
    timer.wrap(gptq, "inverse_hessian_factor", "GPTQ: inverse Hessian factor")
    timer.wrap(gptq, "gptq_column_loop", "GPTQ: column loop")
    timer.wrap(gptq, "relative_error", "GPTQ: relative error")
    timer.wrap(blocks, "_block_and_results_to_cpu", "block + results to CPU")
    timer.wrap(awq.AWQQuantizer, "quantize_block", "AWQ (all)")
    timer.wrap(replay.BlockReplay, "record", "AWQ: capture search inputs")
    timer.wrap(replay.BlockReplay, "expert_inputs", "AWQ: replay expert chunks")
    timer.wrap(awq, "_module_loss", "AWQ: block-loss forwards (shared groups)")
    timer.wrap(awq, "linear_scale_losses", "AWQ: Linear-pair losses (up -> down)")
    timer.wrap(awq, "search_clip", "AWQ: clip search")
    timer.wrap(awq, "rtn_quantize_weight", "AWQ: quantize")
    return timer


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def planned_peak_gib(config, samples: int, seqlen: int, batch: int, true_sequential: bool,
                     method: str = "gptq", all_experts: bool = False) -> float:
    """`quantkit plan`'s GPU peak for this run, context included (W4A16 g128, sym)."""
    from quantkit.arch import spec_for_config
    from quantkit.pipeline.plan import estimate
    from quantkit.types import QuantScheme

    plan = estimate(config, spec_for_config(config), method=method,
                    scheme=QuantScheme(bits=4, group_size=128, symmetric=True),
                    calib_samples=samples, calib_seqlen=seqlen, calibrated=True, device="cuda",
                    calib_batch=batch, true_sequential=true_sequential, moe_all_experts=all_experts)
    return plan.peak_gpu_bytes / 2**30


def run_quantkit(variant: str, args, shape: dict) -> dict:
    from quantkit.arch import spec_for_config
    from quantkit.methods.awq import AWQQuantizer
    from quantkit.methods.gptq import GPTQQuantizer
    from quantkit.pipeline.blocks import quantize_blocks
    from quantkit.pipeline.experts import linearize_experts
    from quantkit.types import QuantScheme

    model = synthetic_moe(args.family, args.layers, shape, args.device).to("cpu").eval()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    spec = spec_for_config(model.config)
    all_experts, true_sequential = VARIANTS[variant]
    if args.method == "awq":
        quantizer, true_sequential = AWQQuantizer(), False
    else:
        quantizer = GPTQQuantizer(true_sequential=true_sequential)
    batch = quantizer.calib_batch_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128000, (args.samples, args.seqlen), generator=g)
    batches = list(ids.split(batch))
    _sync(args.device)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    marks: list[float] = []
    before = dict(PHASES.seconds) if PHASES is not None else {}
    t0 = time.perf_counter()
    linearize_experts(model, spec, calibrate_all=all_experts)
    results = quantize_blocks(model, spec, quantizer, QuantScheme(bits=4, group_size=128, symmetric=True),
                              batches, device=args.device, compute_dtype=torch.bfloat16,
                              on_progress=lambda *_: (_sync(args.device), marks.append(time.perf_counter())))
    _sync(args.device)
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else 0.0
    planned = planned_peak_gib(model.config, args.samples, args.seqlen, batch, true_sequential,
                               args.method, all_experts)
    experts = {k: r for k, r in results.items() if ".experts." in k}
    linear_attention = [k for k in results if ".linear_attn." in k]
    tokens = [r.calib_tokens or 0 for r in experts.values()]
    row = {"tool": "quantkit", "method": args.method, "variant": variant, "all_experts": all_experts,
           "true_sequential": true_sequential,
           "layers": args.layers, "samples": args.samples, "seqlen": args.seqlen,
           "seconds": round(dt, 2), "seconds_per_layer": round(dt / args.layers, 2),
           "seconds_per_block": [round(b - a, 2) for a, b in zip([t0] + marks[:-1], marks, strict=True)],
           "projected_48_layers_s": round(dt / args.layers * 48, 1),
           "peak_gpu_gib": round(peak, 2), "plan_peak_gpu_gib": round(planned, 2),
           "plan_vs_measured_plus_context": round(planned / (peak + 0.5) - 1, 3) if peak else None,
           "family": args.family,
           "quantized_linears": len(results), "expert_linears_quantized": len(experts),
           "linear_attention_linears_quantized": len(linear_attention),
           "expert_tokens_min_max": [min(tokens, default=0), max(tokens, default=0)],
           "expert_linears_without_tokens": sum(t == 0 for t in tokens),
           "mean_rel_error": round(sum(r.loss for r in results.values() if r.loss is not None)
                                   / max(len(results), 1), 5),
           "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
           "torch": torch.__version__}
    if args.method == "awq":
        row["awq_groups_searched"] = len(quantizer.history)
        row["awq_expert_groups_scaled"] = sum(
            1 for h in quantizer.history if h["alpha"] is not None
            and any(".experts." in n for n in h["balance"]))
        # the experts' down_proj search inputs: chunks of experts per block (0: one pass)
        row["awq_expert_chunks"] = [c["expert_chunks"] for c in quantizer.captures]
        row["awq_largest_chunk_gib"] = round(max(c["largest_chunk_bytes"] for c in quantizer.captures) / 2**30, 3)
        row["awq_one_pass_inputs_gib"] = round(max(c["one_pass_bytes"] for c in quantizer.captures) / 2**30, 3)
    if PHASES is not None:
        row["phase_seconds"] = {k: round(v - before.get(k, 0.0), 2) for k, v in PHASES.seconds.items()}
    print("RESULT " + json.dumps(row), flush=True)
    del model, results
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return row


def run_peer(variant: str, args, shape: dict) -> dict | None:
    """llm-compressor's oneshot in a child process; its RESULT row (None if it failed)."""
    cmd = [args.peer_python or sys.executable, str(HERE / "llmcompressor_moe_gpu_peer.py"),
           "--layers", str(args.layers), "--samples", str(args.samples), "--seqlen", str(args.seqlen),
           "--device", args.device, "--method", args.method, "--family", args.family,
           *(["--routed-only"] if variant == "routed" else []),
           *(["--shape", json.dumps(shape)] if shape else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
    rows = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not rows:
        print(f"peer failed (rc {proc.returncode}): {shlex.join(cmd)}\n{proc.stdout[-3000:]}\n"
              f"{proc.stderr[-5000:]}", flush=True)
        return None
    row = {"tool": "llm-compressor 0.14", "variant": variant, **rows[0], "command": shlex.join(cmd)}
    print("RESULT " + json.dumps(row), flush=True)
    return row


def compare(rows: list[dict]) -> list[dict]:
    """quantkit / llm-compressor per variant: time and peak ratios against the goals."""
    out = []
    for variant in VARIANTS:
        qk = next((r for r in rows if r["tool"] == "quantkit" and r["variant"] == variant), None)
        lc = next((r for r in rows if r["tool"] != "quantkit" and qk is not None
                   and r["method"] == qk["method"] and r["all_experts"] == qk["all_experts"]), None)
        if not (qk and lc and lc["seconds"] and lc["peak_gpu_gib"]):
            continue
        t, m = qk["seconds"] / lc["seconds"], qk["peak_gpu_gib"] / lc["peak_gpu_gib"]
        plan_err = qk["plan_vs_measured_plus_context"]
        # issue 18's goal for Qwen3-30B-A3B shapes, issue 44's for Qwen3.5-MoE (<= 0.2x time)
        goal = 0.2 if qk.get("family") == "qwen3_5_moe" else 0.25
        out.append({"variant": variant, "peer_all_experts": lc["all_experts"], "time_ratio": round(t, 3), "peak_ratio": round(m, 3),
                    f"goal_time_le_{goal}": t <= goal, "goal_peak_le_0.5": m <= 0.5,
                    "goal_plan_within_30pct": plan_err is not None and abs(plan_err) <= 0.3})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--method", default="gptq", choices=("gptq", "awq"))
    p.add_argument("--family", default="qwen3_moe", choices=tuple(FAMILIES),
                   help="qwen3_moe: Qwen3-30B-A3B shapes; qwen3_5_moe: Qwen3.5-35B-A3B shapes")
    p.add_argument("--variants", default="routed,all", help=", ".join(VARIANTS) + " (AWQ: "
                   + ", ".join(AWQ_VARIANTS) + ")")
    p.add_argument("--tools", default="quantkit,llmcompressor")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU dry run of the script)")
    p.add_argument("--peer-python", default="", help="python with llm-compressor (default: this one)")
    p.add_argument("--warm-up", action="store_true",
                   help="one untimed quantkit run first (1 layer, 8 x 256): Triton's compile off the clock")
    p.add_argument("--phases", action="store_true",
                   help="time the pipeline's steps in each quantkit run (synchronizing: a little slower)")
    p.add_argument("--peer-from", default="",
                   help="results JSON whose llm-compressor rows to compare with (the peer is not run)")
    p.add_argument("--out", default="")
    args = p.parse_args()
    global PHASES
    if args.phases:
        PHASES = time_phases(args.device)
    shape = TINY_FAMILY[args.family] if args.tiny else {}
    variants = [v for v in args.variants.split(",") if v]
    if args.method == "awq" and set(variants) - set(AWQ_VARIANTS):
        p.error(f"AWQ has no true-sequential order; --variants takes {', '.join(AWQ_VARIANTS)}")
    tools = args.tools.split(",")
    rows: list[dict] = []
    earlier = json.loads(Path(args.peer_from).read_text()) if args.peer_from else None
    if earlier is not None:
        if "llmcompressor" in tools:
            p.error("--peer-from replaces running the peer: pass --tools quantkit")
        same = {**FAMILIES[args.family], **shape, "num_hidden_layers": args.layers}
        if earlier.get("shape") != same or any(
                (r["samples"], r["seqlen"], r["layers"]) != (args.samples, args.seqlen, args.layers)
                for r in earlier["rows"]):
            p.error(f"--peer-from {args.peer_from}: its shapes, layers or tokens differ from this run's")
        rows += [{**r, "from": f"{args.peer_from} (commit {earlier.get('commit')})"}
                 for r in earlier["rows"] if r["tool"] != "quantkit" and r.get("method") == args.method
                 and r["variant"] in variants]
    warm = None
    if args.warm_up and "quantkit" in tools:
        t0 = time.perf_counter()
        small = argparse.Namespace(**{**vars(args), "layers": 1, "samples": 8, "seqlen": 256})
        run_quantkit("routed", small, shape)
        warm = round(time.perf_counter() - t0, 2)
    for variant in variants:
        if "quantkit" in tools:
            rows.append(run_quantkit(variant, args, shape))
        if "llmcompressor" in tools and variant in ("routed", "all"):
            peer = run_peer(variant, args, shape)
            if peer:
                rows.append(peer)
    ratios = compare(rows)
    doc = {"benchmark": f"{args.method.upper()} W4A16 g128 on a synthetic {MODEL_NAMES[args.family]} MoE, "
                        "quantkit vs llm-compressor 0.14",
           "family": args.family,
           "shape": {**FAMILIES[args.family], **shape, "num_hidden_layers": args.layers},
           "quantkit_placement": "model in CPU memory, one block at a time on the GPU",
           "peer_placement": "model whole on the GPU (the shared peer script)",
           "warm_up_seconds": warm, "commit": git_commit(),
           **({"peer_rows_from": f"{args.peer_from}, commit {earlier.get('commit')}, not rerun"}
              if earlier is not None else {}),
           "command": "python3 " + shlex.join(sys.argv), "rows": rows, "ratios": ratios}
    for r in ratios:
        print("RATIO " + json.dumps(r), flush=True)
    print(f"{'tool':22} {'variant':16} {'s/layer':>8} {'peak GiB':>9} {'plan GiB':>9} {'experts q':>9}")
    for r in rows:
        print(f"{r['tool']:22} {r['variant']:16} {r['seconds_per_layer']:8.2f} {r['peak_gpu_gib']:9.2f} "
              f"{r.get('plan_peak_gpu_gib', float('nan')):9.2f} {r.get('expert_linears_quantized', 0):9d}")
    if args.out:
        tmp = Path(args.out + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.rename(args.out)


if __name__ == "__main__":
    main()
