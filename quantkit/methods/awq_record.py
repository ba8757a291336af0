"""The awq method's record parts (quantkit.methods.awq registers it): its flags' rules, its
request, and its memory terms for `quantkit plan` (what its scale search holds at once)."""

from __future__ import annotations

from quantkit.errors import QuantkitError
from quantkit.methods.options import FlagValues, MethodRequest, int_scheme, parse_size
from quantkit.types import PlanFacts

__all__ = ["awq_request", "check_awq_flags", "search_bytes", "expert_down_inputs",
           "expert_gate_up_inputs"]


def awq_request(v: FlagValues, options: dict) -> MethodRequest:
    if v["fmt"] == "modelopt":  # TensorRT-LLM reads pre_quant_scale (GQA o_proj)
        options["pre_quant_scale"] = True
    if v["awq_expert_inputs"] is not None:
        options["expert_input_bytes"] = parse_size(v["awq_expert_inputs"], "--awq-expert-inputs")
    return int_scheme(v, options, activations="fp8" if v["fp8_scheme"] == "w4a8" else None)


def check_awq_flags(v: FlagValues) -> None:
    scheme, fmt = v["fp8_scheme"], v["fmt"]
    if scheme not in (None, "w4a16", "w4a8"):
        raise QuantkitError(f"Unknown AWQ scheme {scheme!r}.",
                            "Choose w4a16 (default) or w4a8 (FP8 inputs, --format modelopt).")
    if scheme == "w4a8" and fmt != "modelopt":
        raise QuantkitError(
            f"--scheme w4a8 (int4 weights, FP8 inputs) is written only as ModelOpt W4A8_AWQ for "
            f"TensorRT-LLM; --format {fmt} has no FP8 input scales.",
            "Pass --format modelopt, or drop --scheme w4a8.")


def expert_down_inputs(search: int, experts: int, top_k: int, width: int, act_bytes: int,
                       all_experts: bool, budget: int) -> int:
    """Bytes of the experts' down_proj search inputs AWQ holds at once (quantkit.methods.awq):
    all of them where they fit `budget` (AWQQuantizer's expert_input_bytes), else one chunk
    of experts. An expert reads every search token with all experts calibrated, top_k /
    experts of them routed."""
    per_expert = search * (1 if all_experts else top_k / max(1, experts)) * width * act_bytes
    if per_expert * experts <= budget:
        return int(per_expert * experts)
    return int(max(1, budget // per_expert) * per_expert)


def expert_gate_up_inputs(search: int, experts: int, top_k: int, hidden: int, act_bytes: int,
                          all_experts: bool, budget: int) -> tuple[int, bool]:
    """(bytes, chunked) of the routed experts' gate/up search inputs AWQ holds at once: each
    expert its own routed rows (top_k per search token in all), in the one-pass capture where
    they fit `budget`, else replayed one chunk of experts at a time for their clip after the
    fold (chunked). With all experts calibrated they read one shared hidden-wide tensor,
    counted with the block's other inputs: 0."""
    if all_experts:
        return 0, False
    total = search * top_k * hidden * act_bytes
    if total <= budget:
        return int(total), False
    per_expert = total / max(1, experts)
    return int(max(1, budget // per_expert) * per_expert), True


def search_bytes(f: PlanFacts, search_tokens: dict[str, int], default_budget: int) -> int:
    """The scale search holds every Linear's input over its search tokens (q/k/v, o, gate/up:
    hidden wide; down: intermediate), the attention and MLP outputs, x / s copies of the
    norm-fed inputs, and fp32 copies of one group's weights (measured on the H100: 13.7 GiB
    for Llama-3.1-8B shapes, 9.1 GiB for 3.2-3B)."""
    budget = f.expert_input_bytes or default_budget
    search = min(f.tokens, search_tokens["accel" if f.cuda else "cpu"])
    down = search * f.inter * f.act_bytes  # a dense block's down_proj input
    group_weights = 2 * f.block_params * 4
    if f.moe:
        # the experts' down_proj inputs: at most one chunk of them at a time (all experts
        # calibrated, Qwen3-30B-A3B shapes: 10 of 128 experts x 65536 x 768 x 2 B = 0.94 GiB
        # instead of all 12 GiB;
        # benchmarks/results/moe_awq_2_layers_h100_chunked_vs_llmcompressor.json)
        spec, config = f.spec, f.config
        n_exp = spec.experts.count(config)
        top_k = int(getattr(config, "num_experts_per_tok", 1) or 1)
        widest = max(f.linears, key=len, default={})
        expert_inter = max((k for name, (_, k) in widest.items()
                            if spec.is_expert_linear(name) and k != f.hidden), default=f.inter)
        dense_blocks = any(not any(spec.is_expert_linear(n) for n in lin) for lin in f.linears)
        down = max(down if dense_blocks else 0, expert_down_inputs(
            search, n_exp, top_k, expert_inter, f.act_bytes, f.moe_all_experts, budget))
        # routed gate/up: in the capture beside the rest, or (chunked) one chunk after
        # the fold, when the search's fp32 group weights are gone
        gate_up, chunked = expert_gate_up_inputs(
            search, n_exp, top_k, f.hidden, f.act_bytes, f.moe_all_experts, budget)
        if chunked:
            group_weights = max(group_weights, gate_up)
        else:
            down += gate_up
    return search * 7 * f.hidden * f.act_bytes + down + group_weights
