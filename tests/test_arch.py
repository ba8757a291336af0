"""Every supported architecture resolves, quantizes through the pipeline and loads back; the
family facts (GGUF names, the 70B rule) live in quantkit.arch and nowhere else."""

from __future__ import annotations

import pytest
import torch

from quantkit.arch import spec_for_config, supported_architectures
from quantkit.errors import UnsupportedArchitecture
from quantkit.loader import load_artifact
from quantkit.pipeline.quantize import QuantizeRequest, quantize
from quantkit.types import QuantScheme


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_arch_quantizes_and_loads(tiny_model_factory, tmp_path, arch):
    src = tiny_model_factory(arch)
    out = tmp_path / f"{arch}-rtn"
    meta = quantize(QuantizeRequest(model=str(src), method="rtn",
                                    scheme=QuantScheme(bits=8, group_size=64), out=out))
    assert meta["source_model"]["architecture"] == arch
    q = load_artifact(out)
    base = load_artifact(src)
    ids = torch.randint(10, 40000, (1, 32))
    with torch.no_grad():
        lq, lb = q.model(ids).logits, base.model(ids).logits
    # int8 g64 is close to the original; a wrong layout would be far off
    assert torch.nn.functional.cosine_similarity(lq.flatten(), lb.flatten(), dim=0) > 0.99
    assert (lq.argmax(-1) == lb.argmax(-1)).float().mean() > 0.8
    spec = spec_for_config(q.model.config)
    assert len(meta) and spec.name == arch


@pytest.mark.fast
def test_unknown_architecture_lists_supported():
    with pytest.raises(UnsupportedArchitecture) as e:
        spec_for_config({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    assert "GPT2LMHeadModel" in str(e.value)
    for name in supported_architectures():
        assert name in str(e.value)


def test_every_family_linear_has_one_gguf_name_from_the_gguf_package():
    """The names come from gguf's TensorNameMap for the family's llama.cpp arch: every Linear
    of a block has one (but the per-head pieces a family cuts), no two share one (experts
    share their block's 3-D tensor, each its own slice), and the checkpoint spelling maps
    like the module one (Mixtral's block_sparse_moe)."""
    from quantkit.arch import ARCHS, gguf_architectures

    assert gguf_architectures() == ["llama", "qwen2", "qwen3", "qwen3moe", "gpt-oss",
                                    "deepseek2", "gemma3", "phi3", "olmo2", "mistral3", "gemma4", "qwen35",
                                    "qwen35moe", "minimax-m2", "llama4", "qwen3next",
                                    "nemotron_h_moe", "granitehybrid", "glm4moe"]
    for spec in ARCHS:
        names = {}
        for rel in spec.linears_for(2):
            full = f"{spec.block_path}.3.{rel}.weight"
            slot = spec.gguf_tensor(full)
            # llama.cpp's qwen3moe has no dense blocks (the GGUF check refuses mlp_only_layers)
            if rel in spec.gguf_head_splits or (spec.name == "qwen3_moe" and rel.startswith("mlp.")
                                                and not spec.is_expert_linear(rel)):
                assert slot is None, rel
                continue
            assert slot is not None and slot[0].startswith("blk.3."), (spec.name, rel)
            assert spec.gguf_tensor(spec.checkpoint_name(full)) == slot
            assert slot not in names.values(), (spec.name, rel, slot)
            names[rel] = slot
        assert spec.gguf_tensor(f"{spec.embed}.weight") == ("token_embd.weight", None)
        assert spec.gguf_tensor(f"{spec.lm_head}.weight") == ("output.weight", None)
        assert spec.gguf_tensor(f"{spec.final_norm}.weight") == ("output_norm.weight", None)
    by_name = {s.name: s for s in ARCHS}
    assert by_name["mixtral"].gguf_tensor("model.layers.1.block_sparse_moe.experts.2.w2.weight") \
        == ("blk.1.ffn_down_exps.weight", 2)
    assert by_name["gpt_oss"].gguf_tensor("model.layers.0.self_attn.sinks") == \
        ("blk.0.attn_sinks.weight", None)
    assert by_name["gemma3_text"].gguf_slot("pre_feedforward_layernorm") == \
        ("blk.{bid}.ffn_norm", None)


def test_llama_cpp_70b_rule_is_the_families():
    """llama.cpp calls 80 layers 70B for its llama arch with grouped-query attention only
    (Mixtral is written as llama too), for qwen2 always, for the other archs never."""
    from quantkit.arch import ARCHS

    gqa = {"num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8}
    mha = {**gqa, "num_key_value_heads": 64}
    want = {"llama": (True, False), "mistral": (True, False), "mixtral": (True, False),
            "qwen2": (True, True)}
    for spec in ARCHS:
        assert (spec.gguf_is_70b(gqa), spec.gguf_is_70b(mha)) == want.get(spec.name, (False, False))
        assert not spec.gguf_is_70b({**gqa, "num_hidden_layers": 32})


def test_no_family_name_is_tested_outside_arch():
    """Code outside quantkit/arch asks the spec for a family fact, never a family's name."""
    import re
    from pathlib import Path

    import quantkit

    root = Path(quantkit.__file__).parent
    test = re.compile(r"(\bspec\.name|gguf_arch|model_type)\s*(==|!=|\bin\b|\bnot in\b)")
    hits = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py")
            if p.relative_to(root).parts[0] != "arch"
            for i, line in enumerate(p.read_text().splitlines(), 1) if test.search(line)]
    assert not hits, hits
