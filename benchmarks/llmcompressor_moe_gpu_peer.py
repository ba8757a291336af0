"""Peer timing: llm-compressor 0.14 GPTQ or AWQ (`--method`; W4A16, group 128) on a synthetic mixture-of-experts model
with Qwen3-30B-A3B layer shapes (hidden 2048, 128 experts, 8 active, moe_intermediate 768, 32 heads /
4 KV heads, head_dim 128; random bf16 weights), a few decoder layers, the whole model on one GPU.
`--family qwen3_5_moe`: Qwen3.5-35B-A3B's shapes instead (Gated DeltaNet and full-attention
blocks, 256 experts plus a shared expert; see QWEN3_5_35B_A3B).

Copied from the project's shared/bench/llmcompressor_moe_gpu_peer.py (the recipe and the model are
the same) so it travels with the repo to the GPU machine; moe_gpu_vs_llmcompressor.py runs it. Added:
- the row records what llm-compressor really did with the experts: `oneshot` linearizes transformers
  5's fused 3-D experts into per-expert Linears (llmcompressor.modeling.moe.linearize_moe) and the
  row counts the expert Linears that carry a quantization scheme and a weight_scale afterwards;
- `all_experts` is the value oneshot used: its `moe_calibrate_all_experts` DEFAULTS TO TRUE in 0.14
  (every token through every expert for statistics), so the shared script's rows, which passed
  nothing, calibrated all experts although they said `"all_experts": false`. `--routed-only` passes
  False (statistics from the routed tokens only, as quantkit's default);
- `--device cpu` and the shape flags, for a dry run of the script on a tiny model without a GPU;
- `--method awq`: its AWQModifier (llmcompressor.modifiers.transform.awq, Qwen3-MoE default
  mappings: input_layernorm -> q/k/v, v -> o, post_attention_layernorm -> router + every
  expert's gate/up, up -> down) then QuantizationModifier W4A16 (RTN on the smoothed weights;
  0.14's AWQ does no clipping). The row lists the mappings it resolved and checks that the
  smoothing really reached the experts: post_attention_layernorm's weight changed, and one
  expert's down_proj columns are scaled against the original fused weight (s of up -> down).

Random weights and random tokens are fine for TIME and MEMORY, not for accuracy.
Prints one RESULT JSON line.
usage: python llmcompressor_moe_gpu_peer.py [--layers 2] [--samples 128] [--seqlen 2048] [--routed-only]
       [--family qwen3_moe|qwen3_5_moe]
"""
import argparse
import inspect
import json
import time

import torch
from llmcompressor_gpu_peer import calibration, stand_in_tokenizer

