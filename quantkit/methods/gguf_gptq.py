"""GPTQ error feedback onto llama.cpp's own block grids (`--method gguf --rounding gptq`).

llama.cpp rounds every block on its own (imatrix-weighted at best). Here each Linear goes
through GPTQ's column loop (quantkit.methods.gptq) and the round-to-grid step is the GGML
block grid itself, so the file is an ordinary GGUF of that type:

  * when the loop reaches a super-block (256 columns), its scales/mins are chosen by
    llama.cpp's own encoder (make_qkx3 for Q4_K, the Q6_K search), imatrix-weighted by the
    imatrix when one is given, else by diag(H), on the CURRENT (error-updated) columns;
  * each column of the super-block is then rounded to that fixed grid with llama.cpp's own
    rounding formula and its error is carried into the later columns through H^-1;
  * the final codes are packed into the super-block bytes the encoder produced (its scale
    bytes are kept as they are), so the writer gets finished GGML blocks.

With H = I nothing is fed back and the bytes are `encode_rows`'s, bit for bit (the tests
check it). Supported grids: GPTQ_GRIDS (Q4_K, Q6_K: every type of the Q4_K_M mix on widths
that are multiples of 256); other types are encoded by the plain llama.cpp encoder and the
result says so (QuantResult.fallback, in the file's quantkit.metadata stats).
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from quantkit.methods.gptq import gptq_column_loop, inverse_hessian_factor, one_cpu_thread
from quantkit.methods.kquants_encode import encode_rows

__all__ = ["GPTQ_GRIDS", "GGMLColumnGrid", "gptq_ggml", "SUPER_BLOCK"]

Q = GGMLQuantizationType
SUPER_BLOCK = 256
GPTQ_GRIDS = (Q.Q4_K, Q.Q6_K)


def _f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).reshape(-1).float()


def _q4k_grid(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K bytes [N, 144] -> (step d*sc, offset dmin*m) per sub-block of 32, [N, 8] each."""
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    s = blocks[:, 4:16].to(torch.int32)
    sc = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)], 1)
    mn = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], 1)
    return d[:, None] * sc.float(), dmin[:, None] * mn.float()


