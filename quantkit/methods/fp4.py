"""FP4 (E2M1) weights in the two block-scaled layouts of 2026's hardware:

  NVFP4  16 values share one FP8 E4M3 scale; one FP32 global scale per tensor keeps the E4M3
         scales inside their range (Blackwell's tcgen05 block-scaled MMA). W4A16 (weights only)
         or W4A4: Linear inputs also go through NVFP4 at run time (per-16 scales computed by
         the engine) under a global input scale calibrated here on the shared calibration data.
  MXFP4  32 values share one E8M0 scale (a power of two); no global scale (OCP MX, gpt-oss).

The arithmetic follows compressed-tensors / llm-compressor (the reference writer), step for
step and in the same dtypes, so that the stored codes and scales are theirs:
  global  g = 448 * 6 / max|W|                     (compressed-tensors `generate_gparam`;
                                                    ModelOpt's weight_scale_2 is 1 / g)
  NVFP4   s = fp8(g * (max|W_group| / 6)),  0 -> 0.125;  q = e2m1(W / (s / g))
  MXFP4   s = 2 ** (floor(log2(p2(max|W_group|))) - 2), p2 = the power of two nearest below
          (mantissa >= 1.75 rounds up, compressed-tensors `round_to_power_2`);  q = e2m1(W / s)
  e2m1    round half to even onto {0, 0.5, 1, 1.5, 2, 3, 4, 6}, clamped to 6, sign kept
          (a negative value that rounds to zero stays -0: its code has the sign bit set)
Engines fuse q/k/v and gate/up into one GEMM with one global scale: the group shares the
smallest g (largest max|W|), as llm-compressor's `update_fused_layer_weight_global_scales`.

How a result is encoded (formats read only this, never this module):
  QuantResult.scheme   QuantScheme(kind="nvfp4" | "mxfp4", bits=4, group_size=16 | 32,
                                   activations=None | "dynamic" (NVFP4 W4A4))
  QuantResult.codes    uint8 [N, K], original column order: E2M1 code, sign << 3 | magnitude
                       index into E2M1_VALUES
  QuantResult.scale    NVFP4: float8_e4m3fn [N, K/16];  MXFP4: uint8 [N, K/32] E8M0 exponent
                       (scale = 2 ** (e - 127))
  extra["global_scale"]        float32 [1], NVFP4: g (compressed-tensors' convention)
  extra["input_global_scale"]  float32 [1], NVFP4 W4A4: 448 * 6 / max|x| over calibration
  extra["dequantized"] float32 [N, K], exactly the stored weight (what the pipeline propagates)
"""

from __future__ import annotations

import time

import torch

from quantkit.e2m1 import dequantize_fp4, nvfp4_global_scale, quantize_mxfp4, quantize_nvfp4
from quantkit.errors import CalibrationError, SchemeMismatch
from quantkit.methods.fp8 import fused_groups
from quantkit.types import BlockContext, QuantResult, QuantScheme

__all__ = ["FP4Quantizer", "fp4_scheme", "NVFP4_SCHEMES", "GROUPS"]

GROUPS = {"nvfp4": 16, "mxfp4": 32}
NVFP4_SCHEMES = ("w4a16", "w4a4")


def fp4_scheme(method: str = "nvfp4", scheme: str = "w4a16") -> QuantScheme:
    """The QuantScheme of `--method nvfp4 [--scheme w4a16|w4a4]` or `--method mxfp4`."""
    if method not in GROUPS:
        raise SchemeMismatch(f"Unknown FP4 method {method!r}.", "Use nvfp4 or mxfp4.")
    if method == "mxfp4" and scheme != "w4a16":
        raise SchemeMismatch(
            f"--method mxfp4 writes weight-only MXFP4 (MXFP4A16), not {scheme!r}.",
            "Drop --scheme, or use --method nvfp4 --scheme w4a4 for FP4 activations.")
    if scheme not in NVFP4_SCHEMES:
        raise SchemeMismatch(f"Unknown NVFP4 scheme {scheme!r}.",
                             f"Choose one of: {', '.join(NVFP4_SCHEMES)} (default w4a16).")
    return QuantScheme(kind=method, bits=4, group_size=GROUPS[method], symmetric=True,
                       activations="dynamic" if scheme == "w4a4" else None)


# ---------------------------------------------------------------- the quantizer ----

