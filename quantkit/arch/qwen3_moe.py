"""Qwen3-MoE: the llama block with routed experts; dense blocks (mlp_only_layers) keep the
llama MLP."""

from __future__ import annotations

from quantkit.arch.spec import DENSE_AWQ, DENSE_LINEARS, ArchSpec, ExpertsSpec, moe_awq_groups
from quantkit.errors import UnsupportedArchitecture

EXPERTS = ExpertsSpec()


def _check_llama_cpp_qwen3moe(config: dict) -> None:
    """llama.cpp's qwen3moe graph (src/models/qwen3moe.cpp) makes every block MoE and always
    renormalises the top-k routing weights: other configs would load wrong or run wrong."""
    dense = list(config.get("mlp_only_layers") or [])
    step = config.get("decoder_sparse_step", 1)
    if dense or step not in (None, 1):
        raise UnsupportedArchitecture(
            f"Qwen3-MoE with dense MLP blocks (mlp_only_layers={dense}, decoder_sparse_step={step}) "
            "has no llama.cpp layout: its qwen3moe loader expects experts in every block.",
            "Use --format compressed-tensors for this model.")
    if config.get("norm_topk_prob") is False:
        raise UnsupportedArchitecture(
            "Qwen3-MoE with norm_topk_prob=false: llama.cpp's qwen3moe always renormalises the "
            "top-k routing weights, so the GGUF would compute another function.",
            "Use --format compressed-tensors for this model.")


SPECS = (
    ArchSpec("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), experts=EXPERTS,
             sequential=DENSE_LINEARS + ((EXPERTS.linear("gate"), EXPERTS.linear("up")),
                                         (EXPERTS.linear("down"),)),
             awq_groups=DENSE_AWQ + moe_awq_groups(EXPERTS), attention_v=True,
             gguf_arch="qwen3moe", gguf_attention_bias=False, gguf_check=_check_llama_cpp_qwen3moe,
             gguf_kv=("head_dim_if_set", "expert_count", "expert_used_count",
                      "expert_feed_forward_length")),
)
