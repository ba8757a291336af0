"""The spec types: what quantkit needs to know about a model family, as data.

An ArchSpec's defaults describe the common pre-norm decoder block (llama's: q/k/v, o, gate/up,
down, norms before attention and MLP); a family module states only where it differs. GGUF
tensor names are not written here at all: they come from the gguf package's TensorNameMap
(llama.cpp's own table) for the family's `gguf_arch` (quantkit.arch.gguf_names).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from quantkit.arch.gguf_names import gguf_lookup

__all__ = ["ArchSpec", "AwqGroup", "ExpertsSpec", "EXPERT", "DENSE_LINEARS", "DENSE_AWQ",
           "DENSE_ROLES", "config_getter", "moe_awq_groups", "gguf_name", "gguf_linear_name"]

EXPERT = "{e}"  # in a block-relative Linear name: the expert index (see ExpertsSpec)


def config_getter(config) -> Callable:
    """`get(key, default=None)` on a transformers config or a config.json dict alike."""
    return config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)


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
    # a norm `prev` computes x_hat * (norm_offset + w); None: the ArchSpec's norm_offset. A
    # discovered group states it (measured on the norm itself, quantkit.arch.dataflow): a
    # discovered spec keeps norm_offset 0, its GGUF layout adds what the converter adds
    norm_offset: float | None = None

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
                                  self.compensate, self.norm_offset) for e in range(num_experts))
        if any(EXPERT in b for b in self.balance):
            return (AwqGroup(self.prev, _expand(self.balance, num_experts), self.inspect,
                             self.prev_tail, self.compensate, self.norm_offset),)
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
    `gate=""`: experts without a gate (Nemotron-H's down(act(up(x))), relu^2); `fused_gate_up`
    then holds the up rows alone (E, I, H).
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
    # the experts' activation as vLLM's MoEActivation names it (what its fused-MoE kernels
    # must take): discovered from the experts' act_fn, "_no_mul" when ungated
    activation: str = "silu"

    @property
    def gated(self) -> bool:
        return bool(self.gate)

    @property
    def inputs(self) -> tuple[str, ...]:
        """The projections that read an expert's input: ("gate", "up"), or ("up",) ungated."""
        return ("gate", "up") if self.gated else ("up",)

    def linear(self, which: str, expert: int | str = EXPERT) -> str:
        """Block-relative name of expert `expert`'s `which` Linear ("gate", "up" or "down")."""
        if not getattr(self, which):
            raise ValueError(f"experts at {self.module} have no {which} projection")
        return f"{self.module}.{expert}.{getattr(self, which)}"

    def input_linears(self, expert: int | str = EXPERT) -> tuple[str, ...]:
        """Block-relative names of expert `expert`'s input-side Linears (gate and up, or up)."""
        return tuple(self.linear(w, expert) for w in self.inputs)

    def count(self, config) -> int:
        get = config_getter(config)
        return int(next((v for v in map(get, self.count_keys) if v), 0))


# The common pre-norm decoder block (llama's), what a family differs from.
# Linears of one block, in true-sequential order: each inner tuple shares inputs.
DENSE_LINEARS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)

DENSE_AWQ = (
    AwqGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
             "self_attn"),
    AwqGroup("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"),
    AwqGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
    AwqGroup("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
)

# roles used by mixed-precision recipes (Q4_K_M): llama.cpp's tensor role -> block-relative Linear
DENSE_ROLES = {"attn_v": "self_attn.v_proj", "ffn_down": "mlp.down_proj",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
               "ffn_up": "mlp.up_proj"}


