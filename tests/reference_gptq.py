"""Textbook GPTQ (one column at a time, float64, no lazy blocks, no act-order): the reference
the fast loops are checked against, in the tests (CPU) and in benchmarks/gpu_gptq_check.py (GPU)."""

from __future__ import annotations

import torch

from quantkit.methods.intquant import group_qparams, quantize_to_codes
from quantkit.types import QuantScheme


def naive_gptq(w: torch.Tensor, h: torch.Tensor, scheme: QuantScheme, damp: float = 0.01) -> torch.Tensor:
    """Codes [N, K] (float64) of textbook GPTQ on w's device."""
    w = w.clone().double()
    eye = torch.eye(h.shape[0], dtype=torch.float64, device=h.device)
    h = h.double() + damp * h.diagonal().mean() * eye
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    g = scheme.effective_group(w.shape[1])
    codes = torch.empty_like(w)
    for i in range(w.shape[1]):
        if i % g == 0:
            s, z = group_qparams(w[:, i:i + g].float(), scheme.bits, scheme.symmetric)
        q = quantize_to_codes(w[:, i].float(), s, z, scheme.bits).double()
        err = (w[:, i] - (q - z) * s) / hinv[i, i]
        w[:, i:] -= err[:, None] * hinv[i, i:][None, :]
        codes[:, i] = q
    return codes
