"""Discovery of a model's layout (quantkit.arch.discover) on shape-only models.

The models are built under torch's FakeTensorMode (no weights, no memory), from transformers'
own config classes, so every family transformers ships can be checked in milliseconds.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import ARCH_CONFIGS, FAMILY_DEFAULTS, MOE_DEFAULTS
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from quantkit.arch import EXPERT, spec_for_config
from quantkit.arch.discover import discover_layout, trace_groups

pytestmark = pytest.mark.fast

_COMMON = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=49152, tie_word_embeddings=False)


def _fake(config_cls: str, model_cls: str, **kwargs):
    config = getattr(transformers, config_cls)(**{**_COMMON, **kwargs})
    config.architectures = [model_cls]
    with FakeTensorMode(allow_non_fake_inputs=True):
        return getattr(transformers, model_cls)(config)


def _known(arch: str):
    config_cls, model_cls = ARCH_CONFIGS[arch]
    kwargs = {"intermediate_size": 512, "head_dim": 64, **FAMILY_DEFAULTS.get(arch, {}),
              **MOE_DEFAULTS.get(arch, {})}
    if arch == "deepseek_v3":  # MLA: as many kv heads as heads
        kwargs["num_key_value_heads"] = 4
    return _fake(config_cls, model_cls, **kwargs)


def _present(group: tuple[str, ...], block: nn.Module, experts_module: str | None):
    modules = dict(block.named_modules())
    return tuple(n for n in group if n in modules
                 or (EXPERT in n and experts_module and experts_module in modules))


@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
def test_discovery_finds_what_the_table_says_on_the_known_families(arch):
    """Blocks, embeddings, norm, head, every block's sequential groups and the experts'
    checkpoint names equal the hand-written row (the row may name modules a block lacks,
    such as Qwen3-MoE's dense mlp_only_layers rows: those are skipped per block, as the
    pipeline skips them)."""
    model = _known(arch)
    spec = spec_for_config(model.config)
    layout = discover_layout(model)
    assert (layout.block_path, layout.embed, layout.final_norm, layout.lm_head) == \
        (spec.block_path, spec.embed, spec.final_norm, spec.lm_head)
    blocks = model.get_submodule(spec.block_path)
    em = spec.experts.module if spec.experts else None
    for block, found in zip(blocks, trace_groups(model, blocks, layout.experts), strict=True):
        expected = [g for g in (_present(g, block, em) for g in spec.sequential) if g]
        assert found == expected
    assert (layout.experts is None) == (spec.experts is None)
    if spec.experts:
        got, want = layout.experts, spec.experts
        assert (got.module, got.gate, got.up, got.down, got.router) == \
            (want.module, want.gate, want.up, want.down, want.router)
        assert got.count(model.config) == want.count(model.config) > 0
    assert layout.checkpoint_renames == spec.checkpoint_renames


NEW_FAMILIES = {
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(intermediate_size=512, head_dim=64)),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                    dict(moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                         head_dim=64)),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(intermediate_size=512, moe_intermediate_size=128, num_experts=4,
                        num_experts_per_tok=2, head_dim=64)),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(intermediate_size=512, n_routed_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=128, first_k_dense_replace=1)),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM",
               dict(intermediate_size=512, intermediate_size_mlp=512, num_local_experts=4)),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
                         dict(intermediate_size=512, num_local_experts=4)),
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM",
                   dict(intermediate_size=512, rotary_dim=32, num_local_experts=4,
                        num_experts_per_tok=2)),
    "ministral3": ("Ministral3Config", "Ministral3ForCausalLM", dict(intermediate_size=512)),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(intermediate_size=512)),
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM",
                   dict(num_hidden_layers=4, hybrid_override_pattern="ME*-", mamba_num_heads=8,
                        mamba_head_dim=64, ssm_state_size=16, n_groups=2, n_routed_experts=4,
                        moe_intermediate_size=256, moe_shared_expert_intermediate_size=256,
                        intermediate_size=512, head_dim=64)),
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM",
                     dict(num_key_value_heads=4, n_routed_experts=4, moe_intermediate_size=128,
                          intermediate_size=512, first_k_dense_replace=1,
                          num_experts_per_tok=2, n_group=2, topk_group=1)),
}


@pytest.mark.parametrize("family", sorted(NEW_FAMILIES))
def test_discovery_leaves_no_linear_out_on_families_no_table_names(family):
    """On families no row describes (hybrid linear attention, new MoEs), every Linear of every
    block is in exactly one sequential group, or is the router that stays dense; fused experts
    are found with the per-expert names transformers' conversion mapping gives them."""
    config_cls, model_cls, kwargs = NEW_FAMILIES[family]
    model = _fake(config_cls, model_cls, **kwargs)
    layout = discover_layout(model)
    blocks = model.get_submodule(layout.block_path)
    assert len(blocks) == model.config.num_hidden_layers
    fused_seen = False
    for block, groups in zip(blocks, trace_groups(model, blocks, layout.experts), strict=True):
        names = [n for g in groups for n in g]
        assert len(names) == len(set(names))
        linears = {n for n, m in block.named_modules() if isinstance(m, nn.Linear)}
        assert linears - set(layout.dense_linears) == {n for n in names if EXPERT not in n}
        templates = {n for n in names if EXPERT in n}
        if layout.experts and layout.experts.module in dict(block.named_modules()):
            fused_seen = True
            assert templates == {*layout.experts.input_linears(), layout.experts.linear("down")}
        else:
            assert not templates
    assert fused_seen == any(k in kwargs for k in ("num_experts", "n_routed_experts",
                                                    "num_local_experts"))


