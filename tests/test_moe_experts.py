"""Mixture of experts: the arch rows' expert facts (Qwen3-MoE, Mixtral) and
pipeline/experts.py's per-expert Linears (linearizing fused experts, routing like transformers)."""

from __future__ import annotations

import json

import pytest
import torch

from quantkit.arch import spec_for_config
from quantkit.formats.common import load_tensors
from quantkit.pipeline.quantize import linear_shapes

pytestmark = pytest.mark.fast


def test_arch_row_describes_experts(moe_model):
    config = json.loads((moe_model / "config.json").read_text())
    spec = spec_for_config(config)
    assert spec.name == "qwen3_moe" and spec.experts.count(config) == 8
    groups = spec.groups_for(8)
    assert groups[2:4] == (("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))  # dense blocks
    assert groups[4][:2] == ("mlp.experts.0.gate_proj", "mlp.experts.0.up_proj")
    assert len(groups[4]) == 16 and groups[5][7] == "mlp.experts.7.down_proj"
    assert spec.is_expert_linear("mlp.experts.3.down_proj")
    assert not spec.is_expert_linear("mlp.gate") and not spec.is_expert_linear("mlp.down_proj")
    from quantkit.model_io import load_config

    shapes = linear_shapes(load_config(moe_model), spec)
    assert shapes["model.layers.1.mlp.experts.7.gate_proj"] == (256, 256)
    assert shapes["model.layers.1.mlp.experts.7.down_proj"] == (256, 256)
    assert len([n for n in shapes if ".mlp.experts." in n]) == 2 * 8 * 3
    assert not any(n.endswith("mlp.gate") for n in shapes)  # the router stays unquantized


def test_mixtral_row_names_what_transformers_saves(mixtral_model):
    """The row's per-expert Linears, written under the checkpoint's names, are exactly the
    expert tensors save_pretrained wrote (so shards stream as they are)."""
    config = json.loads((mixtral_model / "config.json").read_text())
    spec = spec_for_config(config)
    assert spec.name == "mixtral" and spec.experts.count(config) == 4
    on_disk = set(load_tensors(mixtral_model))
    ours = {spec.checkpoint_name(f"model.layers.{i}.{n}.weight")
            for i in (0, 1) for n in spec.linears_for(4) + (spec.experts.router,)}
    assert ours <= on_disk
    assert {k for k in on_disk if ".experts." in k or ".gate." in k} <= ours
    assert spec.checkpoint_name("model.layers.1.mlp.experts.3.w2.weight") == \
        "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    assert spec.module_name("model.layers.1.block_sparse_moe.gate.weight") == \
        "model.layers.1.mlp.gate.weight"


def test_linearize_copies_fused_experts_without_random_init(moe_model):
    """The per-expert Linears are the fused tensors' slices, made without nn.Linear's random
    init (it cost seconds per Qwen3-30B-A3B block on the CPU): the global RNG is not advanced."""
    from transformers import AutoModelForCausalLM

    from quantkit.pipeline.experts import LinearExperts, linearize_experts

    model = AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.bfloat16)
    fused = model.model.layers[1].mlp.experts
    gate_up, down = fused.gate_up_proj.detach().clone(), fused.down_proj.detach().clone()
    inter = gate_up.shape[1] // 2
    rng = torch.random.get_rng_state()
    linearize_experts(model, spec_for_config(model.config))
    assert torch.equal(torch.random.get_rng_state(), rng)
    experts = model.model.layers[1].mlp.experts
    assert isinstance(experts, LinearExperts) and len(experts) == 8
    assert torch.equal(experts[5].gate_proj.weight, gate_up[5, :inter])
    assert torch.equal(experts[5].up_proj.weight, gate_up[5, inter:])
    assert torch.equal(experts[7].down_proj.weight, down[7])


def _random_experts(n: int, seed: int) -> list:
    """n Qwen3-MoE experts (hidden 64, intermediate 32) with N(0, 0.1) weights."""
    from quantkit.pipeline.experts import _Expert

    spec = spec_for_config({"model_type": "qwen3_moe"}).experts
    torch.manual_seed(seed)
    experts = [_Expert(spec, 64, 32, torch.nn.functional.silu, torch.float32, "cpu") for _ in range(n)]
    for ex in experts:
        for lin in ex.children():
            torch.nn.init.normal_(lin.weight, 0, 0.1)
    return experts


@pytest.mark.parametrize("calibrate_all", [False, True])
def test_linear_experts_route_like_a_per_expert_where_loop(calibrate_all):
    """LinearExperts dispatches with one stable sort; the sums must equal, bit for bit, a loop
    of torch.where per expert (the fused module's order: experts in index order, each expert's
    tokens by top-k slot then token), and every expert's Linears see its routed tokens."""
    from quantkit.pipeline.experts import LinearExperts
    from quantkit.pipeline.stats import StatCollector

    experts = _random_experts(6, seed=3)
    module = LinearExperts(experts, calibrate_all)
    hidden = torch.randn(50, 64)
    top_k_index = torch.randint(0, 5, (50, 2))  # expert 5 never chosen
    top_k_weights = torch.rand(50, 2)
    want = torch.zeros_like(hidden)
    for e, ex in enumerate(experts):
        pos, tok = torch.where(top_k_index.T == e)
        y = ex(hidden)[tok] if calibrate_all else ex(hidden[tok])
        want.index_add_(0, tok, y * top_k_weights[tok, pos, None])
    linears = {f"{e}.gate_proj": ex.gate_proj for e, ex in enumerate(experts)}
    with StatCollector(linears, ("hessian",)) as collector:
        got = module(hidden, top_k_index, top_k_weights)
    assert torch.equal(got, want)
    tokens = [collector.results[f"{e}.gate_proj"]["tokens"] for e in range(6)]
    assert tokens == ([50] * 6 if calibrate_all else
                      [int((top_k_index == e).sum()) for e in range(6)])


def test_awq_loss_forwards_run_only_routed_tokens_under_all_experts_calibration():
    """AWQ's per-candidate loss reads the MoE output, which sums routed tokens only: under
    --moe-calibrate-all-experts the experts must run just their routed tokens there (not all
    tokens, 16x the work for Qwen3-30B-A3B), with the same output, and the flag comes back."""
    from quantkit.pipeline.experts import LinearExperts, routed_only

    experts = _random_experts(4, seed=4)
    module = LinearExperts(experts, calibrate_all=True)
    hidden, top_k_index, top_k_weights = torch.randn(40, 64), torch.randint(0, 4, (40, 2)), torch.rand(40, 2)
    seen: list[int] = []
    experts[0].gate_proj.register_forward_hook(lambda _m, args, _o: seen.append(args[0].shape[0]))
    everything = module(hidden, top_k_index, top_k_weights)
    with pytest.raises(RuntimeError), routed_only(torch.nn.Sequential(module)):
        routed = module(hidden, top_k_index, top_k_weights)
        raise RuntimeError("the flag must come back after an error too")
    assert seen == [40, int((top_k_index == 0).sum())]
    assert torch.allclose(routed, everything, atol=1e-6)
    assert module.calibrate_all is True
