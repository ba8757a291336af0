"""GPTQ (Frantar et al. 2022): quantize a Linear column by column, folding each column's
rounding error into the columns not yet quantized, weighted by the inverse Hessian of the
layer's inputs (H = sum x^T x over the calibration tokens).

Why this layout:
  * `gptq_quantize` is the whole algorithm on one weight matrix and one Hessian (no hooks,
    no modules), so tests can call it on a small Linear and the pipeline on a real one.
  * Linears that read the same input (q/k/v, gate/up) share H, so their weights are stacked
    and quantized in ONE call: one Cholesky, one column loop over more rows. Rows of W are
    independent in GPTQ, so stacking changes nothing but the speed.
  * Codes, scales and zeros come from `quantkit.methods.intquant`, the grid RTN uses, and the
    result obeys QuantResult's invariant: dequantize() is exactly the weight the column loop
    settled on (codes in ORIGINAL column order, g_idx for act-order).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from quantkit import reproducible
from quantkit.errors import BadWeights, CalibrationError, SchemeMismatch
from quantkit.ggml.jit import compiled_available
from quantkit.methods import gptq_triton
from quantkit.methods.intquant import (
    affine_refit,
    check_int_scheme,
    group_qparams,
    quantize_to_codes,
    relative_error,
    rtn_fallback,
)
from quantkit.methods.options import MethodRecord, int_scheme, int_scheme_args
from quantkit.types import BlockContext, Quantizer, QuantResult, QuantScheme, int_qrange

__all__ = ["GPTQQuantizer", "GPTQOutput", "gptq_quantize", "inverse_hessian_factor",
           "ColumnGrid", "IntColumnGrid", "gptq_column_loop", "prepare_hessian",
           "shared_input_sets", "solve_cost", "one_cpu_thread", "DEFAULT_DAMP", "DEFAULT_BLOCK_SIZE",
           "V_HESSIANS", "check_v_hessian"]

# v_proj's Hessian: "tokens" (X^T X, every token alike) or "attention" (the error its output
# makes after the attention weights; quantkit.pipeline.attention_v computes it)
V_HESSIANS = ("tokens", "attention")
DEFAULT_DAMP = 0.01  # fraction of mean(diag(H)) added to the diagonal
DEFAULT_BLOCK_SIZE = 128  # columns per lazy batched update
_MAX_DAMP_TRIES = 7  # damp x10 per retry: 0.01 -> 1e4 before giving up


@dataclass
class GPTQOutput:
    """Unpacked result for one (possibly stacked) weight, ORIGINAL column order.

    codes uint8 [N, K]; scale float32 [N, G]; zero int32 [N, G];
    g_idx int32 [K] (None when it is k // group_size); damp: the dampening finally used.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    g_idx: torch.Tensor | None
    damp: float


def check_v_hessian(value: str) -> str:
    """The v_hessian option's value, or a clear error (every GPTQ-family quantizer takes it)."""
    if value not in V_HESSIANS:
        raise SchemeMismatch(f"Unknown v_proj Hessian {value!r}.",
                             f"Choose one of: {', '.join(V_HESSIANS)} (default tokens).")
    return value


def check_gptq_scheme(scheme: QuantScheme) -> None:
    """Refuse what GPTQ cannot do before any calibration runs."""
    check_int_scheme(scheme)
    if scheme.kind != "int":
        raise SchemeMismatch(f"GPTQ quantizes integer schemes, not {scheme.kind!r}.")
    if scheme.act_order and scheme.group_size in (-1, 0):
        raise SchemeMismatch(
            "act-order needs a group size: with group size -1 there is one group per row, so "
            "reordering columns changes nothing that can be stored (g_idx would be all zero).",
            "Pass --group-size 32/64/128, or drop --act-order.")


def column_block_width(block_size: int, group: int, fixed: bool) -> int:
    """Columns per lazy-update block: whole groups when group parameters are computed on the
    fly, so a group's parameters always come from fully updated columns."""
    if fixed:
        return block_size
    return block_size // group * group if group <= block_size else group


def inverse_hessian_factor(h: torch.Tensor, damp: float, name: str = "") -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor U of (H + damp * mean(diag H) * I)^-1, i.e. H^-1 = U^T U.

    Computed as U = J L^-1 J with J the order-reversing permutation and L L^T = J H J: one
    Cholesky and one triangular solve (4/3 n^3 flops) instead of Cholesky, inverse and a
    second Cholesky (on a GPU cholesky_inverse is a full solve: 8/3 n^3). Both give the
    unique factor with a positive diagonal. A Hessian that is not positive definite (too few
    tokens, collinear inputs, float32 round-off) gets damp x10 until the factorization
    succeeds, with a warning; never NaN.
    """
    k = h.shape[0]
    mean_diag = float(h.diagonal().abs().mean())
    if not torch.isfinite(h).all():
        raise BadWeights(f"Hessian of {name or 'a layer'} holds NaN/Inf.",
                         "The calibration activations overflowed: check the model in float32.")
    if mean_diag == 0.0:
        mean_diag = 1.0
    cur = damp
    info = torch.empty((), dtype=torch.int32, device=h.device)
    for _ in range(_MAX_DAMP_TRIES):
        low = h.flip((0, 1))  # a copy: damping it leaves h as it was for a retry
        low.diagonal().add_(cur * mean_diag)
        # factor, solve and flip each in the memory of their input: three K x K buffers at
        # most (h, L, L^-1) instead of six (K = 14336: 2.3 instead of 4.6 GiB on the GPU)
        with _pinned_threads(h.device):
            torch.linalg.cholesky_ex(low, out=(low, info))
        if int(info) == 0:
            inv = torch.eye(k, dtype=h.dtype, device=h.device)
            with _pinned_threads(h.device):
                torch.linalg.solve_triangular(low, inv, upper=False, out=inv)
            del low
            upper = _reverse_in_place(inv)
            if torch.isfinite(upper).all():
                return upper, cur
        nxt = cur * 10 if cur > 0 else 1e-3
        warnings.warn(f"GPTQ: Hessian of {name or 'a layer'} is not positive definite with "
                      f"damp={cur:g}; retrying with damp={nxt:g}.", RuntimeWarning, stacklevel=2)
        cur = nxt
    raise BadWeights(f"GPTQ: Hessian of {name or 'a layer'} stays singular even with damp={cur:g}.",
                     "Use more calibration samples, or quantize this layer with RTN.")


class ColumnGrid(Protocol):
    """GPTQ's round-to-grid step, the only part that differs between formats: the column
    loop (error feedback through the inverse-Hessian factor) is `gptq_column_loop`'s alone."""

    def round_column(self, col: int, block: torch.Tensor, i: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, dequantized values) of processed column `col`, which is block[:, i] after
        error feedback; block[:, i:] are the block's remaining updated columns."""
        ...


class IntColumnGrid:
    """The integer grid of `quantkit.methods.intquant` (what RTN uses): per-group scale and
    zero, fixed up front or taken from the updated columns when a group starts."""

    def __init__(self, scheme: QuantScheme, scale: torch.Tensor, zero: torch.Tensor,
                 col_group: list[int], group: int, fixed: bool) -> None:
        self.bits, self.symmetric = scheme.bits, scheme.symmetric
        self.scale, self.zero = scale, zero  # [NG, N], written here when not fixed
        self.zs = zero * scale
        self.col_group, self.group, self.fixed = col_group, group, fixed
        self._grp = -1

    def round_column(self, col: int, block: torch.Tensor, i: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        grp = self.col_group[col]
        if grp != self._grp:
            self._grp = grp
            if not self.fixed:
                s, z = group_qparams(block[:, i:i + self.group], self.bits, self.symmetric)
                self.scale[grp], self.zero[grp] = s, z
                self.zs[grp] = self.zero[grp] * s
            self._s, self._z, self._nzs = self.scale[grp], self.zero[grp], self.zs[grp].neg()
        q = quantize_to_codes(block[:, i], self._s, self._z, self.bits)
        return q, torch.addcmul(self._nzs, q, self._s)


BlockKernel = Callable[[torch.Tensor, torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor]]


def gptq_column_loop(w: torch.Tensor, hinv: torch.Tensor, grid: ColumnGrid, block_size: int,
                     block_kernel: BlockKernel | None = None) -> torch.Tensor:
    """GPTQ's column loop over w [N, K] float32 (updated in place): round each column with
    `grid`, fold its error / H^-1_ii into the block's later columns along row i of the upper
    Cholesky factor `hinv` of H^-1, and the block's errors into the columns after it in one
    matmul (the lazy batch update). `block_kernel(w1, hinv1, i1, i2) -> (codes, err)` runs a
    whole block instead (the compiled integer loops). Returns the codes [N, K] as float32."""
    n, k = w.shape
    codes = torch.empty_like(w)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        hinv1 = hinv[i1:i2, i1:i2]
        if block_kernel is not None:
            q1, err1 = block_kernel(w[:, i1:i2], hinv1, i1, i2)
            codes[:, i1:i2] = q1
        else:
            w1 = w[:, i1:i2].clone()
            err1 = torch.empty_like(w1)
            diag = hinv1.diagonal().tolist()
            for i in range(i2 - i1):
                q, deq = grid.round_column(i1 + i, w1, i)
                e = torch.div(w1[:, i] - deq, diag[i], out=err1[:, i])
                w1[:, i:].addr_(e, hinv1[i, i:], alpha=-1.0)  # fold the error into later columns
                codes[:, i1 + i] = q
        w[:, i2:].addmm_(err1, hinv[i1:i2, i2:], alpha=-1.0)  # lazy update of the rest
    return codes


def prepare_hessian(hessian: torch.Tensor, device: torch.device, overwrite: bool = False
                    ) -> torch.Tensor:
    """H as float32 on `device` (a copy unless `overwrite`), with columns whose input was
    always zero decoupled (H_kk = 1): they carry no information, and their weight is then
    rounded as RTN rounds it instead of zeroed as reference GPTQ does."""
    h = hessian.detach().to(device=device, dtype=torch.float32)
    if h.data_ptr() == hessian.data_ptr() and not overwrite:
        h = h.clone()  # .to made no copy: keep the caller's H as it was
    # (masked_fill_ on the diagonal view: the same entries as h[dead, dead] = 1.0, without the
    # boolean-index nonzero() that waits for the GPU)
    h.diagonal().masked_fill_(h.diagonal() == 0, 1.0)
    return h


def _reverse_in_place(t: torch.Tensor, chunk: int = 1 << 24) -> torch.Tensor:
    """t.flip(every dim) written into t itself (contiguous t): flipping every dim reverses the
    flattened elements, done by swapping mirrored chunks through chunk-sized temporaries
    instead of a second full-size copy."""
    flat = t.view(-1)
    n = flat.numel()
    for i in range(0, n // 2, chunk):
        j = min(i + chunk, n // 2)
        front, back = flat[i:j], flat[n - j:n - i]
        tmp = front.flip(0)
        front.copy_(back.flip(0))
        back.copy_(tmp)
    return t


@contextlib.contextmanager
def one_cpu_thread(device: torch.device) -> Iterator[None]:
    """The torch column loop is thousands of tiny ops: on CPU, worker threads only add
    barrier waits (measured 40x slower with 2 threads on a busy 2-core machine), so use one."""
    if device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _pinned_threads(device: torch.device) -> contextlib.AbstractContextManager:
    """One thread in reproducible mode: MKL's Cholesky and triangular solve split their sums
    by thread count even under MKL_CBWR=...,STRICT (measured: 1 vs 2 threads differ by up to
    6e-7), so the same factor on every machine needs a fixed count."""
    return one_cpu_thread(device) if reproducible.active() else contextlib.nullcontext()


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, scheme: QuantScheme, *,
                  damp: float = DEFAULT_DAMP, block_size: int = DEFAULT_BLOCK_SIZE,
                  static_groups: bool = True, name: str = "", loop: str | None = None,
                  overwrite_hessian: bool = False) -> GPTQOutput:
    """GPTQ of one weight [N, K] given H [K, K] (sum x^T x; any positive scale).

    Runs on weight's device in float32. Group parameters are taken from the error-updated
    weights when a group starts (as GPTQ does). With act-order, `static_groups` (default)
    fixes every group's scale/zero from the original weights first, so groups stay contiguous
    (g_idx = k // group_size): the only act-order vLLM 0.32 loads. static_groups=False makes
    groups of consecutive columns in act-order (a permuted g_idx, "desc_act" / actorder group).
    `loop` picks the CPU column loop: "compiled" (numba, gptq_cpu; the default) or "torch"
    (the reference loop below; the fallback without numba). CUDA runs the Triton kernel.
    `overwrite_hessian` lets the solve use `hessian` (float32, on weight's device) as its own
    scratch instead of copying it: one K x K float32 buffer less (784 MiB for K = 14336).
    """
    if loop not in (None, "compiled", "torch"):
        raise ValueError(f"GPTQ loop {loop!r}: choose 'compiled' or 'torch'")
    if loop is None:  # the CPU's choice (a GPU runs Triton): numba is imported only there
        loop = "compiled" if weight.device.type != "cpu" or compiled_available() else "torch"
    ctx = one_cpu_thread(weight.device) if loop == "torch" else contextlib.nullcontext()
    with ctx:
        return _gptq(weight, hessian, scheme, damp, block_size, static_groups, name, loop,
                     overwrite_hessian)


def _gptq(weight: torch.Tensor, hessian: torch.Tensor, scheme: QuantScheme, damp: float,
          block_size: int, static_groups: bool, name: str, loop: str,
          overwrite_hessian: bool = False) -> GPTQOutput:
    check_gptq_scheme(scheme)
    n, k = weight.shape
    g = scheme.effective_group(k)
    if k % g:
        raise SchemeMismatch(f"group size {g} does not divide in_features {k} of {name}.")
    n_groups = k // g
    _, qmax = int_qrange(scheme.bits)
    w = weight.detach().to(torch.float32, copy=True)  # one copy (.float().clone(): two)
    # float zero points (scheme.float_zero): the pair (scale, zero) of every group is refitted
    # on the final codes against this H (the solve below overwrites its own copy)
    h_fit = prepare_hessian(hessian, w.device) if scheme.float_zero and not scheme.symmetric \
        else None
    h = prepare_hessian(hessian, w.device, overwrite_hessian)

    # per-group parameters, stored [NG, N] so one group's row is contiguous in the loop
    scale = torch.empty(n_groups, n, device=w.device)
    zero = torch.empty(n_groups, n, device=w.device)
    fixed = g == k or (static_groups and scheme.act_order)
    if fixed:  # parameters fixed up front from the original weights
        s, z = group_qparams(w.reshape(n, n_groups, g), scheme.bits, scheme.symmetric)
        scale.copy_(s.T)
        zero.copy_(z.T)

    perm = None
    if scheme.act_order:  # most-activated columns first: their error is spread the widest
        perm = torch.argsort(h.diagonal(), descending=True)
        w = w[:, perm]
        h = h[perm][:, perm]
    # group of each processed column: its original group when fixed, else its position // g
    col_group = (perm // g if perm is not None and fixed else torch.arange(k) // g).tolist()

    hinv, used_damp = inverse_hessian_factor(h, damp, name)
    bs = column_block_width(block_size, g, fixed)
    # the same column loop as one kernel call per block: Triton on CUDA, numba on the CPU
    kernel, kernel_groups = None, None
    if gptq_triton.available(w.device):
        kernel = gptq_triton.gptq_block
        kernel_groups = torch.tensor(col_group, dtype=torch.int32, device=w.device)
    elif w.device.type == "cpu" and loop == "compiled":
        from quantkit.methods import gptq_cpu  # numba: imported only when used

        kernel, kernel_groups = gptq_cpu.gptq_block, col_group
    kernel_kw = {"bits": scheme.bits, "symmetric": scheme.symmetric, "group_size": g, "fixed": fixed}

    def block_kernel(w1: torch.Tensor, hinv1: torch.Tensor, i1: int, i2: int):
        return kernel(w1, hinv1, scale, zero, kernel_groups[i1:i2], **kernel_kw)

    grid = IntColumnGrid(scheme, scale, zero, col_group, g, fixed)
    codes = gptq_column_loop(w, hinv, grid, bs, block_kernel if kernel is not None else None)

    g_idx = None
    if perm is not None:
        inv = torch.argsort(perm)
        codes = codes[:, inv]
        if not fixed:  # group j holds the j-th run of g columns in act-order
            g_idx = torch.empty(k, dtype=torch.int32, device=w.device)
            g_idx[perm] = torch.arange(k, device=w.device, dtype=torch.int32) // g
    codes = codes.clamp_(0, qmax).to(torch.uint8)
    scale, zero = scale.T.contiguous(), zero.T.contiguous()
    if h_fit is not None and g_idx is None:  # the grid loop's integer zeros, refitted as floats
        scale, zero = affine_refit(weight.detach().float(), codes, scale, zero, g, h_fit)
        return GPTQOutput(codes=codes, scale=scale.contiguous(), zero=zero.contiguous(),
                          g_idx=g_idx, damp=used_damp)
    return GPTQOutput(codes=codes, scale=scale, zero=zero.to(torch.int32), g_idx=g_idx,
                      damp=used_damp)


class GPTQQuantizer(Quantizer):
    """The pipeline-facing side: Hessians in, QuantResults out, one sequential group at a time.

    Options: damp (fraction of mean diag H, default 0.01), block_size (128),
    static_groups (with act-order: groups fixed from the original weights, default True),
    true_sequential (default True; False: every Linear of a block calibrates on the
    unquantized block, as llm-compressor does: fewer block forwards on a GPU, a little less
    accurate; on the CPU the true-sequential order runs in one forward and is faster anyway),
    v_hessian ("tokens", default: X^T X for every Linear; "attention": v_proj's Hessian
    weighted by the block's attention probabilities, quantkit.pipeline.attention_v).
    """

    name = "gptq"
    stats: tuple[str, ...] = ("hessian",)
    propagate_quantized = True  # the next group/block calibrates on quantized outputs
    needs_calibration = True
    true_sequential = True  # q/k/v -> o -> gate/up -> down, each on the previous' outputs
    # 8 samples per forward: the same sums as batch 1, but 8x fewer small ops (on a busy CPU
    # a SmolLM2 block ran much faster with 8 x 512 tokens per call than with 1 x 512)
    calib_batch_size = 8
    # reads calibration data only through the summed Hessians: data-parallel ranks can each
    # sum their shard (quantkit.pipeline.distributed)
    data_parallel = True

    def __init__(self, damp: float = DEFAULT_DAMP, block_size: int = DEFAULT_BLOCK_SIZE,
                 static_groups: bool = True, true_sequential: bool = True,
                 v_hessian: str = "tokens"):
        self.v_hessian = check_v_hessian(v_hessian)
        if damp < 0:
            raise SchemeMismatch(f"GPTQ damp must be >= 0, got {damp}.", "The usual value is 0.01.")
        if block_size < 1:
            raise SchemeMismatch(f"GPTQ block_size must be >= 1, got {block_size}.")
        self.damp = float(damp)
        self.block_size = int(block_size)
        self.static_groups = bool(static_groups)
        self.true_sequential = bool(true_sequential)

    def check(self, scheme: QuantScheme) -> None:
        check_gptq_scheme(scheme)

    def warm_up(self, scheme: QuantScheme, device: torch.device) -> None:
        """Start compiling the GPU column-loop kernel for this scheme (a no-op on the CPU)."""
        g = scheme.group_size
        if g is None or g <= 0:
            return  # per-channel: the group is the row width, known per layer only
        fixed = scheme.act_order and self.static_groups
        gptq_triton.warm_up(torch.device(device), bits=scheme.bits, symmetric=scheme.symmetric,
                            group_size=g, fixed=fixed,
                            block_width=column_block_width(self.block_size, g, fixed))

    def quantize_block(self, ctx: BlockContext) -> dict[str, QuantResult]:
        prefix = f"{ctx.arch.block_path}.{ctx.index}." if ctx.arch is not None else f"block {ctx.index} "
        uncalibrated = []
        for lname in ctx.linears:
            st = ctx.stats.get(lname) or {}
            if not st.get("tokens") or "hessian" not in st:
                if ctx.arch is not None and ctx.arch.is_expert_linear(lname):
                    uncalibrated.append(lname)  # routing chose it for no token: RTN below
                    continue
                raise CalibrationError(
                    f"GPTQ: layer {prefix}{lname} received no calibration tokens, so it has no "
                    "Hessian to quantize with.",
                    "Use more or longer calibration samples (MoE experts need tokens routed to "
                    "them), or quantize with --method rtn.")
        results = rtn_fallback(ctx, uncalibrated, "GPTQ")
        for names in shared_input_sets(ctx, [n for n in ctx.linears if n not in results]):
            results.update(self._quantize_set(ctx, names, prefix))
        return results

    def solve_units(self, ctx: BlockContext) -> list[tuple[list[str], int]]:
        """One unit per shared-input set (solved as one stacked weight) and per uncalibrated
        expert (its RTN fallback); cost: the inverse Hessian factor (~K^3) plus the column
        loop's updates (~K^2 per output row)."""
        calibrated = [n for n in ctx.linears
                      if (ctx.stats.get(n) or {}).get("tokens") and "hessian" in ctx.stats[n]]
        units = [([n], ctx.linears[n].weight.numel()) for n in ctx.linears if n not in calibrated]
        for names in shared_input_sets(ctx, calibrated):
            units.append((names, solve_cost(ctx.linears[names[0]].in_features,
                                            sum(ctx.linears[n].out_features for n in names))))
        return units

    def _quantize_set(self, ctx: BlockContext, names: list[str], prefix: str) -> dict[str, QuantResult]:
        """Quantize Linears that share one Hessian as one stacked weight."""
        t0 = time.perf_counter()
        weights = [ctx.linears[n].weight.data for n in names]
        rows = [w.shape[0] for w in weights]
        stacked = torch.cat(weights, 0) if len(weights) > 1 else weights[0]
        hessian = ctx.stats[names[0]]["hessian"]
        for lname in names:  # consumed here: the solve overwrites it (one K x K copy less)
            del ctx.stats[lname]["hessian"]
        out = gptq_quantize(stacked, hessian, ctx.scheme, damp=self.damp,
                            block_size=self.block_size, static_groups=self.static_groups,
                            name=prefix + "+".join(names), overwrite_hessian=True)
        del hessian
        seconds = time.perf_counter() - t0
        results = {}
        start = 0
        for lname, w, nrow in zip(names, weights, rows, strict=True):
            sl = slice(start, start + nrow)
            start += nrow
            linear = ctx.linears[lname]
            res = QuantResult(
                name=lname, scheme=ctx.scheme, codes=out.codes[sl].contiguous(),
                scale=out.scale[sl].contiguous(), zero=out.zero[sl].contiguous(),
                g_idx=out.g_idx,
                bias=None if linear.bias is None else linear.bias.data.clone(),
            )
            res.loss = relative_error(w, res.dequantize().to(w.device))
            res.seconds = seconds * nrow / sum(rows)  # share of the stacked call, by rows
            results[lname] = res
        return results


def solve_cost(in_features: int, rows: int) -> int:
    """Relative cost of one GPTQ solve of `rows` output rows sharing one K x K Hessian: the
    inverse Hessian factor (two Choleskys, ~K^3) and the column loop's updates (K^2 per row).
    What data-parallel runs balance their ranks by (and `quantkit plan --gpus` predicts)."""
    k = int(in_features)
    return k**3 + k * k * int(rows)


def shared_input_sets(ctx: BlockContext, names: list[str]) -> list[list[str]]:
    """Group Linears whose Hessians are identical (same input tensor), in ctx order.

    The diagonals are compared before the whole matrices: a MoE block has hundreds of expert
    Hessians, many with equal token counts but different inputs."""
    sets: list[list[str]] = []
    for lname in names:
        h = ctx.stats[lname]["hessian"]
        tokens = ctx.stats[lname]["tokens"]
        for s in sets:
            ref = ctx.stats[s[0]]
            if ref["tokens"] == tokens and (ref["hessian"] is h or (
                    torch.equal(ref["hessian"].diagonal(), h.diagonal())
                    and torch.equal(ref["hessian"], h))):
                s.append(lname)
                break
        else:
            sets.append([lname])
    return sets


def gptq_command_args(req) -> list[str]:
    """The integer scheme's flags, --no-act-order spelled out (a format's default may be on)."""
    return int_scheme_args(req) + ([] if req.scheme.act_order else ["--no-act-order"])


RECORDS = (MethodRecord(
    name="gptq", quantizer=GPTQQuantizer, build=int_scheme, command_args=gptq_command_args,
    reads_calibration=lambda options: True, handles_experts=True, solves_hessians=True,
    # GPTQ onto GGML grids is the gguf method's gptq rounding
    format_aliases={"gguf": ("gguf", {"rounding": "gptq"})}),)
