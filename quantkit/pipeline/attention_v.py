"""v_proj's attention-weighted Hessian (the `v_hessian="attention"` option of GPTQ methods).

Why: GPTQ minimises tr(E H E^T) with H = X^T X, every token weighted alike. v_proj's output is
only used as sum_t a_st v_t, so the error that reaches query s's attention output is E xbar_s
with xbar_s = sum_t a_st x_t; with attention sinks (much weight on the first token) that
error's Hessian, H_att = sum_h sum_s xbar_hs xbar_hs^T over every query head h, is far from
X^T X. On SmolLM2 (Q5_0 grid) GPTQ with X^T X left v_proj 0.40-2.25x llama.cpp's rounding
error measured under H_att, GPTQ with H_att 0.14-0.16x
(benchmarks/gptq_v_proj_attention_hessian.py). One summed H_att per tensor did as well as one
per KV head, so only the [K, K] matrix handed to the solver changes.

The attention probabilities are the block's own: its attention module runs with eager
attention (transformers looks config._attn_implementation up at forward time; eager returns
the weights) on the very inputs v_proj reads, with the block's kwargs (rotary tables, masks).
"""

from __future__ import annotations

import torch

from quantkit.arch import ARCHS, ArchSpec
from quantkit.errors import UnsupportedArchitecture
from quantkit.pipeline.stats import gram

__all__ = ["MAX_QUERY_ROWS", "attention_v_name", "check_attention_v",
           "attention_v_hessian", "wants_attention_v"]

V_PROJ = "v_proj"
# query rows used per sequence (evenly spaced): bounds the A X products; GPTQ does not care
# about H's scale (its damping is relative to mean diag H). SmolLM2 block 0, 8 x 512 tokens:
# 256 rows give nearly the H of all 512 (Frobenius, trace-normalised), 128 rows less so
MAX_QUERY_ROWS = 256
# attention weights held at once ([n, heads, S, S] float32): whole batches on small models
# (SmolLM2, 8 x 512 tokens: 75 MiB), one sequence at a time on large ones (32 heads x 2048
# tokens: 512 MiB). Per sequence everywhere made SmolLM2's batches markedly slower.
WEIGHTS_BUDGET = 256 << 20


def wants_attention_v(quantizer) -> bool:
    return quantizer.v_hessian == "attention" and "hessian" in quantizer.stats


def check_attention_v(spec: ArchSpec, quantizer) -> None:
    """Refuse the option, before any work, where the block has no separate v_proj whose
    attention weights eager attention returns."""
    if not wants_attention_v(quantizer):
        return
    if not spec.attention_v:  # ArchSpec.attention_v
        built = ", ".join(a.name for a in ARCHS if a.attention_v)
        raise UnsupportedArchitecture(
            f"--gptq-v-hessian attention is not built for {spec.name}: it needs a separate "
            "v_proj Linear next to an attention module whose eager path returns the attention "
            f"weights (built for: {built}).",
            "Drop --gptq-v-hessian (tokens, the default, works for every architecture).")


def attention_v_name(quantizer, spec: ArchSpec | None, group: tuple[str, ...]) -> str | None:
    """The v_proj of this sequential group whose Hessian is replaced, or None."""
    if spec is None or not wants_attention_v(quantizer) or not spec.attention_v:
        return None
    name = f"{spec.attention}.{V_PROJ}"
    return name if name in group else None


def _eager_mask(mask, x: torch.Tensor, module: torch.nn.Module) -> torch.Tensor | None:
    """The additive mask eager attention expects. Under SDPA transformers passes None for a
    plain causal mask (SDPA's is_causal then applies it) and booleans (True: attend) else."""
    s = x.shape[-2]
    if mask is None:
        if not getattr(module, "is_causal", True):
            return None
        keep = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        mask = keep[None, None]
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_fill_(
            ~mask, torch.finfo(x.dtype).min)
    return mask


def _sequences(v, rows: slice, batch: int):
    """Sequences `rows` of a batched kwarg (tensors of 2+ dims whose first dim is the batch);
    shared ones ([1, ...] rotary tables, 1-D positions) as they are."""
    if isinstance(v, tuple):
        return tuple(_sequences(t, rows, batch) for t in v)
    if torch.is_tensor(v) and v.ndim >= 2 and v.shape[0] == batch and batch > 1:
        return v[rows]
    return v


def query_rows(s: int, max_rows: int = MAX_QUERY_ROWS) -> torch.Tensor:
    """At most `max_rows` evenly spaced query positions of a length-s sequence."""
    if s <= max_rows:
        return torch.arange(s)
    return torch.linspace(0, s - 1, max_rows).round().long().unique()


@torch.no_grad()
def attention_v_hessian(block: torch.nn.Module, attention: str, xs: list[torch.Tensor],
                        kwargs: list[dict], max_rows: int = MAX_QUERY_ROWS,
                        budget: int = WEIGHTS_BUDGET) -> torch.Tensor:
    """sum over batches, sequences, query heads h and (sampled) queries s of xbar xbar^T,
    xbar = sum_t a_hst x_t: float32 [K, K] on the inputs' device.

    `xs` are v_proj's inputs [B, S, K] per batch, `kwargs` the block's kwargs of each batch.
    The attention module runs once more under eager attention, on as many sequences at a time
    as `budget` bytes of weights allow; its config is put back afterwards (the caller's forwards are
    paused or finished while this runs)."""
    module = block.get_submodule(attention)
    config = module.config
    device = next(module.parameters()).device
    before = config._attn_implementation
    config._attn_implementation = "eager"
    h, upper_only, scratch = None, False, {}
    try:
        for x_all, kw_all in zip(xs, kwargs, strict=True):
            kw_all = {k: v for k, v in kw_all.items() if k not in ("hidden_states", "use_cache")}
            x_all = x_all.to(device)  # host copies of offloaded batches come back here
            batch, s = x_all.shape[0], x_all.shape[-2]
            heads = getattr(config, "num_attention_heads", 1)
            step = max(1, budget // (heads * s * s * 4))
            for b in range(0, batch, step):
                x = x_all[b:b + step]
                kw = {k: _sequences(v, slice(b, b + step), batch) for k, v in kw_all.items()}
                kw["attention_mask"] = _eager_mask(kw.get("attention_mask"), x, module)
                _, weights = module(hidden_states=x, **kw)[:2]
                if weights is None:
                    raise RuntimeError(f"{type(module).__name__} returned no attention "
                                       "weights under eager attention")
                rows = query_rows(s, max_rows).to(x.device)
                a = weights[:, :, rows, :].float()  # [n, heads, R, S]: every query head counts
                xbar = (a @ x.float()[:, None]).reshape(-1, x.shape[-1])  # [n * heads * R, K]
                del weights, a
                # the statistics' own Gram (CPU: one triangle by BLAS syrk, half the flops)
                upd, upper_only = gram(xbar, xbar, scratch)
                h = upd.clone() if h is None else h.add_(upd)
    finally:
        config._attn_implementation = before
    return h.add_(h.triu(1).T) if upper_only else h
