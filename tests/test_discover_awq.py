"""AWQ smoothing groups discovered from the dataflow (quantkit.arch.dataflow) on shape-only
models: equal to the hand-written tables on the ten known families, and what they are (and
are not) on the families no table names.

The models are built under FakeTensorMode from transformers' own config classes, as in
test_discover.py; the norm probe runs each norm class alone on real tensors.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from discovered_families import _COMMON, FAMILIES
from test_discover import _fake, _known
from tiny_models import ARCH_CONFIGS
from torch import nn

from quantkit.arch import EXPERT, AwqGroup, spec_for_config
from quantkit.arch.dataflow import present_groups
from quantkit.arch.discover import discover_layout, discovered_spec
from quantkit.methods.scaling import fold_scale, scale_plans
from quantkit.pipeline.experts import linearize_experts
from quantkit.types import BlockContext

pytestmark = pytest.mark.fast


def _effective(groups, block: nn.Module, norm_offset: float) -> list[AwqGroup]:
    """Groups with the offset each norm prev folds with (a table row leaves it to the spec)."""
    out = []
    for g in groups:
        linear_prev = EXPERT in g.prev or isinstance(block.get_submodule(g.prev), nn.Linear)
        offset = None if linear_prev else (norm_offset if g.norm_offset is None else g.norm_offset)
        out.append(dataclasses.replace(g, norm_offset=offset))
    return out


def _per_block(model, spec, groups):
    blocks = model.get_submodule(spec.block_path)
    em = spec.experts.module if spec.experts else None
    return [_effective(present_groups(groups, b, em), b, spec.norm_offset) for b in blocks]


@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
def test_discovered_awq_groups_equal_the_family_table(arch):
    """On every block of the ten known families, the discovered groups are the table's rows as
    the scaling code resolves them on that block (quantkit.methods.scaling: balance names the
    block lacks skipped): same prev, balance (in order), inspect module, prev_tail, router
    compensation and norm offset (Gemma 3's 1 + w), in the table's order."""
    model = _known(arch)
    spec = spec_for_config(model.config)
    layout = discover_layout(model)
    got, want = _per_block(model, spec, layout.awq_groups), _per_block(model, spec, spec.awq_groups)
    assert got == want
    assert all(g for g in got)  # every block has groups to compare


def test_phi3_fused_qkv_has_no_v_to_o_group_even_without_grouped_query_attention():
    """Phi-3's v rows are the fused qkv_proj's last rows; with as many kv heads as heads the
    tail fold would even fit, but a slice of a fused Linear's rows through attention is no
    AWQ pair (the table's and AutoAWQ's rule), and discovery says why."""
    config_cls, model_cls = ARCH_CONFIGS["phi3"]
    model = _fake(config_cls, model_cls, intermediate_size=512, num_key_value_heads=4)
    layout = discover_layout(model)
    assert [g.prev for g in layout.awq_groups] == [
        "input_layernorm", "post_attention_layernorm", "mlp.gate_up_proj"]
    assert layout.awq_groups[2].prev_tail
    why = dict(layout.awq_unscaled)[("self_attn.o_proj",)]
    assert "through attention" in why


def test_gemma3_norms_fold_into_one_plus_w():
    """Gemma 3's RMSNorm computes x_hat * (1 + w): the probe measures offset 1 on every norm
    prev, the table's norm_offset."""
    config_cls, model_cls = ARCH_CONFIGS["gemma3_text"]
    layout = discover_layout(_known("gemma3_text"))
    norms = [g for g in layout.awq_groups if "norm" in g.prev]
    assert norms and {g.norm_offset for g in norms} == {1.0}
    llama = discover_layout(_known("llama"))
    assert {g.norm_offset for g in llama.awq_groups if "norm" in g.prev} == {0.0}
    assert config_cls and model_cls


def _groups_of(family: str):
    """A 2026 family as tests/discovered_families.py builds it (Qwen3.5: three Gated DeltaNet
    blocks, then one of full attention), on fake tensors."""
    fam = FAMILIES[family]
    model = _fake(fam.config_cls, fam.model_cls, **fam.settings)
    return model, discover_layout(model)


def test_qwen3_5_hybrid_groups_say_which_apply_to_linear_attention():
    """Qwen3.5: the Gated DeltaNet blocks scale input_layernorm (1 + w) into their input
    projections; out_proj reads a gated norm of the recurrence (two inputs), so it has no
    group, and says so. The full-attention block keeps norm -> q/k/v and v -> o; the MLPs
    their two groups."""
    model, layout = _groups_of("qwen3_5")
    by_prev = {g.prev: g for g in layout.awq_groups}
    blocks = model.get_submodule(layout.block_path)
    kinds = ["linear_attn" if hasattr(b, "linear_attn") else "self_attn" for b in blocks]
    assert "linear_attn" in kinds and "self_attn" in kinds
    lin = next(b for b in blocks if hasattr(b, "linear_attn"))
    in_projs = tuple(n for n, m in lin.named_modules()
                     if isinstance(m, nn.Linear) and n.startswith("linear_attn.in_proj"))
    groups = present_groups(layout.awq_groups, lin, None)
    assert groups[0] == AwqGroup("input_layernorm", in_projs, "linear_attn", norm_offset=1.0)
    assert [g.prev for g in groups] == ["input_layernorm", "post_attention_layernorm",
                                        "mlp.up_proj"]
    why = dict(layout.awq_unscaled)[("linear_attn.out_proj",)]
    assert "gated norm" in why
    full = blocks[kinds.index("self_attn")]  # gated attention: o_proj reads attn * sigmoid(gate)
    assert [g.prev for g in present_groups(layout.awq_groups, full, None)] == [
        "input_layernorm", "self_attn.v_proj", "post_attention_layernorm", "mlp.up_proj"]
    assert by_prev["mlp.up_proj"].balance == ("mlp.down_proj",)


def test_glm4_moe_groups_compensate_the_router_and_take_the_shared_expert():
    """GLM-4.5: dense first block, then routed experts beside a shared expert, as DeepSeek-V3's
    table: one norm scale for every expert's gate/up and the shared expert's (router
    compensated), each expert's up -> down, the shared expert's up -> down."""
    model, layout = _groups_of("glm4_moe")
    spec = discovered_spec(model.config)
    assert spec.awq_groups == layout.awq_groups
    ex = layout.experts
    moe = AwqGroup("post_attention_layernorm",
                   (*ex.input_linears(), "mlp.shared_experts.gate_proj",
                    "mlp.shared_experts.up_proj"), "mlp", compensate=(ex.router,), norm_offset=0.0)
    assert moe in layout.awq_groups
    assert AwqGroup(ex.linear("up"), (ex.linear("down"),), ex.linear("down")) in layout.awq_groups
    assert AwqGroup("mlp.shared_experts.up_proj", ("mlp.shared_experts.down_proj",),
                    "mlp.shared_experts.down_proj") in layout.awq_groups


def test_nemotron_h_mamba_and_relu2_mlps_have_no_inner_groups():
    """Nemotron-H: the norm scales into the Mamba2 in_proj, the attention's q/k/v and the MLPs'
    up; out_proj reads a gated norm, down reads relu^2(up): neither has a group."""
    model, layout = _groups_of("nemotron_h")
    prevs = {g.prev for g in layout.awq_groups}
    assert "norm" in prevs and "mixer.up_proj" not in prevs
    unscaled = dict(layout.awq_unscaled)
    assert ("mixer.out_proj",) in unscaled and ("mixer.down_proj",) in unscaled


# --- the discovered groups are exact: folding any scales leaves the model's function unchanged

def _real(config_cls: str, model_cls: str, settings: dict):
    config = getattr(transformers, config_cls)(**{**_COMMON, "tie_word_embeddings": False,
                                                  **settings})
    config.architectures = [model_cls]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():  # norms away from their init (Gemma's zeros, llama's ones)
        for n, p in model.named_parameters():
            if p.dim() == 1 and "norm" in n:
                p.add_(torch.randn_like(p) * 0.2)
    return model


def _fold_random_scales(model, spec) -> int:
    """Every discovered group of every block folds a random scale s in [0.5, 2] (balance
    columns * s, prev / s, compensated routers * s), through the scaling code AWQ uses."""
    linearize_experts(model, spec)
    folded = 0
    gen = torch.Generator().manual_seed(1)
    for bi, block in enumerate(model.get_submodule(spec.block_path)):
        linears = {n: m for n, m in block.named_modules() if isinstance(m, nn.Linear)}
        ctx = BlockContext(bi, block, linears, {}, None, [], None, arch=spec)
        col = {n: torch.ones(m.in_features) for n, m in linears.items()}
        row = {n: torch.ones(m.out_features) for n, m in linears.items()}
        with torch.no_grad():
            for plan in scale_plans(ctx):
                if plan.mode in ("norm", "linear"):
                    k = next(iter(plan.balance.values())).in_features
                    fold_scale(plan, torch.rand(k, generator=gen) * 1.5 + 0.5, col, row, {})
                    folded += 1
    return folded




def _fold_cases():
    known = {"llama": {}, "phi3": {}, "gemma3_text": {"sliding_window": 32},
             "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2,
                           "moe_intermediate_size": 128},
             "deepseek_v3": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2,
                             "topk_group": 1, "moe_intermediate_size": 128,
                             "first_k_dense_replace": 1, "num_key_value_heads": 4}}
    cases = {a: (*ARCH_CONFIGS[a], {"intermediate_size": 512, **kw}) for a, kw in known.items()}
    for name, fam in FAMILIES.items():
        cases[name] = (fam.config_cls, fam.model_cls, fam.settings)
    return cases


