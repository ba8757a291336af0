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

`rounding="gptq"` keeps every scale above (from the original weights: they are what the
format stores) and replaces only the rounding: GPTQ's column loop (quantkit.methods.gptq,
error feedback through the inverse-Hessian factor, 128-column blocks) with each column rounded
to the nearest E2M1 value of its group's step by the same `e2m1_codes`. With H = I the loop
feeds back nothing and the codes are RTN's, bit for bit.

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

import dataclasses
import time

import torch

from quantkit.e2m1 import (
    dequantize_fp4,
    e2m1_codes,
    e2m1_decode,
    fp4_step,
    nvfp4_global_scale,
    quantize_mxfp4,
    quantize_nvfp4,
)
from quantkit.errors import CalibrationError, QuantkitError, SchemeMismatch
from quantkit.methods.fp8 import fused_groups
from quantkit.methods.gptq import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_DAMP,
    check_v_hessian,
    gptq_column_loop,
    inverse_hessian_factor,
    one_cpu_thread,
    prepare_hessian,
    shared_input_sets,
)
from quantkit.methods.intquant import announce_rtn_fallback, borrow_input_scales, starved_experts
from quantkit.methods.options import (
    FlagValues,
    MethodRecord,
    MethodRequest,
    check_gptq_rounding_flags,
    rounding_args,
)
from quantkit.types import BlockContext, PlanFacts, Quantizer, QuantResult, QuantScheme

__all__ = ["FP4Quantizer", "FP4ColumnGrid", "fp4_scheme", "gptq_fp4", "NVFP4_SCHEMES", "GROUPS",
           "ROUNDINGS"]

GROUPS = {"nvfp4": 16, "mxfp4": 32}
NVFP4_SCHEMES = ("w4a16", "w4a4")
ROUNDINGS = ("rtn", "gptq")


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


# ------------------------------------------------------------ GPTQ onto the grid ----

