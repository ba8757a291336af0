"""Gemma 3 (text): q/k norms, and norms after attention and after the MLP (on their outputs,
before the residual add), so the MLP's input norm is pre_feedforward_layernorm, not
post_attention_layernorm as in llama; RMSNorms compute x * (1 + w)."""

from __future__ import annotations

from quantkit.arch.spec import DENSE_AWQ, ArchSpec, AwqGroup

SPECS = (
    ArchSpec("gemma3_text", ("Gemma3ForCausalLM",), ("gemma3_text",), norm_offset=1.0,
             awq_groups=DENSE_AWQ[:2] + (
                 AwqGroup("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
                 DENSE_AWQ[3]),
             gguf_arch="gemma3", gguf_swa_pattern=6,  # llama.cpp: every 6th layer global
             gguf_kv=("head_dim", "rope_freq_base_swa", "sliding_window",
                      "final_logit_softcapping")),
)
