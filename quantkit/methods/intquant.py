"""Integer grid primitives shared by every weight-only int method (RTN, GPTQ, AWQ).

Convention (see QuantResult): unsigned codes q in [0, 2^b - 1], w = (q - z) * s.
Symmetric: z = 2^(b-1), s = absmax / (2^(b-1) - 0.5) so both -absmax and +absmax land on the
grid edge after rounding (the GPTQ / compressed-tensors convention).
Asymmetric: the range [min, max] always includes 0; s = (max - min) / (2^b - 1), z = round(-min/s).
Float zero (scheme.float_zero: a format whose bias per group is a free float, MLX): s and z
start from the group's own [min, max] (z = -min / s, not rounded), then the codes and the pair
(s, z) are fitted in turn: each code rounded on the current grid, (s, z) by least squares on
those codes, the last fit kept (affine_refit; GPTQ refits once on its own codes, weighted by its Hessian).
"""

from __future__ import annotations

import time
import warnings

import torch

from quantkit.errors import CalibrationError, SchemeMismatch
from quantkit.types import BlockContext, QuantResult, QuantScheme, int_qrange

__all__ = ["check_int_scheme", "group_qparams", "quantize_to_codes", "rtn_quantize_weight",
           "group_quantize", "affine_refit", "FLOAT_ZERO_ROUNDS",
           "relative_error", "rtn_fallback", "announce_rtn_fallback", "starved_experts",
           "borrow_input_scales"]

SUPPORTED_BITS = (2, 3, 4, 8)


def check_int_scheme(scheme: QuantScheme) -> None:
    if scheme.bits not in SUPPORTED_BITS:
        raise SchemeMismatch(
            f"Unsupported bit width {scheme.bits} for integer weights.",
            f"Use one of {SUPPORTED_BITS} (4 and 8 load in every engine).",
        )
    if scheme.group_size not in (-1, 0) and scheme.group_size < 1:
        raise SchemeMismatch(f"Invalid group size {scheme.group_size}.", "Use -1 or a positive size.")


def check_no_act_order(scheme: QuantScheme, method: str) -> None:
    """Methods without a column order refuse act_order rather than record it unapplied."""
    if scheme.act_order:
        raise SchemeMismatch(f"Method {method} quantizes columns in their own order; act-order "
                             "is a GPTQ option.", "Drop --act-order, or use --method gptq.")


