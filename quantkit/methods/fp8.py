"""FP8 (E4M3) W8A8: weight scales per tensor, per output channel or per 128x128 block, and
activation scales that are either dynamic (computed by the engine at run time) or static
(one per-tensor scale calibrated here from the shared calibration loader).

How a result is encoded (formats read only this, never this module):
  QuantResult.scheme   QuantScheme(kind="fp8", bits=8, group_size=G):
                       G = 0 per-tensor, -1 per-channel, B > 0 square B x B blocks
  QuantResult.codes    float8_e4m3fn [N, K], original column order
  QuantResult.scale    float32: [1] tensor | [N, 1] channel | [ceil(N/B), ceil(K/B)] block
  extra["input_scale"] float32 [1], static activations only (absent = dynamic)
  extra["dequantized"] float32 [N, K] = codes * scale, exactly what the pipeline propagates
A layer left in full precision (block fallback) gets scheme kind "none" and codes = its weight.

Engines fuse q/k/v and gate/up into one GEMM with ONE per-tensor weight scale and ONE input
scale (vLLM `requantize_with_max_scale`, TensorRT-LLM `rescale_fused_weights`: both re-round
the shards to the max scale). Sharing the max scale here makes the stored codes exactly what
the engine runs, with one rounding instead of two.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import torch

from quantkit.arch import EXPERT
from quantkit.errors import CalibrationError, QuantkitError, SchemeMismatch
from quantkit.methods.intquant import borrow_input_scales, starved_experts
from quantkit.methods.options import FlagValues, MethodRecord, MethodRequest
from quantkit.types import BlockContext, PlanFacts, Quantizer, QuantResult, QuantScheme

__all__ = ["FP8Quantizer", "FP8Layout", "PRESETS", "fp8_scheme", "resolve_layout", "fused_groups",
           "quantize_fp8_weight", "dequantize_fp8", "FP8_MAX"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
BLOCK = 128


@dataclass(frozen=True)
class FP8Layout:
    """weights: tensor | channel | block; activations: dynamic | static."""

    weights: str
    activations: str
    block: int = BLOCK

    @property
    def group_size(self) -> int:
        return {"tensor": 0, "channel": -1}.get(self.weights, self.block)


# the compressed-tensors preset each CLI scheme corresponds to
PRESETS: dict[str, FP8Layout] = {
    "dynamic": FP8Layout("channel", "dynamic"),  # FP8_DYNAMIC
    "static": FP8Layout("tensor", "static"),  # FP8
    "block": FP8Layout("block", "dynamic"),  # FP8_BLOCK (inputs: dynamic per 1x128 group)
}


def resolve_layout(scheme: str = "dynamic", weights: str | None = None,
                   activations: str | None = None, block_size: int = BLOCK) -> FP8Layout:
    """A preset name, optionally overridden per axis (e.g. channel weights + static inputs)."""
    if scheme not in PRESETS:
        raise SchemeMismatch(f"Unknown FP8 scheme {scheme!r}.",
                             f"Choose one of: {', '.join(PRESETS)} (default dynamic).")
    base = PRESETS[scheme]
    layout = FP8Layout(weights or base.weights, activations or base.activations, block_size)
    if layout.weights not in ("tensor", "channel", "block"):
        raise SchemeMismatch(f"Unknown FP8 weight granularity {layout.weights!r}.",
                             "Use tensor, channel or block.")
    if layout.activations not in ("dynamic", "static"):
        raise SchemeMismatch(f"Unknown FP8 activation scheme {layout.activations!r}.",
                             "Use dynamic or static.")
    if layout.weights == "block" and layout.activations == "static":
        raise SchemeMismatch(
            "FP8 block weights take dynamic per-group activations only "
            "(vLLM's fp8 and compressed-tensors block kernels have no static input scale).",
            "Use --scheme block (dynamic) or --scheme static (per-tensor weights).")
    if block_size < 1:
        raise SchemeMismatch(f"Invalid FP8 block size {block_size}.", "Use 128.")
    return layout


def fp8_scheme(scheme: str = "dynamic", **overrides) -> QuantScheme:
    """The QuantScheme that describes an FP8 preset (what quantkit.json records)."""
    layout = resolve_layout(scheme, **overrides)
    return QuantScheme(kind="fp8", bits=8, group_size=layout.group_size, symmetric=True)


# ---------------------------------------------------------------- E4M3 primitives ----

def _amax_to_scale(amax: torch.Tensor) -> torch.Tensor:
    """scale = amax / 448 computed in float64 then rounded once to float32 (ModelOpt does
    `amax.item() / maxbound` in Python floats); an all-zero group gets scale 1."""
    amax = amax.double()
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).float()


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even onto E4M3, saturating (a plain cast would give NaN above 448)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _expand(scale: torch.Tensor, shape: tuple[int, int], block: int) -> torch.Tensor:
    """Scale broadcast against [N, K]: [1] and [N, 1] broadcast as they are; a block grid
    [ceil(N/B), ceil(K/B)] is repeated B times along each axis and cropped."""
    n, k = shape
    if scale.numel() == 1 or tuple(scale.shape) == (n, 1):
        return scale
    return scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]


def quantize_fp8_weight(w: torch.Tensor, weights: str, block: int = BLOCK,
                        scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 codes [N, K] and float32 scale for a [N, K] weight.

    `scale` forces a precomputed per-tensor scale (shared across fused shards)."""
    w = w.detach().float()
    n, k = w.shape
    if scale is None:
        if weights == "tensor":
            scale = _amax_to_scale(w.abs().amax()).reshape(1)
        elif weights == "channel":
            scale = _amax_to_scale(w.abs().amax(dim=1, keepdim=True))
        else:
            nb, kb = -(-n // block), -(-k // block)
            padded = torch.zeros(nb * block, kb * block)
            padded[:n, :k] = w.abs()
            amax = padded.reshape(nb, block, kb, block).amax(dim=(1, 3))
            scale = _amax_to_scale(amax)
    codes = _to_fp8(w / _expand(scale, (n, k), block))
    return codes, scale.clone()


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """float32 codes * scale (the reader in quantkit.formats.fp8 does the same arithmetic)."""
    return codes.float() * _expand(scale.float(), tuple(codes.shape), block)


# ---------------------------------------------------------------- the quantizer ----

def fused_groups(ctx: BlockContext) -> list[tuple[str, ...]]:
    """Linears that share one input and that engines fuse into one GEMM (q/k/v, gate/up):
    the multi-member groups of the architecture's sequential table; a routed expert's
    gate/up per expert (each expert is its own fused GEMM)."""
    arch = ctx.arch
    experts = 0
    if arch is not None and arch.experts is not None:
        # any expert template counts: a true-sequential group holds gate/up or down, not both
        templates = [n for g in arch.sequential for n in g if EXPERT in n]
        while any(t.replace(EXPERT, str(experts)) in ctx.linears for t in templates):
            experts += 1
    seq = arch.fused_sets_for(experts) if arch is not None else ()
    groups = [tuple(n for n in g if n in ctx.linears) for g in seq]
    seen = {n for g in groups for n in g}
    groups += [(n,) for n in ctx.linears if n not in seen]
    return [g for g in groups if g]


def _with_fused_partners(names, shapes: dict, spec) -> set[str]:
    """`names` plus their fused q/k/v or gate/up partners: what the fallback keeps in bf16."""
    out = set(names)
    pre = f"{spec.block_path}." if spec is not None else None
    for name in names:
        if pre is None or not name.startswith(pre):
            continue
        index, _, local = name[len(pre):].partition(".")
        for group in spec.sequential:
            if local in group:
                out |= {f"{pre}{index}.{m}" for m in group} & set(shapes)
    return out


class FP8Quantizer(Quantizer):
    """FP8 E4M3 weights (+ static input scales when asked). Options:

    scheme        dynamic | static | block (presets, see PRESETS)
    weights, activations   override one axis of the preset
    observer      max | percentile (static input scales); percentile: 0-100 over per-token |x|max
    block_size    128
    on_indivisible  fallback (leave that fused group in full precision, with a warning) | error
    share_fused_scales  per-tensor weight scales shared across q/k/v and gate/up (default True)
    """

    name = "fp8"
    propagate_quantized = False  # static scales are calibrated on the unquantized model (ModelOpt max)

    def __init__(self, scheme: str = "dynamic", weights: str | None = None,
                 activations: str | None = None, observer: str = "max",
                 percentile: float = 99.99, block_size: int = BLOCK,
                 on_indivisible: str = "fallback", share_fused_scales: bool = True) -> None:
        self.layout = resolve_layout(scheme, weights, activations, block_size)
        if observer not in ("max", "percentile"):
            raise SchemeMismatch(f"Unknown FP8 observer {observer!r}.", "Use max or percentile.")
        if not 0 < percentile <= 100:
            raise SchemeMismatch(f"Percentile {percentile} is outside (0, 100].", "Use e.g. 99.99.")
        if on_indivisible not in ("fallback", "error"):
            raise SchemeMismatch(f"Unknown on_indivisible {on_indivisible!r}.",
                                 "Use fallback (keep such layers in bf16) or error.")
        self.observer, self.percentile = observer, percentile
        self.on_indivisible, self.share_fused_scales = on_indivisible, share_fused_scales
        self.static = self.layout.activations == "static"
        self.needs_calibration = self.static
        self.stats: tuple[str, ...] = (
            ("absmax",) if observer == "max" else ("token_absmax",)) if self.static else ()
        # MoE experts: static input scales per expert from its routed tokens; an expert the
        # router fed nothing borrows the widest (loudly), as int8 static and NVFP4 W4A4 do
        self.moe_calibrated = True

    @property
    def scheme(self) -> QuantScheme:
        return QuantScheme(kind="fp8", bits=8, group_size=self.layout.group_size, symmetric=True)

    def check(self, scheme: QuantScheme) -> None:
        if scheme.kind != "fp8":
            raise SchemeMismatch(f"Method fp8 got a {scheme.kind!r} scheme.",
                                 "Build it with quantkit.methods.fp8.fp8_scheme(preset).")
        if (scheme.bits, scheme.group_size) != (8, self.layout.group_size):
            raise SchemeMismatch(
                f"QuantScheme(bits={scheme.bits}, group_size={scheme.group_size}) does not "
                f"describe FP8 {self.layout.weights} weights (bits=8, group_size="
                f"{self.layout.group_size}).",
                "Build it with quantkit.methods.fp8.fp8_scheme(preset).")

    def indivisible(self, shape: tuple[int, int]) -> bool:
        b = self.layout.block
        return self.layout.weights == "block" and (shape[0] % b != 0 or shape[1] % b != 0)

    def prepare(self, *, config=None, spec=None, shapes: dict[str, tuple[int, int]]) -> None:
        """Before any data is loaded: refuse (on_indivisible=error) or announce the fallback."""
        bad = {n: s for n, s in shapes.items() if self.indivisible(s)}
        if not bad:
            return
        shown = ", ".join(f"{n} {list(s)}" for n, s in list(bad.items())[:4])
        more = f" and {len(bad) - 4} more" if len(bad) > 4 else ""
        msg = (f"FP8 {self.layout.block}x{self.layout.block} blocks do not tile {len(bad)} "
               f"Linear(s) (out or in width not a multiple of {self.layout.block}): {shown}{more}")
        if len(_with_fused_partners(bad, shapes, spec)) == len(shapes):  # nothing left in FP8
            raise SchemeMismatch(
                f"{msg}: that is every Linear, so nothing would be stored in FP8.",
                "Use --scheme dynamic (per-channel weight scales, any width) or --scheme static.")
        if self.on_indivisible == "error":
            raise SchemeMismatch(msg + ".", "Use --scheme dynamic (per-channel, any width), or "
                                 "the fallback (on_indivisible='fallback') that keeps those "
                                 "layers in bf16.")
        warnings.warn(msg + "; those layers (with their fused q/k/v or gate/up partners) stay "
                      "in full precision.", stacklevel=2)

    def _input_scale(self, ctx: BlockContext, name: str) -> torch.Tensor:
        st = ctx.stats.get(name) or {}
        if self.observer == "max":
            amax = st.get("absmax")
            amax = None if amax is None else amax.max()
        else:
            tok = st.get("token_absmax")
            amax = None if tok is None else torch.quantile(tok.float(), self.percentile / 100)
        if amax is None or not st.get("tokens"):
            raise CalibrationError(
                f"FP8 static input scales need calibration data, but no activations reached "
                f"block {ctx.index} ({name}).",
                "Pass calibration data (--calib, --calib-samples >= 1) or use --scheme dynamic, "
                "which needs none.")
        return _amax_to_scale(amax).reshape(1)

    def quantize_block(self, ctx: BlockContext) -> dict[str, QuantResult]:
        results: dict[str, QuantResult] = {}
        lay = self.layout
        starved: list[str] = []
        for group in fused_groups(ctx):
            weights = {n: ctx.linears[n].weight.data for n in group}
            if any(self.indivisible(tuple(w.shape)) for w in weights.values()):
                for n, w in weights.items():
                    results[n] = self._full_precision(n, w, ctx.linears[n])
                continue
            shared = None
            if lay.weights == "tensor" and self.share_fused_scales and len(group) > 1:
                amax = torch.stack([w.detach().float().abs().amax() for w in weights.values()])
                shared = _amax_to_scale(amax.max()).reshape(1)
            in_scale = None
            if self.static and starved_experts(ctx, group):
                starved += group  # filled in from the calibrated experts once all are done
            elif self.static:  # one input feeds the whole group: one scale (engines take the max)
                in_scale = torch.stack([self._input_scale(ctx, n) for n in group]).max().reshape(1)
            for n, w in weights.items():
                t0 = time.perf_counter()
                codes, scale = quantize_fp8_weight(w, lay.weights, lay.block, shared)
                deq = dequantize_fp8(codes, scale, lay.block)
                res = QuantResult(name=n, scheme=self.scheme, codes=codes, scale=scale,
                                  extra={"dequantized": deq})
                if in_scale is not None:
                    res.extra["input_scale"] = in_scale.clone()
                lin = ctx.linears[n]
                res.bias = None if lin.bias is None else lin.bias.data.clone()
                wf = w.float()
                res.loss = float((wf - deq).norm() / wf.norm().clamp_min(1e-12))
                res.seconds = time.perf_counter() - t0
                results[n] = res
        if starved:
            borrow_input_scales(ctx, results, starved, "input_scale", torch.maximum,
                                "FP8 static", "largest input scale")
        return results

    def _full_precision(self, name: str, w: torch.Tensor, lin: torch.nn.Linear) -> QuantResult:
        """A layer the block grid cannot tile: kept as is, marked kind "none" for the writers."""
        w = w.detach().float().clone()
        return QuantResult(name=name, scheme=QuantScheme(kind="none", bits=16, group_size=-1),
                           codes=w, scale=torch.ones(1), extra={"dequantized": w},
                           bias=None if lin.bias is None else lin.bias.data.clone(), loss=0.0,
                           seconds=0.0)


# ------------------------------------------------------- GPU runtime: torch._scaled_mm ----

class ScaledMMLinear(torch.nn.Module):
    """An FP8 Linear that stays FP8 on the GPU: E4M3 weight [N, K] (half of bf16's bytes) and
    one `torch._scaled_mm` per call, inputs quantized on the fly as the artifact says:
      tensor weights: static input_scale, or dynamic per-tensor;  channel weights: dynamic
      per-token (row-wise scales on both sides, cuBLASLt's row-wise FP8 GEMM).
    Block weights have no _scaled_mm recipe here; they are dequantized to bf16 at build time.
    Needs an FP8-capable GPU (sm_89+)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, input_scale: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
                 fused_quant: bool = True) -> None:
        super().__init__()
        self.fused_quant = fused_quant
        n, k = codes.shape
        self.out_dtype = out_dtype
        self.rowwise = scale.numel() == n and n > 1
        self.register_buffer("weight", codes.contiguous())
        self.register_buffer("scale_b", scale.float().reshape(1, n) if self.rowwise
                             else scale.float().reshape(()))
        self.register_buffer("input_scale", None if input_scale is None
                             else input_scale.float().reshape(()))
        self.register_buffer("bias", None if bias is None else bias.to(out_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        m = x2.shape[0]
        pad = (-m) % 16  # cuBLASLt FP8 wants every GEMM dimension a multiple of 16
        if pad:
            x2 = torch.nn.functional.pad(x2, (0, 0, 0, pad))
        quant = _quant_input_compiled() if self.fused_quant and x2.is_cuda else _quant_input
        xq, sa = quant(x2, self.input_scale, self.rowwise)
        out = torch._scaled_mm(xq, self.weight.t(), scale_a=sa, scale_b=self.scale_b,
                               bias=self.bias, out_dtype=self.out_dtype)
        return out[:m].reshape(*shape[:-1], -1)


def _quant_input(x: torch.Tensor, input_scale: torch.Tensor | None,
                 rowwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 input and its float32 scale: static, per-token (rowwise) or per-tensor."""
    if input_scale is not None:
        sa = input_scale
    elif rowwise:
        sa = (x.abs().amax(-1, keepdim=True).float() / FP8_MAX).clamp_min(1e-12)
    else:
        sa = (x.abs().amax().float() / FP8_MAX).clamp_min(1e-12)
    return _to_fp8(x.float() / sa), sa


_COMPILED = {}


def _quant_input_compiled():
    """The input quantization as one fused kernel (torch.compile, dynamic token count)."""
    if "q" not in _COMPILED:
        _COMPILED["q"] = torch.compile(_quant_input, dynamic=True)
    return _COMPILED["q"]


def benchmark_scaled_mm(tokens: tuple[int, ...] = (1, 16, 128, 1024, 4096),
                        shapes: dict[str, tuple[int, int]] | None = None, iters: int = 50,
                        device: str = "cuda", compile: bool = True) -> list[dict]:
    """ms per call of bf16 F.linear vs FP8 on Llama-3.1-8B Linear shapes (random weights):
    the FP8 GEMM alone (inputs already E4M3) and the whole ScaledMMLinear call with the input
    quantization fused by torch.compile (and, for reference, unfused eager ops)."""
    shapes = shapes or {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096),
                        "gate_up_proj": (28672, 4096), "down_proj": (4096, 14336)}
    torch.manual_seed(0)
    rows = []
    for name, (n, k) in shapes.items():
        w = (torch.randn(n, k, device=device) * 0.02).to(torch.bfloat16)
        for m in tokens:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            ref = torch.nn.functional.linear(x, w)
            variants = {"bf16": lambda x=x, w=w: torch.nn.functional.linear(x, w)}
            for label, weights in (("tensor_static", "tensor"), ("channel_token", "channel")):
                codes, scale = quantize_fp8_weight(w, weights)
                ins = (_amax_to_scale(x.float().abs().amax()).reshape(1).to(device)
                       if weights == "tensor" else None)
                lin = ScaledMMLinear(codes.to(device), scale.to(device), ins).to(device)
                variants[f"fp8_{label}"] = lin
                if compile:
                    variants[f"fp8_{label}_unfused"] = ScaledMMLinear(
                        codes.to(device), scale.to(device), ins, fused_quant=False).to(device)
                if weights == "channel":
                    mp = m + (-m) % 16
                    xp = torch.nn.functional.pad(x, (0, 0, 0, mp - m)).float()
                    sa = (xp.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
                    xq = _to_fp8(xp / sa)
                    variants["fp8_gemm_only"] = lambda xq=xq, sa=sa, lin=lin: torch._scaled_mm(
                        xq, lin.weight.t(), scale_a=sa, scale_b=lin.scale_b, out_dtype=torch.bfloat16)
            for label, fn in variants.items():
                for _ in range(5):
                    out = fn(x) if label != "fp8_gemm_only" else fn()[:m]
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(iters):
                    out = fn(x) if label != "fp8_gemm_only" else fn()
                end.record()
                torch.cuda.synchronize()
                out = out[:m]
                rel = float((out.float() - ref.float()).norm() / ref.float().norm())
                rows.append({"layer": name, "n": n, "k": k, "tokens": m, "variant": label,
                             "ms": start.elapsed_time(end) / iters, "rel_err_vs_bf16": rel})
    return rows


def _fp8_request(v: FlagValues, options: dict) -> MethodRequest:
    options["scheme"] = v["fp8_scheme"] or "dynamic"
    scheme = QuantScheme(kind="fp8", bits=8, group_size=fp8_scheme(options["scheme"]).group_size,
                         symmetric=v["sym"], act_order=v["act_order"], gguf_type=v["gguf_type"])
    return MethodRequest(scheme, options, v["group_size"] is None, v["fmt"])


def _check_fp8_flags(v: FlagValues) -> None:
    scheme = v["fp8_scheme"]
    if v.calib and (scheme or "dynamic") != "static":
        raise QuantkitError(
            f"{v.calib[0]} is read by --method fp8 only with --scheme static; --scheme "
            f"{scheme or 'dynamic'} computes its scales from the weights alone.",
            f"Drop {v.calib[0]}, or pass --scheme static.")


def one_byte_disk(f: PlanFacts) -> int:
    """FP8 / int8 artifacts: one byte per weight, float32 scales."""
    return f.quantized + f.scales * 4 + f.dense_outside


RECORDS = (MethodRecord(
    name="fp8", quantizer=FP8Quantizer, build=_fp8_request, check_flags=_check_fp8_flags,
    command_args=lambda req: ["--scheme", str(req.method_options.get("scheme", "dynamic"))],
    reads_calibration=lambda options: options.get("scheme") == "static",
    plan_passes=1, plan_disk=one_byte_disk),)
