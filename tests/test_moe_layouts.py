"""Mixture of experts: streamed per-expert shards and transformers 5's fused in-memory experts
give the same compressed-tensors artifact under vLLM's per-expert names (RTN and GPTQ on
Qwen3-MoE; RTN, GPTQ, AWQ and FP8 on Mixtral)."""

from __future__ import annotations

import json

import pytest
import torch
from moe_models import (
    _mixtral,
    _quantize,
)

from quantkit.formats.common import load_tensors


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_per_expert_and_fused_layouts_give_identical_artifacts(moe_model, tmp_path, method):
    """Streaming reads the per-expert tensors of the shards; --no-stream loads transformers 5's
    fused experts and slices them: the same bytes either way, under vLLM's per-expert names."""
    streamed = _quantize(moe_model, tmp_path / "streamed", method)
    fused = _quantize(moe_model, tmp_path / "fused", method, stream=False)
    assert (streamed / "model.safetensors").read_bytes() == (fused / "model.safetensors").read_bytes()
    t = load_tensors(streamed)
    for e in range(8):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            base = f"model.layers.1.mlp.experts.{e}.{proj}"
            assert t[f"{base}.weight_packed"].dtype == torch.int32
            assert t[f"{base}.weight_packed"].shape == (256, 256 * 4 // 32)
            assert t[f"{base}.weight_scale"].shape == (256, 256 // 64)
            assert t[f"{base}.weight_shape"].tolist() == [256, 256]
            assert f"{base}.weight" not in t
    assert t["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16  # router: unquantized
    assert not any("gate_up_proj" in k for k in t)
    qcfg = json.loads((streamed / "config.json").read_text())["quantization_config"]
    assert qcfg["ignore"] == ["lm_head", r"re:.*mlp\.gate$"]
    stats = json.loads((streamed / "quantkit_stats.json").read_text())
    assert stats["experts"]["linears"] == 48 and stats["experts"]["fallback_rtn"] == []
    if method == "gptq":  # every token goes to top-2 experts: tokens sum to 2 x calibration
        layer0 = {k: v["tokens"] for k, v in stats["layers"].items()
                  if k.startswith("model.layers.0.mlp.experts.") and k.endswith("gate_proj")}
        assert sum(layer0.values()) == 2 * 8 * 64 and min(layer0.values()) > 0
        assert stats["layers"]["model.layers.0.self_attn.q_proj"]["tokens"] == 8 * 64


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq", "fp8"])
def test_mixtral_methods_both_layouts(mixtral_model, tmp_path, method):
    """Streamed per-expert shards and transformers 5's fused in-memory experts give the same
    bytes, under the names vLLM's Mixtral loader reads; quantkit's loader reads them back."""
    from quantkit.loader import load_artifact

    streamed = _mixtral(mixtral_model, tmp_path / "streamed", method, stream=True)
    fused = _mixtral(mixtral_model, tmp_path / "fused", method, stream=False)
    assert (streamed / "model.safetensors").read_bytes() == (fused / "model.safetensors").read_bytes()
    t = load_tensors(streamed)
    assert not any(".mlp." in k for k in t)
    suffix = "weight" if method == "fp8" else "weight_packed"
    for e in range(4):
        for w in ("w1", "w2", "w3"):
            assert f"model.layers.1.block_sparse_moe.experts.{e}.{w}.{suffix}" in t
    assert t["model.layers.0.block_sparse_moe.gate.weight"].dtype == torch.bfloat16
    qcfg = json.loads((streamed / "config.json").read_text())["quantization_config"]
    assert r"re:.*block_sparse_moe\.gate$" in qcfg["ignore"]
    stats = json.loads((streamed / "quantkit_stats.json").read_text())
    assert stats["experts"]["linears"] == 2 * 4 * 3
    loaded = load_artifact(streamed).model
    ids = torch.arange(1, 33)[None]
    with torch.no_grad():
        assert torch.isfinite(loaded(ids).logits).all()