def group_qparams(w: torch.Tensor, bits: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero for each row of `w` [..., g] (the last dim is one group).

    Returns float32 scale [...] and int32 zero [...].
    """
    w = w.float()
    _, qmax = int_qrange(bits)
    if symmetric:
        absmax = w.abs().amax(dim=-1)
        scale = absmax / ((qmax + 1) / 2 - 0.5) if bits > 1 else absmax
        zero = torch.full_like(scale, (qmax + 1) // 2, dtype=torch.int32)
    else:
        wmin = w.amin(dim=-1).clamp(max=0)
        wmax = w.amax(dim=-1).clamp(min=0)
        scale = (wmax - wmin) / qmax
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        zero = torch.round(-wmin / scale).clamp(0, qmax).to(torch.int32)
    scale = torch.where(scale > 0, scale, torch.full_like(scale, 1e-8))
    return scale, zero


def quantize_to_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Round w / scale + zero onto [0, 2^b - 1]; scale/zero broadcast against w (a float zero
    is added before rounding, an integer one after: the same codes, ties included)."""
    _, qmax = int_qrange(bits)
    if zero.is_floating_point():
        return torch.clamp(torch.round(w.float() / scale + zero), 0, qmax)
    return torch.clamp(torch.round(w.float() / scale) + zero, 0, qmax)


# least-squares fits of the float-zero grid, codes re-rounded between them (each round lowers
# the group's squared error; the codes of the last fit are kept, so (s, z) is their
# least-squares pair)
FLOAT_ZERO_ROUNDS = 3


def _lstsq_groups(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, z) minimising sum (w - (q - z) s)^2 over the last dim of w, q [..., g]: the
    regression of w on q (s = cov(q, w) / var(q), bias = mean(w) - s mean(q), z = -bias / s);
    groups whose codes are all equal keep `scale` / `zero`."""
    qm, wm = q.mean(-1, keepdim=True), w.mean(-1, keepdim=True)
    dq = q - qm
    var = dq.pow(2).sum(-1)
    s = (dq * (w - wm)).sum(-1) / var.clamp_min(1e-12)
    ok = (var > 0) & (s > 0)
    s = torch.where(ok, s, scale)
    bias = wm.squeeze(-1) - s * qm.squeeze(-1)
    return s, torch.where(ok, -bias / s, zero)


def group_quantize(wg: torch.Tensor, scheme: QuantScheme
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scale, zero) of groups wg [..., g] on the scheme's grid (codes float32, scale
    and zero [...]): the integer grid of group_qparams, or the float-zero grid fitted in
    FLOAT_ZERO_ROUNDS code / least-squares rounds (scheme.float_zero)."""
    wg = wg.float()
    if not scheme.float_zero or scheme.symmetric:
        scale, zero = group_qparams(wg, scheme.bits, scheme.symmetric)
        return quantize_to_codes(wg, scale[..., None], zero[..., None], scheme.bits), scale, zero
    _, qmax = int_qrange(scheme.bits)
    wmin, wmax = wg.amin(-1), wg.amax(-1)
    scale = ((wmax - wmin) / qmax).clamp_min(1e-8)
    zero = -wmin / scale
    q = quantize_to_codes(wg, scale[..., None], zero[..., None], scheme.bits)
    for r in range(FLOAT_ZERO_ROUNDS):
        scale, zero = _lstsq_groups(wg, q, scale, zero)
        if r + 1 < FLOAT_ZERO_ROUNDS:  # the last fit is kept: the least-squares pair of q
            q = quantize_to_codes(wg, scale[..., None], zero[..., None], scheme.bits)
    return q, scale, zero


def affine_refit(w: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 group: int, hessian: torch.Tensor | None = None, rows: int = 256
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Float (scale, zero) [N, G] for fixed codes [N, K] (contiguous groups of `group`) that
    minimise the reconstruction error of w [N, K]: per group in weight space, or with
    `hessian` H [K, K] the output error sum_n (w_n - wq_n) H (w_n - wq_n)^T, one 2G x 2G
    normal system per row (GPTQ's objective, its codes kept). A 1e-6 relative ridge pulls
    each row toward its given (scale, zero), which a group of equal codes keeps."""
    n, k = w.shape
    ng = k // group
    w = w.float()
    q = codes.float()
    if hessian is None:
        return _lstsq_groups(w.reshape(n, ng, group), q.reshape(n, ng, group), scale.float(),
                             zero.float())
    h = hessian.float()
    hb = h.reshape(k, ng, group).sum(-1)  # [K, G]: H summed over each group's columns
    bb = hb.reshape(ng, group, ng).sum(1)  # [G, G]
    out_s, out_z = [], []
    for r0 in range(0, n, rows):
        qr, wr = q[r0:r0 + rows], w[r0:r0 + rows]
        s0, z0 = scale[r0:r0 + rows].float(), zero[r0:r0 + rows].float()
        m = qr.shape[0]
        qg = qr.reshape(m, ng, group)
        t = torch.einsum("igj,mgj->mig", h.reshape(k, ng, group), qg)  # [m, K, G] = H q per group
        ss = torch.einsum("mgi,mgih->mgh", qg, t.reshape(m, ng, group, ng))
        sb = torch.einsum("mgi,gih->mgh", qg, hb.reshape(ng, group, ng))
        hw = wr @ h  # [m, K]
        rs = (qg * hw.reshape(m, ng, group)).sum(-1)
        rb = hw.reshape(m, ng, group).sum(-1)
        a = torch.cat([torch.cat([ss, sb], 2),
                       torch.cat([sb.transpose(1, 2), bb.expand(m, ng, ng)], 2)], 1)
        p0 = torch.cat([s0, -s0 * z0], 1)  # (scale, bias) as given
        ridge = 1e-6 * a.diagonal(dim1=1, dim2=2).mean(-1).clamp_min(1e-12)
        reg = torch.diag_embed(ridge[:, None].expand(m, 2 * ng))
        rhs = torch.cat([rs, rb], 1) + reg.diagonal(dim1=1, dim2=2) * p0
        p = torch.linalg.solve(a.double() + reg.double(), rhs.double()[..., None])[..., 0].float()
        s, bias = p[:, :ng], p[:, ng:]
        ok = torch.isfinite(p).all(1, keepdim=True) & (s > 0)
        s = torch.where(ok, s, s0)
        out_s.append(s)
        out_z.append(torch.where(ok, -bias / s, z0))
    return torch.cat(out_s), torch.cat(out_z)


def relative_error(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    w = w.float()
    return float((w - w_hat.float()).norm() / w.norm().clamp_min(1e-12))


def rtn_quantize_weight(name: str, weight: torch.Tensor, scheme: QuantScheme) -> QuantResult:
    """Round-to-nearest of a [N, K] weight, group-wise along K."""
    check_int_scheme(scheme)
    n, k = weight.shape
    g = scheme.effective_group(k)
    if k % g:
        raise SchemeMismatch(f"group size {g} does not divide in_features {k} of {name}.")
    codes, scale, zero = group_quantize(weight.reshape(n, k // g, g), scheme)
    result = QuantResult(
        name=name,
        scheme=scheme,
        codes=codes.reshape(n, k).to(torch.uint8),
        scale=scale,
        zero=zero,
    )
    result.loss = relative_error(weight, result.dequantize())
    return result


def announce_rtn_fallback(ctx: BlockContext, names: list[str], method: str,
                          stacklevel: int = 2) -> None:
    """The loud part of a fallback to RTN: one warning per block naming the Linears."""
    if not names:
        return
    prefix = f"{ctx.arch.block_path}.{ctx.index}." if ctx.arch is not None else f"block {ctx.index} "
    warnings.warn(
        f"{method}: {len(names)} Linear(s) of {prefix.rstrip('.')} received no calibration tokens "
        f"and fall back to RTN: {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}. "
        "Use more calibration samples or --moe-calibrate-all-experts.",
        RuntimeWarning, stacklevel=stacklevel + 1)


def rtn_fallback(ctx: BlockContext, names: list[str], method: str) -> dict[str, QuantResult]:
    """RTN for Linears that got no calibration tokens (MoE experts the router never chose):
    a calibrated method has nothing to work from there, and dividing by a zero token count
    would give NaN. Loud: a warning per block naming them, and `fallback` on each result."""
    if not names:
        return {}
    announce_rtn_fallback(ctx, names, method, stacklevel=2)
    results = {}
    for name in names:
        t0 = time.perf_counter()
        linear = ctx.linears[name]
        res = rtn_quantize_weight(name, linear.weight.data, ctx.scheme)
        res.bias = None if linear.bias is None else linear.bias.data.clone()
        res.fallback = "rtn"
        res.seconds = time.perf_counter() - t0
        results[name] = res
    return results


def starved_experts(ctx: BlockContext, names) -> bool:
    """Whether `names` are routed experts' Linears that all received no calibration token."""
    return ctx.arch is not None and all(
        ctx.arch.is_expert_linear(n) and not (ctx.stats.get(n) or {}).get("tokens") for n in names)


def borrow_input_scales(ctx: BlockContext, results: dict[str, QuantResult], starved: list[str],
                        key: str, widest, method: str, what: str) -> None:
    """Experts the router fed no calibration token get, per projection (gate_proj, up_proj,
    down_proj), the static input scale `extra[key]` of the block's calibrated experts with the
    widest input range (`widest`: torch.minimum for NVFP4's global scale 448 * 6 / max|x|,
    torch.maximum for int8's max|x| / 127.5 and FP8's max|x| / 448): a scale the engine may
    apply to them without clipping more than any calibrated expert clips. Loud: one warning per
    block, and the Linear's `fallback` (quantkit_stats.json, quantkit.json). `what` names that
    scale in the warning."""
    donors: dict[str, torch.Tensor] = {}
    for n, res in results.items():
        s = res.extra.get(key)
        if s is not None and n not in starved and ctx.arch.is_expert_linear(n):
            proj = n.rsplit(".", 1)[-1]
            donors[proj] = s if proj not in donors else widest(donors[proj], s)
    for n in starved:
        proj = n.rsplit(".", 1)[-1]
        if proj not in donors:
            raise CalibrationError(
                f"{method} input scales: no expert {proj} of block {ctx.index} received a "
                "calibration token, so none has an input scale to share.",
                "Use more calibration samples or --moe-calibrate-all-experts.")
        results[n].extra[key] = donors[proj].clone()
        why = f"{key} of the block's widest calibrated expert"
        results[n].fallback = f"{results[n].fallback}; {why}" if results[n].fallback else why
    shown = ", ".join(starved[:6]) + (" ..." if len(starved) > 6 else "")
    warnings.warn(
        f"{method}: {len(starved)} expert Linear(s) of block {ctx.index} received no "
        f"calibration tokens and take the {what} of the block's calibrated experts: {shown}. "
        "Use --moe-calibrate-all-experts to calibrate each on every token.",
        RuntimeWarning, stacklevel=3)
