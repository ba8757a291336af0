"""MiniMax-M2: carried by discovery (full-width q/k norms, partial RoPE, every block MoE with a
sigmoid router and a score-correction bias); GGUF as llama.cpp's converter writes it, under its
minimax-m2 architecture.

The converter names the router's e_score_correction_bias e_score_correction.bias before its
TensorNameMap lookup (ffn_exp_probs_b.bias), stacks the experts (w1/w3/w2 -> 3-D
ffn_{gate,up,down}_exps), and writes the experts' width (intermediate_size) as
expert_feed_forward_length and rotary_dim as the RoPE width.

Routing: transformers' MiniMaxM2TopKRouter always scores with a sigmoid (top-k on sigmoid +
bias, weights renormalised); llama.cpp's minimax-m2 graph renormalises always and takes the
scoring function from {arch}.expert_gating_func, which the converter writes only from a
config's scoring_func (MiniMax's checkpoints carry "sigmoid"; transformers' config class has no
such field). quantkit writes sigmoid, what transformers computes, whatever the config says: a
file without the key aborts llama.cpp's graph (gating NONE), and a "softmax" would route
otherwise.
"""

from __future__ import annotations

GGUF = {
    "minimax_m2": dict(gguf_arch="minimax-m2",
                       gguf_renames=(("e_score_correction_bias", "e_score_correction.bias"),),
                       gguf_kv=("head_dim_if_set", "expert_count", "expert_used_count",
                                "expert_gating_sigmoid", "expert_feed_forward_length_intermediate",
                                "rotary_dim")),
}
