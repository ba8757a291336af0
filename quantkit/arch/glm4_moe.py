"""GLM-4.5 / 4.6 (`Glm4MoeForCausalLM`): carried by discovery (partial RoPE, first
first_k_dense_replace blocks dense, then routed experts beside a shared expert, a sigmoid router
with a score-correction bias); GGUF as llama.cpp's converter (Glm4MoeModel) writes it, under its
glm4moe architecture.

The converter stacks the per-expert Linears into 3-D ffn_{gate,up,down}_exps, names the
router's e_score_correction_bias e_score_correction.bias before its TensorNameMap lookup
(exp_probs_b.bias), writes the routed-expert width, shared-expert count, leading dense blocks,
sigmoid gating, routed scaling factor and top-k renormalisation as keys, and keeps q/k rows as
they are (GLM's RoPE is already NeoX-ordered). Its MTP block(s) `model.layers.{N + i}.*`
(num_nextn_predict_layers) go in as extra blocks: the decoder tensors under their usual names,
eh_proj / enorm / hnorm / embed_tokens / shared_head as blk.{N + i}.nextn.*, block_count and
glm4moe.nextn_predict_layers counting them (whether or not the checkpoint holds them: llama.cpp
then loads the trunk alone).

Vocabulary: the converter's GLM path (_set_vocab_glm) sets bos = [gMASK], eot = <|user|>,
unk = <|endoftext|>, eom = <|observation|> by their text, each where tokenizer_config.json
did not set that kind; a tokenizer without them is refused, as the converter fails on it.
"""

from __future__ import annotations

GGUF = {
    "glm4_moe": dict(
        gguf_arch="glm4moe",
        gguf_renames=(("e_score_correction_bias", "e_score_correction.bias"),),
        gguf_kv=("head_dim_if_set", "expert_count", "expert_used_count", "expert_groups",
                 "rope_dimension_count", "expert_feed_forward_length", "expert_shared_glm",
                 "leading_dense_block_count", "expert_gating_sigmoid", "nextn_if_set"),
        gguf_nextn_key="num_nextn_predict_layers",
        gguf_special_tokens=(("bos", "[gMASK]"), ("eot", "<|user|>"), ("unk", "<|endoftext|>"),
                             ("eom", "<|observation|>"))),
}
