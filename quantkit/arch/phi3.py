"""Phi-3: one fused Linear for q/k/v and one for gate/up (gate rows first); llama.cpp keeps
them fused (attn_qkv, ffn_up)."""

from __future__ import annotations

from quantkit.arch.spec import ArchSpec, AwqGroup

SPECS = (
    ArchSpec("phi3", ("Phi3ForCausalLM",), ("phi3",),
             sequential=(("self_attn.qkv_proj",), ("self_attn.o_proj",), ("mlp.gate_up_proj",),
                         ("mlp.down_proj",)),
             # v rows -> o_proj is no AWQ pair (the fused qkv_proj's last rows are v only
             # without grouped-query attention), as in AutoAWQ's Phi-3 table
             awq_groups=(
                 AwqGroup("input_layernorm", ("self_attn.qkv_proj",), "self_attn"),
                 AwqGroup("post_attention_layernorm", ("mlp.gate_up_proj",), "mlp"),
                 AwqGroup("mlp.gate_up_proj", ("mlp.down_proj",), "mlp.down_proj",
                          prev_tail=True)),
             roles={"attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
                    "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"},
             gguf_arch="phi3",
             gguf_kv=("rope_scaling_original_context", "rope_dimension_count",
                      "sliding_window_or_0")),
)