class FP4ColumnGrid:
    """GPTQ's round-to-grid step for FP4: column j of row r goes to the nearest E2M1 value of
    its group's step (fixed beforehand from the original weights, as RTN chooses it)."""

    def __init__(self, step: torch.Tensor, group: int) -> None:
        self.step_t = step.float().T.contiguous()  # [K/group, N]: one group's steps contiguous
        self.group = group

    def round_column(self, col: int, block: torch.Tensor, i: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        step = self.step_t[col // self.group]
        codes = e2m1_codes(block[:, i] / step)  # the division RTN does, element for element
        return codes, e2m1_decode(codes) * step  # = dequantize_fp4's value of these codes


def gptq_fp4(weight: torch.Tensor, hessian: torch.Tensor, step: torch.Tensor, group: int, *,
             damp: float = DEFAULT_DAMP, block_size: int = DEFAULT_BLOCK_SIZE, name: str = "",
             overwrite_hessian: bool = False) -> tuple[torch.Tensor, float]:
    """E2M1 codes uint8 [N, K] of `weight` rounded by GPTQ under the fixed per-group steps
    `step` [N, K/group] (fp4_step of the stored scales), and the dampening finally used."""
    w = weight.detach().to(torch.float32, copy=True)
    h = prepare_hessian(hessian, w.device, overwrite_hessian)
    hinv, used_damp = inverse_hessian_factor(h, damp, name)
    del h
    with one_cpu_thread(w.device):  # thousands of tiny ops: worker threads only add waits
        codes = gptq_column_loop(w, hinv, FP4ColumnGrid(step.to(w.device), group), block_size)
    return codes.to(torch.uint8), used_damp


# ---------------------------------------------------------------- the quantizer ----

class FP4Quantizer(Quantizer):
    """NVFP4 (W4A16 / W4A4) or MXFP4 (W4A16) weights. Options:

    method    nvfp4 | mxfp4
    scheme    w4a16 | w4a4 (NVFP4 only: global input scales calibrated on the shared data)
    rounding  rtn (nearest, no calibration for W4A16) | gptq (Hessian-aware, same scales)
    damp, block_size, v_hessian   GPTQ's, when rounding="gptq"
    """

    def __init__(self, method: str = "nvfp4", scheme: str = "w4a16", rounding: str = "rtn",
                 damp: float = DEFAULT_DAMP, block_size: int = DEFAULT_BLOCK_SIZE,
                 v_hessian: str = "tokens") -> None:
        self.name = method
        self.v_hessian = check_v_hessian(v_hessian)
        self._scheme = fp4_scheme(method, scheme)
        if rounding not in ROUNDINGS:
            raise SchemeMismatch(f"Unknown {method} rounding {rounding!r}.",
                                 f"Choose one of: {', '.join(ROUNDINGS)} (default rtn).")
        if v_hessian != "tokens" and rounding != "gptq":
            raise SchemeMismatch(f"v_hessian={v_hessian!r} is read only by GPTQ rounding.",
                                 "Pass --rounding gptq, or drop --gptq-v-hessian.")
        if damp < 0:
            raise SchemeMismatch(f"GPTQ damp must be >= 0, got {damp}.", "The usual value is 0.01.")
        if block_size < 1:
            raise SchemeMismatch(f"GPTQ block_size must be >= 1, got {block_size}.",
                                 "The usual value is 128.")
        self.rounding = rounding
        self.gptq = rounding == "gptq"
        self.damp, self.block_size = float(damp), int(block_size)
        self.w4a4 = self._scheme.activations is not None
        self.stats: tuple[str, ...] = (("absmax",) if self.w4a4 else ()) + (
            ("hessian",) if self.gptq else ())
        self.needs_calibration = bool(self.stats)
        # MoE experts: W4A4 input scales come per expert from its routed tokens and GPTQ rounds
        # each expert with its own Hessian; an expert the router fed nothing borrows an input
        # scale and keeps its RTN codes (both loudly)
        self.moe_calibrated = True
        # RTN: input scales are observed on the unquantized model. GPTQ: later Linears and
        # blocks calibrate on the quantized outputs (q/k/v -> o -> gate/up -> down), as
        # --method gptq does; on the CPU that order runs in one forward per block
        self.propagate_quantized = self.gptq
        self.true_sequential = self.gptq
        self.calib_batch_size = 8 if self.gptq else 1  # the same sums, fewer and larger ops
        self.dtype: torch.dtype | None = None  # the checkpoint's: the reference's arithmetic

    @property
    def scheme(self) -> QuantScheme:
        return self._scheme

    def check(self, scheme: QuantScheme) -> None:
        """The request's scheme must be this method's; only NVFP4's tensor scale is the
        format's choice (QuantScheme.tensor_scale, set by the pipeline), taken from it."""
        if dataclasses.replace(scheme, tensor_scale=True) != \
                dataclasses.replace(self._scheme, tensor_scale=True):
            raise SchemeMismatch(
                f"Method {self.name} makes {self._scheme.describe()}, not {scheme.describe()}.",
                "Build the scheme with quantkit.methods.fp4.fp4_scheme(method, scheme).")
        self._scheme = scheme

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
        starved: list[str] = []
        for group in fused_groups(ctx):
            weights = {n: ctx.linears[n].weight.data for n in group}
            shared = None
            if nv and not self._scheme.tensor_scale:  # the format keeps none: g = 1
                shared = torch.ones(1)
            elif nv:  # one global scale per fused GEMM: the smallest g (largest max|W|)
                shared = torch.cat([nvfp4_global_scale(w.abs().amax(), self.dtype)
                                    for w in weights.values()]).min().reshape(1)
            in_scale = None
            if self.w4a4 and starved_experts(ctx, group):
                starved += group  # filled in from the calibrated experts once all are done
            elif self.w4a4:
                in_scale = self._input_global_scale(ctx, group)
            for n, w in weights.items():
                t0 = time.perf_counter()
                extra: dict[str, torch.Tensor] = {}
                if nv:
                    codes, scale, g = quantize_nvfp4(w, shared, self.dtype)
                    extra["global_scale"] = g.clone()  # fused members share the value, not storage
                else:
                    codes, scale = quantize_mxfp4(w)
                if in_scale is not None:
                    extra["input_global_scale"] = in_scale.clone()
                lin = ctx.linears[n]
                res = QuantResult(name=n, scheme=self._scheme, codes=codes, scale=scale,
                                  extra=extra,
                                  bias=None if lin.bias is None else lin.bias.data.clone())
                res.seconds = time.perf_counter() - t0
                results[n] = res
        if starved:
            borrow_input_scales(ctx, results, starved, "input_global_scale", torch.minimum,
                                "NVFP4 W4A4", "smallest input global scale")
        if self.gptq:
            self._gptq_codes(ctx, results)
        for n, res in results.items():  # the stored weight, exactly: what later blocks see
            w = ctx.linears[n].weight.data.float()
            deq = dequantize_fp4(res.codes, res.scale, res.extra.get("global_scale"))
            res.extra["dequantized"] = deq
            res.loss = float((w - deq).norm() / w.norm().clamp_min(1e-12))
            res.codes, res.scale = res.codes.cpu(), res.scale.cpu()
        return results

    def _gptq_codes(self, ctx: BlockContext, results: dict[str, QuantResult]) -> None:
        """Replace the RTN codes with GPTQ's under the same scales; Linears that read the same
        input (q/k/v, gate/up) share H and are solved as one stacked weight."""
        prefix = f"{ctx.arch.block_path}.{ctx.index}." if ctx.arch is not None else f"block {ctx.index} "
        calibrated, starved = [], []
        for n in ctx.linears:
            st = ctx.stats.get(n) or {}
            if st.get("tokens") and "hessian" in st:
                calibrated.append(n)
            elif ctx.arch is None or not ctx.arch.is_expert_linear(n):
                raise CalibrationError(
                    f"GPTQ rounding: layer {prefix}{n} received no calibration tokens, so it has "
                    "no Hessian to round with.",
                    f"Use more or longer calibration samples, or drop --rounding gptq "
                    f"(--method {self.name} rounds to nearest without calibration).")
            else:  # an expert routing chose for no token keeps its RTN codes
                starved.append(n)
                results[n].fallback = (f"rtn; {results[n].fallback}" if results[n].fallback
                                       else "rtn")
        announce_rtn_fallback(ctx, starved, f"{self.name} GPTQ rounding", stacklevel=3)
        group = self._scheme.group_size
        for names in shared_input_sets(ctx, calibrated):
            t0 = time.perf_counter()
            hessian = ctx.stats[names[0]]["hessian"]
            for n in names:  # consumed here: the solve overwrites it (one K x K copy less)
                del ctx.stats[n]["hessian"]
            stacked = torch.cat([ctx.linears[n].weight.data for n in names])
            step = torch.cat([fp4_step(results[n].scale, results[n].extra.get("global_scale"))
                              for n in names])
            codes, _ = gptq_fp4(stacked, hessian, step, group, damp=self.damp,
                                block_size=self.block_size, name=prefix + "+".join(names),
                                overwrite_hessian=True)
            del hessian
            seconds = time.perf_counter() - t0
            start = 0
            for n in names:
                rows = ctx.linears[n].weight.shape[0]
                results[n].codes = codes[start:start + rows].contiguous()
                results[n].seconds += seconds * rows / stacked.shape[0]
                start += rows


def _stored_dtype(config) -> torch.dtype:
    """The checkpoint's dtype (config.dtype / torch_dtype), bfloat16 when it says nothing."""
    name = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "bfloat16"
    if isinstance(name, torch.dtype):
        return name
    return {"float16": torch.float16, "float32": torch.float32}.get(str(name), torch.bfloat16)


def _fp4_request(method: str):
    def build(v: FlagValues, options: dict) -> MethodRequest:
        if v["fp8_scheme"] is not None:
            options["scheme"] = v["fp8_scheme"]
        if v["rounding"]:
            options["rounding"] = v["rounding"]
        # groups fixed: 16 / 32
        return MethodRequest(fp4_scheme(method, options.get("scheme", "w4a16")), options, False,
                             v["fmt"])
    return build


def _check_nvfp4_flags(v: FlagValues) -> None:
    check_gptq_rounding_flags("nvfp4", v)
    if v.calib and (v["fp8_scheme"] or "w4a16") != "w4a4" and v.rounding != "gptq":
        raise QuantkitError(
            f"{v.calib[0]} is read by --method nvfp4 only with --scheme w4a4 (input scales) or "
            "--rounding gptq; W4A16 rounded to nearest needs no calibration.",
            f"Drop {v.calib[0]}, or pass --scheme w4a4 or --rounding gptq.")


def _check_mxfp4_flags(v: FlagValues) -> None:
    check_gptq_rounding_flags("mxfp4", v)
    if v.calib and v.rounding != "gptq":
        raise QuantkitError(
            f"{v.calib[0]} is read by --method mxfp4 only with --rounding gptq; MXFP4 rounded "
            "to nearest computes its scales from the weights alone.",
            f"Drop {v.calib[0]}, or pass --rounding gptq.")


def _fp4_disk(f: PlanFacts) -> int:
    """Two E2M1 codes per byte, one-byte scales (E4M3 / E8M0)."""
    return f.quantized // 2 + f.scales + f.dense_outside


RECORDS = (
    MethodRecord(
        name="nvfp4", quantizer=lambda **options: FP4Quantizer(method="nvfp4", **options),
        build=_fp4_request("nvfp4"), check_flags=_check_nvfp4_flags,
        command_args=lambda req: ["--scheme", str(req.method_options.get("scheme", "w4a16"))]
        + rounding_args(req),
        reads_calibration=lambda o: o.get("scheme") == "w4a4" or o.get("rounding") == "gptq",
        plan_passes=1, plan_disk=_fp4_disk),
    MethodRecord(
        name="mxfp4", quantizer=lambda **options: FP4Quantizer(method="mxfp4", **options),
        build=_fp4_request("mxfp4"), check_flags=_check_mxfp4_flags, command_args=rounding_args,
        reads_calibration=lambda o: o.get("rounding") == "gptq", plan_passes=1,
        plan_disk=_fp4_disk),
)
