"""The GGML types and llama-quantize's type mixes: one row per fact, read by every layer.

`TYPES` has a row per GGML type quantkit encodes or writes: its codec module (the family
module of quantkit.ggml that holds its encoders and decoders; `quantkit.ggml.codec` finds it
through this row), whether ggml refuses to encode it without an imatrix, and the type llama.cpp
writes instead on rows whose width is not a multiple of its block. Block sizes and bytes are
gguf-py's `GGML_QUANT_SIZES`, never retyped. `PRESETS` has a row per `--gguf-type`: its
llama_ftype (general.file_type), base type, llama.cpp's bits per weight for the mix, and the
per-tensor rules of llama_tensor_get_type (applied by quantkit.ggml.mix.plan_types).

A new GGML type is a codec module and a row here; a new mix is a row of PRESETS.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

__all__ = ["GGMLType", "TYPES", "FALLBACK", "REQUIRES_IMATRIX", "block_size", "type_size",
           "Rule", "Preset", "PRESETS", "AUTO", "AUTO_BASE", "GGUF_TYPES", "LLAMA_FTYPES",
           "use_more_bits", "file_type", "bits_per_weight"]

Q = GGMLQuantizationType


def block_size(qtype: int) -> int:
    """Values per block of a GGML type (gguf-py's table)."""
    return GGML_QUANT_SIZES[Q(qtype)][0]


def type_size(qtype: int) -> int:
    """Bytes per block of a GGML type (gguf-py's table)."""
    return GGML_QUANT_SIZES[Q(qtype)][1]


@dataclass(frozen=True)
class GGMLType:
    """One GGML type: where its codec lives and how llama.cpp treats it."""
    qtype: Q
    codec: str  # module of quantkit.ggml holding its encoders / decoders (its CODECS)
    # ggml_quantize_requires_imatrix: ggml's quantizer asserts an imatrix for these
    requires_imatrix: bool = False
    # llama.cpp's type for rows whose width is not a multiple of this type's block (then F16
    # if that one's block does not divide them either)
    narrow: Q | None = None

    @property
    def block(self) -> int:
        return block_size(self.qtype)

    @property
    def type_size(self) -> int:
        return type_size(self.qtype)

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.type_size / self.block


TYPES: dict[Q, GGMLType] = {t.qtype: t for t in (
    GGMLType(Q.F32, "floats"),
    GGMLType(Q.F16, "floats"),
    GGMLType(Q.BF16, "floats"),
    GGMLType(Q.Q8_0, "legacy"),
    GGMLType(Q.Q4_0, "legacy"),
    GGMLType(Q.Q4_1, "legacy"),
    GGMLType(Q.Q5_0, "legacy"),
    GGMLType(Q.Q5_1, "legacy"),
    GGMLType(Q.Q2_K, "k_quants", narrow=Q.Q4_0),
    GGMLType(Q.Q3_K, "k_quants", narrow=Q.Q4_0),
    GGMLType(Q.Q4_K, "k_quants", narrow=Q.Q5_0),
    GGMLType(Q.Q5_K, "k_quants", narrow=Q.Q5_1),
    GGMLType(Q.Q6_K, "k_quants", narrow=Q.Q8_0),
    GGMLType(Q.IQ4_NL, "iq4"),
    GGMLType(Q.IQ4_XS, "iq4", narrow=Q.IQ4_NL),
    GGMLType(Q.IQ3_XXS, "iq3", narrow=Q.IQ4_NL),
    GGMLType(Q.IQ3_S, "iq3", narrow=Q.IQ4_NL),
    GGMLType(Q.IQ2_XXS, "iq2", requires_imatrix=True, narrow=Q.IQ4_NL),
    GGMLType(Q.IQ2_XS, "iq2", requires_imatrix=True, narrow=Q.IQ4_NL),
    GGMLType(Q.IQ2_S, "iq2", narrow=Q.IQ4_NL),
    GGMLType(Q.IQ1_S, "iq1", requires_imatrix=True, narrow=Q.IQ4_NL),
    GGMLType(Q.IQ1_M, "iq1", narrow=Q.IQ4_NL),
)}
# a 256-wide type on rows whose width is not a multiple of 256 (then F16 if 32 fails too)
FALLBACK: dict[Q, Q] = {t.qtype: t.narrow for t in TYPES.values() if t.narrow is not None}
REQUIRES_IMATRIX: tuple[Q, ...] = tuple(t.qtype for t in TYPES.values() if t.requires_imatrix)


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's layer pattern for the sensitive tensors (first/last eighth, every third)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


# Conditions of a rule see (i, n, n_gqa, imatrix, n_expert): i the tensor's counter, n its
# total, n_gqa the model's query heads per KV head, imatrix whether llama.cpp was given one,
# n_expert the routed experts (0 for a dense model).
_CONDITIONS = {
    "always": lambda i, n, g, m, e: True,
    "more_bits": lambda i, n, g, m, e: use_more_bits(i, n),
    "first_2": lambda i, n, g, m, e: i < 2,
    "first_4": lambda i, n, g, m, e: i < 4,
    "first_eighth": lambda i, n, g, m, e: i < n // 8,
    "first_16th": lambda i, n, g, m, e: i < n // 16,
    "gqa_4": lambda i, n, g, m, e: g >= 4,
    "no_imatrix": lambda i, n, g, m, e: not m,
    "gqa_4_or_experts_4": lambda i, n, g, m, e: g >= 4 or e >= 4,
    "first_eighth_or_8_experts_more_bits": lambda i, n, g, m, e: i < n // 8 or (e == 8 and use_more_bits(i, n)),
    "middle": lambda i, n, g, m, e: n // 8 <= i < 7 * n // 8,
}


@dataclass(frozen=True)
class Rule:
    """`then` where the condition holds, else `otherwise` (None: the preset's base type; a
    Rule: asked next, for llama.cpp's if / else-if chains)."""
    when: str
    then: Q
    otherwise: Q | Rule | None = None

    def pick(self, i: int, n: int, n_gqa: int, has_imatrix: bool = False, n_expert: int = 0) -> Q | None:
        if _CONDITIONS[self.when](i, n, n_gqa, has_imatrix, n_expert):
            return self.then
        if isinstance(self.otherwise, Rule):
            return self.otherwise.pick(i, n, n_gqa, has_imatrix, n_expert)
        return self.otherwise

    @property
    def types(self) -> tuple[Q, ...]:
        rest = self.otherwise.types if isinstance(self.otherwise, Rule) else (self.otherwise,)
        return tuple(t for t in (self.then, *rest) if t is not None)


@dataclass(frozen=True)
class Preset:
    """One llama.cpp ftype: its base type and the per-tensor rules llama_tensor_get_type has
    for it (attn_v counts attn_v/attn_qkv tensors, ffn_down counts layers)."""
    name: str
    ftype: int  # llama_ftype, written as general.file_type
    base: Q
    # llama.cpp's bits per weight of the quantized tensors (its mix averaged): plan's estimates
    bpw: float
    attn_v: Rule | None = None
    ffn_down: Rule | None = None
    attn_output: Rule | None = None
    ffn_down_imatrix: Rule | None = None  # only when an imatrix is given (Q4_0 / Q5_0)
    ffn_down_no_imatrix: Rule | None = None  # only without an imatrix (IQ4_NL / IQ4_XS)
    # models with exactly 8 experts: attn_output's type replaces the attn_output rule (None:
    # the base type; llama.cpp bumps it to Q5_K for the low-bit K presets only)
    attn_output_8_experts: Q | None = None
    attn_q: Rule | None = None
    attn_k: Rule | None = None  # models with exactly 8 experts: Q8_0 whatever this says
    ffn_gate: Rule | None = None  # by layer (read from the name with experts), as ffn_down
    ffn_up: Rule | None = None
    output: Q = Q.Q6_K  # output.weight, and token_embd when tied (Q8_0 kept as Q8_0)
    token_embd: Q | None = None  # untied token_embd (None: the base type)
    # llama.cpp's own branch for IQ2_XXS/IQ2_XS/IQ2_S/IQ2_M (and IQ1_*): attn_v takes only its
    # rule (no 70B bump, no Q8_0 with 8 experts), attn_k is Q4_K with 8 experts, ffn_down is
    # counted in tensor order even with experts, ffn_gate/ffn_up keep the base type
    iq2_branch: bool = False
    # llama.cpp refuses to write these types without an imatrix (tensor_requires_imatrix;
    # token_embd and output excepted; Q2_K only in a Q2_K_S file)
    needs_imatrix: tuple[Q, ...] = (Q.IQ3_XXS, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ1_S, Q.IQ1_M)

    @property
    def quantized(self) -> bool:
        return self.base not in (Q.F16, Q.BF16, Q.F32)

    @property
    def dense_type(self) -> Q:
        """What the writer stores 2-D weights that have no quantized result as."""
        return Q.BF16 if self.base == Q.BF16 else Q.F16

    @property
    def imatrix_required(self) -> bool:
        """Whether llama.cpp's mix for this ftype can hold a type it refuses without an imatrix."""
        return bool({self.base, *(t for r in self.rules for t in r.types)} & set(self.needs_imatrix))

    @property
    def rules(self) -> tuple[Rule, ...]:
        return tuple(r for r in (self.attn_v, self.ffn_down, self.attn_output, self.ffn_down_imatrix,
                                 self.ffn_down_no_imatrix, self.attn_q, self.attn_k, self.ffn_gate,
                                 self.ffn_up) if r)


_MORE_BITS_Q6 = Rule("more_bits", Q.Q6_K)
# --gguf-type auto keeps this preset's rules for token_embd and output (Q6_K, Q8_0 on widths
# that are not multiples of 256) and chooses every block tensor by measured sensitivity
PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("q4_k_m", 15, Q.Q4_K, 4.9, attn_v=_MORE_BITS_Q6, ffn_down=_MORE_BITS_Q6,
           attn_output_8_experts=Q.Q5_K),
    Preset("q4_k_s", 14, Q.Q4_K, 4.6, attn_v=Rule("first_4", Q.Q5_K), ffn_down=Rule("first_eighth", Q.Q5_K),
           attn_output_8_experts=Q.Q5_K),
    Preset("q5_k_m", 17, Q.Q5_K, 5.7, attn_v=_MORE_BITS_Q6, ffn_down=_MORE_BITS_Q6),
    Preset("q5_k_s", 16, Q.Q5_K, 5.5),
    Preset("q6_k", 18, Q.Q6_K, 6.5625),
    Preset("q8_0", 7, Q.Q8_0, 8.5),
    Preset("q5_1", 9, Q.Q5_1, 6.0),
    Preset("q5_0", 8, Q.Q5_0, 5.5, ffn_down_imatrix=Rule("first_eighth", Q.Q5_1)),
    Preset("q4_1", 3, Q.Q4_1, 5.0),
    Preset("q4_0", 2, Q.Q4_0, 4.5, ffn_down_imatrix=Rule("first_eighth", Q.Q4_1)),
    Preset("q3_k_l", 13, Q.Q3_K, 4.3, attn_v=Rule("always", Q.Q5_K), ffn_down=Rule("always", Q.Q5_K),
           attn_output=Rule("always", Q.Q5_K)),
    Preset("q3_k_m", 12, Q.Q3_K, 3.9, attn_v=Rule("first_2", Q.Q5_K, Q.Q4_K),
           ffn_down=Rule("first_16th", Q.Q5_K, Q.Q4_K), attn_output=Rule("always", Q.Q4_K),
           attn_output_8_experts=Q.Q5_K),
    Preset("q3_k_s", 11, Q.Q3_K, 3.5, attn_output_8_experts=Q.Q5_K),
    Preset("q2_k", 10, Q.Q2_K, 3.0, attn_v=Rule("gqa_4", Q.Q4_K, Q.Q3_K), ffn_down=Rule("always", Q.Q3_K),
           attn_output=Rule("always", Q.Q3_K), attn_output_8_experts=Q.Q5_K),
    # Q2_K_S: its Q2_K tensors need an imatrix (tensor_requires_imatrix's one ftype-dependent case)
    Preset("q2_k_s", 21, Q.Q2_K, 2.8, attn_v=Rule("gqa_4", Q.Q4_K), ffn_down=Rule("first_eighth", Q.Q4_K),
           needs_imatrix=(Q.IQ3_XXS, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ1_S, Q.IQ1_M, Q.Q2_K)),
    Preset("iq4_nl", 25, Q.IQ4_NL, 4.5, attn_v=Rule("gqa_4", Q.Q5_K),
           ffn_down_no_imatrix=Rule("first_eighth", Q.Q5_K), attn_output_8_experts=Q.Q5_K),
    Preset("iq4_xs", 30, Q.IQ4_XS, 4.25, attn_v=Rule("gqa_4", Q.Q5_K),
           ffn_down_no_imatrix=Rule("first_eighth", Q.Q5_K), attn_output_8_experts=Q.Q5_K),
    Preset("iq3_xxs", 23, Q.IQ3_XXS, 3.06, attn_v=Rule("gqa_4", Q.Q4_K, Rule("no_imatrix", Q.IQ3_S)),
           ffn_down_no_imatrix=Rule("first_eighth", Q.Q4_K, Q.Q3_K), attn_output=Rule("always", Q.IQ3_S),
           attn_output_8_experts=Q.Q5_K, attn_q=Rule("always", Q.IQ2_S), attn_k=Rule("always", Q.IQ2_S),
           output=Q.Q5_K, token_embd=Q.IQ3_S),
    Preset("iq3_s", 26, Q.IQ3_S, 3.44, attn_v=Rule("gqa_4", Q.Q4_K), attn_output_8_experts=Q.Q5_K),
    Preset("iq3_xs", 22, Q.IQ3_S, 3.3, attn_v=Rule("gqa_4", Q.Q4_K), attn_q=Rule("always", Q.IQ3_XXS),
           attn_k=Rule("always", Q.IQ3_XXS), ffn_gate=Rule("middle", Q.IQ3_XXS), ffn_up=Rule("middle", Q.IQ3_XXS),
           attn_output_8_experts=Q.Q5_K),
    Preset("iq3_m", 27, Q.IQ3_S, 3.66, attn_v=Rule("always", Q.Q4_K),
           ffn_down=Rule("first_eighth_or_8_experts_more_bits", Q.Q4_K), attn_output=Rule("always", Q.Q4_K),
           attn_output_8_experts=Q.Q5_K),
    *(Preset(name, ftype, base, bpw, attn_v=Rule("gqa_4_or_experts_4", Q.Q4_K, Q.Q2_K),
             ffn_down=Rule("first_eighth", Q.Q2_K), attn_output_8_experts=Q.Q5_K, output=Q.Q5_K,
             token_embd=Q.Q2_K, iq2_branch=True)
      for name, ftype, base, bpw in (("iq2_xxs", 19, Q.IQ2_XXS, 2.06), ("iq2_xs", 20, Q.IQ2_XS, 2.31))),
    # IQ1_S / IQ1_M: the IQ2 branch of IQ2_XXS, plus attn_output IQ2_XXS (Q5_K with 8 experts)
    *(Preset(name, ftype, base, bpw, attn_v=Rule("gqa_4_or_experts_4", Q.Q4_K, Q.Q2_K),
             ffn_down=Rule("first_eighth", Q.Q2_K), attn_output=Rule("always", Q.IQ2_XXS),
             attn_output_8_experts=Q.Q5_K, output=Q.Q5_K, token_embd=Q.Q2_K, iq2_branch=True)
      for name, ftype, base, bpw in (("iq1_s", 24, Q.IQ1_S, 1.56), ("iq1_m", 31, Q.IQ1_M, 1.75))),
    *(Preset(name, ftype, base, bpw, attn_v=Rule("gqa_4_or_experts_4", Q.Q4_K, Q.IQ3_S),
             ffn_down=Rule("first_eighth", Q.IQ3_S), attn_output=Rule("always", Q.IQ3_S),
             attn_output_8_experts=Q.Q5_K, output=Q.Q5_K, token_embd=Q.IQ3_S, iq2_branch=True)
      for name, ftype, base, bpw in (("iq2_s", 28, Q.IQ2_XS, 2.5), ("iq2_m", 29, Q.IQ2_S, 2.7))),
    Preset("f16", 1, Q.F16, 16),
    Preset("bf16", 32, Q.BF16, 16),
)}
AUTO_BASE = "q4_k_m"
AUTO = "auto"  # per-tensor types chosen by quantkit (--gguf-type auto), on AUTO_BASE's rules
# every --gguf-type a GGUF file is written as
GGUF_TYPES: tuple[str, ...] = (*PRESETS, AUTO)
# the llama_ftype of each preset (what llama-quantize is asked for)
LLAMA_FTYPES: dict[str, int] = {name: p.ftype for name, p in PRESETS.items()}


def file_type(gguf_type: str) -> tuple[int | None, Q]:
    """(general.file_type, type of 2-D weights without a quantized result) of a --gguf-type.

    auto has no llama_ftype that names its mix, so general.file_type is left out (None) and
    llama.cpp guesses it from the most common tensor type (llama_model_loader:
    LLAMA_FTYPE_GUESSED). KeyError for a name outside GGUF_TYPES.
    """
    if gguf_type == AUTO:
        return None, PRESETS[AUTO_BASE].dense_type
    preset = PRESETS[gguf_type]
    return preset.ftype, preset.dense_type


def bits_per_weight(gguf_type: str | None, default: float | None = None) -> float | None:
    """llama.cpp's bits per weight of a --gguf-type's quantized tensors (its mix averaged),
    `default` for auto and unknown names: what size estimates start from."""
    preset = PRESETS.get(str(gguf_type))
    return default if preset is None else preset.bpw
