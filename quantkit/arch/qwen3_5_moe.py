"""Qwen3.5-MoE (text): carried by discovery (Qwen3.5's Gated DeltaNet / gated attention blocks,
every block MoE: routed experts, a shared expert and its one-row sigmoid gate); GGUF as
llama.cpp's converter writes it, under its qwen35moe architecture.

Beyond Qwen3.5's transforms (quantkit.arch.qwen3_5): the experts stacked into 3-D
ffn_{gate,up,down}_exps, the router ffn_gate_inp and the shared-expert gate ffn_gate_inp_shexp
in F32, the shared expert as ffn_*_shexp, and the expert widths as keys. transformers'
Qwen3_5MoeTopKRouter always renormalises the top-k softmax weights, and llama.cpp's qwen35moe
graph always does too (build_moe_ffn(..., norm_w=true, ..., SOFTMAX)): no config variant of the
routing to refuse. The converter's value-head reorder (more value than key heads) is Qwen3.5's
(its gguf_order, inherited here).
"""

from __future__ import annotations

from quantkit.arch.qwen3_5 import GGUF as _QWEN3_5

_DENSE = _QWEN3_5["qwen3_5_text"]

GGUF = {
    "qwen3_5_moe_text": dict(
        _DENSE, gguf_arch="qwen35moe",
        gguf_kv=(*_DENSE["gguf_kv"], "expert_count", "expert_used_count",
                 "expert_feed_forward_length", "expert_shared_feed_forward_length")),
}
