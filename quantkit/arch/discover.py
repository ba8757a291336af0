"""Find a decoder model's layout from the model itself: blocks, Linears, groups and experts.

Why: a family entered quantkit only as a hand-written ArchSpec row, so every model of a new
family was refused, RTN included, although everything RTN, GPTQ or FP8 needs can be read off
the model transformers builds:
- the decoder blocks: the longest ModuleList of the text decoder (`model.get_decoder()`, so a
  vision-language model's language part, not its vision tower);
- embeddings, final norm and head: `get_input_embeddings()`, the decoder's own norm, and
  `get_output_embeddings()`;
- the sequential groups: one forward of the model on the meta device (shapes only, no weights
  needed) with a pre-hook on every Linear; consecutive Linears that read the very same tensor
  form one group, in the order the forward runs them (the rule the staged forward checks);
- routed experts: transformers 5 keeps them fused as 3-D `gate_up_proj` / `down_proj`
  parameters (`up_proj` / `down_proj` for experts without a gate, Nemotron-H's); the per-expert names the checkpoints (and vLLM) use come from transformers' own
  checkpoint conversion mapping, which says how it fused them.
A family module then only overrides what cannot be discovered (AWQ pairs, GGUF names, engine
gaps, layouts stored differently in the checkpoint).
"""

from __future__ import annotations

import dataclasses
import re
from contextlib import ExitStack
from dataclasses import dataclass

import torch
from torch import nn

from quantkit.arch.dataflow import Dataflow, Found, ordered_union, present_groups
from quantkit.arch.spec import EXPERT, ArchSpec, AwqGroup, ExpertsSpec
from quantkit.errors import UnsupportedArchitecture

__all__ = ["Layout", "discover_layout", "trace_groups"]


@dataclass(frozen=True)
class Layout:
    """What discovery found: module paths as the model's module tree names them."""

    block_path: str
    embed: str
    final_norm: str
    lm_head: str
    sequential: tuple[tuple[str, ...], ...]
    experts: ExpertsSpec | None
    # block-relative names of modules that stay dense although they are Linears (routers)
    dense_linears: tuple[str, ...] = ()
    # (module substring, checkpoint substring) where the checkpoint names tensors otherwise
    # (transformers' WeightRenaming, reversed), as ArchSpec.checkpoint_renames
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    # the decoder's Linears outside the blocks, but the head (ArchSpec.outer_linears)
    outer_linears: tuple[str, ...] = ()
    # a vision-language model's parts beside the language model (vision / audio towers,
    # projectors), and the vision encoders' block lists (what --quantize-vision quantizes)
    towers: tuple[str, ...] = ()
    vision_blocks: tuple[str, ...] = ()
    # AWQ smoothing groups read off the dataflow (quantkit.arch.dataflow), and the Linear
    # sets that have none, with why (ArchSpec.awq_unscaled)
    awq_groups: tuple[AwqGroup, ...] = ()
    awq_unscaled: tuple[tuple[tuple[str, ...], str], ...] = ()


def _path_of(model: nn.Module, target: nn.Module | None) -> str:
    if target is None:
        return ""
    return next((n for n, m in model.named_modules() if m is target), "")


