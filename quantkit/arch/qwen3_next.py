"""Qwen3-Next: carried by discovery (Gated DeltaNet linear attention beside gated full
attention, every block MoE with a shared expert and its one-row gate); GGUF as llama.cpp's
converter writes it, under its qwen3next architecture.

Qwen3.5's dense-tensor transforms apply (quantkit.arch.qwen3_5: ssm_a = -exp(A_log), dt_bias
-> ssm_dt.bias, conv1d squeezed, every RMSNorm + 1 but ssm_norm), and Qwen2-MoE's expert
layout. What differs: Qwen3-Next's fused in_proj_qkvz holds, per key head, that head's
[q, k, v, z] rows; the converter (Qwen3NextModel.modify_tensors) regroups them into attn_qkv
[all q, all k, all v] and attn_gate [all z] (gguf_row_splits), while in_proj_ba stays one
tensor (ssm_ba); value heads are not reordered (that is Qwen3.5's converter), so any
key / value head ratio is written; no MRoPE sections.

Refused (_check): a Qwen3-Next whose top-k routing weights are not renormalised
(norm_topk_prob=false; llama.cpp's qwen3next graph always renormalises) or with dense MLP
blocks (mlp_only_layers, decoder_sparse_step != 1; its loader wants experts in every block).
"""

from __future__ import annotations

import torch

from quantkit.arch.qwen3_5 import GGUF as _QWEN3_5
from quantkit.arch.qwen3_5 import value_transform
from quantkit.errors import UnsupportedArchitecture

_DENSE = _QWEN3_5["qwen3_5_text"]


def _check(config: dict) -> None:
    dense = list(config.get("mlp_only_layers") or [])
    step = config.get("decoder_sparse_step", 1)
    found = []
    if config.get("norm_topk_prob") is False:
        found.append("norm_topk_prob=false (llama.cpp's qwen3next always renormalises the top-k "
                     "routing weights)")
    if dense or step not in (None, 1):
        found.append(f"dense MLP blocks (mlp_only_layers={dense}, decoder_sparse_step={step}; "
                     "llama.cpp's qwen3next loader wants experts in every block)")
    if found:
        raise UnsupportedArchitecture(
            f"Qwen3-Next with {'; '.join(found)} would compute another function in llama.cpp.",
            "Use a safetensors format (compressed-tensors) with quantkit (llama.cpp's "
            "convert_hf_to_gguf.py converts it, silently computing the other function).")


def _qkvz_rows(get) -> tuple[tuple[str, torch.Tensor], ...]:
    """in_proj_qkvz's rows, per key head [q (dk), k (dk), v (r x dv), z (r x dv)] with r value
    heads per key head -> attn_qkv [q of every head, k of every head, v of every head] and
    attn_gate [z of every head]."""
    nk, nv = int(get("linear_num_key_heads")), int(get("linear_num_value_heads"))
    dk, dv = int(get("linear_key_head_dim")), int(get("linear_value_head_dim"))
    sizes = [dk, dk, nv // nk * dv, nv // nk * dv]
    per_head = torch.arange(nk * sum(sizes)).reshape(nk, sum(sizes))
    q, k, v, z = (part.reshape(-1) for part in per_head.split(sizes, dim=1))
    return (("blk.{bid}.attn_qkv", torch.cat((q, k, v))), ("blk.{bid}.attn_gate", z))


GGUF = {
    "qwen3_next": dict(
        gguf_arch="qwen3next", gguf_check=_check, gguf_transform=value_transform,
        gguf_renames=_DENSE["gguf_renames"], gguf_bare=_DENSE["gguf_bare"],
        gguf_row_splits={"linear_attn.in_proj_qkvz": _qkvz_rows},
        gguf_kv=("head_dim_if_set", "gated_deltanet", "expert_count", "expert_used_count",
                 "expert_feed_forward_length", "expert_shared_feed_forward_length")),
}
