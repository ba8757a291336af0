"""Qwen3.5 (dense, text): carried by discovery (Gated DeltaNet `linear_attn` beside gated full
attention); GGUF as llama.cpp's converter writes it, under its qwen35 architecture.

The converter's transforms, which quantkit applies to the same tensors (GGUF names):
ssm_a = -exp(A_log) (bare name, no .weight), dt_bias -> ssm_dt.bias, conv1d squeezed to
(channels, kernel), every RMSNorm + 1 (Qwen3.5's norms compute x * (1 + w)) except the
gated linear-attention norm ssm_norm (x * w); the SSM sizes, recurrent-layer list and
interleaved-MRoPE sections as keys. MTP layers are refused by the writer (its MTP check).
"""

from __future__ import annotations

import torch

from quantkit.errors import UnsupportedArchitecture


def _check(config: dict) -> None:
    """The converter reorders value heads (grouped -> tiled) when key and value head counts
    differ, out_proj's columns included: a column permutation that must come before K-quant
    rounding, which quantkit does not do yet."""
    k, v = config.get("linear_num_key_heads"), config.get("linear_num_value_heads")
    if k and v and k != v:
        raise UnsupportedArchitecture(
            f"quantkit's GGUF writer does not write Qwen3.5 linear attention with "
            f"{k} key heads and {v} value heads yet (llama.cpp's converter reorders the value "
            "heads, out_proj's columns included).",
            "Use llama.cpp's convert_hf_to_gguf.py for this checkpoint, or a safetensors "
            "format (compressed-tensors) with quantkit.")


def gguf_transform(gname: str, t: torch.Tensor, config: dict) -> torch.Tensor:
    """A dense tensor as the converter writes it (by its GGUF name)."""
    base = gname.removesuffix(".weight").rpartition(".")[2]
    if base == "ssm_a":
        return -torch.exp(t.float())
    if base == "ssm_conv1d":
        return t.squeeze()
    if gname.endswith("norm.weight") and base != "ssm_norm":
        return t.float() + 1.0
    return t


GGUF = {
    "qwen3_5_text": dict(gguf_arch="qwen35", gguf_check=_check, gguf_transform=gguf_transform,
                         gguf_renames=(("linear_attn.dt_bias", "linear_attn.dt_proj.bias"),),
                         gguf_bare=("ssm_a",),
                         gguf_kv=("head_dim_if_set", "gated_deltanet", "mrope_sections")),
}
