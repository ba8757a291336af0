"""GGML block decoders in torch (on the tensor's device), with llama.cpp's float order.

Block layouts are drawn in kquants_encode.py. Each decoder mirrors `dequantize_row_*` of
ggml-quants.c: e.g. Q4_K is (f32(d) * sc) * q - (f32(dmin) * m), Q6_K is (d * sc) * q.
gguf's numpy dequantizer gives the same values but runs on the CPU only; this one keeps the
GPU path on the GPU.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from quantkit.methods.kquants_math import IQ4NL_VALUES

__all__ = ["decode_rows", "DECODABLE"]

Q = GGMLQuantizationType


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[B, 2] little-endian fp16 bytes -> float32 [B]."""
    return b.contiguous().view(torch.float16).reshape(-1).float()


def _lo_hi(qs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q = qs.to(torch.int32)
    return q & 15, q >> 4


def _bit4(qh: torch.Tensor) -> torch.Tensor:
    """[B, 4] bytes of a little-endian uint32 -> [B, 32] bit values."""
    word = (qh.to(torch.int64) << (8 * torch.arange(4, device=qh.device))).sum(1, keepdim=True)
    return ((word >> torch.arange(32, device=qh.device)) & 1).to(torch.int32)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2])[:, None] * b[:, 2:].contiguous().view(torch.int8).float()


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    lo, hi = _lo_hi(b[:, 2:])
    return torch.cat([lo, hi], 1).sub(8).float() * _f16(b[:, :2])[:, None]


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    lo, hi = _lo_hi(b[:, 4:])
    return torch.cat([lo, hi], 1).float() * _f16(b[:, :2])[:, None] + _f16(b[:, 2:4])[:, None]


