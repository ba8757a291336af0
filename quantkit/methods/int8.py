"""Integer W8A8: int8 weights, one scale per output channel, and int8 Linear inputs, either
dynamic (the engine computes one scale per token at run time) or static (one per-tensor
scale calibrated here from the shared calibration loader). Optional SmoothQuant first
(`quantkit.methods.smoothquant`), and GPTQ rounding of the weights instead of round-to-nearest
(the GPTQ solver of `quantkit.methods.gptq`, per-channel int8 grid).

How a result is encoded (formats read only this, never this module):
  QuantResult.scheme   QuantScheme(kind="int", bits=8, group_size=-1, symmetric=True,
                                   activations="dynamic" | "static")
  QuantResult.codes    uint8 [N, K], original column order: signed int8 code + 128
  QuantResult.scale    float32 [N, 1]; zero int32 [N, 1] = 128 (intquant's symmetric grid,
                       s = max|w| / 127.5: the compressed-tensors convention, codes in
                       [-128, 127] once the 128 is taken off)
  extra["input_scale"] float32 [1], static only: max|x| / 127.5 over the calibration tokens
                       (after smoothing; llm-compressor's static_minmax observer), ONE for
                       q/k/v and one for gate/up: vLLM 0.32 fuses them into one GEMM whose
                       int8 input_scale is a single [1] parameter each shard's load overwrites
                       (BasevLLMParameter), so the last shard loaded would win.
dequantize() is exactly the weight the pipeline writes back (smoothed when SmoothQuant ran;
the folded norms travel with the block's dense tensors).
"""

from __future__ import annotations

import logging
import time

import torch

from quantkit.errors import CalibrationError, QuantkitError, SchemeMismatch
from quantkit.methods.fp8 import fused_groups, one_byte_disk
from quantkit.methods.gptq import DEFAULT_BLOCK_SIZE, DEFAULT_DAMP, GPTQQuantizer, check_v_hessian
from quantkit.methods.intquant import (
    borrow_input_scales,
    relative_error,
    rtn_quantize_weight,
    starved_experts,
)
from quantkit.methods.options import (
    FlagValues,
    MethodRecord,
    MethodRequest,
    check_gptq_rounding_flags,
    rounding_args,
)
from quantkit.methods.scaling import require_scaling_table
from quantkit.methods.smoothquant import (
    SMOOTHQUANT_PAIRS,
    SMOOTHQUANT_STATS,
    Smoothing,
    check_alpha,
    smooth_block,
)
from quantkit.types import BlockContext, Quantizer, QuantResult, QuantScheme

__all__ = ["Int8Quantizer", "int8_scheme", "SCHEMES", "ROUNDINGS", "STATIC_QMAX"]

log = logging.getLogger("quantkit.int8")

SCHEMES = ("dynamic", "static")  # input activations; weights are always per-channel
ROUNDINGS = ("rtn", "gptq")
STATIC_QMAX = 127.5  # compressed-tensors' symmetric int8 range / 2 (calculate_qparams)


def int8_scheme(scheme: str = "dynamic") -> QuantScheme:
    """The QuantScheme of W8A8 int8 with `scheme` input activations (what quantkit.json records)."""
    if scheme not in SCHEMES:
        raise SchemeMismatch(f"Unknown int8 scheme {scheme!r}.",
                             f"Choose one of: {', '.join(SCHEMES)} (default dynamic).")
    return QuantScheme(kind="int", bits=8, group_size=-1, symmetric=True, activations=scheme)