def moe_awq_groups(experts: ExpertsSpec, norm: str = "post_attention_layernorm"
                   ) -> tuple[AwqGroup, ...]:
    """AWQ groups of an MoE block: the norm's one scale shared by EVERY expert's gate/up (the
    router reads the same input: compensated, not quantized), loss on the whole MoE block
    with its real routing; then each expert's up -> down on its own routed tokens."""
    up, down = experts.linear("up"), experts.linear("down")
    moe_block = experts.module.rpartition(".")[0]
    return (AwqGroup(norm, experts.input_linears(), moe_block, compensate=(experts.router,)),
            AwqGroup(up, (down,), down))


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
    sequential: tuple[tuple[str, ...], ...] = DENSE_LINEARS
    awq_groups: tuple[AwqGroup, ...] = DENSE_AWQ
    # Linear sets of a block that have no AWQ group, and why (what discovery found between
    # their input and any norm or Linear: a residual sum, a conv, a recurrence, a gated norm);
    # a family module's table does not list them
    awq_unscaled: tuple[tuple[tuple[str, ...], str], ...] = ()
    # where awq_groups come from: "table" (a family module's rows) or "discovered" (the
    # model's dataflow, quantkit.arch.dataflow); a discovered spec's artifact records them
    awq_source: str = "table"
    # roles used by mixed-precision recipes (Q4_K_M): role -> block-relative Linear name
    roles: dict[str, str] = field(default_factory=lambda: dict(DENSE_ROLES))
    # mixture of experts: per-expert Linears appear in `sequential` as templates with EXPERT
    experts: ExpertsSpec | None = None
    # RMSNorms compute x * (norm_offset + w): Gemma's (1 + w). Scales fold into (offset + w),
    # and GGUF stores offset + w (llama.cpp multiplies by the stored weight)
    norm_offset: float = 0.0
    # where the checkpoint's tensor names differ from transformers 5's module names (the
    # family's WeightRenaming in transformers' conversion_mapping.py, reversed): (module
    # substring, checkpoint substring). Shards are read and artifacts written under the
    # checkpoint's names, the ones the engines load (Mixtral: block_sparse_moe)
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    # engines known to mis-load this family's quantized safetensors artifacts: engine -> why.
    # quantize drops them from the artifact's `engines` and warns (never a silent wrong load)
    engine_gaps: dict[str, str] = field(default_factory=dict)
    # why per-layer FP8 k/v scales (--kv-cache fp8) do not fit this family's cache ("" = they do)
    kv_cache_gap: str = ""
    # block-relative Linears that stay unquantized besides the router (listed in the artifact's
    # ignore list): a scalar gate the engine builds without a quantization method
    dense_linears: tuple[str, ...] = ()
    # full names of the decoder's Linears outside the blocks besides the head, kept dense and
    # listed in the ignore list (Gemma 4's per_layer_model_projection, which vLLM builds with
    # the checkpoint's quantization method: unlisted, it would expect packed weights)
    outer_linears: tuple[str, ...] = ()
    # a separate v_proj Linear next to a transformers attention module whose eager path
    # returns softmax(q k^T) itself, so GPTQ's attention-weighted v_proj Hessian applies
    # (quantkit.pipeline.attention_v; fused qkv_proj, MLA's latent, sinks: not this)
    attention_v: bool = False
    # a vision-language checkpoint's modules beside the language model (vision and audio
    # towers, projectors): dense and in the ignore list unless --quantize-vision quantizes
    # the Linears of `vision_blocks` (the vision encoders' block lists); module-tree paths
    towers: tuple[str, ...] = ()
    vision_blocks: tuple[str, ...] = ()

    # --- GGUF (llama.cpp): the architecture, and what its loader expects beyond the names
    # llama.cpp's architecture name (gguf.MODEL_ARCH_NAMES); None: no GGUF layout
    gguf_arch: str | None = None
    gguf_permute_qk: bool = False  # llama.cpp's llama arch wants q/k rows permuted
    # optional {arch}.* hyper-parameter keys this GGUF arch carries (formats/gguf.py's
    # _OPTIONAL_KV writes each); the rest of the GGUF header is common to every arch
    gguf_kv: tuple[str, ...] = ("vocab_size", "rope_dimension_count", "head_dim_if_set")
    # config keys of {arch}.feed_forward_length, the first one set is written (none set: no
    # key, as the converter's optional lookup); Llama 4's dense MLP is intermediate_size_mlp
    # wide (its intermediate_size is the experts')
    gguf_feed_forward: tuple[str, ...] = ("intermediate_size",)
    # a Linear llama.cpp stores as per-head 3-D pieces (DeepSeek's kv_b_proj -> attn_k_b,
    # attn_v_b): block-relative Linear -> ((GGUF base name with {bid}, config key of the rows
    # each head gives this piece, transposed per head), ...); rows are (head, piece, row)
    gguf_head_splits: dict[str, tuple[tuple[str, str, bool], ...]] = field(default_factory=dict)
    # a Linear llama.cpp stores as other 2-D tensors made of its rows (Qwen3-Next's grouped
    # in_proj_qkvz -> attn_qkv [all q, all k, all v] and attn_gate [all z]): block-relative
    # Linear -> (config_getter(config) -> ((GGUF base name with {bid}, the Linear's row indices
    # in that tensor's order), ...)); rows are independent in every GGML type, so a piece's
    # bytes are its rows' bytes
    gguf_row_splits: dict[str, Callable[[Callable], tuple[tuple[str, object], ...]]] = field(
        default_factory=dict)
    # tensor-name renames llama.cpp's converter applies before its TensorNameMap lookup:
    # (block-relative substring, replacement)
    gguf_renames: tuple[tuple[str, str], ...] = ()
    # RoPE scaling types beyond none/default/linear/yarn this arch's loader applies
    # (llama's llama3 frequency factors, written as rope_freqs)
    gguf_rope_types: tuple[str, ...] = ()
    # llama.cpp's loader fixes which layers are global (set_swa_pattern(n): every nth); the
    # converter writes no pattern, so other layer_types would run differently there (0: none)
    gguf_swa_pattern: int = 0
    # whether the arch's graph reads q/k/v/o biases (attention_bias configs)
    gguf_attention_bias: bool = True
    # further refusals of configs the arch's llama.cpp graph would run differently
    gguf_check: Callable[[dict], None] | None = None
    # the converter's value transforms of dense tensors, by GGUF name: (GGUF name, tensor,
    # config) -> tensor (Qwen3.5's ssm_a = -exp(A_log)); None: written as they are
    gguf_transform: Callable[[str, object, dict], object] | None = None
    # the converter's permutation of a tensor, by GGUF name: (GGUF name, config) -> (row
    # index, column index), None where an axis stays (Qwen3.5's value heads, grouped ->
    # tiled). The GGUF quantizer applies it to a Linear's weight before rounding (a column
    # order does not commute with K-quant blocks) and to its imatrix / Hessian columns;
    # gguf_transform applies it to dense tensors. None: every tensor keeps its order
    gguf_order: Callable[[str, dict], tuple[object, object]] | None = None
    # GGUF base names the converter writes without a .weight suffix (Qwen3.5's ssm_a)
    gguf_bare: tuple[str, ...] = ()
    # embedding tables outside the blocks besides `embed` that llama-quantize quantizes as
    # token embeddings (Gemma 4's per-layer embeddings): (module, its (rows, cols) from
    # config_getter(config), None where the config has no such table)
    gguf_outer_embeds: tuple[tuple[str, Callable[[Callable], tuple[int, int] | None]], ...] = ()
    # which configs llama.cpp's loader calls a 70B model (llama_model_quantize then gives
    # attn_v more bits): a predicate on config_getter(config); None: never
    gguf_70b: Callable[[Callable], bool] | None = None
    # multi-token-prediction (MTP) layers as llama.cpp's converter writes them: extra decoder
    # blocks after the trunk's (blk.{num_hidden_layers + i}, their own tensors named nextn.*
    # by the arch's TensorNameMap), counted in block_count and in {arch}.nextn_predict_layers.
    # The config key of how many (GLM-4.5: num_nextn_predict_layers); None: the converter
    # writes no MTP layers for this arch, and a checkpoint with MTP tensors is refused for GGUF
    gguf_nextn_key: str | None = None
    # why llama.cpp keeps no MTP layers for this arch, where gguf_nextn_key is None and
    # that is a family fact (DeepSeek-V3: the converter drops them); the refusal says it
    gguf_no_mtp: str = ""
    # llama.cpp's architecture for a family whose GGUF quantkit does not write (gguf_arch
    # None): the refusal names it and why (DeepSeek-V3.2's deepseek32)
    gguf_unwritten: str | None = None
    # special tokens the converter's vocabulary path of this arch sets by their text, each
    # only where tokenizer_config.json has not set that kind already (gguf.SpecialVocab's
    # _set_special_token): ((kind, token text), ...); GLM's [gMASK] / <|user|> / ...
    gguf_special_tokens: tuple[tuple[str, str], ...] = ()

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
        get = config_getter(config)
        pieces = self.gguf_head_splits[rel]
        sizes = [int(get(key)) for _, key, _ in pieces]
        heads = weight.reshape(int(get("num_attention_heads")), sum(sizes), weight.shape[-1])
        return [(base, (part.transpose(1, 2) if transpose else part).contiguous())
                for (base, _, transpose), part in zip(pieces, heads.split(sizes, dim=1), strict=True)]

    def gguf_split(self, rel: str) -> bool:
        """Whether block-relative Linear `rel` is written as pieces (gguf_head_splits or
        gguf_row_splits), each its own GGUF tensor with its own type."""
        return rel in self.gguf_head_splits or rel in self.gguf_row_splits

    def split_bases(self, rel: str, config) -> tuple[str, ...]:
        """The GGUF base names (with {bid}) of a split Linear's pieces, in piece order."""
        if rel in self.gguf_head_splits:
            return tuple(base for base, _, _ in self.gguf_head_splits[rel])
        return tuple(base for base, _ in self.gguf_row_splits[rel](config_getter(config)))

    def split_pieces(self, rel: str, weight, config) -> list[tuple[str, object]]:
        """A split Linear's weight -> [(GGUF base name with {bid}, piece)]: per-head 3-D
        pieces (head_pieces) or 2-D row pieces (gguf_row_splits)."""
        if rel in self.gguf_head_splits:
            return self.head_pieces(rel, weight, config)
        return [(base, weight[rows].contiguous())
                for base, rows in self.gguf_row_splits[rel](config_getter(config))]

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

    def gguf_nextn_layers(self, config) -> int:
        """How many MTP (nextn) blocks llama.cpp's converter appends for this config (0: none)."""
        if self.gguf_nextn_key is None:
            return 0
        return int(config_getter(config)(self.gguf_nextn_key) or 0)

    def gguf_block_count(self, config) -> int:
        """{arch}.block_count as the converter writes it: the trunk's blocks and the nextn
        blocks after them (Nemotron-H's config.json has no num_hidden_layers: its layer list
        says how many)."""
        get = config_getter(config)
        trunk = get("num_hidden_layers") or len(get("layers_block_type"))
        return int(trunk) + self.gguf_nextn_layers(config)

    def gguf_is_70b(self, config) -> bool:
        """Whether llama.cpp's loader calls this model 70B (see gguf_70b)."""
        return self.gguf_70b is not None and bool(self.gguf_70b(config_getter(config)))

    # ------------------------------------------------------------------ GGUF tensor names
    def gguf_tensor(self, name: str) -> tuple[str, int | None] | None:
        """HF tensor name -> (GGUF tensor name, expert index or None), or None where GGUF has
        no such tensor: "model.layers.0.self_attn.q_proj.bias" -> ("blk.0.attn_q.bias", None).

        Routed experts share one 3-D GGUF tensor per projection (llama.cpp's
        `ffn_{gate,up,down}_exps`, expert axis slowest), so a routed expert's weight is one
        slice of it: "...mlp.experts.5.up_proj.weight" -> ("blk.0.ffn_up_exps.weight", 5).
        Checkpoint spellings (Mixtral's block_sparse_moe, as streamed from the shards) and
        module names map alike. The one place HF -> GGUF naming is decided.
        """
        module, _, suffix = self.module_name(name).rpartition(".")
        prefix = self.block_path + "."
        if module.startswith(prefix):
            bid, _, rel = module[len(prefix):].partition(".")
            # a bare parameter of the block itself (Gemma 4's layer_scalar): no module part
            slot = self._gguf_block(f"{rel}.{suffix}" if rel else suffix) if bid.isdigit() else None
            return (slot[0].format(bid=int(bid)), slot[1]) if slot else None
        if self.gguf_arch is None:
            return None
        # the embeddings, final norm and head, and whatever else outside the blocks the arch's
        # table names (Gemma 4's per-layer embeddings and their projection)
        found = gguf_lookup(self.gguf_arch, self.checkpoint_name(name))
        return (found, None) if found and not found.startswith("blk.") else None

    def gguf_slot(self, rel: str) -> tuple[str, int | None] | None:
        """Block-relative module name -> (GGUF base name template with {bid}, expert index):
        `mlp.experts.3.down_proj` -> ("blk.{bid}.ffn_down_exps", 3)."""
        slot = self._gguf_block(f"{rel}.weight")
        return (slot[0].removesuffix(".weight"), slot[1]) if slot else None

    def _gguf_block(self, rel: str) -> tuple[str, int | None] | None:
        """Block-relative tensor name -> (GGUF tensor name template with {bid}, expert)."""
        if self.gguf_arch is None or self.gguf_split(rel.rpartition(".")[0]):
            return None  # no GGUF layout / written as pieces (split_pieces)
        def renamed(name: str) -> str:
            for old, new in self.gguf_renames:
                name = name.replace(old, new)
            return name

        expert = None
        # experts by the checkpoint's name (Granite's block_sparse_moe.experts, renamed below)
        # or by the renamed one (families whose renames lead into the experts module)
        for name in (rel, renamed(rel)):
            if self.is_expert_linear(name):
                head, _, tail = name[len(self.experts.module) + 1:].partition(".")
                if head.isdigit():  # every expert's tensor is one slice of the stacked one
                    expert, rel = int(head), f"{self.experts.module}.{tail}"
                break
        full = f"{self.block_path}.0.{renamed(rel)}"
        # the checkpoint's spelling; else the module tree's, under which the converter names
        # what it renames itself (Nemotron-H's stacked experts: model.layers.N.mlp.experts.*)
        found = gguf_lookup(self.gguf_arch, self.checkpoint_name(full)) or \
            gguf_lookup(self.gguf_arch, full)
        if found is None or not found.startswith("blk.0."):
            return None
        return "blk.{bid}." + found[len("blk.0."):], expert


def gguf_name(spec: ArchSpec, hf_name: str) -> str | None:
    """HF tensor name -> GGUF tensor name ("model.layers.0.self_attn.q_proj.bias" -> "blk.0.attn_q.bias")."""
    slot = spec.gguf_tensor(hf_name)
    return slot[0] if slot else None


def gguf_linear_name(spec: ArchSpec, module: str) -> str | None:
    """HF Linear (module) name -> its GGUF weight name ("model.layers.3.mlp.down_proj" ->
    "blk.3.ffn_down.weight"; every expert's Linear -> its block's 3-D tensor)."""
    return gguf_name(spec, f"{module}.weight")
