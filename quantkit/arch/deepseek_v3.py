"""DeepSeek-V3: multi-head latent attention (MLA) and, after the first_k_dense_replace dense
blocks, routed experts beside one always-on shared expert.

Blocks of both kinds share the table: a row names what either kind holds, absent names are
skipped. q_proj replaces q_a_proj / q_a_layernorm / q_b_proj where q_lora_rank is None
(DeepSeek-V2-Lite). GGUF: llama.cpp's deepseek2, kv_b_proj split per head into attn_k_b /
attn_v_b.
"""

from __future__ import annotations

from quantkit.arch.spec import DENSE_AWQ, ArchSpec, AwqGroup, ExpertsSpec

EXPERTS = ExpertsSpec(count_keys=("n_routed_experts", "num_local_experts"))
_SHARED = "mlp.shared_experts"

# in the order the attention runs them (quantkit.pipeline.staged pauses the forward at each
# group): kv_a_proj_with_mqa reads the same input as q_a_proj but runs after q_b_proj
_LINEARS = (
    ("self_attn.q_a_proj", "self_attn.q_proj"),
    ("self_attn.q_b_proj",),   # reads q_a_layernorm(q_a_proj(x))
    ("self_attn.kv_a_proj_with_mqa",),
    ("self_attn.kv_b_proj",),  # reads kv_a_layernorm(the latent part of kv_a_proj_with_mqa(x))
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),  # the dense blocks
    ("mlp.down_proj",),
    (EXPERTS.linear("gate"), EXPERTS.linear("up"), f"{_SHARED}.gate_proj", f"{_SHARED}.up_proj"),
    (EXPERTS.linear("down"), f"{_SHARED}.down_proj"),
)

# the shared expert reads the norm's output as every routed expert does: one scale for all
# (its statistics see every token once, the routed ones top_k times: the mean is the same)
_AWQ = (
    AwqGroup("input_layernorm", ("self_attn.q_a_proj", "self_attn.q_proj",
                                 "self_attn.kv_a_proj_with_mqa"), "self_attn"),
    AwqGroup("self_attn.q_a_layernorm", ("self_attn.q_b_proj",), "self_attn.q_b_proj"),
    AwqGroup("self_attn.kv_a_layernorm", ("self_attn.kv_b_proj",), "self_attn.kv_b_proj"),
    *DENSE_AWQ[2:],
    AwqGroup("post_attention_layernorm", (EXPERTS.linear("gate"), EXPERTS.linear("up"),
                                          f"{_SHARED}.gate_proj", f"{_SHARED}.up_proj"),
             "mlp", compensate=(EXPERTS.router,)),
    AwqGroup(EXPERTS.linear("up"), (EXPERTS.linear("down"),), EXPERTS.linear("down")),
    AwqGroup(f"{_SHARED}.up_proj", (f"{_SHARED}.down_proj",), f"{_SHARED}.down_proj"),
)

SPECS = (
    ArchSpec("deepseek_v3", ("DeepseekV3ForCausalLM",), ("deepseek_v3",), experts=EXPERTS,
             sequential=_LINEARS, awq_groups=_AWQ,
             roles={"ffn_down": "mlp.down_proj", "attn_output": "self_attn.o_proj"},
             kv_cache_gap="vLLM's MLA caches the compressed latent (kv_a_proj's output), not the "
                          "per-head keys and values transformers computes, so their k/v scales "
                          "would describe other tensors",
             gguf_arch="deepseek2",
             gguf_kv=("mla", "expert_count", "expert_used_count", "expert_groups",
                      "leading_dense_block_count", "vocab_size", "expert_feed_forward_length",
                      "expert_shared", "expert_gating_sigmoid", "yarn_log_mul"),
             # the converter (DeepseekV2Model.modify_tensors) names the router's
             # score-correction bias e_score_correction.bias before its TensorNameMap lookup
             gguf_renames=(("e_score_correction_bias", "e_score_correction.bias"),),
             # the converter's DeepseekV2Model (skip_mtp) leaves the blocks past
             # num_hidden_layers out, and llama.cpp's deepseek2 reads no nextn block
             gguf_no_mtp="llama.cpp's converter drops DeepSeek-V3's MTP block (its "
                         "DeepseekV2Model skips the blocks past num_hidden_layers) and its "
                         "deepseek2 architecture reads none",
             gguf_head_splits={"self_attn.kv_b_proj": (
                 ("blk.{bid}.attn_k_b", "qk_nope_head_dim", True),
                 ("blk.{bid}.attn_v_b", "v_head_dim", False))}),
)