FOLD_CASES = _fold_cases()


@pytest.mark.parametrize("family", sorted(FOLD_CASES))
def test_folding_discovered_scales_keeps_the_function(family):
    """The proof that a discovered group is an AWQ pair: with random scales folded into every
    group of every block, a real float32 model (random weights, experts as per-expert
    Linears as the pipeline runs them) computes the same logits. A wrong prev, a missed
    consumer, a wrong norm offset or tail would change them by the size of the scales."""
    config_cls, model_cls, settings = FOLD_CASES[family]
    model = _real(config_cls, model_cls, settings)
    spec = dataclasses.replace(spec_for_config(model.config),
                               awq_groups=discovered_spec(model.config).awq_groups)
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(ids).logits
    assert _fold_random_scales(model, spec) > 0
    with torch.no_grad():
        out = model(ids).logits
    assert float((out - ref).abs().max()) <= 1e-4 * float(ref.abs().max()), family


def test_granite_mamba_out_proj_and_olmo3_post_norm_inputs_have_no_group():
    """Granite 4 hybrid's Mamba out_proj reads a gated norm; OLMo 3 normalises after
    attention and MLP, so q/k/v and gate/up read the residual stream: no norm group there,
    only the Linear -> Linear pairs (v -> o, up -> down)."""
    _, granite = _groups_of("granitemoehybrid")
    assert "gated norm" in dict(granite.awq_unscaled)[("mamba.out_proj",)]
    assert ("input_layernorm", ("mamba.in_proj",)) in [(g.prev, g.balance)
                                                       for g in granite.awq_groups]
    _, olmo = _groups_of("olmo3")
    assert [g.prev for g in olmo.awq_groups] == ["self_attn.v_proj", "mlp.up_proj"]
    why = [w for names, w in olmo.awq_unscaled if names == ("self_attn.q_proj",)]
    # block 0 reads the embeddings; later blocks the residual sum after the post-MLP norm
    assert any("residual stream" in w for w in why)
    assert any("add of post_feedforward_layernorm" in w for w in why)