QWEN3_30B_A3B = {"hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                 "num_experts": 128, "num_experts_per_tok": 8, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 128256}


# Qwen3.5-35B-A3B's text shapes are transformers 5's Qwen3_5MoeTextConfig defaults (hidden 2048,
# 256 experts, 8 active, moe_intermediate 512, one shared expert of 512 with its 1-row gate,
# Gated DeltaNet 16 key / 32 value heads of 128, attention 16 / 2 heads of 256); the vocabulary is
# cut to the stand-in tokenizer's as for Qwen3-30B-A3B. Two layers: one linear-attention block,
# one full-attention block (the model's 3:1 pattern holds both kinds).
QWEN3_5_35B_A3B = {"vocab_size": 128256}
FAMILIES = {"qwen3_moe": QWEN3_30B_A3B, "qwen3_5_moe": QWEN3_5_35B_A3B}
MODEL_NAMES = {"qwen3_moe": "qwen3-30b-a3b-shapes", "qwen3_5_moe": "qwen3.5-35b-a3b-shapes"}


def synthetic_moe(family, n_layers, shape=None, device="cuda"):
    """Random bf16 model of `family`'s real transformers classes with its flagship MoE shapes."""
    if family == "qwen3_5_moe":
        from transformers import Qwen3_5MoeForCausalLM as cls
        from transformers import Qwen3_5MoeTextConfig as config_cls

        extra = {"layer_types": (["linear_attention", "full_attention"] * n_layers)[:n_layers]}
    else:
        from transformers import Qwen3MoeConfig as config_cls
        from transformers import Qwen3MoeForCausalLM as cls

        extra = {}
    cfg = config_cls(**{**FAMILIES[family], **(shape or {})}, num_hidden_layers=n_layers,
                     max_position_embeddings=8192, tie_word_embeddings=False,
                     architectures=[cls.__name__], torch_dtype="bfloat16", **extra)
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(cfg).to(torch.bfloat16)
    where = f"/tmp/synthetic-{family}"
    cfg.save_pretrained(where)
    stand_in_tokenizer().save_pretrained(where)
    model.name_or_path = model.config._name_or_path = where
    return model


def expert_quantization(model) -> dict:
    """What got quantized: expert Linears with a scheme and a weight_scale, the experts modules'
    class, and whether one expert's weight sits on its 4-bit grid (max |w - round(w/s)*s|)."""
    schemed = [n for n, m in model.named_modules() if getattr(m, "quantization_scheme", None) is not None]
    scaled = {n.rsplit(".", 1)[0] for n, _ in model.named_parameters() if n.endswith("weight_scale")}
    experts = [n for n in schemed if ".experts." in n]
    grid_err = None
    for n, m in model.named_modules():
        if ".experts." in n and n in scaled and m.weight.dim() == 2:
            w, s = m.weight.detach().float(), m.weight_scale.detach().float()
            g = w.shape[1] // s.shape[1]
            q = (w.reshape(w.shape[0], -1, g) / s.unsqueeze(-1)).round()
            grid_err = (w.reshape(w.shape[0], -1, g) - q * s.unsqueeze(-1)).abs().max().item()
            break
    return {"quantized_modules": len(schemed), "expert_linears_quantized": len(experts),
            "expert_linears_with_weight_scale": len([n for n in experts if n in scaled]),
            "experts_module_types": sorted({type(m).__name__ for n, m in model.named_modules()
                                            if n.endswith("mlp.experts")}),
            "router_quantized": any(n.endswith("mlp.gate") for n in schemed),
            "linear_attention_linears_quantized": len([n for n in schemed if ".linear_attn." in n
                                                       and n in scaled]),
            "expert_weight_off_grid": grid_err}


def resolved_awq_mappings(modifier_cls, seen: list) -> None:
    """Record (smooth layer, balance Linears, expert balance Linears, parent) of every mapping
    the AWQ modifier resolves (its _resolved_mappings is cleared at finalize)."""
    original = modifier_cls._set_resolved_mappings

    def record(self, model):
        original(self, model)
        for m in self._resolved_mappings:
            seen.append((m.smooth_name, len(m.balance_names),
                         sum(".experts." in n for n in m.balance_names), m.parent_name))
    modifier_cls._set_resolved_mappings = record


def awq_smoothing_reached_experts(model, before: dict, mappings: list) -> dict:
    """Did AWQ smooth the experts? Mapping counts, the norm feeding the experts changed, and
    expert 0's down_proj columns vs the original fused slice (their spread is s of up -> down;
    4-bit rounding alone leaves the per-column ratio median near 1 with a small spread)."""
    norm = model.get_submodule("model.layers.0.post_attention_layernorm").weight.detach().float().cpu()
    down = model.get_submodule("model.layers.0.mlp.experts.0.down_proj").weight.detach().float().cpu()
    ratio = (down.abs().sum(0) / before["down0"].abs().sum(0).clamp(min=1e-12))
    return {"awq_mappings_resolved": len(mappings),
            "awq_expert_mappings": sum(1 for m in mappings if m[2]),
            "awq_expert_balance_linears": sum(m[2] for m in mappings),
            "awq_mappings": sorted({f"{m[0].split('.', 3)[-1] if m[0].startswith('model.layers.') else m[0]}"
                                    f" -> {m[1]} Linears ({m[2]} expert) in {m[3].rsplit('.', 1)[-1]}"
                                    for m in mappings})[:8],
            "awq_post_attention_norm_changed": not torch.equal(norm, before["norm"]),
            "awq_expert0_down_column_scale_min_max": [round(ratio.min().item(), 3),
                                                      round(ratio.max().item(), 3)]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--routed-only", action="store_true",
                   help="oneshot(moe_calibrate_all_experts=False): statistics from routed tokens only")
    p.add_argument("--shape", default="{}", help="JSON overrides of the Qwen3-30B-A3B config (dry runs)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--method", default="gptq", choices=("gptq", "awq"))
    p.add_argument("--family", default="qwen3_moe", choices=tuple(FAMILIES))
    args = p.parse_args()
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    cuda = args.device == "cuda"
    # routers stay dense, as quantkit keeps them (and Qwen3.5's 1-row shared_expert_gate)
    ignore = ["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$"]
    mappings: list = []
    if args.method == "awq":
        from llmcompressor.modifiers.transform.awq import AWQModifier

        resolved_awq_mappings(AWQModifier, mappings)
        recipe = [AWQModifier(), QuantizationModifier(targets="Linear", scheme="W4A16", ignore=ignore)]
    else:
        recipe = GPTQModifier(targets="Linear", scheme="W4A16", ignore=ignore)
    model = synthetic_moe(args.family, args.layers, json.loads(args.shape), args.device)
    layer0 = model.model.layers[0]
    before = {"norm": layer0.post_attention_layernorm.weight.detach().float().cpu().clone(),
              "down0": layer0.mlp.experts.down_proj[0].detach().float().cpu().clone()}
    ds = calibration(args.samples, args.seqlen)
    kw = {"moe_calibrate_all_experts": False} if args.routed_only else {}
    all_experts = kw.get("moe_calibrate_all_experts",
                         inspect.signature(oneshot).parameters["moe_calibrate_all_experts"].default)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    oneshot(model=model, dataset=ds, recipe=recipe, max_seq_length=args.seqlen,
            num_calibration_samples=args.samples, processor=stand_in_tokenizer(), **kw)
    if cuda:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    row = {"peer": "llm-compressor", "method": args.method, "model": MODEL_NAMES[args.family], "layers": args.layers,
           "all_experts": all_experts, "model_device": args.device, "samples": args.samples,
           "seqlen": args.seqlen, "seconds": round(dt, 2), "seconds_per_layer": round(dt / args.layers, 2),
           "projected_48_layers_s": round(dt / args.layers * 48, 1),
           "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else 0.0,
           "gpu": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           **expert_quantization(model)}
    if args.method == "awq":
        row.update(awq_smoothing_reached_experts(model, before, mappings))
    print("RESULT " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
