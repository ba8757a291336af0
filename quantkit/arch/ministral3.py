"""Ministral 3 (text): carried by discovery (the llama block); GGUF as llama.cpp's converter
writes it, under its mistral3 architecture: the llama arch's q/k row permutation, YaRN RoPE,
and Llama-4-style attention temperature scaling (rope_parameters' llama_4_scaling_beta)."""

from __future__ import annotations

GGUF = {
    "ministral3": dict(gguf_arch="mistral3", gguf_permute_qk=True,
                       gguf_kv=("vocab_size", "rope_dimension_count", "head_dim_if_set",
                                "yarn_log_mul_mscale", "attn_temperature_scale")),
}