class FP4Quantizer:
    """NVFP4 (W4A16 / W4A4) or MXFP4 (W4A16) weights, rounded to nearest. Options:

    method   nvfp4 | mxfp4
    scheme   w4a16 | w4a4 (NVFP4 only: global input scales calibrated on the shared data)
    """

    propagate_quantized = False  # input scales are observed on the unquantized model
    true_sequential = False

    def __init__(self, method: str = "nvfp4", scheme: str = "w4a16") -> None:
        self.name = method
        self._scheme = fp4_scheme(method, scheme)
        self.w4a4 = self._scheme.activations is not None
        self.needs_calibration = self.w4a4
        self.stats: tuple[str, ...] = ("absmax",) if self.w4a4 else ()
        self.dtype: torch.dtype | None = None  # the checkpoint's: the reference's arithmetic

    @property
    def scheme(self) -> QuantScheme:
        return self._scheme

    def check(self, scheme: QuantScheme) -> None:
        if scheme != self._scheme:
            raise SchemeMismatch(
                f"Method {self.name} makes {self._scheme.describe()}, not {scheme.describe()}.",
                "Build the scheme with quantkit.methods.fp4.fp4_scheme(method, scheme).")

    def prepare(self, *, config=None, spec=None, shapes: dict[str, tuple[int, int]] | None = None,
                **_) -> None:
        """Before any data is loaded: every Linear's input width must hold whole groups."""
        self.dtype = _stored_dtype(config)
        group = self._scheme.group_size
        bad = {n: s for n, s in (shapes or {}).items() if s[1] % group}
        if bad:
            shown = ", ".join(f"{n} {list(s)}" for n, s in list(bad.items())[:4])
            raise SchemeMismatch(
                f"{self.name.upper()} groups of {group} do not tile {len(bad)} Linear(s) "
                f"(input width not a multiple of {group}): {shown}.",
                "Use --method fp8 or an int method (--group-size that divides the widths).")

    def _input_global_scale(self, ctx: BlockContext, group: tuple[str, ...]) -> torch.Tensor:
        amax = None
        for name in group:
            st = ctx.stats.get(name) or {}
            if "absmax" not in st or not st.get("tokens", 1):
                raise CalibrationError(
                    f"NVFP4 W4A4 input scales need calibration data, but no activations reached "
                    f"block {ctx.index} ({name}).",
                    "Pass calibration data (--calib, --calib-samples >= 1) or use --scheme "
                    "w4a16, which needs none.")
            m = st["absmax"].float().max()
            amax = m if amax is None else torch.maximum(amax, m)
        return nvfp4_global_scale(amax, self.dtype)

    def quantize_block(self, ctx: BlockContext) -> dict[str, QuantResult]:
        results: dict[str, QuantResult] = {}
        nv = self._scheme.kind == "nvfp4"
        for group in fused_groups(ctx):
            weights = {n: ctx.linears[n].weight.data for n in group}
            shared = None
            if nv:  # one global scale per fused GEMM: the smallest g (largest max|W|)
                shared = torch.cat([nvfp4_global_scale(w.abs().amax(), self.dtype)
                                    for w in weights.values()]).min().reshape(1)
            in_scale = self._input_global_scale(ctx, group) if self.w4a4 else None
            for n, w in weights.items():
                t0 = time.perf_counter()
                extra: dict[str, torch.Tensor] = {}
                if nv:
                    codes, scale, g = quantize_nvfp4(w, shared, self.dtype)
                    extra["global_scale"] = g
                    deq = dequantize_fp4(codes, scale, g)
                else:
                    codes, scale = quantize_mxfp4(w)
                    deq = dequantize_fp4(codes, scale)
                if in_scale is not None:
                    extra["input_global_scale"] = in_scale.clone()
                extra["dequantized"] = deq
                lin = ctx.linears[n]
                res = QuantResult(name=n, scheme=self._scheme, codes=codes.cpu(),
                                  scale=scale.cpu(), extra=extra,
                                  bias=None if lin.bias is None else lin.bias.data.clone())
                wf = w.float()
                res.loss = float((wf - deq).norm() / wf.norm().clamp_min(1e-12))
                res.seconds = time.perf_counter() - t0
                results[n] = res
        return results


def _stored_dtype(config) -> torch.dtype:
    """The checkpoint's dtype (config.dtype / torch_dtype), bfloat16 when it says nothing."""
    name = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "bfloat16"
    if isinstance(name, torch.dtype):
        return name
    return {"float16": torch.float16, "float32": torch.float32}.get(str(name), torch.bfloat16)
