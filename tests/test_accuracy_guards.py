"""Accuracy guards that fail when the product breaks: GPTQ's model-level accuracy on the real
model, and every directory format decoded by someone other than quantkit's own reader.

quantkit scores directory artifacts through its own loader, so a bug shared by a writer and its
reader (a swapped nibble order, a transposed scale) would cancel out in every other test. Here
each format is read back by an independent decoder (the compressed-tensors library through
transformers, or the format's published layout written out below from its reference
implementation: AutoGPTQ, AutoAWQ, vLLM, ModelOpt) and must give exactly the weights
quantkit's loader serves to the eval.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from quantkit.formats.common import load_tensors
from quantkit.types import QuantScheme

G64 = QuantScheme(bits=4, group_size=64)


# ---------------------------------------------------------------- GPTQ vs RTN on SmolLM2

@pytest.mark.slow
def test_gptq_kld_at_most_0_9_of_rtn_on_smollm2(smollm2_gptq_artifacts, rtn4_artifact, capsys):
    """Same scheme (W4 g64 sym), same held-out tokens: GPTQ (8 x 256 calibration tokens) must
    cut RTN's KLD by at least 10 % and lower its perplexity."""
    from quantkit.eval.harness import evaluate
    from quantkit.eval.logits import PPLConvention

    keys = ["gptq"]
    arts = [str(smollm2_gptq_artifacts[k]) for k in keys] + [str(rtn4_artifact)]
    recs = evaluate(arts, "smollm2-135m", conv=PPLConvention(max_windows=4))
    m = dict(zip([*keys, "rtn"], (r["metrics"] for r in recs), strict=True))
    with capsys.disabled():
        print("\nSmolLM2-135M W4 g64, held-out mixed 4 x 512: " + ", ".join(
            f"{k} KLD {v['kld']['mean']:.4f} PPL {v['ppl']['value']:.3f}" for k, v in m.items())
            + f" (base PPL {m['rtn']['base_ppl']['value']:.3f})")
    for k in keys:
        assert m[k]["kld"]["mean"] <= 0.9 * m["rtn"]["kld"]["mean"], (k, m[k]["kld"], m["rtn"]["kld"])
        assert m[k]["ppl"]["value"] < m["rtn"]["ppl"]["value"], k
        assert m[k]["top1_agreement"]["value"] > m["rtn"]["top1_agreement"]["value"], k


# ---------------------------------------------------------------- independent decoders



def _u32(t: torch.Tensor) -> np.ndarray:
    return t.numpy().view(np.uint32).astype(np.int64)


def decode_gptq_v1(path: Path) -> dict[str, torch.Tensor]:
    """AutoGPTQ v1 (its dequantize in `QuantLinear`): qweight int32 [K/8, N] packs 8 codes of
    consecutive input rows, LSB first; qzeros int32 [G, N/8] packs stored zeros along N, and
    the true zero is stored + 1; scales fp16 [G, N]; g_idx int32 [K] names each input's group."""
    raw, out = load_tensors(path), {}
    bits = json.loads((Path(path) / "config.json").read_text())["quantization_config"]["bits"]
    per, mask = 32 // bits, (1 << bits) - 1
    shifts = np.arange(per) * bits
    for key in [k for k in raw if k.endswith(".qweight")]:
        base = key[: -len(".qweight")]
        qw = _u32(raw[key])  # [K/per, N]
        q = ((qw[:, None, :] >> shifts[None, :, None]) & mask).reshape(-1, qw.shape[1])  # [K, N]
        qz = _u32(raw[base + ".qzeros"])  # [G, N/per]
        z = ((qz[:, :, None] >> shifts[None, None, :]) & mask).reshape(qz.shape[0], -1) + 1
        s = raw[base + ".scales"].float().numpy().astype(np.float64)
        g = raw[base + ".g_idx"].numpy().astype(np.int64)
        w = (q - z[g]) * s[g]  # [K, N]
        out[base + ".weight"] = torch.from_numpy(w.T.astype(np.float32))
    return out


AUTOAWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]  # awq/utils/packing_utils.py


def decode_awq_gemm(path: Path, group: int) -> dict[str, torch.Tensor]:
    """AutoAWQ GEMM (`unpack_awq` + `reverse_awq_order` + `dequantize_gemm`): qweight int32
    [K, N/8] and qzeros [G, N/8] hold 8 nibbles per word, shifted out LSB first and then
    reordered by [0,4,1,5,2,6,3,7]; zeros are the true zeros; W^T = (q - z) * scales."""
    raw, out = load_tensors(path), {}
    shifts = np.arange(8) * 4

    def unpack(t: torch.Tensor) -> np.ndarray:
        words = _u32(t)
        nib = (words[..., None] >> shifts) & 0xF  # [rows, cols, 8] in shift order
        return nib[..., AUTOAWQ_REVERSE_ORDER].reshape(words.shape[0], -1)

    for key in [k for k in raw if k.endswith(".qweight")]:
        base = key[: -len(".qweight")]
        q, z = unpack(raw[key]), unpack(raw[base + ".qzeros"])  # [K, N], [G, N]
        s = raw[base + ".scales"].float().numpy().astype(np.float64)
        g = np.arange(q.shape[0]) // group
        out[base + ".weight"] = torch.from_numpy(((q - z[g]) * s[g]).T.astype(np.float32))
    return out


def decode_modelopt_w4a16_awq(path: Path) -> dict[str, torch.Tensor]:
    """ModelOpt W4A16_AWQ as TensorRT-LLM reads it: weight uint8 [N/2, K], output row 2i in the
    low nibble and 2i+1 in the high one, signed int4; weight_scale [N, K/G]; an optional
    pre_quant_scale [K] multiplies the inputs (so, here, the weight's columns)."""
    raw, out = load_tensors(path), {}
    for key in [k for k in raw if k.endswith(".weight") and raw[k].dtype == torch.uint8]:
        base = key[: -len(".weight")]
        packed = raw[key].numpy().astype(np.int64)
        lo, hi = packed & 0xF, packed >> 4
        q = np.empty((2 * packed.shape[0], packed.shape[1]), dtype=np.int64)
        q[0::2], q[1::2] = lo, hi
        q = np.where(q >= 8, q - 16, q)
        s = raw[base + ".weight_scale"].float().numpy().astype(np.float64)
        w = q * np.repeat(s, q.shape[1] // s.shape[1], axis=1)
        if base + ".pre_quant_scale" in raw:
            w = w * raw[base + ".pre_quant_scale"].float().numpy()[None, :]
        out[key] = torch.from_numpy(w.astype(np.float32))
    return out


def _expand_blocks(scale: torch.Tensor, shape: tuple[int, int], block: int = 128) -> torch.Tensor:
    """A [ceil(N/B), ceil(K/B)] tile scale spread over [N, K]."""
    return scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[: shape[0], : shape[1]]


def decode_fp8(path: Path) -> dict[str, torch.Tensor]:
    """vLLM's native fp8 and ModelOpt's FP8 checkpoints: weight float8_e4m3fn [N, K] times its
    scale: a scalar (per tensor), [N] or [N, 1] (per channel), or a [N/128, K/128] tile grid
    (vLLM names it weight_scale_inv, yet it multiplies: Fp8LinearMethod's block path)."""
    raw, out = load_tensors(path), {}
    for key in [k for k in raw if k.endswith(".weight") and raw[k].dtype == torch.float8_e4m3fn]:
        base = key[: -len(".weight")]
        w = raw[key].float()
        scale = raw.get(base + ".weight_scale", raw.get(base + ".weight_scale_inv")).float()
        if scale.numel() == 1:
            out[key] = w * scale.reshape(())
        elif scale.numel() == w.shape[0]:
            out[key] = w * scale.reshape(-1, 1)
        else:
            out[key] = w * _expand_blocks(scale, tuple(w.shape))
    return out


def decode_compressed_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The compressed-tensors library's own decompression, as transformers runs it."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False))
    return {k: v for k, v in model.state_dict().items() if k.endswith("_proj.weight")}


def _quantize(model: Path, out: Path, method: str, fmt: str, qscheme: QuantScheme, opts: dict) -> Path:
    from quantkit.pipeline.quantize import QuantizeRequest, quantize

    quantize(QuantizeRequest(model=str(model), method=method, format=fmt, scheme=qscheme, out=out,
                             calib_samples=4, calib_seqlen=128, method_options=opts))
    return out


def _fp8(preset: str) -> tuple[QuantScheme, dict]:
    from quantkit.methods.fp8 import fp8_scheme

    return fp8_scheme(preset), {"scheme": preset}


# name: (method, format, scheme + method options, independent decoder)
CASES = {
    "ct-int4-asym-rtn": (
        "rtn", "compressed-tensors", (QuantScheme(bits=4, group_size=64, symmetric=False), {}),
        decode_compressed_tensors),
    "ct-int4-actorder-gptq": (
        "gptq", "compressed-tensors", (QuantScheme(bits=4, group_size=64, act_order=True), {}),
        decode_compressed_tensors),
    "gptq-v1-gptq": ("gptq", "gptq", (G64, {}), decode_gptq_v1),
    "awq-gemm-asym-awq": (
        "awq", "awq", (QuantScheme(bits=4, group_size=64, symmetric=False),
                       {"n_grid": 4, "clip_grid": 4}),
        lambda p: decode_awq_gemm(p, 64)),
    "modelopt-w4a16-awq-prequant": (
        "awq", "modelopt", (G64, {"n_grid": 4, "clip_grid": 4, "pre_quant_scale": True}),
        decode_modelopt_w4a16_awq),
    "ct-fp8-dynamic": ("fp8", "compressed-tensors", _fp8("dynamic"),
                                       decode_compressed_tensors),
    "ct-fp8-block": ("fp8", "compressed-tensors", _fp8("block"),
                                     decode_compressed_tensors),
    "fp8-native-static": ("fp8", "fp8", _fp8("static"), decode_fp8),
    "fp8-native-block": ("fp8", "fp8", _fp8("block"), decode_fp8),
    "modelopt-fp8-dynamic": ("fp8", "modelopt", _fp8("dynamic"), decode_fp8),
    "modelopt-fp8-block": ("fp8", "modelopt", _fp8("block"), decode_fp8),
}


@pytest.fixture(scope="module")
def wide_tiny(tmp_path_factory) -> Path:
    """Widths that are multiples of 128 (FP8 blocks) and GQA (AWQ's skipped v -> o pair)."""
    from tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("guards") / "llama", "llama", hidden=256,
                           intermediate=640, layers=2, heads=4, kv_heads=2)


