"""Mixtral: llama attention, every block MoE.

transformers 5 names the MoE block `mlp` (router mlp.gate, fused experts mlp.experts); its
checkpoints, save_pretrained and vLLM say block_sparse_moe, and the experts' Linears are w1
(gate), w3 (up), w2 (down), of intermediate_size. llama.cpp's converter writes it as arch
llama (q/k permuted) with 3-D experts.
"""

from __future__ import annotations

from quantkit.arch.llama import LLAMA_CPP_LLAMA
from quantkit.arch.spec import (
    DENSE_AWQ,
    DENSE_LINEARS,
    DENSE_ROLES,
    ArchSpec,
    ExpertsSpec,
    moe_awq_groups,
)

EXPERTS = ExpertsSpec(count_keys=("num_local_experts",), gate="w1", up="w3", down="w2")

SPECS = (
    ArchSpec("mixtral", ("MixtralForCausalLM",), ("mixtral",), experts=EXPERTS,
             sequential=DENSE_LINEARS[:2] + ((EXPERTS.linear("gate"), EXPERTS.linear("up")),
                                             (EXPERTS.linear("down"),)),
             awq_groups=DENSE_AWQ[:2] + moe_awq_groups(EXPERTS),
             roles={k: v for k, v in DENSE_ROLES.items() if k.startswith("attn")},
             checkpoint_renames=((".mlp.", ".block_sparse_moe."),), attention_v=True,
             **LLAMA_CPP_LLAMA,
             gguf_kv=("vocab_size", "rope_dimension_count", "head_dim_if_set", "expert_count",
                      "expert_used_count")),
)
