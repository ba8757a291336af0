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
