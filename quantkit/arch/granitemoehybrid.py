"""Granite 4 hybrid (GraniteMoeHybrid: Mamba2 or attention, then MoE with a shared expert, in
every layer): carried by discovery; GGUF as llama.cpp's converter writes it, under its
granitehybrid architecture.

The converter's transforms, which quantkit applies to the same tensors (GGUF names):
ssm_a = -exp(A_log) and ssm_d = D, each as one column (n_heads, 1), bare names without
.weight; dt_bias -> ssm_dt.bias; conv1d squeezed to (channels, kernel); the gated norm
ssm_norm as (n_groups, d_inner / n_groups); q/k rows in llama's rotary order; the routed
experts' fused input_linear cut into ffn_gate_exps / ffn_up_exps, the shared expert's fused
input_linear into ffn_gate_shexp / ffn_up_shexp (rows: gate first); Granite's embedding,
attention, residual and logit multipliers as keys; per layer 0 KV heads marks a Mamba2 layer.

The converter reads layer_types "mamba" / "attention" (the spelling of Granite 4's own
config.json); transformers 5 saves them as "linear_attention" / "full_attention", which the
converter (llama-cpp-python 0.3.36) takes for no attention layer at all: it then writes 0 KV
heads everywhere, and llama.cpp reads the attention layers as Mamba2 layers without their
tensors. quantkit reads both spellings.
"""

from __future__ import annotations

import torch

from quantkit.arch.gguf_names import refuse_gguf
from quantkit.arch.nemotron_h import mamba2_tensor

ATTENTION = ("attention", "full_attention")


def _check(config: dict) -> None:
    """Refuse what llama.cpp's granitehybrid would compute otherwise, or that the tests have
    not compared with the converter."""
    found = []
    kinds = config.get("layer_types") or []
    mamba = [k for k in kinds if k not in ATTENTION]
    if mamba and config.get("position_embedding_type") == "rope":
        # the converter writes rope.scaling.finetuned false whenever there are Mamba2 layers,
        # and llama.cpp's granitehybrid then rotates nothing
        found.append("RoPE in the attention layers (position_embedding_type 'rope')")
    if not mamba:
        found.append("no Mamba2 layer (the converter writes it as granite / granitemoe)")
    if set(kinds) - set(ATTENTION) - {"mamba", "linear_attention"}:
        found.append(f"layer types {sorted(set(kinds) - set(ATTENTION) - {'mamba', 'linear_attention'})}")
    if config.get("hidden_act", "silu") != "silu":
        found.append(f"hidden_act {config['hidden_act']!r} (llama.cpp runs SiLU)")
    if int(config.get("mamba_expand") or 2) != 2:
        found.append(f"mamba_expand {config['mamba_expand']} (llama.cpp's loader asserts 2)")
    if config.get("mamba_proj_bias"):
        found.append("Mamba2 in/out projection biases (llama.cpp's ssm_in / ssm_out have none)")
    # config.json spells inf as {"__float__": "Infinity"} (transformers decodes it on load)
    limit = [float(v["__float__"]) if isinstance(v, dict) else float(v)
             for v in config.get("time_step_limit") or (0.0, float("inf"))]
    if limit != [0.0, float("inf")]:
        found.append(f"time_step_limit {limit} (llama.cpp's ssm_scan clamps nothing)")
    if not config.get("num_local_experts"):
        found.append("a dense MLP in place of the experts")
    if not config.get("shared_intermediate_size"):
        found.append("no shared expert")
    refuse_gguf("Granite 4 hybrid", found)


def gguf_transform(gname: str, t: torch.Tensor, config: dict) -> torch.Tensor:
    """A dense tensor as the converter writes it (by its GGUF name): Nemotron-H's Mamba2 rule."""
    return mamba2_tensor(gname, t, int(config["mamba_n_groups"]))


_SHARED_IN = "shared_mlp.input_linear"


def _shared_in_rows(get) -> tuple[tuple[str, torch.Tensor], ...]:
    """The fused shared-expert input_linear [gate rows; up rows] -> ffn_gate_shexp, ffn_up_shexp
    (the converter's cut in half)."""
    rows = int(get("shared_intermediate_size"))
    return (("blk.{bid}.ffn_gate_shexp", torch.arange(rows)),
            ("blk.{bid}.ffn_up_shexp", torch.arange(rows, 2 * rows)))
GGUF = {
    "granitemoehybrid": dict(
        gguf_arch="granitehybrid", gguf_check=_check, gguf_transform=gguf_transform,
        gguf_permute_qk=True, gguf_bare=("ssm_a", "ssm_d"),
        gguf_renames=(("mamba.dt_bias", "mamba.dt_proj.bias"),
                      ("block_sparse_moe.experts.", "mlp.experts.")),
        gguf_row_splits={_SHARED_IN: _shared_in_rows},
        gguf_kv=("vocab_size", "rope_dimension_count", "granite_hybrid")),
}
