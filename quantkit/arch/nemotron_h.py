"""Nemotron-H (hybrid Mamba2 / attention / MoE): carried by discovery; GGUF as llama.cpp's
converter writes it. The converter picks its nemotron_h_moe architecture whenever config.json
carries num_experts_per_tok, which transformers' NemotronHConfig always writes (its
nemotron_h architecture is for configs without it): quantkit writes nemotron_h_moe.

The converter's transforms, which quantkit applies to the same tensors (GGUF names):
ssm_a = -exp(A_log) and ssm_d = D, each as one column (n_heads, 1), bare names without
.weight; dt_bias -> ssm_dt.bias; conv1d squeezed to (channels, kernel); the gated norm
ssm_norm as (n_groups, d_inner / n_groups) (llama.cpp normalises per group); RMSNorms as they
are (x * w); per layer, 0 KV heads and 0 FFN length mark a Mamba2 layer (llama.cpp's
is_recr); q/k rows in llama's rotary order. The experts' up/down (no gate, relu^2) become ffn_up_exps / ffn_down_exps, the
router's e_score_correction_bias ffn_exp_probs_b.

One difference no config avoids: transformers' chunked Mamba2 scan clamps dt below at
time_step_min (its one-token recurrent step does not), llama.cpp's ssm_scan never clamps;
they differ only where softplus(dt + dt_bias) < time_step_min.
"""

from __future__ import annotations

import torch

from quantkit.arch.gguf_names import refuse_gguf

_MAMBA, _ATTN, _MOE = ("mamba", "linear_attention"), ("attention", "full_attention"), ("moe",)


def layer_kinds(config: dict) -> list[str]:
    """Per layer "mamba", "attention" or "moe" (or the config's own word where it is none of
    those), from layers_block_type as transformers 5 writes it."""
    kinds = config.get("layers_block_type") or config.get("layer_types") or []
    return ["mamba" if k in _MAMBA else "attention" if k in _ATTN else k for k in kinds]


def _check(config: dict) -> None:
    """Refuse what llama.cpp's nemotron_h_moe would compute otherwise, or not load."""
    found = []
    kinds = layer_kinds(config)
    if "mlp" in kinds:
        # the converter counts FFN lengths for "moe" layers only when the config has experts:
        # a dense MLP layer gets 0 KV heads and 0 FFN length, which llama.cpp reads as Mamba2
        found.append("dense MLP layers (layers_block_type 'mlp') beside MoE layers")
    if set(kinds) - {"mamba", "attention", "moe", "mlp"}:
        found.append(f"layer types {sorted(set(kinds) - {'mamba', 'attention', 'moe', 'mlp'})}")
    if config.get("mlp_hidden_act", "relu2") != "relu2":
        found.append(f"mlp_hidden_act {config['mlp_hidden_act']!r} (llama.cpp runs relu^2)")
    if config.get("mamba_hidden_act", "silu") != "silu":
        found.append(f"mamba_hidden_act {config['mamba_hidden_act']!r} (llama.cpp runs SiLU)")
    if config.get("use_bias") or config.get("mamba_proj_bias"):
        found.append("Mamba2 in/out projection biases (llama.cpp's ssm_in / ssm_out have none)")
    if config.get("mlp_bias"):
        found.append("MLP biases")
    if config.get("sliding_window"):
        found.append("sliding-window attention")
    if (config.get("n_group") or 1) > 1:
        found.append(f"group-limited routing (n_group {config['n_group']})")
    if (config.get("n_shared_experts") or 0) != 1:
        found.append(f"{config.get('n_shared_experts')} shared experts (llama.cpp reads one)")
    if config.get("moe_latent_size"):
        found.append("latent MoE projections (moe_latent_size)")
    refuse_gguf("Nemotron-H", found)


def mamba2_tensor(gname: str, t: torch.Tensor, n_groups: int) -> torch.Tensor:
    """A Mamba2 mixer's dense tensor as llama.cpp's converter writes it (by its GGUF name):
    ssm_a = -exp(A_log) and ssm_d = D as one column, conv1d squeezed, the gated norm as
    (n_groups, d_inner / n_groups); other tensors as they are (Granite 4 hybrid's too)."""
    base = gname.removesuffix(".weight").rpartition(".")[2]
    if base == "ssm_a":
        return (-torch.exp(t.float())).reshape(-1, 1)
    if base == "ssm_d":
        return t.reshape(-1, 1)
    if base == "ssm_conv1d":
        return t.squeeze()
    if base == "ssm_norm":
        return t.reshape(n_groups, -1)
    return t


def gguf_transform(gname: str, t: torch.Tensor, config: dict) -> torch.Tensor:
    """A dense tensor as the converter writes it (by its GGUF name)."""
    return mamba2_tensor(gname, t, int(config["n_groups"]))


GGUF = {
    # the converter's Nemotron-H is its GraniteHybrid, a llama: q/k rows permuted for llama's
    # rotary layout (an attention without RoPE computes the same with them permuted alike)
    "nemotron_h": dict(gguf_arch="nemotron_h_moe", gguf_check=_check, gguf_permute_qk=True,
                       gguf_transform=gguf_transform, gguf_bare=("ssm_a", "ssm_d"),
                       gguf_renames=(("mixer.dt_bias", "mixer.dt_proj.bias"),
                                     ("gate.e_score_correction_bias", "gate.e_score_correction.bias"),
                                     ("mixer.experts.", "mlp.experts.")),
                       gguf_kv=("nemotron_h",)),
}
