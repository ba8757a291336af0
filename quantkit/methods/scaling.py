"""Per-input-channel scales folded into the op before a Linear: the one implementation AWQ
and SmoothQuant share.

Both multiply the input columns of the "balance" Linears of a scaling group by s and divide
the activations by s, by dividing the previous op (a norm's weight, or the matching output
rows of a previous Linear) by s. The block then computes the same function before any
rounding; only where the rounding happens moves. Which groups exist is the architecture's
table (`quantkit.arch.AwqGroup`: prev op -> balance Linears, inspect module).

A Linear -> Linear pair folds only where prev.out_features == balance.in_features (AutoAWQ's
rule; v_proj -> o_proj under grouped-query attention fails it: that group is skipped, with a
reason), unless the caller keeps such scales as a per-input-channel `pre_quant_scale` on the
balance Linear (ModelOpt's W4A16_AWQ layout).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quantkit.arch import ArchSpec, AwqGroup
from quantkit.errors import SchemeMismatch, UnsupportedArchitecture
from quantkit.types import BlockContext

__all__ = ["ScalePlan", "scale_plans", "fold_scale", "linear_pair_problem", "submodule",
           "require_scaling_table"]


@dataclass
class ScalePlan:
    """One scaling group resolved on a live block."""

    group: AwqGroup
    prev: torch.nn.Module
    balance: dict[str, torch.nn.Linear]
    mode: str  # "norm" | "linear" | "pre_quant_scale" | "skip"
    reason: str = ""
    norm_offset: float = 0.0  # the norm computes x * (norm_offset + w) (ArchSpec.norm_offset)
    # unquantized modules reading the balance input (AwqGroup.compensate: an MoE router)
    compensate: dict[str, torch.nn.Module] = field(default_factory=dict)


def submodule(block: torch.nn.Module, name: str) -> torch.nn.Module:
    return block if name == "" else block.get_submodule(name)


def require_scaling_table(spec: ArchSpec | None, method: str, instead: str) -> None:
    if spec is None or not spec.awq_groups:
        name = getattr(spec, "name", None) or "this model"
        raise UnsupportedArchitecture(
            f"{method} has no scaling table for architecture {name!r}.",
            "Add its AwqGroup rows (prev op, balance Linears, inspect module) to its ArchSpec "
            f"in its family module in quantkit/arch/ (e.g. quantkit/arch/gemma3.py), or {instead}.")


def linear_pair_problem(grp: AwqGroup, prev_out: int, balance_in: dict[str, int],
                        method: str = "AWQ", still: str = "quantized") -> str:
    """Why a Linear -> Linear group cannot fold (the reason logged), or ""."""
    fits = (lambda k: k <= prev_out) if grp.prev_tail else (lambda k: k == prev_out)
    bad = {b: k for b, k in balance_in.items() if not fits(k)}
    if not bad:
        return ""
    b, k = next(iter(bad.items()))
    return (f"{method}: skipping scaling pair {grp.prev} -> {b}: {grp.prev} has {prev_out} "
            f"outputs but {b} has {k} inputs (grouped-query attention), so the scale cannot be "
            f"folded; AutoAWQ's rule. {b} is still {still}.")


def block_experts(ctx: BlockContext) -> int:
    """Routed experts of this block (0: a dense block, or a dense architecture)."""
    experts = getattr(ctx.arch, "experts", None)
    if experts is None:
        return 0
    try:
        return len(ctx.block.get_submodule(experts.module))
    except (AttributeError, TypeError):
        return 0


def scale_plans(ctx: BlockContext, *, pre_quant_scale: bool = False, log=None,
                method: str = "AWQ", still: str = "quantized") -> list[ScalePlan]:
    """The block's scaling groups with how each folds: "norm", "linear", "pre_quant_scale"
    (Linear -> Linear kept on the balance Linear) or "skip" (`log(reason)` is told why)."""
    log = log or (lambda _msg: None)
    plans = []
    for grp in ctx.arch.awq_groups_for(block_experts(ctx)):
        balance = {b: ctx.linears[b] for b in grp.balance if b in ctx.linears}
        if not balance:
            continue
        prev = submodule(ctx.block, grp.prev)
        if grp.compensate and isinstance(prev, torch.nn.Linear):
            raise SchemeMismatch(f"{method} group {grp} compensates modules behind a Linear: "
                                 "only a norm's fold can be compensated.")
        k = {lin.in_features for lin in balance.values()}
        if len(k) != 1:
            raise SchemeMismatch(f"{method} group {grp} mixes input widths {sorted(k)}.")
        if isinstance(prev, torch.nn.Linear):
            reason = linear_pair_problem(grp, prev.out_features,
                                         {b: lin.in_features for b, lin in balance.items()},
                                         method, still)
            if pre_quant_scale:
                mode = "pre_quant_scale"
            elif reason:
                log(reason)
                mode = "skip"
            else:
                mode = "linear"
            plans.append(ScalePlan(grp, prev, balance, mode, reason))
        else:
            weight = getattr(prev, "weight", None)
            if weight is None or tuple(weight.shape) != (k.pop(),):
                log(f"{method}: skipping group {grp.prev} -> {', '.join(grp.balance)}: "
                    f"{grp.prev} has no per-channel weight to fold scales into.")
                plans.append(ScalePlan(grp, prev, balance, "skip"))
            else:
                offset = ctx.arch.norm_offset if grp.norm_offset is None else grp.norm_offset
                plans.append(ScalePlan(grp, prev, balance, "norm", norm_offset=offset,
                                       compensate={c: submodule(ctx.block, c) for c in grp.compensate}))
    return plans


def fold_scale(plan: ScalePlan, s: torch.Tensor, col: dict, row: dict, pqs: dict) -> None:
    """Apply scale s [K]: balance columns *= s, and 1/s into the previous op (or into a
    pre_quant_scale). `col[name]` / `row[name]` accumulate what each Linear's columns / rows
    were multiplied by (so callers can measure errors in the original weights' terms);
    `pqs[name]` collects pre_quant_scales."""
    if torch.all(s == 1):
        return
    for mod in plan.compensate.values():  # e.g. the router: reads x / s now, so W * s
        mod.weight.data.mul_(s[None, :].to(mod.weight.dtype))
    for bname, lin in plan.balance.items():
        lin.weight.data.mul_(s[None, :].to(lin.weight.dtype))
        col[bname] = col[bname] * s
        if plan.mode == "pre_quant_scale":
            pqs[bname] = pqs.get(bname, torch.ones_like(s)) / s
    prev = plan.prev
    if plan.mode == "norm" and plan.norm_offset:  # (offset + w) / s = offset + w'
        off = plan.norm_offset
        prev.weight.data.copy_(((prev.weight.float() + off) / s.float() - off).to(prev.weight.dtype))
        if getattr(prev, "bias", None) is not None:
            prev.bias.data.div_(s.to(prev.bias.dtype))
    elif plan.mode == "norm":
        prev.weight.data.div_(s.to(prev.weight.dtype))
        if getattr(prev, "bias", None) is not None:
            prev.bias.data.div_(s.to(prev.bias.dtype))
    elif plan.mode == "linear":
        k = s.shape[0]
        prev.weight.data[-k:].div_(s[:, None].to(prev.weight.dtype))
        if prev.bias is not None:
            prev.bias.data[-k:].div_(s.to(prev.bias.dtype))
        pname = plan.group.prev
        if pname in row:
            row[pname] = row[pname].clone()
            row[pname][-k:] = row[pname][-k:] / s