def _q6k_grid(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K bytes [N, 210] -> (step d*sc per sub-block of 16 [N, 16], no offset)."""
    sc = blocks[:, 192:208].contiguous().view(torch.int8).float()
    step = _f16(blocks[:, 208:210])[:, None] * sc
    return step, torch.zeros_like(step)


def _pack_q4k(blocks: torch.Tensor, q: torch.Tensor) -> None:
    """Codes [N, 256] (0..15) into the qs bytes of Q4_K blocks [N, 144], in place."""
    q = q.to(torch.int32).reshape(-1, 4, 2, 32)  # chunk, half, lane
    blocks[:, 16:144] = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128).to(torch.uint8)


def _pack_q6k(blocks: torch.Tensor, q: torch.Tensor) -> None:
    """Codes [N, 256] (0..63) into the ql/qh bytes of Q6_K blocks [N, 210], in place."""
    v = q.to(torch.int32).reshape(-1, 2, 4, 32)  # half, quarter, lane
    lo, hi = v & 15, v >> 4
    ql = torch.stack([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], 2)
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    blocks[:, 0:128] = ql.reshape(-1, 128).to(torch.uint8)
    blocks[:, 128:192] = qh.reshape(-1, 64).to(torch.uint8)


_GRIDS = {Q.Q4_K: (_q4k_grid, _pack_q4k, 32, 144), Q.Q6_K: (_q6k_grid, _pack_q6k, 16, 210)}


class GGMLColumnGrid:
    """GPTQ's round-to-grid step onto a GGML super-block grid (Q4_K / Q6_K).

    At each super-block start the encoder picks the grid from the updated columns; each
    column is then rounded as ggml-quants.c rounds it once the scales are fixed:
      Q4_K  q = clamp(nearest((x + dmin*m) / (d*sc)), 0, 15),   x' = d*sc*q - dmin*m
      Q6_K  q = clamp(nearest(x / (d*sc)), -32, 31) + 32,       x' = d*sc*(q - 32)
    (a zero step gives code 0: its value is the offset whatever the code).
    """

    def __init__(self, qtype: Q, n: int, k: int, qw: torch.Tensor | None) -> None:
        if qtype not in _GRIDS:
            raise ValueError(f"no GPTQ grid for GGML type {qtype.name}")
        self.qtype = qtype
        self.grid_of, self.pack, self.sub, size = _GRIDS[qtype]
        self.qw = qw
        self.blocks = torch.empty(n, k // SUPER_BLOCK, size, dtype=torch.uint8)
        self.dequantized = torch.empty(n, k)
        self._step = self._offset = None

    def round_column(self, col: int, block: torch.Tensor, i: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        sb, j = divmod(col, SUPER_BLOCK)
        if j == 0:  # the grid of this super-block, from its error-updated columns
            if i + SUPER_BLOCK > block.shape[1]:
                raise ValueError("the GPTQ column block must hold whole 256-column super-blocks")
            qw = None if self.qw is None else self.qw[col:col + SUPER_BLOCK]
            self.blocks[:, sb] = encode_rows(block[:, i:i + SUPER_BLOCK].contiguous(),
                                             self.qtype, qw)
            self._step, self._offset = self.grid_of(self.blocks[:, sb])
        step = self._step[:, j // self.sub]
        offset = self._offset[:, j // self.sub]
        zero = step == 0
        safe = torch.where(zero, torch.ones_like(step), step)
        x = block[:, i]
        if self.qtype == Q.Q6_K:
            q = torch.where(zero, 0.0, torch.round(x / safe).clamp_(-32, 31))
            deq = step * q
            q = q + 32
        else:
            q = torch.where(zero, 0.0, torch.round((x + offset) / safe).clamp_(0, 15))
            deq = step * q - offset
        self.dequantized[:, col] = deq
        return q, deq

    def finish(self, codes: torch.Tensor) -> torch.Tensor:
        """Pack the loop's codes [N, K] into the super-blocks: bytes [N, row_bytes]."""
        n, nsb, size = self.blocks.shape
        for sb in range(nsb):
            self.pack(self.blocks[:, sb], codes[:, sb * SUPER_BLOCK:(sb + 1) * SUPER_BLOCK])
        return self.blocks.reshape(n, nsb * size)


def gptq_ggml(weight: torch.Tensor, hinv: torch.Tensor, qtype: Q, qw: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """GGML bytes [N, row_bytes] of `weight` [N, K] rounded by GPTQ onto the `qtype` grid, and
    the weight those bytes decode to (float32 [N, K]). `hinv` is the upper Cholesky factor
    of the damped H^-1 (gptq.inverse_hessian_factor); `qw` [K] weights the scale search."""
    w = weight.detach().to(torch.float32, copy=True).cpu()
    n, k = w.shape
    if k % SUPER_BLOCK:
        raise ValueError(f"row width {k} is not a multiple of {SUPER_BLOCK} ({qtype.name})")
    grid = GGMLColumnGrid(qtype, n, k, qw)
    with one_cpu_thread(w.device):
        codes = gptq_column_loop(w, hinv.cpu(), grid, SUPER_BLOCK)
    return grid.finish(codes), grid.dequantized


def hessian_factor(hessian: torch.Tensor, damp: float, name: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """(upper Cholesky factor of the damped H^-1, diag(H) with dead columns set to 1)."""
    h = hessian.detach().to(torch.float32).cpu().clone()
    h.diagonal().masked_fill_(h.diagonal() == 0, 1.0)
    diag = h.diagonal().clone()
    hinv, _ = inverse_hessian_factor(h, damp, name)
    return hinv, diag