def _blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The decoder's blocks: the longest ModuleList under the text decoder."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    prefix = _path_of(model, decoder)
    lists = [(n, m) for n, m in decoder.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no ModuleList of decoder blocks")
    name, blocks = max(lists, key=lambda nm: (len(nm[1]), -nm[0].count(".")))
    return ".".join(p for p in (prefix, name) if p), blocks


def _final_norm(model: nn.Module, block_path: str) -> str:
    """The decoder's norm after the blocks: a direct child of the blocks' owner with a 1-D
    weight as wide as the hidden size (`norm`, `norm_f`, `final_layernorm`, ...)."""
    owner_path = block_path.rpartition(".")[0]
    owner = model.get_submodule(owner_path) if owner_path else model
    hidden = model.get_input_embeddings().weight.shape[-1]
    for name, child in owner.named_children():
        weight = getattr(child, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 1 and weight.shape[0] == hidden \
                and "norm" in type(child).__name__.lower():
            return f"{owner_path}.{name}" if owner_path else name
    return ""


def _fused_experts(block: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules of `block` holding routed experts as fused 3-D parameters (transformers 5's
    `*Experts`: gate_up_proj + down_proj, or up_proj + down_proj without a gate)."""
    return [(n, m) for n, m in block.named_modules()
            if not isinstance(m, nn.modules.conv._ConvNd)
            and any(p.dim() == 3 and "proj" in n for n, p in m.named_parameters(recurse=False))]


def _checkpoint_expert_names(model: nn.Module
                             ) -> tuple[tuple[str, str, str], tuple[tuple[str, str], ...], bool]:
    """(gate, up, down) per-expert Linear names the checkpoint uses ("" gate: experts without
    one, whose fused `up_proj` merges per-expert up Linears), the renames between module and
    checkpoint names, and whether the checkpoint stores experts per expert (a converter merges
    them) rather than fused as the module holds them (Llama 4, Granite 4), from transformers'
    checkpoint conversion mapping."""
    names = ("gate_proj", "up_proj", "down_proj")
    renames: list[tuple[str, str]] = []
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:  # an older transformers without conversion mappings
        return names, (), True
    gate = up = down = None
    for t in get_model_conversion_mapping(model, add_legacy=False):
        sources = list(getattr(t, "source_patterns", []) or [])
        targets = list(getattr(t, "target_patterns", []) or [])
        if isinstance(t, WeightConverter) and targets:
            per_expert = [re.search(r"experts\.\*\.(\w+)\.weight", s) for s in sources]
            found = [m.group(1) for m in per_expert if m]
            if targets[0].endswith("experts.gate_up_proj") and len(found) == 2:
                gate, up = found
            elif targets[0].endswith("experts.up_proj") and len(found) == 1:
                gate, up = "", found[0]
            elif targets[0].endswith("experts.down_proj") and len(found) == 1:
                down = found[0]
        elif isinstance(t, WeightRenaming) and len(sources) == 1 and len(targets) == 1:
            # plain names, or regexes that only escape their dots (Granite's
            # block_sparse_moe\.input_linear\.weight -> block_sparse_moe.experts.gate_up_proj)
            src, dst = (p.replace("\\.", ".") for p in (sources[0], targets[0]))
            if re.fullmatch(r"[\w.]+", src) and re.fullmatch(r"[\w.]+", dst):
                renames.append((dst, src))  # (module substring, checkpoint substring)
    if gate is not None and up and down:
        names = (gate, up, down)
    return names, tuple(renames), gate is not None and bool(up and down)


# transformers' activation modules -> vLLM's MoEActivation names (ExpertsSpec.activation)
_ACTIVATIONS = {"SiLUActivation": "silu", "SiLU": "silu", "GELUTanh": "gelu_tanh",
                "PytorchGELUTanh": "gelu_tanh", "GELUActivation": "gelu", "GELU": "gelu",
                "ReLUSquaredActivation": "relu2"}


def _experts_spec(model: nn.Module, blocks: nn.ModuleList) -> tuple[ExpertsSpec | None, tuple]:
    for block in blocks:
        fused = _fused_experts(block)
        if not fused:
            continue
        module, experts = fused[0]
        (gate, up, down), renames, per_expert = _checkpoint_expert_names(model)
        # gated: gate_up_proj (E, 2I, H); without a gate (Nemotron-H): up_proj (E, I, H)
        fused_in = next((p for p in ("gate_up_proj", "up_proj")
                         if isinstance(getattr(experts, p, None), torch.Tensor)
                         and getattr(experts, p).dim() == 3), None)
        if not per_expert and fused_in is not None:  # stored fused: the module's own names
            gate = "gate_proj" if fused_in == "gate_up_proj" else ""
        if fused_in is None or (fused_in == "up_proj") != (gate == ""):
            raise UnsupportedArchitecture(
                f"{type(model).__name__}: the routed experts at {module} have neither a fused "
                "gate_up_proj nor (without a gate) an up_proj that the checkpoint's "
                "conversion mapping names per expert.",
                "Quantize with a family module that describes these experts (quantkit/arch/).")
        n = int(getattr(experts, fused_in).shape[0])
        owner = module.rpartition(".")[0]
        router = next((f"{owner}.{c}" if owner else c
                       for c, m in (block.get_submodule(owner) if owner else block).named_children()
                       if isinstance(getattr(m, "weight", None), torch.Tensor)
                       and m.weight.dim() == 2 and m.weight.shape[0] == n), "")
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
            else model.config
        keys = tuple(k for k in ("num_experts", "num_local_experts", "n_routed_experts")
                     if getattr(config, k, None) == n) or ("num_experts",)
        has_bias = isinstance(getattr(experts, f"{fused_in}_bias", None), torch.Tensor)
        # a converter merges F.linear weights: (E, out, in); stored fused, it may be either
        transposed = not per_expert and _transposed(model, module, getattr(experts, fused_in),
                                                    experts.down_proj)
        act = _ACTIVATIONS.get(type(getattr(experts, "act_fn", None)).__name__, "silu")
        return ExpertsSpec(module=module, count_keys=keys, gate=gate, up=up, down=down,
                           router=router, fused_gate_up=fused_in, bias=has_bias,
                           fused_transposed=transposed, stored_fused=not per_expert,
                           activation=act if gate else f"{act}_no_mul"), renames
    return None, ()


def _transposed(model: nn.Module, module: str, fused_in: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether fused experts are (E, in, out), applied as x @ W (Llama 4), not F.linear's
    (E, out, in): the input side's middle axis is the hidden size (its last axis then is not)."""
    hidden = model.get_input_embeddings().weight.shape[-1]
    for w, in_axis in ((fused_in, 1), (down, 2)):  # where the hidden size sits if transposed
        if w.shape[in_axis] == hidden and w.shape[3 - in_axis] != hidden:
            return True
        if w.shape[3 - in_axis] == hidden and w.shape[in_axis] != hidden:
            return False
    raise UnsupportedArchitecture(
        f"{type(model).__name__}: the fused experts at {module} are as wide as the hidden size "
        "on both axes, so their layout ((E, out, in) or (E, in, out)) cannot be told apart.",
        "Quantize with a family module that describes these experts (quantkit/arch/).")


def dense_linears(blocks: nn.ModuleList, experts: ExpertsSpec | None) -> tuple[str, ...]:
    """Block-relative Linears that stay unquantized: the router, and one-row Linears (a scalar
    gate such as Qwen3-Next's shared_expert_gate, which vLLM builds with quant_config=None)."""
    names = {experts.router} if experts is not None and experts.router else set()
    for block in blocks:
        names |= {n for n, m in block.named_modules()
                  if isinstance(m, nn.Linear) and m.out_features == 1}
    return tuple(sorted(names))


def trace_groups(model: nn.Module, blocks: nn.ModuleList, experts: ExpertsSpec | None,
                 seq_len: int | None = None) -> list[list[tuple[str, ...]]]:
    """Per block, its sequential groups, from one meta-device forward of the whole model.

    Fused experts are not run (their forward is replaced by zeros of the right shape: routing
    needs real values); the experts module counts as two template groups, (gate, up) (or (up)
    without a gate) reading
    its input and (down) reading what they make, at the point where the module is called.
    """
    return _trace(model, blocks, experts, seq_len)[0]


def _trace(model: nn.Module, blocks: nn.ModuleList, experts: ExpertsSpec | None,
           seq_len: int | None = None) -> tuple[list[list[tuple[str, ...]]], list[Found]]:
    """trace_groups' groups, and per block the AWQ groups the same forward's dataflow shows
    (quantkit.arch.dataflow)."""
    if seq_len is None:  # fake tensors cost nothing: long enough for every top-k of the config
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
            else model.config
        seq_len = max(16, int(getattr(config, "index_topk", 0) or 0))
    calls: list[list[tuple[str, object]]] = [[] for _ in blocks]
    dense = set(dense_linears(blocks, experts))
    flow = Dataflow()
    with ExitStack() as stack:
        for bi, block in enumerate(blocks):
            fused = dict(_fused_experts(block))
            quantized = set()
            for name, mod in block.named_modules():
                if name in fused:
                    def run(*args, _bi=bi, _mod=mod, **kwargs):
                        hidden = args[0] if args else next(iter(kwargs.values()))
                        calls[_bi].append(("<experts>", hidden))
                        if experts is not None:
                            flow.experts(_bi, experts, _mod, hidden)
                        flow.quiet += 1
                        try:
                            return torch.zeros_like(hidden)
                        finally:
                            flow.quiet -= 1
                    stack.callback(setattr, mod, "forward", mod.forward)
                    mod.forward = run
                elif isinstance(mod, nn.Linear) and name not in dense \
                        and not any(name.startswith(f + ".") for f in fused):
                    quantized.add(name)
                    def hook(_m, args, _bi=bi, _name=name):
                        calls[_bi].append((_name, args[0]))
                    stack.enter_context(mod.register_forward_pre_hook(hook))
            flow.hook_block(bi, block, quantized, dense | ({experts.router} if experts else set()),
                            tuple(fused), stack)
        device = next(model.parameters()).device
        with torch.no_grad(), _fake_mode(model) as mode:
            ids = torch.zeros((1, seq_len), dtype=torch.long, device=device)
            ids = mode.from_tensor(ids) if mode is not None else ids
            with flow:
                model(input_ids=ids, use_cache=False)
    out = []
    for block_calls in calls:
        out.append(_groups(block_calls, experts))
    compensable = dense | ({experts.router} if experts is not None and experts.router else set())
    found = [flow.groups(bi, block, compensable) for bi, block in enumerate(blocks)]
    return out, found


def _fake_mode(model: nn.Module):
    """FakeTensorMode when the model's tensors are fake (shapes only; transformers skips its
    data-dependent mask checks for fake tensors), else a no-op context."""
    from contextlib import nullcontext

    from torch._subclasses.fake_tensor import FakeTensor

    param = next(model.parameters())
    if isinstance(param, FakeTensor):
        return param.fake_mode
    return nullcontext()


def _groups(calls: list[tuple[str, object]], experts: ExpertsSpec | None) -> list[tuple[str, ...]]:
    groups: list[list[str]] = []
    last = None
    for name, x in calls:
        if name == "<experts>":
            groups.append(list(experts.input_linears()))
            groups.append([experts.linear("down")])
            last = None
            continue
        if groups and x is last and name not in groups[-1]:
            groups[-1].append(name)
        elif not any(name in g for g in groups):
            groups.append([name])
            last = x
    return _merge_shared_experts([tuple(g) for g in groups], experts)


def _merge_shared_experts(groups: list[tuple[str, ...]], experts: ExpertsSpec | None
                          ) -> list[tuple[str, ...]]:
    """A shared expert (a dense MLP beside the routed experts, under the same MoE module) reads
    the MoE block's input as every routed expert does: its groups join the routed experts'
    groups depth by depth ((gate, up) with theirs, down with theirs), routed names first."""
    if experts is None:
        return groups
    moe = experts.module.rpartition(".")[0]
    routed = [i for i, g in enumerate(groups) if any(EXPERT in n for n in g)]
    if not routed:
        return groups
    shared = [i for i, g in enumerate(groups) if i not in routed and moe
              and all(n.startswith(moe + ".") for n in g)]
    # a 1-row gate on the shared expert's output (Qwen3-Next's shared_expert_gate) is no MLP
    # depth of its own: it stays where it is
    merged = [list(g) for g in groups]
    for depth, si in enumerate(shared[:len(routed)]):
        merged[routed[depth]] += groups[si]
        merged[si] = []
    return [tuple(g) for g in merged if g]


def _towers(model: nn.Module, decoder: str, head: str) -> tuple[str, ...]:
    """The modules beside the text decoder on its way up to the root (a vision-language
    model's `visual`, `vision_tower`, `multi_modal_projector`, `audio_tower`, ... beside
    `model.language_model`; Llama 4's `vision_model` beside the whole `language_model` causal
    LM): what the language model's blocks do not hold, the output head excepted. A causal LM
    (its decoder, the blocks' owner, a child of the root) has none."""
    if "." not in decoder:
        return ()
    found = []
    below = decoder  # the module holding the blocks (get_decoder() may name its owner)
    while below:
        owner_path = below.rpartition(".")[0]
        owner = model.get_submodule(owner_path) if owner_path else model
        for name, child in owner.named_children():
            full = f"{owner_path}.{name}" if owner_path else name
            if full != below and full != head and any(True for _ in child.parameters()):
                found.append(full)
        below = owner_path
    return tuple(found)


def _vision_blocks(model: nn.Module, towers: tuple[str, ...]) -> tuple[str, ...]:
    """Per vision tower (a tower whose name says vision: `visual`, `vision_tower`,
    `vision_model`), its encoder blocks: the longest ModuleList holding Linears."""
    out = []
    for tower in towers:
        if "vis" not in tower.rpartition(".")[2]:
            continue
        lists = [(n, m) for n, m in model.get_submodule(tower).named_modules()
                 if isinstance(m, nn.ModuleList) and len(m)
                 and any(isinstance(x, nn.Linear) for x in m.modules())]
        if lists:
            name = max(lists, key=lambda nm: (len(nm[1]), -nm[0].count(".")))[0]
            out.append(f"{tower}.{name}")
    return tuple(out)


def _prefix_renames(model: nn.Module, prefixes: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """(module prefix, checkpoint prefix) for the top-level parts a multimodal checkpoint
    names otherwise (Mistral 3's `model.language_model.` is `language_model.model.` in the
    checkpoint, `lm_head.` is `language_model.lm_head.`): transformers' own renamings,
    reversed the way save_pretrained reverses them, applied to one tensor name of each part."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:
        return ()
    renamings = [t.reverse_transform() for t in get_model_conversion_mapping(model, add_legacy=False)[::-1]
                 if isinstance(t, WeightRenaming)]
    if not renamings:
        return ()
    names = list(model.state_dict())
    out = []
    for prefix in prefixes:
        name = next((n for n in names if n.startswith(prefix + ".")), None)
        if name is None:
            continue
        stored, _ = rename_source_key(name, renamings, [], reverse=True)
        tail = name[len(prefix):]
        if stored != name and stored.endswith(tail):
            out.append((prefix + ".", stored[: -len(tail)] + "."))
    return tuple(out)


def discover_layout(model: nn.Module) -> Layout:
    """The layout of `model` (built on the meta device is enough)."""
    block_path, blocks = _blocks(model)
    embed = _path_of(model, model.get_input_embeddings())
    head = _path_of(model, model.get_output_embeddings()) if model.get_output_embeddings() is not None else ""
    experts, renames = _experts_spec(model, blocks)
    per_block, found = _trace(model, blocks, experts)
    awq_groups, unscaled = _awq(found, blocks, experts)
    decoder = block_path.rpartition(".")[0]
    outer = tuple(n for n, m in model.named_modules() if isinstance(m, nn.Linear)
                  and n != head and not n.startswith(block_path + ".")
                  and (not decoder or n.startswith(decoder + ".")))
    towers = _towers(model, decoder, head)
    if towers:  # a vision-language checkpoint: its parts as the checkpoint names them
        renames += _prefix_renames(model, (decoder, *towers, head))
    return Layout(block_path, embed, _final_norm(model, block_path), head,
                  ordered_union(per_block), experts,
                  dense_linears(blocks, experts), renames, outer_linears=outer,
                  towers=towers, vision_blocks=_vision_blocks(model, towers),
                  awq_groups=awq_groups, awq_unscaled=unscaled)


def _awq(found: list[Found], blocks: nn.ModuleList, experts: ExpertsSpec | None
         ) -> tuple[tuple[AwqGroup, ...], tuple[tuple[tuple[str, ...], str], ...]]:
    """One table of AWQ groups for every block (ArchSpec.awq_groups: the scaling code takes
    per block the rows whose balance Linears it holds), and the Linear sets without a group.
    A row that would resolve on some block to other than what that block's own dataflow
    showed (the same Linears scaled into another prev) is dropped, with why."""
    table = list(ordered_union([f.groups for f in found]))
    em = experts.module if experts is not None else None
    unscaled = list(dict.fromkeys(u for f in found for u in f.unscaled))
    for f, block in zip(found, blocks, strict=True):
        bad = [g for g in table if g.balance and g not in f.groups
               and present_groups((g,), block, em) and present_groups((g,), block, em)[0]
               not in f.groups]
        for g in bad:
            table.remove(g)
            unscaled.append((g.balance, f"they scale into {g.prev} in some blocks only"))
    return tuple(table), tuple(unscaled)


_DISCOVERED: dict[str, ArchSpec] = {}



def discovered_spec(config, engine_dense: dict[str, tuple[str, ...]] | None = None) -> ArchSpec:
    """An ArchSpec for a config no family module describes, from its model built on fake
    tensors (transformers' own class, named by the config; never remote code). Cached per
    config. Only what discovery finds is set: AWQ groups where the dataflow shows them
    (quantkit.arch.dataflow), no GGUF layout. `engine_dense`:
    per model_type, block-relative Linears the engine builds without a quantization method
    (facts no model can tell; they leave the groups and stay dense). Refusals are
    UnsupportedArchitecture whose message says why (the caller names the architecture)."""
    import json

    import transformers
    from torch._subclasses.fake_tensor import FakeTensorMode

    raw = config if isinstance(config, dict) else config.to_dict()
    key = json.dumps(raw, sort_keys=True, default=str)
    if key in _DISCOVERED:
        return _DISCOVERED[key]
    classes = list(raw.get("architectures") or ())
    model_type = raw.get("model_type")
    cls = next((getattr(transformers, c) for c in classes if hasattr(transformers, c)), None)
    if cls is None or model_type not in transformers.CONFIG_MAPPING:
        raise UnsupportedArchitecture(
            f"transformers {transformers.__version__} has no model class for it "
            "(custom code is never discovered).")
    if isinstance(config, dict):
        config_cls = transformers.CONFIG_MAPPING[model_type]
        # a raw config.json: transformers writes inf / nan as {"__float__": ...} objects
        # (Nemotron-H's time_step_limit) and decodes them when it reads the file itself
        decode = getattr(config_cls, "_decode_special_floats", lambda d: d)
        config = config_cls.from_dict(decode(dict(raw)))
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = cls(config)
        layout = discover_layout(model)
    except UnsupportedArchitecture:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of the trace is a clear refusal
        raise UnsupportedArchitecture(
            f"its layout could not be discovered ({type(exc).__name__}: {exc}).") from exc
    if not layout.sequential:
        raise UnsupportedArchitecture(
            f"its blocks ({layout.block_path}) hold no torch.nn.Linear to quantize.")
    router = layout.experts.router if layout.experts is not None else ""
    kept = tuple((engine_dense or {}).get(model_type, ()))
    sequential = tuple(g for g in (tuple(n for n in group if n not in kept)
                                   for group in layout.sequential) if g)
    awq_groups, unscaled = _keep_dense(layout.awq_groups, kept)
    spec = ArchSpec(model_type or classes[0], tuple(classes), (model_type,),
                    block_path=layout.block_path, embed=layout.embed,
                    final_norm=layout.final_norm, lm_head=layout.lm_head,
                    sequential=sequential, experts=layout.experts,
                    awq_groups=awq_groups, awq_unscaled=layout.awq_unscaled + unscaled,
                    awq_source="discovered",
                    roles={}, attention_v=False,
                    checkpoint_renames=layout.checkpoint_renames,
                    outer_linears=layout.outer_linears,
                    towers=layout.towers, vision_blocks=layout.vision_blocks,
                    dense_linears=tuple(n for n in layout.dense_linears if n != router) + kept,
                    kv_cache_gap="per-layer k/v scales are checked on the families that have "
                                 "a family module only")
    _DISCOVERED[key] = spec
    return spec


def _keep_dense(groups: tuple[AwqGroup, ...], kept: tuple[str, ...]):
    """AWQ groups with the Linears the engine keeps dense out of their balance: behind a norm
    they are compensated (their columns * s, as a router's); behind a Linear, whose rows the
    fold would divide under them, the group goes."""
    out, unscaled = [], []
    for g in groups:
        stay = tuple(n for n in g.balance if n in kept)
        if not stay:
            out.append(g)
        elif g.norm_offset is None:  # a Linear prev
            unscaled.append((g.balance, f"{', '.join(stay)} stay dense behind {g.prev}"))
        elif len(stay) < len(g.balance):
            out.append(dataclasses.replace(
                g, balance=tuple(n for n in g.balance if n not in kept),
                compensate=g.compensate + stay))
        else:
            unscaled.append((g.balance, "the engine keeps them all dense"))
    return tuple(out), tuple(unscaled)