@pytest.mark.parametrize("case", list(CASES))
def test_independent_decoder_reads_what_quantkit_loader_serves(wide_tiny, tmp_path, case):
    """Every quantized Linear's weight, decoded independently, equals what quantkit's loader
    puts in the model it evaluates (bit for bit; ModelOpt's two products to float32 rounding),
    and differs from the unquantized weight (something was really quantized)."""
    from quantkit.loader import load_artifact
    from quantkit.model_io import load_model

    method, fmt, (scheme, opts), decode = CASES[case]
    art = _quantize(wide_tiny, tmp_path / "art", method, fmt, scheme, opts)
    ref = decode(art)
    ours = load_artifact(art).model.state_dict()
    base = load_model(wide_tiny, dtype=torch.float32).state_dict()
    linears = [k for k in base if k.endswith("_proj.weight")]
    assert sorted(ref) == sorted(linears), (sorted(ref)[:3], linears[:3])  # all 14, nothing else
    for key in linears:
        assert ours[key].shape == ref[key].shape, key
        if fmt == "modelopt" and method == "awq":
            torch.testing.assert_close(ours[key], ref[key], rtol=2e-7, atol=0, msg=key)
        else:
            assert torch.equal(ours[key], ref[key]), (key, float((ours[key] - ref[key]).abs().max()))
        assert not torch.equal(ref[key], base[key]), key
