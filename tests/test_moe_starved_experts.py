"""Experts the router never picks (the starved model): GPTQ's RTN fallback and
--moe-calibrate-all-experts, and the static input scales the starved experts borrow."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from moe_models import (
    STARVED,
    _quantize,
)

from quantkit.formats.common import load_tensors
from quantkit.formats.compressed_tensors import read_compressed_tensors
from quantkit.methods.fp4 import fp4_scheme
from quantkit.pipeline.quantize import QuantizeRequest, quantize


def _output_error(model_dir: Path, artifact: Path, expert: int) -> float:
    """||X (W - Wq)^T|| / ||X W^T|| of block 0's expert `expert` gate_proj, X = every token's
    normalised hidden state (what that expert would read if the router picked it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantkit.calibration import load_heldout_text

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(load_heldout_text("mixed")[0], return_tensors="pt")["input_ids"][:, :512]
    seen = []
    hook = model.model.layers[0].mlp.register_forward_pre_hook(lambda _m, a: seen.append(a[0]))
    with torch.no_grad():
        model(ids)
    hook.remove()
    x = seen[0].reshape(-1, seen[0].shape[-1])
    inter = model.config.moe_intermediate_size
    w = model.model.layers[0].mlp.experts.gate_up_proj[expert, :inter]
    wq = read_compressed_tensors(artifact)[f"model.layers.0.mlp.experts.{expert}.gate_proj.weight"]
    return float((x @ (w - wq).T).norm() / (x @ w.T).norm())


def test_starved_experts_fall_back_to_rtn_and_calibrate_with_all_experts(starved_model, tmp_path):
    with pytest.warns(RuntimeWarning, match="received no calibration tokens and fall back to RTN"):
        routed = _quantize(starved_model, tmp_path / "routed", "gptq")
    stats = json.loads((routed / "quantkit_stats.json").read_text())
    starved = [f"model.layers.{i}.mlp.experts.{e}.{p}" for i in (0, 1) for e in STARVED
               for p in ("gate_proj", "up_proj", "down_proj")]
    experts = {k: v for k, v in stats["layers"].items() if ".mlp.experts." in k}
    # this tiny random model's routing is lopsided anyway: other experts may starve too
    empty = sorted(k for k, v in experts.items() if v["tokens"] == 0)
    few = sorted(k for k, v in experts.items() if v["tokens"] < 16)
    assert set(starved) <= set(empty)
    assert sorted(stats["experts"]["fallback_rtn"]) == empty
    assert sorted(stats["experts"]["below_min_tokens"]) == few
    for name in empty:
        assert 0 < experts[name]["rel_error"] < 1
    assert all("fallback" not in v for k, v in experts.items() if k not in empty)
    assert sum(v["tokens"] for v in experts.values()) == 2 * 3 * 2 * 8 * 64  # layers x projs x top-2
    weights = read_compressed_tensors(routed)
    assert all(torch.isfinite(v).all() for v in weights.values() if v.is_floating_point())

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback, no few-token warning
        everyone = _quantize(starved_model, tmp_path / "all", "gptq",
                             moe_calibrate_all_experts=True)
    stats_all = json.loads((everyone / "quantkit_stats.json").read_text())
    assert stats_all["experts"]["fallback_rtn"] == [] == stats_all["experts"]["below_min_tokens"]
    assert all(v["tokens"] == 8 * 64 for k, v in stats_all["layers"].items() if ".mlp.experts." in k)
    meta = json.loads((everyone / "quantkit.json").read_text())
    assert meta["moe"]["calibrate_all_experts"] is True
    assert "--moe-calibrate-all-experts" in meta["command"]
    # the block outputs keep the real routing: the attention and the fed experts of block 0
    # see exactly the same inputs in both runs, so they quantize to the same codes
    routed_t, all_t = load_tensors(routed), load_tensors(everyone)
    assert torch.equal(routed_t["model.layers.0.self_attn.q_proj.weight_packed"],
                       all_t["model.layers.0.self_attn.q_proj.weight_packed"])
    for e in STARVED:
        before = _output_error(starved_model, routed, e)
        after = _output_error(starved_model, everyone, e)
        print(f"expert {e}: output error RTN fallback {before:.4f} -> all-experts GPTQ {after:.4f}")
        assert after < 0.9 * before


@pytest.mark.parametrize("method", ["nvfp4", "int8", "fp8"])
def test_starved_experts_borrow_the_widest_input_scale(starved_model, tmp_path, method):
    """Routed calibration: experts the router never picks have no input statistics. Each
    borrows, per projection, the static input scale of its block's calibrated experts with
    the widest input range (NVFP4 W4A4: the smallest input global scale 448 * 6 / max|x|;
    int8 static: the largest max|x| / 127.5; FP8 static: the largest max|x| / 448), loudly: a warning, `fallback` in
    quantkit_stats.json and quantkit.json; every scale finite and positive."""
    from quantkit.formats.common import load_tensors
    from quantkit.methods.fp8 import fp8_scheme
    from quantkit.methods.int8 import int8_scheme

    scheme, option, key, widest, label = {
        "nvfp4": (fp4_scheme("nvfp4", "w4a4"), "w4a4", "input_global_scale", torch.min,
                  "NVFP4 W4A4"),
        "int8": (int8_scheme("static"), "static", "input_scale", torch.max, "int8 static"),
        "fp8": (fp8_scheme("static"), "static", "input_scale", torch.max, "FP8 static")}[method]
    with pytest.warns(RuntimeWarning, match=f"{label}: .* received no calibration tokens"):
        out = tmp_path / method  # 2 x 32 tokens: input maxima need few (the starved get none)
        quantize(QuantizeRequest(model=str(starved_model), method=method, out=out, scheme=scheme,
                                 method_options={"scheme": option}, calib_samples=2,
                                 calib_seqlen=32, resume=False))
    t = load_tensors(out)
    stats = json.loads((out / "quantkit_stats.json").read_text())["layers"]
    empty = {k for k, v in stats.items() if ".experts." in k and v["tokens"] == 0}
    assert {f"model.layers.{i}.mlp.experts.{e}.{p}" for i in (0, 1) for e in STARVED
            for p in ("gate_proj", "up_proj", "down_proj")} <= empty
    assert {k for k, v in stats.items() if "fallback" in v} == empty
    assert set(json.loads((out / "quantkit.json").read_text())["fallbacks"]) == empty
    for name in empty:
        block, proj = name.split(".mlp.experts.")[0], name.rsplit(".", 1)[-1]
        fed = [t[f"{block}.mlp.experts.{e}.{proj}.{key}"] for e in range(8)
               if f"{block}.mlp.experts.{e}.{proj}" not in empty]
        assert torch.equal(t[f"{name}.{key}"], widest(torch.stack(fed), 0).values), name
    scales = [v for k, v in t.items() if k.endswith(key)]
    assert all(torch.isfinite(v).all() and (v > 0).all() for v in scales)