class Int8Quantizer(Quantizer):
    """W8A8 int8 for the block pipeline. Options:

    scheme       dynamic (per-token inputs, no calibration needed) | static (per-tensor)
    smoothquant  None, or alpha in [0, 1]: migrate activation outliers into the weights
    smoothquant_pairs  all (every group of the scaling table) | norms (norm -> Linear groups
                 only: llm-compressor's default SmoothQuant mappings)
    rounding     rtn | gptq (Hessian-aware rounding; the next block sees quantized outputs)
    damp, block_size, v_hessian   GPTQ's, when rounding="gptq"
    """

    name = "int8"
    true_sequential = False  # one set of statistics per block: SmoothQuant folds across groups

    def __init__(self, scheme: str = "dynamic", smoothquant: float | None = None,
                 rounding: str = "rtn", damp: float = DEFAULT_DAMP,
                 smoothquant_pairs: str = "all",
                 block_size: int = DEFAULT_BLOCK_SIZE, v_hessian: str = "tokens") -> None:
        self._scheme = int8_scheme(scheme)
        self.v_hessian = check_v_hessian(v_hessian)
        if rounding not in ROUNDINGS:
            raise SchemeMismatch(f"Unknown int8 rounding {rounding!r}.",
                                 f"Choose one of: {', '.join(ROUNDINGS)} (default rtn).")
        if v_hessian != "tokens" and rounding != "gptq":
            raise SchemeMismatch(f"v_hessian={v_hessian!r} is read only by GPTQ rounding.",
                                 "Pass --rounding gptq, or drop --gptq-v-hessian.")
        self.alpha = None if smoothquant is None else check_alpha(smoothquant)
        if smoothquant_pairs not in SMOOTHQUANT_PAIRS:
            raise SchemeMismatch(f"Unknown SmoothQuant pairs {smoothquant_pairs!r}.",
                                 f"Choose one of: {', '.join(SMOOTHQUANT_PAIRS)} (default all).")
        self.smoothquant_pairs = smoothquant_pairs
        self.rounding = rounding
        self.static = scheme == "static"
        self._gptq = (GPTQQuantizer(damp=damp, block_size=block_size, true_sequential=False)
                      if rounding == "gptq" else None)
        stats = list(SMOOTHQUANT_STATS) if self.alpha is not None else []
        if self.static:
            stats.append("absmax")
        if self._gptq is not None:
            stats.append("hessian")
        self.stats: tuple[str, ...] = tuple(stats)
        self.needs_calibration = bool(self.stats)
        # MoE experts: static input scales per expert from its routed tokens (an expert the
        # router fed nothing borrows the widest, loudly), SmoothQuant's norm scale shared by
        # the router and every expert, GPTQ per expert (RTN for a starved one, loudly)
        self.moe_calibrated = True
        # GPTQ's choice: later blocks calibrate on this block's quantized outputs
        self.propagate_quantized = self._gptq is not None
        self.calib_batch_size = 8  # the same sums as batch 1, fewer and larger ops (see GPTQ)
        self.history: list[dict] = []  # SmoothQuant's folded groups (for reports and tests)
        self._logged: set[str] = set()

    @property
    def scheme(self) -> QuantScheme:
        return self._scheme

    def check(self, scheme: QuantScheme) -> None:
        if scheme != self._scheme:
            raise SchemeMismatch(
                f"Method int8 makes {self._scheme.describe()}, not {scheme.describe()}.",
                "Build the scheme with quantkit.methods.int8.int8_scheme(scheme).")

    def prepare(self, *, config=None, spec=None, shapes=None, **_) -> None:
        """Before any data is loaded: SmoothQuant needs the architecture's scaling table."""
        if self.alpha is not None:
            require_scaling_table(spec, "SmoothQuant", "drop --smoothquant")

    def _log_once(self, msg: str) -> None:
        if msg not in self._logged:
            self._logged.add(msg)
            log.warning(msg)

    def quantize_block(self, ctx: BlockContext) -> dict[str, QuantResult]:
        t0 = time.perf_counter()
        smooth = None
        if self.alpha is not None:
            require_scaling_table(ctx.arch, "SmoothQuant", "drop --smoothquant")
            smooth = smooth_block(ctx, self.alpha, log=self._log_once,
                                  pairs=self.smoothquant_pairs)
            self.history += smooth.history
            if self._gptq is not None:
                _smooth_hessians(ctx, smooth)
        originals = {n: _unsmoothed(lin.weight.data, n, smooth) for n, lin in ctx.linears.items()
                     } if smooth is not None else {}
        if self._gptq is not None:
            results = self._gptq.quantize_block(ctx)  # reads ctx.scheme: int8 per-channel sym
        else:
            results = {}
            for name, lin in ctx.linears.items():
                res = rtn_quantize_weight(name, lin.weight.data, ctx.scheme)
                res.bias = None if lin.bias is None else lin.bias.data.clone()
                results[name] = res
        for name, res in results.items():
            res.scheme = self._scheme
            if smooth is not None:  # the error in the original weights' terms, as AWQ reports it
                w_hat = _unsmoothed(res.dequantize().to(originals[name].device), name, smooth)
                res.loss = relative_error(originals[name], w_hat)
        if self.static:
            starved: list[str] = []
            for group in fused_groups(ctx):  # q/k/v, and each expert's gate/up, share one
                if starved_experts(ctx, group):
                    starved += group  # borrowed from the calibrated experts below
                    continue
                scale = _static_input_scale(ctx, group, smooth)
                for name in group:
                    results[name].extra["input_scale"] = scale.clone()
            if starved:
                borrow_input_scales(ctx, results, starved, "input_scale", torch.maximum,
                                    "int8 static", "largest input scale")
        seconds = time.perf_counter() - t0
        total = sum(lin.weight.numel() for lin in ctx.linears.values())
        for name, res in results.items():
            res.seconds = seconds * ctx.linears[name].weight.numel() / total
        return results


