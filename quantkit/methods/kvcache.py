"""FP8 E4M3 KV-cache scales: one per layer for keys, one for values.

scale = max|x| / 448 over every calibration token and head (per tensor), so the largest
cached entry maps to E4M3's largest finite value. Per tensor because that is what the
engines apply: vLLM 0.32's attention layers keep one float each (`_k_scale_float`, also on
the CPU backend), and ModelOpt exports amax / 448 per layer.
"""

from __future__ import annotations

import torch

__all__ = ["FP8_E4M3_MAX", "fp8_kv_scales"]

FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
_TINY = 1e-12  # an all-zero layer still gets a usable (positive) scale


def fp8_kv_scales(k_absmax: float, v_absmax: float) -> tuple[float, float]:
    """(k_scale, v_scale) of one attention layer from its observed max |key| and |value|."""
    return max(k_absmax, _TINY) / FP8_E4M3_MAX, max(v_absmax, _TINY) / FP8_E4M3_MAX
