"""Which GGML type each tensor of a GGUF file gets: llama.cpp's `llama_tensor_get_type`.

The type mix of a preset (Q4_K_M, Q5_K_M, ...) is a data table, `catalogue.PRESETS`, read by
`plan_types`, which mirrors llama.cpp's `llama_tensor_get_type` for dense decoder models:

  output.weight (and token_embd when tied) -> Q6_K, or Q8_0 when the row width is not a
                                               multiple of the preset's block (Q8_0 stays Q8_0)
  attn_v / ffn_down / attn_output           -> the preset's rule (e.g. Q6_K where
                                               use_more_bits(i, n), counted in llama.cpp's
                                               tensor order: layer, then name); Q4_0/Q5_0
                                               with an imatrix: Q4_1/Q5_1 early ffn_down;
                                               IQ4_NL/IQ4_XS: attn_v Q5_K with >= 4 query
                                               heads per KV head, without an imatrix the
                                               first eighth of ffn_down Q5_K
  IQ3_S                                     -> attn_v Q4_K with >= 4 query heads per KV head
  IQ3_XXS                                   -> output Q5_K, untied token_embd IQ3_S,
                                               attn_q/attn_k IQ2_S, attn_output IQ3_S,
                                               attn_v Q4_K with >= 4 query heads per KV
                                               head, else IQ3_S without an imatrix;
                                               without one ffn_down Q4_K (first eighth) /
                                               Q3_K, and llama.cpp refuses the file (its
                                               IQ3_XXS and IQ2_S tensors need an imatrix)
  IQ3_XS (base IQ3_S)                       -> attn_v Q4_K with >= 4 query heads per KV head,
                                               attn_q/attn_k and the middle 3/4 of the
                                               ffn_gate/ffn_up layers IQ3_XXS (so it needs an
                                               imatrix)
  IQ3_M (base IQ3_S)                        -> attn_v Q4_K, attn_output Q4_K, the first
                                               eighth of ffn_down Q4_K (8 experts: and
                                               use_more_bits layers)
  IQ2_XXS / IQ2_XS (base IQ2_XXS / IQ2_XS)  -> output Q5_K, untied token_embd Q2_K, attn_v
  IQ2_S / IQ2_M (base IQ2_XS / IQ2_S)          Q4_K with >= 4 query heads per KV head or >= 4
                                               experts, else Q2_K (IQ2_S/M: IQ3_S); the first
                                               eighth of ffn_down (counted in tensor order)
                                               Q2_K (IQ2_S/M: IQ3_S); IQ2_S/M: untied
                                               token_embd and attn_output IQ3_S; 8 experts:
                                               attn_k Q4_K, attn_output Q5_K, no Q8_0 attn_v;
                                               all four need an imatrix
  IQ1_S / IQ1_M (base IQ1_S / IQ1_M)        -> as IQ2_XXS, and attn_output IQ2_XXS; need an
                                               imatrix
  Q2_K_S (base Q2_K)                        -> attn_v Q4_K with >= 4 query heads per KV head,
                                               the first eighth of ffn_down Q4_K; its Q2_K
                                               tensors need an imatrix
  everything else                           -> the preset's base type
  row width % block != 0                    -> Q2_K/Q3_K->Q4_0, Q4_K->Q5_0, Q5_K->Q5_1,
                                               Q6_K->Q8_0, IQ4_XS/IQ3_*/IQ2_*/IQ1_*->IQ4_NL,
                                               then F16
  mixture of experts                        -> ffn_down(_exps) by the layer in its name;
                                               exactly 8 experts: attn_v, attn_k Q8_0 and
                                               attn_output by attn_output_8_experts
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gguf import GGMLQuantizationType

from quantkit.ggml.catalogue import FALLBACK, PRESETS, Preset, Rule, block_size

__all__ = ["TensorPlan", "plan_types", "layer_of", "NEVER_QUANTIZED", "TOKEN_EMBD"]

Q = GGMLQuantizationType



@dataclass(frozen=True)
class TensorPlan:
    qtype: Q  # what is written
    wanted: Q  # what the recipe asked for before the row-width fallback

    @property
    def note(self) -> str | None:
        if self.qtype == self.wanted:
            return None




def layer_of(name: str) -> int:
    """The block number of a GGUF tensor name ("blk.3.ffn_down.weight" -> 3), -1 outside blocks."""
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


# 2-D weights llama-quantize never quantizes, whatever the preset (tensor_allows_quantization
# in llama-quant.cpp): they keep the type of the file it reads
NEVER_QUANTIZED = ("per_layer_model_proj",)
# llama-quantize's token-embedding tensors (tensor_name_match_token_embd): they take the
# preset's token_embd type
TOKEN_EMBD = ("token_embd.weight", "per_layer_token_embd.weight")


def _quantizable(name: str, shape: tuple[int, ...]) -> bool:
    return (len(shape) >= 2 and name.endswith("weight") and "_norm.weight" not in name
            and not any(n in name for n in NEVER_QUANTIZED))


def plan_types(preset: Preset | str, tensors: dict[str, tuple[int, ...]], n_layer: int, *,
               is_70b: bool = False, has_imatrix: bool = False, n_gqa: int = 1,
               n_expert: int = 0) -> dict[str, TensorPlan]:
    """GGML type of every quantizable tensor, by GGUF name ({name: torch-order shape}).

    Tensors not in the result (norms, biases, 1-D) keep their float type. Counters run in
    llama.cpp's order (layer number, then name), as its quantizer iterates its weights map.
    has_imatrix: llama.cpp was given an imatrix at all (Q4_0/Q5_0 then guard early ffn_down;
    IQ4_NL/IQ4_XS bump it to Q5_K only without one).
    n_expert: routed experts (llama.cpp's expert_count): with more than one, ffn_down's
    (ffn_gate's, ffn_up's) layer is read from its name ("blk.N."); with exactly 8, attn_v and
    attn_k become Q8_0 and attn_output takes the preset's attn_output_8_experts
    (llama-quant.cpp). The IQ2 presets (iq2_branch) differ: see Preset.
    """
    p = PRESETS[preset] if isinstance(preset, str) else preset
    names = sorted(tensors, key=lambda s: (layer_of(s), s))
    tied = "output.weight" not in tensors
    n_attn_v = sum(1 for s in names if "attn_v.weight" in s or "attn_qkv.weight" in s)
    i_attn_v = i_ffn_down = i_ffn_gate = i_ffn_up = 0
    plans = {}

    def apply(rule: Rule | None, t: Q, i: int, n: int) -> Q:
        picked = rule.pick(i, n, n_gqa, has_imatrix, n_expert) if rule else None
        return picked if picked is not None else t

    for name in names:
        shape = tuple(tensors[name])
        if not _quantizable(name, shape):
            continue
        t = p.base
        if p.quantized:
            ncols = shape[-1]
            if name == "output.weight" or (tied and name in TOKEN_EMBD):
                t = Q.Q8_0 if ncols % block_size(t) else (t if t == Q.Q8_0 else p.output)
            elif name in TOKEN_EMBD:
                t = p.token_embd or t
            elif "attn_qkv.weight" in name or "attn_v.weight" in name:
                t = apply(p.attn_v, t, i_attn_v, n_attn_v)
                if is_70b and t in (Q.Q3_K, Q.Q4_K) and not p.iq2_branch:
                    t = Q.Q5_K
                if n_expert == 8 and not p.iq2_branch:
                    t = Q.Q8_0
                i_attn_v += 1
            elif "attn_k.weight" in name:
                if n_expert == 8:
                    t = Q.Q4_K if p.iq2_branch else Q.Q8_0
                else:
                    t = apply(p.attn_k, t, 0, 1)
            elif "attn_q.weight" in name:
                t = apply(p.attn_q, t, 0, 1)
            elif "ffn_up" in name:
                t = apply(p.ffn_up, t, layer_of(name) if n_expert > 1 else i_ffn_up, n_layer)
                i_ffn_up += 1
            elif "ffn_gate" in name:
                t = apply(p.ffn_gate, t, layer_of(name) if n_expert > 1 else i_ffn_gate, n_layer)
                i_ffn_gate += 1
            elif "ffn_down" in name:
                i = layer_of(name) if n_expert > 1 and not p.iq2_branch else i_ffn_down
                t = apply(p.ffn_down, t, i, n_layer)
                t = apply(p.ffn_down_imatrix if has_imatrix else p.ffn_down_no_imatrix, t, i, n_layer)
                i_ffn_down += 1
            elif "attn_output.weight" in name:
                t = (p.attn_output_8_experts or p.base) if n_expert == 8 else apply(p.attn_output, t, 0, 1)
            wanted = t
            if ncols % block_size(t):
                t = FALLBACK.get(t, t)
                if ncols % block_size(t):
                    t = Q.F16
            plans[name] = TensorPlan(t, wanted)
        else:
            plans[name] = TensorPlan(t, t)
    return plans
