"""SmoothQuant (Xiao et al. 2022): move activation outliers into the weights before W8A8.

Why: with int8 inputs, one input channel that runs 50x larger than the others sets every
token's scale, and the other channels are left with a few integer steps. SmoothQuant divides
input channel j by s_j and multiplies column j of the weights by s_j, so the product is
unchanged and the difficulty is shared between activations and weights. The scales are
llm-compressor 0.14's (`SmoothQuantModifier._calculate_smoothing_scales`), so that its
artifacts are the reference quantkit's are tested against value for value:

    s_j = R_j^alpha / (2 max|W_:,j|)^(1 - alpha)          alpha: migration strength (0.5)

R_j = max X_j - min X_j is channel j's dynamic range over every calibration token of the
shared loader (the pipeline's "colmax" / "colmin" statistics); 2 max|W_:,j| the weights'
range, over the rows of every balance Linear of the group (q/k/v share one s). For a channel
symmetric about 0 this is the paper's max|X_j|^alpha / max|W_:,j|^(1 - alpha). A channel that
saw no activation or holds no weight keeps s = 1 (llm-compressor: its activation range, which
such a channel ignores anyway); s is clamped at 1e-5 (both). The 1/s goes into the previous op
exactly as AWQ's scales do (`quantkit.methods.scaling`, the architecture's scaling table):
norm -> q/k/v, norm -> gate/up, up -> down, and v -> o where the shapes allow (not under
grouped-query attention). llm-compressor's default mappings are the two norm pairs only; its
recipe takes the other pairs as `mappings` (tests/llmc_reference.py passes quantkit's).
Folding alone leaves the block's function unchanged (tests check it before any rounding).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quantkit.errors import CalibrationError, SchemeMismatch
from quantkit.methods.intquant import starved_experts
from quantkit.methods.scaling import fold_scale, scale_plans
from quantkit.types import BlockContext

__all__ = ["smoothing_scales", "smooth_block", "group_input_range", "Smoothing", "check_alpha",
           "SMOOTHQUANT_STATS", "SMOOTHQUANT_PAIRS"]

MIN_SCALE = 1e-5
SMOOTHQUANT_STATS = ("colmax", "colmin")  # what smooth_block reads
SMOOTHQUANT_PAIRS = ("all", "norms")  # norms: llm-compressor's default mappings


def check_alpha(alpha: float) -> float:
    alpha = float(alpha)
    if not 0.0 <= alpha <= 1.0:
        raise SchemeMismatch(f"SmoothQuant strength {alpha} is outside [0, 1].",
                             "Use e.g. --smoothquant 0.5 (the paper's value for most models).")
    return alpha


def smoothing_scales(act_range: torch.Tensor, weights: list[torch.Tensor],
                     alpha: float) -> torch.Tensor:
    """s [K] for inputs whose per-channel range (max x - min x) is `act_range` [K], read by
    `weights` (each [N_i, K]); float32."""
    a = act_range.float()
    w = 2.0 * torch.cat([x.detach().float().abs() for x in weights]).amax(0)
    s = a.pow(alpha) / w.pow(1 - alpha)
    ok = (a > 0) & (w > 0) & torch.isfinite(s)
    return torch.where(ok, s, torch.ones_like(s)).clamp(min=MIN_SCALE)


def group_input_range(stats: dict, names: list[str]) -> torch.Tensor | None:
    """Per-channel max x - min x of the input a scaling group's Linears share, over every
    calibration token: the extremes over its fed members. q/k/v read the same tokens; an MoE
    block's experts each read their routed ones, and every token is routed to some expert
    (top-k >= 1), so the experts' extremes together are those of the block's whole normalised
    input (the router's too). None when no member received a token."""
    fed = [st for st in (stats.get(n) or {} for n in names) if st.get("tokens") and "colmax" in st]
    if not fed:
        return None
    hi = torch.stack([st["colmax"].float() for st in fed]).amax(0)
    lo = torch.stack([st["colmin"].float().to(hi.device) for st in fed]).amin(0)
    return hi - lo


@dataclass
class Smoothing:
    """What smooth_block did: `col[name]` [K] multiplies each Linear's input columns (its input
    is now x / col), `row[name]` [N] its output rows (a Linear -> Linear fold divides the
    previous Linear's rows); `history` one record per folded group."""

    col: dict[str, torch.Tensor]
    row: dict[str, torch.Tensor]
    history: list[dict] = field(default_factory=list)

    def input_divisor(self, name: str) -> torch.Tensor:
        return self.col[name]


def smooth_block(ctx: BlockContext, alpha: float, log=None, pairs: str = "all") -> Smoothing:
    """Fold SmoothQuant scales into the block in place, group by group in table order
    (each group's s from the weights as they are when its turn comes); pairs="norms" folds
    only the norm -> Linear groups (llm-compressor's default mappings)."""
    dev = next(ctx.block.parameters()).device
    col = {n: torch.ones(lin.in_features, device=dev) for n, lin in ctx.linears.items()}
    row = {n: torch.ones(lin.out_features, device=dev) for n, lin in ctx.linears.items()}
    out = Smoothing(col, row)
    with torch.no_grad():
        for plan in scale_plans(ctx, log=log, method="SmoothQuant"):
            if plan.mode == "skip" or (pairs == "norms" and plan.mode != "norm"):
                continue
            act_range = group_input_range(ctx.stats, list(plan.balance))
            if act_range is None and starved_experts(ctx, plan.balance):
                # an expert's up -> down the router fed no token: nothing to smooth on (s = 1)
                out.history.append({"block": ctx.index, "prev": plan.group.prev,
                                    "balance": list(plan.balance), "mode": "skip",
                                    "reason": "no calibration tokens"})
                continue
            if act_range is None:
                raise CalibrationError(
                    f"SmoothQuant: {next(iter(plan.balance))} of block {ctx.index} received no "
                    "calibration tokens.",
                    "Pass calibration data (--calib, --calib-samples >= 1), or drop --smoothquant.")
            s = smoothing_scales(act_range.to(dev), [lin.weight.data for lin in
                                                      plan.balance.values()], alpha)
            fold_scale(plan, s, col, row, {})
            out.history.append({"block": ctx.index, "prev": plan.group.prev,
                                "balance": list(plan.balance), "mode": plan.mode,
                                "s_min": float(s.min()), "s_max": float(s.max())})
    return out
