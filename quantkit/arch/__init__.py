"""Per-architecture facts as data: which blocks, which Linears, how they group.

Families share rows (llama, mistral, qwen2 and qwen3 have the same decoder block layout);
code never tests a model_type string anywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from quantkit.errors import UnsupportedArchitecture

__all__ = ["ArchSpec", "AwqGroup", "ExpertsSpec", "ARCHS", "EXPERT", "spec_for_config",
           "supported_architectures"]

EXPERT = "{e}"  # in a block-relative Linear name: the expert index (see ExpertsSpec)


@dataclass(frozen=True)
class AwqGroup:
    """Scales are searched on `balance` inputs and folded into `prev` (a norm or Linear).

    `inspect` is the submodule whose output measures the loss ("" = the whole block).
    """

    prev: str
    balance: tuple[str, ...]
    inspect: str
    # `prev` is a fused Linear whose LAST rows feed the balance Linears (Phi-3's gate_up_proj
    # -> down_proj: the up half); the fold then divides only those rows
    prev_tail: bool = False
    # modules that read the same input but stay unquantized (an MoE router): their weight
    # columns are multiplied by s as well, so they compute exactly what they did (the fold
    # divides their input by s too); routing is unchanged before any rounding
    compensate: tuple[str, ...] = ()

    def for_experts(self, num_experts: int) -> tuple[AwqGroup, ...]:
        """This row on a block with `num_experts` routed experts (names with EXPERT written out).

        EXPERT in `prev` (an expert's up_proj -> its down_proj): one group per expert, each
        scaled on that expert's own routed tokens. EXPERT in `balance` only (the norm -> every
        expert's gate/up): ONE group over all experts, since they all read the same normalised
        input and the norm can hold one scale. No EXPERT: the row itself.
        """
        if EXPERT in self.prev:
            return tuple(AwqGroup(self.prev.replace(EXPERT, str(e)),
                                  tuple(b.replace(EXPERT, str(e)) for b in self.balance),
                                  self.inspect.replace(EXPERT, str(e)), self.prev_tail,
                                  self.compensate) for e in range(num_experts))
        if any(EXPERT in b for b in self.balance):
            return (AwqGroup(self.prev, _expand(self.balance, num_experts), self.inspect,
                             self.prev_tail, self.compensate),)
        return (self,)


def _expand(names: tuple[str, ...], num_experts: int) -> tuple[str, ...]:
    """Expert templates written out for experts 0..num_experts-1 (expert after expert), then
    the names without EXPERT once (DeepSeek's shared expert beside the routed ones)."""
    templates = tuple(n for n in names if EXPERT in n)
    return (tuple(n.replace(EXPERT, str(e)) for e in range(num_experts) for n in templates)
            + tuple(n for n in names if EXPERT not in n))


@dataclass(frozen=True)
class ExpertsSpec:
    """A block's mixture of experts, as data (quantkit.pipeline.experts acts on it).

    transformers 5 keeps routed experts as fused 3-D parameters on one module (`module`):
    `fused_gate_up` (E, 2I, H) with the gate rows first, `fused_down` (E, H, I). Checkpoints
    on the Hub, vLLM's FusedMoE loader and quantkit's pipeline use per-expert Linears
    `{module}.{e}.{gate,up,down}` instead, which is what `linears` names. The router
    (`router`, an (E, H) weight) stays unquantized. Which blocks are MoE is the model's own
    choice (e.g. Qwen3-MoE's mlp_only_layers): a block is MoE when `module` exists in it.
    """

    module: str = "mlp.experts"
    # config keys of the routed experts per MoE block (transformers 5 writes Qwen3-MoE's
    # num_experts as num_local_experts in config.json; the config object answers both)
    count_keys: tuple[str, ...] = ("num_experts", "num_local_experts")
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    router: str = "mlp.gate"
    fused_gate_up: str = "gate_up_proj"
    fused_down: str = "down_proj"
    # gpt-oss's fused layout: (E, in, out) tensors applied as x @ W (not F.linear's (E, out,
    # in)), gate and up rows interleaved (even = gate, odd = up) instead of halves, and biases
    # `{fused}_bias` on every expert projection
    fused_transposed: bool = False
    gate_up_interleaved: bool = False
    bias: bool = False
    # the fused module's own method that maps the (interleaved) gate_up output to the down
    # input (gpt-oss's clamped SwiGLU `_apply_gate`); "" = act_fn(gate) * up
    glu: str = ""
    # the checkpoint keeps the fused 3-D tensors (gpt-oss), optionally as MXFP4
    # `{fused}_blocks` / `{fused}_scales`; per-expert tensors are sliced out as they are read
    stored_fused: bool = False

    def linear(self, which: str, expert: int | str = EXPERT) -> str:
        """Block-relative name of expert `expert`'s `which` Linear ("gate", "up" or "down")."""
        return f"{self.module}.{expert}.{getattr(self, which)}"

    def count(self, config) -> int:
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        return int(next((v for v in map(get, self.count_keys) if v), 0))


@dataclass(frozen=True)
class ArchSpec:
    name: str
    hf_classes: tuple[str, ...]
    model_types: tuple[str, ...]
    block_path: str = "model.layers"
    embed: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"
    # the attention module of a block (its k/v states are what the engine's KV cache holds)
    attention: str = "self_attn"
    # Linears of one block, in true-sequential order: each inner tuple shares inputs.
    sequential: tuple[tuple[str, ...], ...] = ()
    awq_groups: tuple[AwqGroup, ...] = ()
    gguf_arch: str = "llama"
    # block-relative module name -> GGUF tensor base name with {bid}
    gguf_names: dict[str, str] = field(default_factory=dict)
    gguf_permute_qk: bool = False  # llama.cpp's llama arch wants q/k rows permuted
    # roles used by mixed-precision recipes (Q4_K_M): role -> block-relative Linear name
    roles: dict[str, str] = field(default_factory=dict)
    # mixture of experts: per-expert Linears appear in `sequential` as templates with EXPERT
    experts: ExpertsSpec | None = None
    # RMSNorms compute x * (norm_offset + w): Gemma's (1 + w). Scales fold into (offset + w),
    # and GGUF stores offset + w (llama.cpp multiplies by the stored weight)
    norm_offset: float = 0.0
    # optional {arch}.* hyper-parameter keys this GGUF arch carries (formats/gguf.py's
    # _OPTIONAL_KV writes each); the rest of the GGUF header is common to every arch
    gguf_kv: tuple[str, ...] = ("vocab_size", "rope_dimension_count", "head_dim_if_set")
    # where the checkpoint's tensor names differ from transformers 5's module names (the
    # family's WeightRenaming in transformers' conversion_mapping.py, reversed): (module
    # substring, checkpoint substring). Shards are read and artifacts written under the
    # checkpoint's names, the ones the engines load (Mixtral: block_sparse_moe)
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    # engines known to mis-load this family's quantized safetensors artifacts: engine -> why.
    # quantize drops them from the artifact's `engines` and warns (never a silent wrong load)
    engine_gaps: dict[str, str] = field(default_factory=dict)
    # a Linear llama.cpp stores as per-head 3-D pieces (DeepSeek's kv_b_proj -> attn_k_b,
    # attn_v_b): block-relative Linear -> ((GGUF base name with {bid}, config key of the rows
    # each head gives this piece, transposed per head), ...); rows are (head, piece, row)
    gguf_head_splits: dict[str, tuple[tuple[str, str, bool], ...]] = field(default_factory=dict)
    # why per-layer FP8 k/v scales (--kv-cache fp8) do not fit this family's cache ("" = they do)
    kv_cache_gap: str = ""
    # block-relative Linears that stay unquantized besides the router (listed in the artifact's
    # ignore list): a scalar gate the engine builds without a quantization method
    dense_linears: tuple[str, ...] = ()

    def checkpoint_name(self, name: str) -> str:
        """A full module-tree tensor name as the checkpoint (and the engines) spell it."""
        for module, ckpt in self.checkpoint_renames:
            name = name.replace(module, ckpt)
        return name

    def module_name(self, name: str) -> str:
        """A checkpoint tensor name as transformers 5's module tree spells it."""
        for module, ckpt in self.checkpoint_renames:
            name = name.replace(ckpt, module)
        return name

    def head_pieces(self, rel: str, weight, config) -> list[tuple[str, object]]:
        """A gguf_head_splits Linear's weight [heads x rows, K] -> [(GGUF base name with {bid},
        3-D piece (heads, rows, K) or transposed (heads, K, rows))], as llama.cpp's converter
        cuts it (view per head, split the rows, transpose where the table says)."""
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        pieces = self.gguf_head_splits[rel]
        sizes = [int(get(key)) for _, key, _ in pieces]
        heads = weight.reshape(int(get("num_attention_heads")), sum(sizes), weight.shape[-1])
        return [(base, (part.transpose(1, 2) if transpose else part).contiguous())
                for (base, _, transpose), part in zip(pieces, heads.split(sizes, dim=1), strict=True)]

    @property
    def block_linears(self) -> tuple[str, ...]:
        """Every Linear name of `sequential` (expert templates unexpanded; see groups_for)."""
        return tuple(n for group in self.sequential for n in group)

    def groups_for(self, num_experts: int) -> tuple[tuple[str, ...], ...]:
        """`sequential` with each expert template written out for experts 0..num_experts-1
        (all experts' Linears of one template row form one group: they read the same
        normalised hidden states, each its own routed tokens)."""
        return tuple(_expand(group, num_experts) for group in self.sequential)

    def fused_sets_for(self, num_experts: int) -> tuple[tuple[str, ...], ...]:
        """The Linears each engine GEMM reads together (q/k/v, gate/up), per expert: `sequential`
        with each expert template row split into one tuple per expert (vLLM's FusedMoE keeps
        ONE w13 global / input scale per expert for its gate and up), the non-expert names of
        such a row (DeepSeek's shared expert) as a tuple of their own."""
        out: list[tuple[str, ...]] = []
        for group in self.sequential:
            templates = tuple(n for n in group if EXPERT in n)
            out += [tuple(n.replace(EXPERT, str(e)) for n in templates) for e in range(num_experts)
                    ] if templates else []
            rest = tuple(n for n in group if EXPERT not in n)
            out += [rest] if rest else []
        return tuple(out)

    def linears_for(self, num_experts: int) -> tuple[str, ...]:
        return tuple(n for group in self.groups_for(num_experts) for n in group)

    def awq_groups_for(self, num_experts: int) -> tuple[AwqGroup, ...]:
        """`awq_groups` with expert templates written out (AwqGroup.for_experts)."""
        return tuple(g for row in self.awq_groups for g in row.for_experts(num_experts))

    def is_expert_linear(self, name: str) -> bool:
        """Whether block-relative `name` is a routed expert's Linear (it may get no tokens)."""
        return self.experts is not None and name.startswith(self.experts.module + ".")

    def gguf_slot(self, rel: str) -> tuple[str, int | None] | None:
        """Block-relative module name -> (GGUF base name template with {bid}, expert index).

        Routed experts share one 3-D GGUF tensor per projection (llama.cpp's
        `ffn_{gate,up,down}_exps`, expert axis slowest): `mlp.experts.3.down_proj` ->
        ("blk.{bid}.ffn_down_exps", 3). Other modules have no expert index (None).
        """
        expert = None
        if self.is_expert_linear(rel):
            head, _, tail = rel[len(self.experts.module) + 1:].partition(".")
            if head.isdigit():
                expert, rel = int(head), f"{self.experts.module}.{EXPERT}.{tail}"
        tmpl = self.gguf_names.get(rel)
        return (tmpl, expert) if tmpl else None


_LLAMA_LINEARS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)

_LLAMA_AWQ = (
    AwqGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
    AwqGroup("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
    AwqGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
    AwqGroup("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
)

_GGUF_BLOCK_NAMES = {
    "input_layernorm": "blk.{bid}.attn_norm",
    "self_attn.q_proj": "blk.{bid}.attn_q",
    "self_attn.k_proj": "blk.{bid}.attn_k",
    "self_attn.v_proj": "blk.{bid}.attn_v",
    "self_attn.o_proj": "blk.{bid}.attn_output",
    "self_attn.q_norm": "blk.{bid}.attn_q_norm",
    "self_attn.k_norm": "blk.{bid}.attn_k_norm",
    "post_attention_layernorm": "blk.{bid}.ffn_norm",
    "mlp.gate_proj": "blk.{bid}.ffn_gate",
    "mlp.up_proj": "blk.{bid}.ffn_up",
    "mlp.down_proj": "blk.{bid}.ffn_down",
}

_ROLES = {"attn_v": "self_attn.v_proj", "ffn_down": "mlp.down_proj", "attn_q": "self_attn.q_proj",
          "attn_k": "self_attn.k_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj"}

_LLAMA_LIKE = dict(sequential=_LLAMA_LINEARS, awq_groups=_LLAMA_AWQ, gguf_names=_GGUF_BLOCK_NAMES,
                   roles=_ROLES)

_QWEN3_MOE_EXPERTS = ExpertsSpec()


def _moe_awq(experts: ExpertsSpec, norm: str = "post_attention_layernorm") -> tuple[AwqGroup, ...]:
    """AWQ groups of an MoE block: the norm's one scale shared by EVERY expert's gate/up (the
    router reads the same input: compensated, not quantized), loss on the whole MoE block
    with its real routing; then each expert's up -> down on its own routed tokens."""
    gate, up, down = (experts.linear(w) for w in ("gate", "up", "down"))
    moe_block = experts.module.rpartition(".")[0]
    return (AwqGroup(norm, (gate, up), moe_block, compensate=(experts.router,)),
            AwqGroup(up, (down,), down))

# dense blocks (mlp_only_layers) keep the llama MLP names; MoE blocks have the expert rows
_QWEN3_MOE_LINEARS = _LLAMA_LINEARS + (
    (_QWEN3_MOE_EXPERTS.linear("gate"), _QWEN3_MOE_EXPERTS.linear("up")),
    (_QWEN3_MOE_EXPERTS.linear("down"),),
)

# Mixtral: transformers 5 names the MoE block `mlp` (router mlp.gate, fused experts
# mlp.experts); its checkpoints, save_pretrained and vLLM say block_sparse_moe, and the experts'
# Linears are w1 (gate), w3 (up), w2 (down), of intermediate_size (every block is MoE)
_MIXTRAL_EXPERTS = ExpertsSpec(count_keys=("num_local_experts",), gate="w1", up="w3", down="w2")

_MIXTRAL_LINEARS = _LLAMA_LINEARS[:2] + (
    (_MIXTRAL_EXPERTS.linear("gate"), _MIXTRAL_EXPERTS.linear("up")),
    (_MIXTRAL_EXPERTS.linear("down"),),
)

# llama.cpp's qwen3moe: the llama names, the router as ffn_gate_inp and each expert projection
# stacked into one 3-D tensor per block (names from gguf-py's constants, MODEL_TENSOR.FFN_*_EXP)
_QWEN3_MOE_GGUF_NAMES = {
    **_GGUF_BLOCK_NAMES,
    _QWEN3_MOE_EXPERTS.router: "blk.{bid}.ffn_gate_inp",
    _QWEN3_MOE_EXPERTS.linear("gate"): "blk.{bid}.ffn_gate_exps",
    _QWEN3_MOE_EXPERTS.linear("up"): "blk.{bid}.ffn_up_exps",
    _QWEN3_MOE_EXPERTS.linear("down"): "blk.{bid}.ffn_down_exps",
}

# llama.cpp's converter writes Mixtral as arch llama: the llama names, the router as
# ffn_gate_inp and the experts' w1/w3/w2 stacked into ffn_{gate,up,down}_exps
_MIXTRAL_GGUF_NAMES = {
    **_GGUF_BLOCK_NAMES,
    _MIXTRAL_EXPERTS.router: "blk.{bid}.ffn_gate_inp",
    _MIXTRAL_EXPERTS.linear("gate"): "blk.{bid}.ffn_gate_exps",
    _MIXTRAL_EXPERTS.linear("up"): "blk.{bid}.ffn_up_exps",
    _MIXTRAL_EXPERTS.linear("down"): "blk.{bid}.ffn_down_exps",
}

# gpt-oss: biased q/k/v/o and attention sinks (a per-head logit, kept unquantized), every
# block MoE with a biased router `mlp.router` and biased experts stored fused in the
# checkpoint (MXFP4 in OpenAI's). Per-expert Linears take llm-compressor's names
# (`mlp.experts.{e}.gate_proj`, ...), what its gpt-oss calibration modules write
_GPT_OSS_EXPERTS = ExpertsSpec(count_keys=("num_local_experts",), router="mlp.router",
                               fused_transposed=True, gate_up_interleaved=True, bias=True,
                               glu="_apply_gate", stored_fused=True)

_GPT_OSS_LINEARS = _LLAMA_LINEARS[:2] + (
    (_GPT_OSS_EXPERTS.linear("gate"), _GPT_OSS_EXPERTS.linear("up")),
    (_GPT_OSS_EXPERTS.linear("down"),),
)

# AWQ: no up -> down group for gpt-oss: down reads (clamp(up) + 1) * glu(gate), not
# linear in up's output, so a scale folded from down's columns into up's rows would change
# what the block computes (the norm -> every expert's gate/up group stays: one scale, the
# router compensated)

# llama.cpp's gpt-oss (gguf-py MODEL_ARCH.GPT_OSS): the norm before the MoE is
# post_attention_norm, sinks attn_sinks, the router ffn_gate_inp
_GPT_OSS_GGUF_NAMES = {
    **{k: v for k, v in _GGUF_BLOCK_NAMES.items() if not k.startswith("mlp.")},
    "post_attention_layernorm": "blk.{bid}.post_attention_norm",
    "self_attn.sinks": "blk.{bid}.attn_sinks",
    _GPT_OSS_EXPERTS.router: "blk.{bid}.ffn_gate_inp",
    _GPT_OSS_EXPERTS.linear("gate"): "blk.{bid}.ffn_gate_exps",
    _GPT_OSS_EXPERTS.linear("up"): "blk.{bid}.ffn_up_exps",
    _GPT_OSS_EXPERTS.linear("down"): "blk.{bid}.ffn_down_exps",
}

# Gemma 3: q/k norms, and norms after attention and after the MLP (on their outputs, before
# the residual add), so the MLP's input norm is pre_feedforward_layernorm, not
# post_attention_layernorm as in llama
_GEMMA3_AWQ = (
    AwqGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
    AwqGroup("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
    AwqGroup("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
    AwqGroup("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
)

_GEMMA3_GGUF_NAMES = {
    **_GGUF_BLOCK_NAMES,
    "post_attention_layernorm": "blk.{bid}.post_attention_norm",
    "pre_feedforward_layernorm": "blk.{bid}.ffn_norm",
    "post_feedforward_layernorm": "blk.{bid}.post_ffw_norm",
}

# Phi-3: one fused Linear for q/k/v and one for gate/up (gate rows first); llama.cpp keeps
# them fused (attn_qkv, ffn_up). v rows -> o_proj is no AWQ pair (the fused qkv_proj's last
# rows are v only without grouped-query attention), as in AutoAWQ's Phi-3 table
_PHI3_LINEARS = (
    ("self_attn.qkv_proj",),
    ("self_attn.o_proj",),
    ("mlp.gate_up_proj",),
    ("mlp.down_proj",),
)

_PHI3_AWQ = (
    AwqGroup("input_layernorm", ("self_attn.qkv_proj",), "self_attn"),
    AwqGroup("post_attention_layernorm", ("mlp.gate_up_proj",), "mlp"),
    AwqGroup("mlp.gate_up_proj", ("mlp.down_proj",), "mlp.down_proj", prev_tail=True),
)

_PHI3_GGUF_NAMES = {
    "input_layernorm": "blk.{bid}.attn_norm",
    "self_attn.qkv_proj": "blk.{bid}.attn_qkv",
    "self_attn.o_proj": "blk.{bid}.attn_output",
    "post_attention_layernorm": "blk.{bid}.ffn_norm",
    "mlp.gate_up_proj": "blk.{bid}.ffn_up",
    "mlp.down_proj": "blk.{bid}.ffn_down",
}

# DeepSeek-V3: multi-head latent attention (MLA) and, after the first_k_dense_replace dense
# blocks, routed experts beside one always-on shared expert. Blocks of both kinds share the
# table: a row names what either kind holds, absent names are skipped. q_proj replaces
# q_a_proj / q_a_layernorm / q_b_proj where q_lora_rank is None (DeepSeek-V2-Lite)
_DEEPSEEK_EXPERTS = ExpertsSpec(count_keys=("n_routed_experts", "num_local_experts"))
_SHARED = "mlp.shared_experts"

# in the order the attention runs them (quantkit.pipeline.staged pauses the forward at each
# group): kv_a_proj_with_mqa reads the same input as q_a_proj but runs after q_b_proj
_DEEPSEEK_LINEARS = (
    ("self_attn.q_a_proj", "self_attn.q_proj"),
    ("self_attn.q_b_proj",),   # reads q_a_layernorm(q_a_proj(x))
    ("self_attn.kv_a_proj_with_mqa",),
    ("self_attn.kv_b_proj",),  # reads kv_a_layernorm(the latent part of kv_a_proj_with_mqa(x))
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),  # the dense blocks
    ("mlp.down_proj",),
    (_DEEPSEEK_EXPERTS.linear("gate"), _DEEPSEEK_EXPERTS.linear("up"),
     f"{_SHARED}.gate_proj", f"{_SHARED}.up_proj"),
    (_DEEPSEEK_EXPERTS.linear("down"), f"{_SHARED}.down_proj"),
)

# the shared expert reads the norm's output as every routed expert does: one scale for all
# (its statistics see every token once, the routed ones top_k times: the mean is the same)
_DEEPSEEK_AWQ = (
    AwqGroup("input_layernorm", ("self_attn.q_a_proj", "self_attn.q_proj",
                                 "self_attn.kv_a_proj_with_mqa"), "self_attn"),
    AwqGroup("self_attn.q_a_layernorm", ("self_attn.q_b_proj",), "self_attn.q_b_proj"),
    AwqGroup("self_attn.kv_a_layernorm", ("self_attn.kv_b_proj",), "self_attn.kv_b_proj"),
    *_LLAMA_AWQ[2:],
    AwqGroup("post_attention_layernorm", (_DEEPSEEK_EXPERTS.linear("gate"),
                                          _DEEPSEEK_EXPERTS.linear("up"),
                                          f"{_SHARED}.gate_proj", f"{_SHARED}.up_proj"),
             "mlp", compensate=(_DEEPSEEK_EXPERTS.router,)),
    AwqGroup(_DEEPSEEK_EXPERTS.linear("up"), (_DEEPSEEK_EXPERTS.linear("down"),),
             _DEEPSEEK_EXPERTS.linear("down")),
    AwqGroup(f"{_SHARED}.up_proj", (f"{_SHARED}.down_proj",), f"{_SHARED}.down_proj"),
)

# llama.cpp's deepseek2 (gguf-py constants MODEL_TENSOR.ATTN_Q_A ..., FFN_*_SHEXP, FFN_EXP_PROBS_B)
_DEEPSEEK_GGUF_NAMES = {
    **{k: v for k, v in _GGUF_BLOCK_NAMES.items() if not k.startswith(("self_attn.k", "self_attn.v"))},
    "self_attn.q_a_proj": "blk.{bid}.attn_q_a",
    "self_attn.q_a_layernorm": "blk.{bid}.attn_q_a_norm",
    "self_attn.q_b_proj": "blk.{bid}.attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "blk.{bid}.attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "blk.{bid}.attn_kv_a_norm",
    _DEEPSEEK_EXPERTS.router: "blk.{bid}.ffn_gate_inp",
    # a whole tensor name (not a module): the router's score-correction bias
    f"{_DEEPSEEK_EXPERTS.router}.e_score_correction_bias": "blk.{bid}.exp_probs_b.bias",
    _DEEPSEEK_EXPERTS.linear("gate"): "blk.{bid}.ffn_gate_exps",
    _DEEPSEEK_EXPERTS.linear("up"): "blk.{bid}.ffn_up_exps",
    _DEEPSEEK_EXPERTS.linear("down"): "blk.{bid}.ffn_down_exps",
    f"{_SHARED}.gate_proj": "blk.{bid}.ffn_gate_shexp",
    f"{_SHARED}.up_proj": "blk.{bid}.ffn_up_shexp",
    f"{_SHARED}.down_proj": "blk.{bid}.ffn_down_shexp",
}

ARCHS: tuple[ArchSpec, ...] = (
    ArchSpec("llama", ("LlamaForCausalLM",), ("llama",), gguf_arch="llama", gguf_permute_qk=True,
             **_LLAMA_LIKE),
    ArchSpec("mistral", ("MistralForCausalLM",), ("mistral",), gguf_arch="llama",
             gguf_permute_qk=True, **_LLAMA_LIKE),
    ArchSpec("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), gguf_arch="qwen2", **_LLAMA_LIKE),
    ArchSpec("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), gguf_arch="qwen3", **_LLAMA_LIKE),
    # Dense blocks (mlp_only_layers) take the llama rows, MoE blocks the expert rows
    ArchSpec("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), gguf_arch="qwen3moe",
             sequential=_QWEN3_MOE_LINEARS, experts=_QWEN3_MOE_EXPERTS, roles=_ROLES,
             awq_groups=_LLAMA_AWQ + _moe_awq(_QWEN3_MOE_EXPERTS),
             gguf_names=_QWEN3_MOE_GGUF_NAMES,
             gguf_kv=("head_dim_if_set", "expert_count", "expert_used_count",
                      "expert_feed_forward_length")),
    # GGUF: llama.cpp's converter writes Mixtral as arch llama (q/k permuted) with 3-D experts
    ArchSpec("mixtral", ("MixtralForCausalLM",), ("mixtral",), gguf_arch="llama",
             gguf_permute_qk=True, sequential=_MIXTRAL_LINEARS, experts=_MIXTRAL_EXPERTS,
             awq_groups=_LLAMA_AWQ[:2] + _moe_awq(_MIXTRAL_EXPERTS),
             roles={k: v for k, v in _ROLES.items() if k.startswith("attn")},
             gguf_names=_MIXTRAL_GGUF_NAMES,
             gguf_kv=("vocab_size", "rope_dimension_count", "head_dim_if_set", "expert_count",
                      "expert_used_count"),
             checkpoint_renames=((".mlp.", ".block_sparse_moe."),)),
    ArchSpec("gpt_oss", ("GptOssForCausalLM",), ("gpt_oss",), gguf_arch="gpt-oss",
             sequential=_GPT_OSS_LINEARS, experts=_GPT_OSS_EXPERTS,
             awq_groups=_LLAMA_AWQ[:2] + _moe_awq(_GPT_OSS_EXPERTS)[:1],
             roles={k: v for k, v in _ROLES.items() if k.startswith("attn")},
             gguf_names=_GPT_OSS_GGUF_NAMES,
             gguf_kv=("head_dim_if_set", "expert_count", "expert_used_count", "sliding_window",
                      "expert_feed_forward_length_intermediate"),
             engine_gaps={"vllm": "vLLM 0.32's gpt-oss loader reads experts only fused "
                          "(gate_up_proj / down_proj) or under its own w13_*/w2_* names and "
                          "skips per-expert gate_proj/up_proj/down_proj tensors without an "
                          "error (a decoded bf16 artifact under these names generated '' on "
                          "CPU); use --format gguf for llama.cpp"}),
    # GGUF: llama.cpp's deepseek2, kv_b_proj split per head into attn_k_b / attn_v_b
    ArchSpec("deepseek_v3", ("DeepseekV3ForCausalLM",), ("deepseek_v3",), gguf_arch="deepseek2",
             sequential=_DEEPSEEK_LINEARS, experts=_DEEPSEEK_EXPERTS,
             awq_groups=_DEEPSEEK_AWQ, gguf_names=_DEEPSEEK_GGUF_NAMES,
             roles={"ffn_down": "mlp.down_proj", "attn_output": "self_attn.o_proj"},
             gguf_kv=("mla", "expert_count", "expert_used_count", "expert_groups",
                      "leading_dense_block_count", "vocab_size", "expert_feed_forward_length",
                      "expert_shared", "expert_gating_sigmoid", "yarn_log_mul"),
             kv_cache_gap="vLLM's MLA caches the compressed latent (kv_a_proj's output), not the "
                          "per-head keys and values transformers computes, so their k/v scales "
                          "would describe other tensors",
             gguf_head_splits={"self_attn.kv_b_proj": (
                 ("blk.{bid}.attn_k_b", "qk_nope_head_dim", True),
                 ("blk.{bid}.attn_v_b", "v_head_dim", False))}),
    ArchSpec("gemma3_text", ("Gemma3ForCausalLM",), ("gemma3_text",), gguf_arch="gemma3",
             sequential=_LLAMA_LINEARS, awq_groups=_GEMMA3_AWQ, gguf_names=_GEMMA3_GGUF_NAMES,
             roles=_ROLES, norm_offset=1.0,
             gguf_kv=("head_dim", "rope_freq_base_swa", "sliding_window",
                      "final_logit_softcapping")),
    ArchSpec("phi3", ("Phi3ForCausalLM",), ("phi3",), gguf_arch="phi3",
             sequential=_PHI3_LINEARS, awq_groups=_PHI3_AWQ, gguf_names=_PHI3_GGUF_NAMES,
             roles={"attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
                    "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"},
             gguf_kv=("rope_scaling_original_context", "rope_dimension_count",
                      "sliding_window_or_0")),
)


def supported_architectures() -> list[str]:
    return [c for a in ARCHS for c in a.hf_classes]


def spec_for_config(config) -> ArchSpec:
    """The row for a transformers config (or a config.json dict); a clear error otherwise."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    classes = tuple(get("architectures") or ())
    model_type = get("model_type")
    for spec in ARCHS:
        if any(c in spec.hf_classes for c in classes) or (not classes and model_type in spec.model_types):
            return spec
    from quantkit.arch.discover import discovered_spec  # noqa: PLC0415 - it imports this module

    return discovered_spec(config, ArchSpec)
    name = ", ".join(classes) or f"model_type={model_type!r}"
    raise UnsupportedArchitecture(
        f"Architecture {name} is not supported by quantkit.",
        f"Supported: {', '.join(supported_architectures())}. "
        "Adding one is a new ArchSpec row in quantkit/arch/__init__.py.",
    )