def test_minimax_m2_experts_keep_the_checkpoints_w1_w3_w2_names():
    """MiniMax-M2 checkpoints name experts as Mixtral's do (block_sparse_moe.experts.N.w1/w3/w2);
    transformers' conversion mapping says so, and discovery takes the names from it."""
    model = _fake(*NEW_FAMILIES["minimax_m2"][:2], **NEW_FAMILIES["minimax_m2"][2])
    layout = discover_layout(model)
    assert (layout.experts.gate, layout.experts.up, layout.experts.down) == ("w1", "w3", "w2")
    assert (".mlp.", ".block_sparse_moe.") in layout.checkpoint_renames


def test_experts_without_a_gate_are_up_and_down_only():
    """Nemotron-H's experts are down(relu^2(up(x))): no gate, the fused `up_proj` merges the
    checkpoint's per-expert up_proj (its conversion mapping says so); the (up) group reads the
    MoE input with the shared expert's up_proj, then (down) with its down_proj."""
    model = _fake(*NEW_FAMILIES["nemotron_h"][:2], **NEW_FAMILIES["nemotron_h"][2])
    layout = discover_layout(model)
    es = layout.experts
    assert (es.gate, es.up, es.down, es.fused_gate_up, es.router) == \
        ("", "up_proj", "down_proj", "up_proj", "mixer.gate")
    assert not es.gated and es.input_linears(0) == ("mixer.experts.0.up_proj",)
    assert ("mixer.experts.{e}.up_proj", "mixer.shared_experts.up_proj") in layout.sequential
    assert ("mixer.experts.{e}.down_proj", "mixer.shared_experts.down_proj") in layout.sequential
    with pytest.raises(ValueError, match="no gate projection"):
        es.linear("gate")


def test_trace_needs_no_weights():
    """The trace runs on fake tensors: nothing is allocated for the weights."""
    model = _known("llama")
    assert all(type(p).__name__ == "FakeTensor" for p in model.parameters())
    assert discover_layout(model).sequential[0] == (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    assert torch.get_default_device().type == "cpu"


def test_deepseek_v32_indexer_keys_stay_dense_as_vllm_builds_them():
    """vLLM builds the indexer's wk + weights_proj without a quantization method: a discovered
    DeepSeek-V3.2 spec keeps them out of the groups and in the dense list; wq_b is quantized."""
    config_cls, model_cls, kwargs = NEW_FAMILIES["deepseek_v32"]
    config = getattr(transformers, config_cls)(**{**_COMMON, **kwargs})
    config.architectures = [model_cls]
    spec = spec_for_config(config.to_dict())
    linears = {n for g in spec.sequential for n in g}
    assert "self_attn.indexer.wq_b" in linears
    assert not {"self_attn.indexer.wk", "self_attn.indexer.weights_proj"} & linears
    assert {"self_attn.indexer.wk", "self_attn.indexer.weights_proj"} <= set(spec.dense_linears)
