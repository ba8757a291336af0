"""RTN math and the compressed-tensors bytes, checked against the library's own decompressor."""

from __future__ import annotations

import json

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationScheme

from quantkit.formats.common import load_tensors
from quantkit.formats.compressed_tensors import CompressedTensorsWriter, read_compressed_tensors
from quantkit.methods.intquant import rtn_quantize_weight
from quantkit.types import QuantScheme

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group", [32, 64, -1])
def test_rtn_codes_and_invariant(bits, sym, group):
    torch.manual_seed(0)
    w = torch.randn(96, 128) * 0.05
    r = rtn_quantize_weight("x", w, QuantScheme(bits=bits, group_size=group, symmetric=sym))
    assert r.codes.dtype == torch.uint8 and r.codes.shape == w.shape
    assert int(r.codes.max()) <= 2**bits - 1
    if sym:
        assert torch.all(r.zero == 2 ** (bits - 1))
    deq = r.dequantize()
    # every element within half a step of its group's scale
    gi = r.column_groups()
    assert torch.all((deq - w).abs() <= r.scale[:, gi] * 0.5 + 1e-7)
    assert r.loss == pytest.approx(float((w - deq).norm() / w.norm()), rel=1e-5)


def test_int8_error_far_below_int4():
    torch.manual_seed(1)
    w = torch.randn(64, 256)
    e4 = rtn_quantize_weight("w", w, QuantScheme(bits=4, group_size=64)).loss
    e8 = rtn_quantize_weight("w", w, QuantScheme(bits=8, group_size=64)).loss
    assert e8 < e4 / 10


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("bits", [4, 8])
def test_compressed_tensors_bytes_match_the_library(tmp_path, sym, bits):
    """Our packed tensors decompress, through compressed-tensors itself, to our weights."""
    torch.manual_seed(2)
    scheme = QuantScheme(bits=bits, group_size=64, symmetric=sym)
    w = torch.randn(64, 192) * 0.03
    r = rtn_quantize_weight("model.layers.0.mlp.down_proj", w, scheme)
    CompressedTensorsWriter().write(tmp_path, config={"architectures": ["LlamaForCausalLM"]},
                                    dense={"model.norm.weight": torch.ones(4)},
                                    results={r.name: r}, ignore=["lm_head"], dtype=torch.float32)
    cfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == "pack-quantized" and cfg["ignore"] == ["lm_head"]
    assert cfg["config_groups"]["group_0"]["targets"] == ["Linear"]
    raw = load_tensors(tmp_path)
    name = r.name
    assert raw[f"{name}.weight_packed"].dtype == torch.int32
    assert raw[f"{name}.weight_packed"].shape == (64, 192 * bits // 32)
    assert (f"{name}.weight_zero_point" in raw) == (not sym)
    lib_scheme = QuantizationScheme.model_validate(cfg["config_groups"]["group_0"])
    local = {k[len(name) + 1:]: v for k, v in raw.items() if k.startswith(name + ".")}
    lib_w = PackedQuantizationCompressor.decompress(local, lib_scheme)["weight"]
    ours = read_compressed_tensors(tmp_path)[f"{name}.weight"]
    assert torch.allclose(lib_w.float(), r.dequantize(), atol=1e-6)
    assert torch.allclose(ours, r.dequantize(), atol=1e-6)


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_float_zero_grid_fits_each_group_by_least_squares(bits):
    """QuantScheme.float_zero (a format with a free float bias per group: MLX): codes in range,
    zero points floats, the invariant w = (q - z) * s, and a lower squared error than the
    integer asymmetric grid (at 3 and 4 bits by over 10 %); each group's (s, z) is the
    least-squares pair for its codes (refitting them changes nothing)."""
    from quantkit.methods.intquant import affine_refit

    torch.manual_seed(bits)
    w = torch.randn(64, 256) * 0.05 + torch.randn(64, 1) * 0.02
    fz = QuantScheme(bits=bits, group_size=64, symmetric=False, float_zero=True)
    r = rtn_quantize_weight("x", w, fz)
    i = rtn_quantize_weight("x", w, QuantScheme(bits=bits, group_size=64, symmetric=False))
    assert r.zero.dtype == torch.float32 and int(r.codes.max()) <= 2**bits - 1
    assert (r.zero - r.zero.round()).abs().max() > 0.01
    err_f = (w - r.dequantize()).pow(2).sum(1)
    err_i = (w - i.dequantize()).pow(2).sum(1)
    assert err_f.sum() < err_i.sum() * (0.9 if bits <= 4 else 1.0)
    s, z = affine_refit(w, r.codes, r.scale, r.zero, 64)
    assert torch.allclose(s, r.scale, rtol=1e-4) and torch.allclose(z, r.zero, atol=1e-3)


def test_affine_refit_with_a_hessian_lowers_the_output_error():
    """GPTQ's float-zero refit: for fixed codes, (s, z) against H = X^T X give a lower output
    error sum_n dw_n H dw_n^T than the weight-space fit and than the integer grid's pair."""
    from quantkit.methods.intquant import affine_refit

    torch.manual_seed(0)
    w = torch.randn(48, 192) * 0.05
    x = torch.randn(1024, 192) * torch.rand(192) * 3
    h = x.T @ x
    r = rtn_quantize_weight("x", w, QuantScheme(bits=4, group_size=64, symmetric=False))

    def out_err(s, z):
        q = r.codes.float().reshape(48, 3, 64)
        d = w - ((q - z[..., None]) * s[..., None]).reshape(48, 192)
        return float(((d @ h) * d).sum())

    s_h, z_h = affine_refit(w, r.codes, r.scale, r.zero.float(), 64, h)
    s_w, z_w = affine_refit(w, r.codes, r.scale, r.zero.float(), 64)
    assert out_err(s_h, z_h) < out_err(s_w, z_w) < out_err(r.scale, r.zero.float())
