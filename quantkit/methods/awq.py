"""AWQ (Lin et al. 2023, activation-aware weight quantization) in plain torch, CPU or GPU.

Why: int4 error hurts most on the input channels that carry large activations. AWQ scales
those weight columns up before rounding (W * s) and divides the activations by s (folded into
the previous norm or Linear), so the block computes the same function with less error where
it matters. Per decoder block, for each scaling group of the architecture's table
(`quantkit.arch.AwqGroup`: prev op -> balance Linears, loss read on an inspect module):

  1. statistics  x_mean[k] = mean |x_k| over ALL calibration tokens (the pipeline's "absmean");
                 w_mean[k] = mean over rows of |w| / max|w| of its group (AutoAWQ's duo scaling)
  2. search      s(a) = x_mean^a / w_mean^(1-a), a in {0, 1/n, ..., (n-1)/n}, normalised so
                 sqrt(max(s) * min(s)) = 1, plus s = 1 (plain RTN, so AWQ never loses to it);
                 loss(s) = MSE(inspect(x) with W -> Q(W * s) / s, inspect(x) unquantized),
                 on the REAL outputs of the inspect module (self_attn, mlp, o_proj, down_proj)
                 for the first `search_tokens` calibration tokens
  3. fold        prev.weight /= s (a norm's weight, or a previous Linear's rows); balance *= s
  4. clip        per (row, group): max|w| shrunk by (1 - i/n), i < n * max_shrink; keep the one
                 with the smallest error of that group's share of the output. Uses the
                 group's input Gram blocks X_g^T X_g, so every captured token counts at the
                 cost of a few tokens. q/k are not clipped (AutoAWQ: a softmax follows them).
  5. quantize    intquant's grid (the one RTN uses): QuantResult's invariant holds and every
                 integer writer packs AWQ's results as it packs RTN's.

Scales are searched on the unmodified block for every group, then all are folded (AutoAWQ's
order). A Linear -> Linear pair folds only where prev.out_features == balance.in_features
(AutoAWQ's rule; v_proj -> o_proj under grouped-query attention fails it and is skipped with a
logged reason) -- unless `pre_quant_scale=True`, which keeps such scales as a per-input-channel
`pre_quant_scale` = 1/s on the balance Linear (`QuantResult.extra`, ModelOpt / TensorRT-LLM's
W4A16_AWQ layout; only a format that stores it may take those results).

Mixture of experts: the table's rows carry expert templates (AwqGroup.for_experts): the
norm's one scale is searched for every expert's gate/up together, its loss read on the whole
MoE block (real routing), its x_mean over every token (the experts' routed sums added up); the
router reads the scaled input too and is compensated (AwqGroup.compensate), so routing is
unchanged. Each expert's up -> down is its own group on its routed tokens; an expert with no
token keeps s = 1, is not clipped, and is reported as an RTN fallback.

Memory of those expert groups: their searches and clips read each expert's down_proj input
over its search tokens. Where those inputs together exceed `expert_input_bytes` (1 GiB; all
experts calibrated on every token, Qwen3-30B-A3B shapes: 128 x 65536 x 768 x 2 B = 12 GiB),
they are not captured with the rest: the experts module replays its recorded calls for one
chunk of experts at a time (only those experts run), each expert's scale is searched and its
down_proj's clip found on the chunk, and the chunk is freed. Every expert sees the same
tensors as in a one-pass capture, so the artifact is the same bytes (tests/test_moe.py).
The capture, the replays and the chunking are the pipeline's (`ctx.replay`,
quantkit.pipeline.replay.BlockReplay); this module keeps the math and the choice of what to
capture.

Propagation: the next block sees this block's UNQUANTIZED outputs (`propagate_quantized =
False`, AutoAWQ's choice; folding alone leaves outputs unchanged, so scaled-but-unquantized
and original are the same function). `propagate_quantized=True` calibrates each block on the
quantized outputs of the previous ones instead (GPTQ's choice).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from quantkit.arch import ArchSpec
from quantkit.errors import CalibrationError, SchemeMismatch
from quantkit.methods.awq_record import awq_request, check_awq_flags, search_bytes
from quantkit.methods.fp8 import fused_groups
from quantkit.methods.intquant import (
    announce_rtn_fallback,
    check_int_scheme,
    check_no_act_order,
    group_quantize,
    relative_error,
    rtn_quantize_weight,
)
from quantkit.methods.options import MethodRecord, int_scheme_args
from quantkit.methods.scaling import (
    ScalePlan,
    fold_scale,
    linear_pair_problem,
    require_scaling_table,
    scale_plans,
    submodule,
)
from quantkit.types import BlockContext, Quantizer, QuantResult, QuantScheme

__all__ = ["AWQQuantizer", "fake_quantize", "candidate_scales", "search_clip", "weight_mean",
           "DEFAULT_GRID", "MIN_CALIB_TOKENS"]

log = logging.getLogger("quantkit.awq")

DEFAULT_GRID = 20  # alpha points in [0, 1) (AutoAWQ / llm-compressor: 20)
DEFAULT_CLIP_GRID = 20
DEFAULT_MAX_SHRINK = 0.5  # clip max|w| down to at most half (AutoAWQ)
MIN_CALIB_TOKENS = 256  # below this x_mean is noise: refuse rather than scale on it
# AutoAWQ's default is 128 x 512 = 65536. CPU: the SmolLM2 demo's KLD is the same with 2048 as
# with 4096, at half the search's cost (benchmarks/results/awq_cpu_phases_xeon_2threads.txt;
# benchmarks/README.md, AWQ on the CPU)
AUTO_SEARCH_TOKENS = {"cpu": 2048, "accel": 65536}
_MAX_CHUNK_ELEMS = 1 << 25  # bounds temporaries of the vectorised searches (128 MiB fp32)
# the most bytes of expert Linears' search inputs held at once (see the module docstring);
# routed Qwen3-30B-A3B shapes hold 0.75 GiB and stay in the one-pass capture
EXPERT_INPUT_BYTES = 1 << 30


# ---------------------------------------------------------------- math on plain tensors

def fake_quantize(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """Q(w) on intquant's grid, in float32; w [..., N, K], groups along K (leading dims batch)."""
    k = w.shape[-1]
    g = scheme.effective_group(k)
    q, scale, zero = group_quantize(w.reshape(*w.shape[:-1], k // g, g), scheme)
    return ((q - zero[..., None]) * scale[..., None]).reshape(w.shape)


def weight_mean(weights: torch.Tensor, group: int) -> torch.Tensor:
    """w_mean[k]: mean over rows of |w| normalised by its group's max|w| ([N, K] -> [K])."""
    n, k = weights.shape
    # one fp32 copy, divided in place (the MoE's shared group: 256 Linears, 1.5 GiB each copy)
    wg = weights.float().reshape(n, k // group, group)
    wg = (wg.clone() if wg.data_ptr() == weights.data_ptr() else wg).abs_()
    return wg.div_(wg.amax(-1, keepdim=True) + 1e-6).reshape(n, k).mean(0)


def candidate_scales(x_mean: torch.Tensor, w_mean: torch.Tensor | None, n_grid: int) -> torch.Tensor:
    """[n_grid + 1, K]: row 0 is s = 1 (RTN), row 1 + i is alpha = i / n_grid.

    duo scaling (w_mean given): s = x_mean^a / (w_mean^(1-a) + 1e-4), else s = x_mean^a;
    clamped at 1e-4 and normalised so sqrt(max * min) = 1 (AutoAWQ's _compute_best_scale).
    """
    rows = [torch.ones_like(x_mean)]
    for i in range(n_grid):
        a = i / n_grid
        s = x_mean.pow(a) / (w_mean.pow(1 - a) + 1e-4) if w_mean is not None else x_mean.pow(a)
        s = s.clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        rows.append(torch.where(torch.isfinite(s), s, torch.ones_like(s)))
    return torch.stack(rows)


def _chunk(per_item: int) -> int:
    return max(1, _MAX_CHUNK_ELEMS // max(1, per_item))


def linear_scale_losses(w: torch.Tensor, x: torch.Tensor, scales: torch.Tensor,
                        scheme: QuantScheme, gram: torch.Tensor | None = None) -> torch.Tensor:
    """MSE of a Linear's output for every candidate scale, vectorised over candidates.

    out_q - out = x @ dW^T with dW = Q(W * s) / s - W (the bias cancels): [C] losses, float32.
    Float32 x (the CPU's compute dtype) with more tokens than inputs takes the Gram form
    sum_n dW_n (X^T X) dW_n^T: T K^2 / 2 + C N K^2 flops instead of C T N K (down_proj of
    SmolLM2, 4096 tokens: 2x fewer). Half-precision x (an accelerator) keeps the token form:
    its GEMMs run on tensor cores, a float32 Gram would not. `gram`: X^T X when the caller
    already has it (several calls on the same x).
    """
    w = w.float()
    n, k = w.shape
    t = x.shape[0]
    if gram is not None or _gram_form(x, k):
        return _gram_scale_losses(w, _gram(x) if gram is None else gram, scales, scheme) / (t * n)
    tok = min(t, _chunk(n * 4))
    losses = []
    step = _chunk(n * k)
    for c0 in range(0, scales.shape[0], step):
        s = scales[c0:c0 + step, None, :]
        dw = (fake_quantize(w[None] * s, scheme) / s - w[None]).to(x.dtype)  # [c, N, K]
        acc = torch.zeros(dw.shape[0], device=w.device)
        for t0 in range(0, t, max(1, tok // dw.shape[0])):
            out = torch.matmul(x[None, t0:t0 + max(1, tok // dw.shape[0])], dw.transpose(1, 2))
            acc += out.float().pow(2).sum((1, 2))
        losses.append(acc / (t * n))
    return torch.cat(losses)


def _gram_form(x: torch.Tensor, k: int) -> bool:
    return x.dtype == torch.float32 and x.shape[0] > k


def _gram(x: torch.Tensor) -> torch.Tensor:
    """X^T X [K, K] in float32, summed over token chunks."""
    k = x.shape[1]
    h = torch.zeros(k, k, device=x.device)
    step = _chunk(k)
    for t0 in range(0, x.shape[0], step):
        xc = x[t0:t0 + step].float()
        h.addmm_(xc.T, xc)
    return h


def _gram_scale_losses(w: torch.Tensor, h: torch.Tensor, scales: torch.Tensor,
                       scheme: QuantScheme) -> torch.Tensor:
    """[C] sums over rows of dW_n H dW_n^T (unnormalised), candidates in chunks."""
    n, k = w.shape
    losses = []
    step = _chunk(n * k)
    for c0 in range(0, scales.shape[0], step):
        s = scales[c0:c0 + step, None, :]
        dw = (fake_quantize(w[None] * s, scheme) / s - w[None]).reshape(-1, k)
        losses.append(((dw @ h) * dw).sum(-1).reshape(-1, n).sum(-1))
    return torch.cat(losses)


def search_clip(w: torch.Tensor, x: torch.Tensor, scheme: QuantScheme, n_grid: int = DEFAULT_CLIP_GRID,
                max_shrink: float = DEFAULT_MAX_SHRINK) -> torch.Tensor:
    """Best clipping threshold per (row, group): max_val [N, G] (AutoAWQ's _compute_best_clip).

    The error of group g of row n for a clipped-and-quantized row d = Q(clip(w)) - w is its
    share of the output, sum_t (x_tg . d)^2 = d H_g d^T with H_g = X_g^T X_g [G, G]: exact over
    all tokens of x at the cost of G "tokens" per group (the token form is used when T <= G).
    """
    w = w.float()
    n, k = w.shape
    g = scheme.effective_group(k)
    ng = k // g
    quad = x.shape[0] > g
    if quad:  # Gram blocks [ng, g, g], accumulated over token chunks in float32
        h = torch.zeros(ng, g, g, device=w.device)
        step = _chunk(k)
        for t0 in range(0, x.shape[0], step):
            xg = x[t0:t0 + step].float().reshape(-1, ng, g).transpose(0, 1)
            h += xg.transpose(1, 2) @ xg
    else:
        xg = x.float().reshape(-1, ng, g).transpose(0, 1)  # [ng, T, g]
    best_all = []
    rows = max(1, _chunk(k * 4) if quad else _chunk(k * max(4, x.shape[0])))
    for r0 in range(0, n, rows):
        wg = w[r0:r0 + rows].reshape(-1, ng, g).transpose(0, 1)  # [ng, n, g]
        org_max = wg.abs().amax(-1, keepdim=True)
        best = org_max.clone()
        best_err = torch.full(org_max.shape[:2], float("inf"), device=w.device)
        for i in range(int(max_shrink * n_grid)):
            m = org_max * (1 - i / n_grid)
            cur = torch.clamp(wg, -m, m)
            q, scale, zero = group_quantize(cur, scheme)
            d = (q - zero[..., None]) * scale[..., None] - wg
            err = ((d @ h) * d).sum(-1) if quad else (xg @ d.transpose(1, 2)).pow(2).sum(1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = torch.where(better[..., None], m, best)
        best_all.append(best.squeeze(-1).T)  # [n, ng]
    return torch.cat(best_all)


# ---------------------------------------------------------------- the pipeline-facing side

class AWQQuantizer(Quantizer):
    """AWQ for the block pipeline. Options (all keyword):

    n_grid (20) alpha points; duo_scaling (True) uses w_mean too; clip (True) searches
    clipping, clip_grid (20) / max_shrink (0.5); search_tokens: tokens whose outputs measure
    the scale loss (whole calibration samples from the first; None = 2048 on CPU, 65536 on an
    accelerator; statistics always use every token); min_tokens (256) refuses shorter
    calibration; pre_quant_scale (False) keeps Linear -> Linear scales as a pre_quant_scale
    (ModelOpt); propagate_quantized (False); coarse_to_fine (True) searches the alphas coarse,
    then around the best (12 loss evaluations of 21); False: all of them;
    expert_input_bytes (1 GiB): above this the experts' up -> down searches and clips run on
    chunks of experts (the same results, less memory).
    """

    name = "awq"
    stats: tuple[str, ...] = ("absmean",)
    needs_calibration = True
    # data-parallel (quantkit.pipeline.distributed): x_mean comes from the summed absmean of
    # every rank; the search and clip read the FIRST search batches, which rank 0's
    # contiguous share starts with; rank 0 then broadcasts the whole block (folded norms too)
    data_parallel = "block"
    true_sequential = False  # every group of a block is searched on the unmodified block

    def __init__(self, n_grid: int = DEFAULT_GRID, duo_scaling: bool = True, clip: bool = True,
                 clip_grid: int = DEFAULT_CLIP_GRID, max_shrink: float = DEFAULT_MAX_SHRINK,
                 search_tokens: int | None = None, min_tokens: int = MIN_CALIB_TOKENS,
                 pre_quant_scale: bool = False, propagate_quantized: bool = False,
                 coarse_to_fine: bool = True, expert_input_bytes: int = EXPERT_INPUT_BYTES):
        if n_grid < 1 or clip_grid < 1:
            raise SchemeMismatch(f"AWQ grids need at least one point (n_grid={n_grid}, "
                                 f"clip_grid={clip_grid}).", "The usual value is 20.")
        if not 0.0 <= max_shrink < 1.0:
            raise SchemeMismatch(f"AWQ max_shrink must be in [0, 1), got {max_shrink}.",
                                 "The usual value is 0.5.")
        if expert_input_bytes < 1:
            raise SchemeMismatch(f"AWQ expert_input_bytes must be positive, got {expert_input_bytes}.",
                                 f"The default is {EXPERT_INPUT_BYTES} (1 GiB).")
        if pre_quant_scale and propagate_quantized:
            raise SchemeMismatch("AWQ pre_quant_scale=True cannot propagate quantized outputs: "
                                 "the block's Linears then hold W * s without the input scale.")
        self.n_grid, self.duo_scaling, self.clip = int(n_grid), bool(duo_scaling), bool(clip)
        self.clip_grid, self.max_shrink = int(clip_grid), float(max_shrink)
        self.search_tokens = search_tokens
        self.min_tokens = int(min_tokens)
        self.pre_quant_scale = bool(pre_quant_scale)
        self.propagate_quantized = bool(propagate_quantized)
        self.coarse_to_fine = bool(coarse_to_fine)
        self.expert_input_bytes = int(expert_input_bytes)
        self.history: list[dict] = []  # per block and group: chosen alpha, losses (for reports)
        # per block: bytes of the captured search inputs held with the one-pass capture, the
        # expert chunks and the largest chunk's bytes (benchmarks, tests)
        self.captures: list[dict] = []
        self._logged: set[str] = set()

    def check(self, scheme: QuantScheme) -> None:
        if scheme.kind != "int":
            raise SchemeMismatch(f"AWQ produces integer weights, not {scheme.kind!r}.",
                                 "Use --bits 4 (or 8) with an integer format.")
        if scheme.activations not in (None, "fp8"):
            raise SchemeMismatch(f"AWQ's inputs are bf16 or FP8 (W4A8), not {scheme.activations!r}.",
                                 "Use --scheme w4a16 or w4a8.")
        check_int_scheme(scheme)
        check_no_act_order(scheme, self.name)
        # W4A8: the max |input| per channel gives each Linear's FP8 input scale after smoothing
        self.stats = ("absmean", "absmax") if scheme.activations == "fp8" else ("absmean",)

    def prepare(self, *, config=None, spec: ArchSpec, shapes: dict | None = None, **_) -> None:
        """Before calibration: refuse an architecture without a scaling table; say which
        Linear -> Linear pairs the shapes forbid."""
        require_scaling_table(spec, "AWQ", "quantize with --method gptq or rtn")
        if not shapes or self.pre_quant_scale:
            return
        prefix = f"{spec.block_path}.0."
        first = {n[len(prefix):]: s for n, s in shapes.items() if n.startswith(prefix)}
        for grp in spec.awq_groups:
            if grp.prev in first:
                reason = linear_pair_problem(grp, first[grp.prev][0],
                                             {b: first[b][1] for b in grp.balance if b in first},
                                             still="clipped and quantized")
                if reason:
                    self._log_once(reason)

    def _log_once(self, msg: str) -> None:
        if msg not in self._logged:
            self._logged.add(msg)
            log.warning(msg)

    # -- per block

    def quantize_block(self, ctx: BlockContext) -> dict[str, QuantResult]:
        t0 = time.perf_counter()
        spec = ctx.arch
        require_scaling_table(spec, "AWQ", "quantize with --method gptq or rtn")
        scheme = ctx.scheme
        dev = next(ctx.block.parameters()).device
        plans = self._plans(ctx)
        first = next(iter(ctx.linears))
        tokens = int((ctx.stats.get(first) or {}).get("tokens", 0))
        if tokens < self.min_tokens:
            raise CalibrationError(
                f"AWQ: block {ctx.index} saw {tokens} calibration tokens; at least "
                f"{self.min_tokens} are needed for its activation statistics.",
                "Pass more --calib-samples or a longer --calib-seqlen (AWQ usually takes "
                "128 x 512 tokens).")
        batches = self._search_batches(ctx, dev)
        chunks = self._expert_chunks(ctx, plans, batches)
        deferred = {n for chunk in chunks for n in chunk}
        # routed experts' gate/up inputs: read only by their clip, found after the fold
        clip_chunks = self._expert_clip_chunks(ctx, plans, batches, deferred)
        late = {n for chunk in clip_chunks for n in chunk}
        replay = bool(chunks or clip_chunks)
        experts = ctx.block.get_submodule(spec.experts.module) if replay else None
        inspect = {p.group.inspect: submodule(ctx.block, p.group.inspect) for p in plans
                   if p.mode != "skip" and not _is_single_linear(p)}
        linears = {n: lin for n, lin in ctx.linears.items() if n not in deferred and n not in late}
        seen = ctx.replay.record(inspect, linears, batches,
                                 {spec.experts.module: experts} if replay else {})
        calls = seen.pop("in:" + spec.experts.module) if replay else None
        for key in list(seen):
            if key.startswith("mod:"):
                seen[key] = ctx.replay.merge_batches(seen[key])
        xs = ctx.replay.linear_inputs(seen, linears)
        skip_clip = {spec.roles.get("attn_q"), spec.roles.get("attn_k")}

        # 1-2: search every group on the unmodified block (the deferred experts' chunk by chunk)
        searched: dict[int, tuple[torch.Tensor, dict]] = {}
        clip_of: dict[str, torch.Tensor | None] = {}
        largest = 0
        if chunks:
            plan_of = {next(iter(p.balance)): i for i, p in enumerate(plans)
                       if next(iter(p.balance)) in deferred}
            largest = self._search_expert_chunks(ctx, chunks, plans, plan_of, calls, experts,
                                                 searched, clip_of, skip_clip, dev)
        one_pass = _held_bytes(xs)
        if not clip_chunks:
            calls = None  # the recorded expert calls: no later replay
        for i, plan in enumerate(plans):
            if plan.mode != "skip" and i not in searched:
                searched[i] = self._search(ctx, plan, xs, seen, dev)
        found: list[tuple[ScalePlan, torch.Tensor]] = []
        for i, plan in enumerate(plans):  # the table's order: the folds' and the history's
            if i in searched:
                s, entry = searched[i]
                self.history.append(entry)
                found.append((plan, s))
        # 3: fold
        col = {n: torch.ones(lin.in_features, device=dev) for n, lin in ctx.linears.items()}
        row = {n: torch.ones(lin.out_features, device=dev) for n, lin in ctx.linears.items()}
        pqs: dict[str, torch.Tensor] = {}
        in_scales: dict[str, list[torch.Tensor]] = {}  # the late Linears' input divisors
        with torch.no_grad():
            for plan, s in found:
                fold_scale(plan, s, col, row, pqs)
                scaled: dict[int, torch.Tensor] = {}  # balance Linears sharing x share x / s
                for bname in plan.balance:
                    if bname in late:  # clipped below on its chunk, its input divided then
                        in_scales.setdefault(bname, []).append(s)
                    if bname not in xs:  # a deferred expert's: clipped on its chunk
                        continue
                    x = xs[bname]
                    if id(x) not in scaled:
                        scaled[id(x)] = _divide_tokens(x, s)
                    xs[bname] = scaled[id(x)]
        if clip_chunks:
            largest = max(largest, self._clip_expert_chunks(ctx, clip_chunks, calls, experts,
                                                            in_scales, clip_of, skip_clip))
        del calls
        held = {"block": ctx.index, "one_pass_bytes": one_pass, "expert_chunks": len(chunks),
                "gate_up_chunks": len(clip_chunks), "largest_chunk_bytes": largest}
        self.captures.append(held)
        log.debug("AWQ block %d search inputs: %s", ctx.index, held, extra={"awq_capture": held})
        # 4-5: clip, quantize
        # experts the router chose for no calibration token: no statistics, no clipping; they
        # still carry the scale of a group they share (the norm's fold divides their input)
        starved = [n for n in ctx.linears if spec.is_expert_linear(n)
                   and not (ctx.stats.get(n) or {}).get("tokens")]
        announce_rtn_fallback(ctx, starved, "AWQ")
        results: dict[str, QuantResult] = {}
        for name, lin in ctx.linears.items():
            w = lin.weight.data.float()
            if name in clip_of:
                max_val = clip_of[name]
            elif self.clip and name not in skip_clip and xs[name].shape[0]:
                max_val = search_clip(w, xs[name], scheme, self.clip_grid, self.max_shrink)
            else:
                max_val = None
            if max_val is not None:
                g = scheme.effective_group(w.shape[1])
                w = torch.clamp(w.reshape(w.shape[0], -1, g), -max_val[..., None],
                                max_val[..., None]).reshape(w.shape)
            res = rtn_quantize_weight(name, w, scheme)
            effective = res.dequantize() / col[name][None, :] / row[name][:, None]
            res.loss = relative_error(lin.weight.data.float() / col[name][None, :]
                                      / row[name][:, None], effective)
            if name in pqs:
                res.extra["pre_quant_scale"] = pqs[name]
            if name in starved:
                res.fallback = "rtn"
            res.bias = None if lin.bias is None else lin.bias.data.clone()
            results[name] = res
        if scheme.activations == "fp8":
            fp8_scales(ctx, results, col)
        seconds = time.perf_counter() - t0
        total = sum(lin.weight.numel() for lin in ctx.linears.values())
        for name, res in results.items():
            res.seconds = seconds * ctx.linears[name].weight.numel() / total
        return results

    def _plans(self, ctx: BlockContext) -> list[ScalePlan]:
        return scale_plans(ctx, pre_quant_scale=self.pre_quant_scale, log=self._log_once,
                           still="clipped and quantized")

    def _search_batches(self, ctx: BlockContext, dev: torch.device) -> int:
        budget = self.search_tokens or AUTO_SEARCH_TOKENS["cpu" if dev.type == "cpu" else "accel"]
        n, used = 0, 0
        for h in ctx.inputs:
            if n and used + h.shape[0] * h.shape[1] > budget:
                break
            used += h.shape[0] * h.shape[1]
            n += 1
        return max(n, 1)

    def _expert_chunks(self, ctx: BlockContext, plans: list[ScalePlan], batches: int
                       ) -> list[list[str]]:
        """Expert Linears whose search inputs are captured chunk by chunk, in chunks of at
        most `expert_input_bytes` (one expert where one alone is larger); [] where all of
        them fit it (the one-pass capture, as for a dense block).

        Candidates: an expert's Linear that is its group's only balance Linear and read by no
        other group (down_proj of up -> down). Its search tokens are estimated from its
        statistics: tokens x (search tokens / calibration tokens), exact when every expert
        reads every token (--moe-calibrate-all-experts)."""
        spec = ctx.arch
        if ctx.replay.linear_experts() is None:
            return []
        own = [p for p in plans if p.mode != "skip" and _is_single_linear(p)
               and spec.is_expert_linear(p.group.inspect)]
        others = set()
        for p in plans:
            if not any(p is q for q in own):
                others |= set(p.balance) | set(p.compensate) | {p.group.prev}
        names = [p.group.inspect for p in own if p.group.inspect not in others]
        sizes = [h.shape[0] * h.shape[1] for h in ctx.inputs]
        used, total = sum(sizes[:batches]), sum(sizes)
        if not total:
            return []
        need = {}
        for n in names:
            lin = ctx.linears[n]
            tokens = int((ctx.stats.get(n) or {}).get("tokens", 0))
            need[n] = -(-tokens * used // total) * lin.in_features * lin.weight.element_size()
        if sum(need.values()) <= self.expert_input_bytes:
            return []
        return ctx.replay.chunks_within(need, self.expert_input_bytes)

    def _expert_clip_chunks(self, ctx: BlockContext, plans: list[ScalePlan], batches: int,
                            deferred: set[str]) -> list[list[str]]:
        """Routed experts' Linears whose search inputs only their clip reads (gate/up: the
        norm's shared group reads the MoE block, not them), in chunks of whole experts of at
        most `expert_input_bytes`; [] where those inputs together fit it, or where all experts
        read the same tensor (--moe-calibrate-all-experts: one hidden-wide input, as q/k/v's).

        Each expert holds its own routed rows (gate and up share them): Qwen3-30B-A3B shapes,
        8 of 128 experts per token, 65536 search tokens: 8 x 65536 x 2048 x 2 B = 2 GiB. With
        clip=False nothing reads them: every such Linear is left out of the capture."""
        spec = ctx.arch
        experts = ctx.replay.linear_experts()
        if experts is None or experts.calibrate_all:
            return []
        inspected = {p.group.inspect for p in plans if p.mode != "skip" and _is_single_linear(p)}
        prefix = spec.experts.module + "."
        by_expert: dict[str, list[str]] = {}
        for n in ctx.linears:
            if spec.is_expert_linear(n) and n not in deferred and n not in inspected:
                by_expert.setdefault(n[len(prefix):].partition(".")[0], []).append(n)
        sizes = [h.shape[0] * h.shape[1] for h in ctx.inputs]
        used, total = sum(sizes[:batches]), sum(sizes)
        if not by_expert or not total:
            return []
        if not self.clip:
            return [[n for names in by_expert.values() for n in names]]
        need = {}
        for e, names in by_expert.items():
            lin = ctx.linears[names[0]]
            tokens = int((ctx.stats.get(names[0]) or {}).get("tokens", 0))
            need[e] = -(-tokens * used // total) * lin.in_features * lin.weight.element_size()
        if sum(need.values()) <= self.expert_input_bytes:
            return []
        return [[n for e in chunk for n in by_expert[e]]
                for chunk in ctx.replay.chunks_within(need, self.expert_input_bytes)]

    def _clip_expert_chunks(self, ctx: BlockContext, chunks: list[list[str]], calls: Any,
                            experts: torch.nn.Module, in_scales: dict[str, list[torch.Tensor]],
                            clip_of: dict, skip_clip: set) -> int:
        """After the fold: replay the experts module's recorded `calls` for one chunk of
        experts at a time, divide each Linear's input by the scales folded into it (as the
        one-pass capture's x / s) and find its clip on the folded weight; free the chunk.
        Fills `clip_of`; returns the largest chunk's bytes (0 where nothing is clipped)."""
        if not self.clip:
            clip_of.update({n: None for chunk in chunks for n in chunk})
            return 0
        largest = 0
        for chunk in chunks:
            xs = ctx.replay.expert_inputs(experts, calls, {n: ctx.linears[n] for n in chunk})
            largest = max(largest, _held_bytes(xs))
            scaled: dict[int, torch.Tensor] = {}  # gate and up share one input, so x / s
            for n in chunk:
                x = xs.pop(n)
                clip_of[n] = None
                if n not in skip_clip and x.shape[0]:
                    if id(x) not in scaled:
                        y = x
                        for s in in_scales.get(n, []):
                            y = _divide_tokens(y, s)
                        scaled[id(x)] = y
                    w = ctx.linears[n].weight.data.float()
                    clip_of[n] = search_clip(w, scaled[id(x)], ctx.scheme, self.clip_grid,
                                             self.max_shrink)
                del x
            del xs, scaled
        return largest

    def _search_expert_chunks(self, ctx: BlockContext, chunks: list[list[str]],
                              plans: list[ScalePlan], plan_of: dict[str, int], calls: Any,
                              experts: torch.nn.Module, searched: dict, clip_of: dict,
                              skip_clip: set, dev: torch.device) -> int:
        """Search the deferred experts' groups chunk by chunk: replay the experts module's
        recorded `calls` with only the chunk's experts running, search each group, find its
        Linear's clip as it will be after the fold (columns * s, input / s), free the chunk.
        Fills `searched` (plan index -> (s, history entry)) and `clip_of`; returns the
        largest chunk's bytes."""
        largest = 0
        for chunk in chunks:
            xs = ctx.replay.expert_inputs(experts, calls, {n: ctx.linears[n] for n in chunk})
            largest = max(largest, _held_bytes(xs))
            for n in chunk:
                searched[plan_of[n]] = self._search(ctx, plans[plan_of[n]], xs, {}, dev)
                s = searched[plan_of[n]][0]
                x = xs.pop(n)
                clip_of[n] = None
                if self.clip and n not in skip_clip and x.shape[0]:
                    lin = ctx.linears[n]
                    # fold_scale's in-place `weight *= s` on the balance Linear, out of place
                    w = (lin.weight.data * s[None, :].to(lin.weight.dtype)).float()
                    clip_of[n] = search_clip(w, _divide_tokens(x, s), ctx.scheme,
                                             self.clip_grid, self.max_shrink)
                del x
            del xs
        return largest

    def _search(self, ctx: BlockContext, plan: ScalePlan, xs: dict, seen: dict,
                dev: torch.device) -> tuple[torch.Tensor, dict]:
        """The best scale s [K] of one group (ones when plain RTN is best) and its history entry."""
        names = list(plan.balance)
        k = plan.balance[names[0]].in_features
        absmean, tokens = _input_absmean(ctx.stats, names)
        if not tokens or (_is_single_linear(plan) and not xs[names[0]].shape[0]):
            # an expert the router chose for no calibration token: nothing to weigh, s = 1
            return torch.ones(k, device=dev), {
                "block": ctx.index, "prev": plan.group.prev, "balance": names, "alpha": None,
                "loss": None, "rtn_loss": None, "reason": "no calibration tokens"}
        # the originals in their own dtype (restored after the search; .float() of them is
        # exact): the MoE's shared group holds 256 expert Linears, 0.75 GiB in bf16, not 1.5
        weights = [plan.balance[n].weight.data.clone() for n in names]
        stacked = torch.cat(weights)
        x_mean = (absmean.to(dev).float() / tokens).clamp(min=0)
        w_mean = weight_mean(stacked, ctx.scheme.effective_group(k)) if self.duo_scaling else None
        cands = candidate_scales(x_mean, w_mean, self.n_grid)
        if _is_single_linear(plan):
            stacked = stacked.float()
        else:
            del stacked
        if _is_single_linear(plan):
            x = xs[names[0]]
            gram = _gram(x) if _gram_form(x, k) else None
            losses = _grid_losses(
                lambda idx: linear_scale_losses(stacked, x, cands[idx], ctx.scheme, gram).cpu(),
                self.n_grid, self.coarse_to_fine)
        else:
            mod = submodule(ctx.block, plan.group.inspect)
            ref = seen["mod:" + plan.group.inspect]

            def module_losses(idx: list[int]) -> torch.Tensor:
                per_cand = []
                for i in idx:
                    s = cands[i]
                    for n, w in zip(names, weights, strict=True):
                        lin = plan.balance[n]
                        lin.weight.data.copy_((fake_quantize(w.float() * s, ctx.scheme) / s).to(lin.weight.dtype))
                    per_cand.append(_module_loss(mod, ref))
                # one read-back per round (float64 -> float32 as the old per-item store)
                return torch.stack(per_cand).cpu().float()
            try:
                with ctx.replay.routed_only(mod):
                    losses = _grid_losses(module_losses, self.n_grid, self.coarse_to_fine)
            finally:
                for n, w in zip(names, weights, strict=True):
                    plan.balance[n].weight.data.copy_(w.to(plan.balance[n].weight.dtype))
        best = int(torch.argmin(losses.cpu()))
        return cands[best], {
            "block": ctx.index, "prev": plan.group.prev, "balance": names,
            "alpha": None if best == 0 else (best - 1) / self.n_grid,
            "loss": float(losses[best]), "rtn_loss": float(losses[0])}


FP8_MAX = 448.0


def fp8_scales(ctx: BlockContext, results: dict[str, QuantResult], col: dict) -> None:
    """W4A8 (TensorRT-LLM's W4A8_AWQ): the per-tensor FP8 scales of every Linear, in
    `extra` as float32 scalars, as nvidia-modelopt's export derives them:
      input_scale     max |x / col| / 448: the smoothed input the GEMM casts to FP8 (x * pqs
                      where the scale stays a pre_quant_scale, x of the scaled norm elsewhere)
      weight_scale_2  max |q * scale| / 448: the int4 weight rescaled into FP8 range at run time
    Linears the engine fuses (q/k/v, gate/up) share the largest of each (TensorRT-LLM asserts
    one value per fused GEMM)."""
    for group in fused_groups(ctx):
        members = [n for n in group if n in results]
        if not members:
            continue
        in_amax, w_amax = [], []
        for n in members:
            st = ctx.stats.get(n) or {}
            if "absmax" not in st or not st.get("tokens"):
                raise CalibrationError(
                    f"AWQ W4A8: block {ctx.index} {n} saw no calibration tokens, so it has no "
                    "FP8 input scale.", "Use more calibration data or --scheme w4a16.")
            in_amax.append((st["absmax"].float().to(col[n].device) / col[n]).max())
            w_amax.append(results[n].dequantize().abs().max())
        input_scale = (torch.stack(in_amax).max().cpu() / FP8_MAX).float().reshape(())
        weight_scale_2 = (torch.stack(w_amax).max().cpu() / FP8_MAX).float().reshape(())
        for n in members:
            results[n].extra["input_scale"] = input_scale.clone()
            results[n].extra["weight_scale_2"] = weight_scale_2.clone()


def _input_absmean(stats: dict, names: list[str]) -> tuple[torch.Tensor | None, int]:
    """(sum of |x| per input channel, tokens) of the input the balance Linears share.

    Linears of one kind (the same leaf name: every expert's gate_proj) read different tokens,
    so their sums add up (all experts together saw every token top_k times, and the mean is
    that of every token); Linears of different kinds (gate/up, q/k/v) read the same tokens and
    count once. A dense group thus takes its first Linear's statistics as they are.
    """
    kind = names[0].rpartition(".")[2]
    readers = [stats.get(n) or {} for n in names if n.rpartition(".")[2] == kind]
    fed = [st for st in readers if st.get("tokens")]
    if not fed:
        return None, 0
    absmean = fed[0]["absmean"]
    for st in fed[1:]:
        absmean = absmean + st["absmean"].to(absmean.device)
    return absmean, sum(int(st["tokens"]) for st in fed)


def _grid_losses(losses_of, n_grid: int, coarse_to_fine: bool) -> torch.Tensor:
    """[n_grid + 1] losses of candidate_scales' rows (inf where not evaluated).

    The full grid evaluates every row. Coarse to fine evaluates s = 1 and every step-th
    alpha (step = floor(sqrt(n_grid)): 0, 0.2, .. 0.8 of 20), then the alphas within a step
    of the best one: 12 evaluations instead of 21 for n_grid = 20, the same choice where
    the loss is unimodal in alpha (AWQ's loss curve: falls, then rises).
    """
    if not coarse_to_fine:
        return losses_of(list(range(n_grid + 1)))
    step = max(1, int(n_grid ** 0.5))
    losses = torch.full((n_grid + 1,), float("inf"))
    first = [0] + [1 + i for i in range(0, n_grid, step)]
    losses[first] = losses_of(first)
    centre = int(torch.argmin(losses[1:]))
    rest = [1 + i for i in range(max(0, centre - step + 1), min(n_grid, centre + step))
            if 1 + i not in first]
    if rest:
        losses[rest] = losses_of(rest)
    return losses


def _is_single_linear(plan: ScalePlan) -> bool:
    """The inspect module is the (only) balance Linear: its loss is computed vectorised."""
    return list(plan.balance) == [plan.group.inspect]


def _held_bytes(xs: dict[str, torch.Tensor]) -> int:
    """Bytes of the distinct tensors in `xs` (Linears sharing an input share one tensor)."""
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in xs.values()}.values())


def _divide_tokens(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """(x / s).to(x.dtype) in token chunks: the same values without a float32 temporary of
    all of x (down_proj's search input: 3.5 GiB in float32 on the accelerator)."""
    out = torch.empty_like(x)
    step = _chunk(x.shape[-1])
    for t0 in range(0, x.shape[0], step):
        out[t0:t0 + step] = x[t0:t0 + step] / s
    return out


def _module_loss(mod: torch.nn.Module, ref: Any) -> torch.Tensor:
    """MSE between `mod`'s outputs now and the recorded unquantized outputs (0-dim float64).

    Summed in float64 on the module's device: the same IEEE sums as adding Python floats
    (each batch's float32 sum is exact in float64), without a host sync per batch and
    candidate (21 candidates x batches x 2 inspect modules per block).
    """
    total, count = None, 0
    with torch.no_grad():
        for args, kwargs, want in zip(ref.args, ref.kwargs, ref.outs, strict=True):
            out = mod(*args, **kwargs)
            out = out[0] if isinstance(out, tuple) else out
            part = (out.float() - want.float()).pow(2).sum().double()
            total = part if total is None else total + part
            count += want.numel()
    if total is None:
        return torch.zeros((), dtype=torch.float64)
    return total / max(1, count)


RECORDS = (MethodRecord(
    name="awq", quantizer=AWQQuantizer, build=awq_request, check_flags=check_awq_flags,
    command_args=int_scheme_args, reads_calibration=lambda options: True, handles_experts=True,
    plan_passes=8,
    plan_stats=lambda f: search_bytes(f, AUTO_SEARCH_TOKENS, EXPERT_INPUT_BYTES)),)
