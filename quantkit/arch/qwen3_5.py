"""Qwen3.5 (dense, text): carried by discovery (Gated DeltaNet `linear_attn` beside gated full
attention); GGUF as llama.cpp's converter writes it, under its qwen35 architecture.

The converter's transforms, which quantkit applies to the same tensors (GGUF names):
ssm_a = -exp(A_log) (bare name, no .weight), dt_bias -> ssm_dt.bias, conv1d squeezed to
(channels, kernel), every RMSNorm + 1 (Qwen3.5's norms compute x * (1 + w)) except the
gated linear-attention norm ssm_norm (x * w); the SSM sizes, recurrent-layer list and
interleaved-MRoPE sections as keys. MTP layers are refused by the writer (its MTP check).

With more value heads than key heads the converter also reorders the value heads from
grouped by key head [K0: v0..v(r-1), K1: ...] to tiled [v0 of K0, K1, ..., v1 of K0, ...]
(ggml then broadcasts the key heads with a plain repeat): the V rows of attn_qkv and of the
conv1d channels, the rows of attn_gate, ssm_beta and ssm_alpha, the ssm_a and ssm_dt entries,
and ssm_out's columns. `gguf_order` says that permutation per GGUF tensor; the writer applies
it to dense tensors and the GGUF quantizer to each Linear before it is rounded (a column
permutation does not commute with K-quant blocks), so both equal the converter's file. (A
value-head count that is no multiple of the key heads is refused before that: transformers'
own Gated DeltaNet cannot broadcast it, so discovery cannot trace the model.)
"""

from __future__ import annotations

import torch


def _tiled(n_k: int, per_k: int, width: int) -> torch.Tensor:
    """Index of the tiled order: position i of the converter's tensor holds grouped entry
    idx[i] (value heads of `width` entries each, `per_k` of them per key head)."""
    return torch.arange(n_k * per_k * width).reshape(n_k, per_k, width).transpose(0, 1).reshape(-1)


# GGUF base name -> (axis, whether the key channels q, k come first, width of one value head:
# "v" = linear_value_head_dim, 1 = one entry per head)
_REORDERED = {"attn_qkv": (0, True, "v"), "ssm_conv1d": (0, True, "v"), "attn_gate": (0, False, "v"),
              "ssm_beta": (0, False, 1), "ssm_alpha": (0, False, 1), "ssm_a": (0, False, 1),
              "ssm_dt": (0, False, 1), "ssm_out": (1, False, "v")}


def gguf_order(gname: str, config: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(row index, column index) that turn the checkpoint's tensor into the converter's
    (t[rows][:, cols]), None where an axis stays: the value-head reorder, when a config has
    more value heads than key heads; (None, None) for every other tensor."""
    n_k, n_v = config.get("linear_num_key_heads") or 0, config.get("linear_num_value_heads") or 0
    base = gname.removesuffix(".weight").removesuffix(".bias").rpartition(".")[2]
    if not n_k or not n_v or n_k == n_v or base not in _REORDERED:
        return None, None
    axis, qk_first, width = _REORDERED[base]
    idx = _tiled(n_k, n_v // n_k, int(config["linear_value_head_dim"]) if width == "v" else 1)
    if qk_first:  # q and k channels (key heads x key head size each) stay where they are
        qk = 2 * n_k * int(config["linear_key_head_dim"])
        idx = torch.cat((torch.arange(qk), qk + idx))
    return (idx, None) if axis == 0 else (None, idx)


def value_transform(gname: str, t: torch.Tensor, config: dict) -> torch.Tensor:
    """A dense tensor's values as the converter writes them, in the checkpoint's order (what
    Qwen3-Next's converter shares with Qwen3.5's)."""
    base = gname.removesuffix(".weight").rpartition(".")[2]
    if base == "ssm_a":
        return -torch.exp(t.float())
    if base == "ssm_conv1d":
        return t.squeeze()
    if gname.endswith("norm.weight") and base != "ssm_norm":
        return t.float() + 1.0
    return t


def gguf_transform(gname: str, t: torch.Tensor, config: dict) -> torch.Tensor:
    """A dense tensor as Qwen3.5's converter writes it: value heads reordered, then its values."""
    rows, cols = gguf_order(gname, config)
    if rows is not None:
        t = t.index_select(0, rows)
    if cols is not None:
        t = t.index_select(1, cols)
    return value_transform(gname, t, config)


GGUF = {
    "qwen3_5_text": dict(gguf_arch="qwen35", gguf_transform=gguf_transform,
                         gguf_order=gguf_order,
                         gguf_renames=(("linear_attn.dt_bias", "linear_attn.dt_proj.bias"),),
                         gguf_bare=("ssm_a",),
                         gguf_kv=("head_dim_if_set", "gated_deltanet", "mrope_sections")),
}