def _unsmoothed(w: torch.Tensor, name: str, smooth: Smoothing | None) -> torch.Tensor:
    """The weight in the original model's terms (smoothing divided back out), float32."""
    w = w.float()
    if smooth is None:
        return w
    return w / smooth.col[name][None, :].to(w.device) / smooth.row[name][:, None].to(w.device)


def _smooth_hessians(ctx: BlockContext, smooth: Smoothing) -> None:
    """A Linear whose input became x / c has Hessian H / (c c^T): the same statistics without
    a second calibration pass. Linears that shared one Hessian (q/k/v) still share equal ones."""
    done: dict[int, torch.Tensor] = {}
    for name in ctx.linears:
        st = ctx.stats.get(name) or {}
        h = st.get("hessian")
        if h is None:
            continue
        c = smooth.col[name].to(h.device)
        if torch.all(c == 1):
            continue
        key = id(h)
        if key not in done:
            done[key] = h / (c[:, None] * c[None, :])
        st["hessian"] = done[key]


def _static_input_scale(ctx: BlockContext, group: tuple[str, ...],
                        smooth: Smoothing | None) -> torch.Tensor:
    """max|x| / 127.5 over the group's (smoothed) calibration inputs, float32 [1]."""
    amax = None
    for name in group:
        st = ctx.stats.get(name) or {}
        if "absmax" not in st or not st.get("tokens"):
            raise CalibrationError(
                f"int8 static input scales need calibration data, but no activations reached "
                f"block {ctx.index} ({name}).",
                "Pass calibration data (--calib, --calib-samples >= 1) or use --scheme dynamic, "
                "which needs none.")
        a = st["absmax"].float()
        if smooth is not None:
            a = a / smooth.col[name].to(a.device)
        m = a.max()
        amax = m if amax is None else torch.maximum(amax, m)
    amax = amax.double()
    scale = torch.where(amax > 0, amax / STATIC_QMAX, torch.ones_like(amax))
    return scale.float().reshape(1).cpu()


def _int8_request(v: FlagValues, options: dict) -> MethodRequest:
    options["scheme"] = v["fp8_scheme"] or "dynamic"
    if v["smoothquant"] is not None:
        options["smoothquant"] = v["smoothquant"]
    if v["smoothquant_pairs"]:
        options["smoothquant_pairs"] = v["smoothquant_pairs"]
    if v["rounding"]:
        options["rounding"] = v["rounding"]
    # per-channel weights: no group size to fit
    return MethodRequest(int8_scheme(options["scheme"]), options, False, v["fmt"])


def _check_int8_flags(v: FlagValues) -> None:
    check_gptq_rounding_flags("int8", v)
    if "smoothquant_pairs" in v.given and v["smoothquant"] is None:
        raise QuantkitError("--smoothquant-pairs is read by --method int8 only with "
                            "--smoothquant.", "Drop --smoothquant-pairs, or pass "
                            "--smoothquant ALPHA.")
    reads = ((v["fp8_scheme"] or "dynamic") == "static" or v["smoothquant"] is not None
             or v.rounding == "gptq")
    if v.calib and not reads:
        raise QuantkitError(
            f"{v.calib[0]} is read by --method int8 only with --scheme static, --smoothquant "
            "or --rounding gptq; dynamic int8 with round-to-nearest needs no calibration.",
            f"Drop {v.calib[0]}, or pass one of those flags.")


def _int8_args(req) -> list[str]:
    o = req.method_options
    args = ["--scheme", str(o.get("scheme", "dynamic"))]
    if o.get("smoothquant") is not None:
        args += ["--smoothquant", str(o["smoothquant"])]
    if o.get("smoothquant_pairs"):
        args += ["--smoothquant-pairs", str(o["smoothquant_pairs"])]
    return args + rounding_args(req)


RECORDS = (MethodRecord(
    name="int8", quantizer=Int8Quantizer, build=_int8_request, check_flags=_check_int8_flags,
    command_args=_int8_args,
    reads_calibration=lambda o: (o.get("scheme") == "static" or o.get("smoothquant") is not None
                                 or o.get("rounding") == "gptq"),
    plan_passes=1, plan_disk=one_byte_disk),)
