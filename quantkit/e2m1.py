"""FP4 E2M1 numerics shared by the FP4 method (quantkit.methods.fp4: quantize) and the formats
(quantkit.formats.fp4: read back, and emulate NVFP4 W4A4 inputs as the engine rounds them).
It holds no policy (which scales, which groups share them): only the grid arithmetic, step for
step as compressed-tensors computes it (see quantkit.methods.fp4 for the formulas).
"""

from __future__ import annotations

import torch

__all__ = ["E2M1_VALUES", "FP4_MAX", "FP8_MAX", "e2m1_codes", "e2m1_decode", "nvfp4_global_scale",
           "quantize_nvfp4", "quantize_mxfp4", "dequantize_fp4", "dequantize_mxfp4_blocks", "fp4_step", "fake_quant_nvfp4",
           "FP4GroupError"]

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
FP4_MAX = 6.0
FP8_MAX = 448.0
FP8_EPS = 0.125  # compressed-tensors puts this in place of an all-zero group's E4M3 scale
MX_ELEM_OFFSET = 2  # floor(log2(6)): an MX scale maps a group's max near E2M1's top binade
# the midpoints between E2M1 magnitudes; a value exactly on one goes to the even code
_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


class FP4GroupError(ValueError):
    """A weight whose input width is not a multiple of the FP4 group."""


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes (sign << 3 | magnitude index) of x, already divided by its scale:
    round half to even, clamped to +-6 (compressed-tensors' `cast_to_fp4`); a negative value
    that rounds to zero keeps its sign bit (their x * sign(x) is -0.0 there)."""
    mag = x.abs()
    idx = torch.bucketize(mag, _MIDPOINTS.to(mag.device))  # lower index on a midpoint
    tie = torch.isin(mag, _MIDPOINTS.to(mag.device))
    idx = torch.where(tie & (idx % 2 == 1), idx + 1, idx)  # ties go to the even code
    return (idx | ((x < 0).to(idx.dtype) << 3)).to(torch.uint8)  # -0.0 in: +0 out, as theirs


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of E2M1 codes (a sign-bit zero decodes to -0.0)."""
    codes = codes.long()
    mag = E2M1_VALUES.to(codes.device)[codes & 7]
    return torch.where(codes >= 8, -mag, mag)


def _groups(w: torch.Tensor, group: int) -> torch.Tensor:
    n, k = w.shape
    if k % group:
        raise FP4GroupError(f"FP4 groups of {group} do not tile a Linear of input width {k}")
    return w.reshape(n, k // group, group)


def nvfp4_global_scale(amax: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """g = 448 * 6 / amax, divided in `dtype` (the model's: llm-compressor's observer works on
    the bf16 weights, so its g is a bf16 number; compressed-tensors `generate_gparam`),
    float32 [1]; a zero or non-finite result becomes 1."""
    amax = amax.to(dtype or amax.dtype)
    amax = amax.clamp(min=torch.finfo(amax.dtype).tiny)
    g = (FP8_MAX * FP4_MAX) / amax
    return torch.nan_to_num(g, nan=1.0, posinf=1.0, neginf=1.0).float().reshape(1)


def quantize_nvfp4(w: torch.Tensor, global_scale: torch.Tensor | None = None,
                   dtype: torch.dtype | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8 [N, K], E4M3 scales [N, K/16], global scale float32 [1]) of one weight;
    `global_scale` given: shared with the fused partners. `dtype`: the model's, in which the
    reference divides max|group| by 6 (bf16 for a bf16 model)."""
    w = w.detach()
    dtype = dtype or w.dtype
    if global_scale is None:
        global_scale = nvfp4_global_scale(w.abs().amax(), dtype)
    g = global_scale.float().to(w.device)
    local = _groups(w, 16).abs().amax(dim=-1).to(dtype) / FP4_MAX
    scale = (g * local).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    scale = torch.where(scale.float() == 0, torch.tensor(FP8_EPS, device=w.device),
                        scale.float()).to(torch.float8_e4m3fn)
    step = scale.float() / g  # the dequantization scale of each group
    codes = e2m1_codes((_groups(w.float(), 16) / step[..., None]).reshape(w.shape))
    return codes, scale, g.cpu().reshape(1)


def _round_to_power_2(x: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' `round_to_power_2` for float32: keep sign+exponent after adding a
    quarter of the significand (1.75 and above go up one binade)."""
    bits = x.float().view(torch.int32)
    return ((bits + (1 << 21)) & ~((1 << 23) - 1)).view(torch.float32)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [N, K], E8M0 exponents uint8 [N, K/32]) of one weight."""
    w = w.detach()
    amax = _groups(w, 32).abs().amax(dim=-1).float()
    exp = 127 + torch.floor(torch.log2(_round_to_power_2(amax))) - MX_ELEM_OFFSET
    exp = exp.clamp(0, 255).round().to(torch.uint8)  # an all-zero group: exponent 0
    step = torch.exp2(exp.float() - 127)
    codes = e2m1_codes((_groups(w.float(), 32) / step[..., None]).reshape(w.shape))
    return codes, exp


def fp4_step(scale: torch.Tensor, global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [N, K/group] dequantization step of each group (a code's value times it is the
    weight): NVFP4 E4M3 scale / global scale, or MXFP4 2 ** (E8M0 exponent - 127)."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - 127)
    return scale.float() / global_scale.float().to(scale.device)


def dequantize_fp4(codes: torch.Tensor, scale: torch.Tensor,
                   global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """float32 weight of E2M1 codes (or of their float values, as a packer's unpacking gives
    them): NVFP4 (E4M3 scale, global scale) or MXFP4 (uint8 E8M0)."""
    n, k = codes.shape
    step = fp4_step(scale, global_scale)
    group = k // scale.shape[1]
    vals = codes.float() if codes.is_floating_point() else e2m1_decode(codes)
    vals = vals.reshape(n, k // group, group)
    return (vals * step[..., None]).reshape(n, k)


def dequantize_mxfp4_blocks(blocks: torch.Tensor, scales: torch.Tensor,
                            dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(..., rows, cols) weights of MXFP4 as gpt-oss checkpoints store it: `blocks` uint8
    (..., rows, cols/32, 16), element 2j of a block in byte j's low nibble and 2j+1 in its
    high nibble; `scales` uint8 E8M0 (..., rows, cols/32). Exact in bf16 (a code times a
    power of two)."""
    codes = torch.stack((blocks & 15, blocks >> 4), -1).flatten(-2)  # (..., rows, G, 32)
    vals = e2m1_decode(codes) * torch.exp2(scales.float() - 127)[..., None]
    return vals.flatten(-2).to(dtype)


def fake_quant_nvfp4(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """x through NVFP4 as a W4A4 engine quantizes a Linear input: per 16 values along the last
    axis an E4M3 scale under the stored global input scale (vLLM's scaled_fp4_quant)."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    codes, scale, g = quantize_nvfp4(flat.float(), global_scale)
    return dequantize_fp4(codes, scale, g).reshape(shape).to(x.dtype)