def _q5(b: torch.Tensor, off: int) -> torch.Tensor:
    lo, hi = _lo_hi(b[:, off + 4:])
    return torch.cat([lo, hi], 1) | (_bit4(b[:, off:off + 4]) << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    return (_q5(b, 2) - 16).float() * _f16(b[:, :2])[:, None]


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    return _q5(b, 4).float() * _f16(b[:, :2])[:, None] + _f16(b[:, 2:4])[:, None]


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed bytes -> 8 six-bit scales and mins (get_scale_min_k4)."""
    s = s.to(torch.int32)
    sc = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)], 1)
    mn = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], 1)
    return sc, mn


def _qk45(b: torch.Tensor, five: bool) -> torch.Tensor:
    nb = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    qs = b[:, 48:176] if five else b[:, 16:144]
    lo, hi = _lo_hi(qs.reshape(nb, 4, 32))
    q = torch.stack([lo, hi], 2)  # [nb, chunk, half, lane] = sub-block 2c + half
    if five:
        qh = b[:, 16:48].to(torch.int32)  # bit 2c+half of qh[lane]
        shift = (2 * torch.arange(4, device=b.device))[:, None] + torch.arange(2, device=b.device)[None]
        q = q | (((qh[:, None, None, :] >> shift[None, :, :, None]) & 1) << 4)
    q = q.reshape(nb, 8, 32).float()
    dl = (d[:, None] * sc.float())[:, :, None]
    ml = (dmin[:, None] * mn.float())[:, :, None]
    return (dl * q - ml).reshape(nb, 256)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    sc, qs = b[:, :16].to(torch.int32), b[:, 16:80].to(torch.int32)
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    q = (qs.reshape(nb, 2, 1, 32) >> (2 * torch.arange(4, device=b.device))[None, None, :, None]) & 3
    dl = (d[:, None] * (sc & 15).float()).repeat_interleave(16, 1)
    ml = (dmin[:, None] * (sc >> 4).float()).repeat_interleave(16, 1)
    return dl * q.reshape(nb, 256).float() - ml


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    hm, qs, s = (b[:, a:z].to(torch.int32) for a, z in ((0, 32), (32, 96), (96, 108)))
    d = _f16(b[:, 108:110])
    four = torch.arange(4, device=b.device)
    high = ((s[:, None, 8:12] >> (2 * four)[None, :, None]) & 3).reshape(nb, 16)  # j = 4c + k
    sc = torch.cat([s[:, 0:8] & 15, s[:, 0:8] >> 4], 1) | (high << 4)
    lo = (qs.reshape(nb, 2, 1, 32) >> (2 * four)[None, None, :, None]) & 3  # value 128h + 32k + l
    hi = (hm[:, None, :] >> torch.arange(8, device=b.device)[None, :, None]) & 1  # value 32b + m
    q = (lo.reshape(nb, 256) | (hi.reshape(nb, 256) << 2)) - 4
    dl = d[:, None] * (sc - 32).float()
    return dl.repeat_interleave(16, 1) * q.float()


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    ql = b[:, :128].to(torch.int32).reshape(nb, 2, 2, 32)  # half, (l | l+32), lane
    qh = b[:, 128:192].to(torch.int32).reshape(nb, 2, 1, 32)
    sc = b[:, 192:208].contiguous().view(torch.int8).float().reshape(nb, 2, 8)
    d = _f16(b[:, 208:210])
    lo, hi = ql & 15, ql >> 4  # quarters 0,1 from the low nibbles, 2,3 from the high ones
    nib = torch.cat([lo, hi], 2)  # [nb, half, quarter, lane]
    shift = (2 * torch.arange(4, device=b.device))[None, None, :, None]
    q = (nib | (((qh >> shift) & 3) << 4)) - 32
    # sub-block of value 128h + 32q + l is 8h + 2q + l // 16
    scale = d[:, None, None] * sc  # [nb, half, 8]
    scale = scale.reshape(nb, 2, 4, 2).repeat_interleave(16, dim=3)  # [nb, half, quarter, lane]
    return (scale * q.float()).reshape(nb, 256)


_IQ4NL = torch.tensor(IQ4NL_VALUES, dtype=torch.float32)


def _iq4_levels(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] code bytes -> [..., 32] kvalues_iq4nl levels (low nibbles, then high)."""
    lo, hi = _lo_hi(qs)
    return _IQ4NL.to(qs.device)[torch.cat([lo, hi], -1).long()]


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2])[:, None] * _iq4_levels(b[:, 2:])


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    nb = b.shape[0]
    high = b[:, 2].to(torch.int32) | (b[:, 3].to(torch.int32) << 8)
    ib = torch.arange(8, device=b.device)
    low = (b[:, 4 + ib // 2].to(torch.int32) >> (4 * (ib % 2))) & 15
    ls = low | (((high[:, None] >> (2 * ib)) & 3) << 4)
    dl = _f16(b[:, :2])[:, None] * (ls - 32).float()  # [nb, 8]
    return (dl[:, :, None] * _iq4_levels(b[:, 8:].reshape(nb, 8, 16))).reshape(nb, 256)


_DECODERS = {Q.Q8_0: (_q8_0, 32, 34), Q.Q4_0: (_q4_0, 32, 18), Q.Q4_1: (_q4_1, 32, 20), Q.Q5_0: (_q5_0, 32, 22),
             Q.Q5_1: (_q5_1, 32, 24), Q.Q2_K: (_q2_k, 256, 84), Q.Q3_K: (_q3_k, 256, 110), Q.Q4_K: (lambda b: _qk45(b, False), 256, 144),
             Q.Q5_K: (lambda b: _qk45(b, True), 256, 176), Q.Q6_K: (_q6_k, 256, 210),
             Q.IQ4_NL: (_iq4_nl, 32, 18), Q.IQ4_XS: (_iq4_xs, 256, 136)}
DECODABLE = tuple(_DECODERS)


def decode_rows(data: torch.Tensor, qtype: int) -> torch.Tensor:
    """GGML bytes [N, row_bytes] (uint8, any device) -> float32 [N, K] on the same device."""
    fn, block, size = _DECODERS[Q(qtype)]
    n = data.shape[0]
    k = data.shape[1] // size * block
    return fn(data.reshape(-1, size)).reshape(n, k)
