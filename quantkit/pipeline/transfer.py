"""Device -> host copies of many tensors at once, through two reused pinned staging buffers.

Why: `t.cpu()` of a CUDA tensor into ordinary (pageable) memory is a synchronous copy that the
driver bounces through its own small pinned buffer; on the H100 machine a GPTQ block spent
~0.5 s of its ~2.1 s in such copies (the block moved back to the CPU, then each result's codes,
scales and zeros one `.cpu()` at a time). Here every tensor of a block goes in one call: the GPU
copies chunks into a pinned buffer asynchronously while the CPU drains the other buffer into the
final pageable tensors, and there is one wait per chunk instead of one stall per tensor. The
pinned buffers are freed to torch's caching host allocator, so the next block reuses them
(no new page-locking per block), and the results end up in ordinary memory as before.

Values are copied bit for bit; tensors already on the CPU are returned as they are, so the CPU
code path does not change.
"""

from __future__ import annotations

import torch

__all__ = ["fetch_to_cpu", "any_finite_problem"]

_STAGE_BYTES = 128 << 20  # per staging buffer (two of them)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (bool and 1-byte dtypes included)."""
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def fetch_to_cpu(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """CPU copies of `tensors` (same dtypes, shapes, values; contiguous); CPU ones unchanged."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    jobs = []
    for i, t in enumerate(tensors):
        t = t.detach()
        if not t.is_cuda:
            out[i] = t
            continue
        dst = torch.empty(t.shape, dtype=t.dtype)
        out[i] = dst
        if t.numel():
            src = t.contiguous()
            jobs.append((_bytes(src), _bytes(dst)))
    if not jobs:
        return out  # type: ignore[return-value]
    device = jobs[0][0].device
    total = sum(s.numel() for s, _ in jobs)
    size = min(_STAGE_BYTES, total)
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream()
        bufs = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        events = [torch.cuda.Event(), torch.cuda.Event()]
        pending: list[list[tuple[torch.Tensor, int, int]]] = [[], []]  # (dst piece, offset, n)
        cur, used = 0, 0

        def drain(b: int) -> None:
            events[b].synchronize()
            for dst_piece, off, n in pending[b]:
                dst_piece.copy_(bufs[b][off:off + n])
            pending[b] = []

        def flush() -> int:
            """Close the current buffer; return the other one, drained and free."""
            events[cur].record(stream)
            nxt = 1 - cur
            drain(nxt)
            return nxt

        for src, dst in jobs:
            pos, n_all = 0, src.numel()
            while pos < n_all:
                if used == size:
                    cur, used = flush(), 0
                n = min(size - used, n_all - pos)
                bufs[cur][used:used + n].copy_(src[pos:pos + n], non_blocking=True)
                pending[cur].append((dst[pos:pos + n], used, n))
                used += n
                pos += n
        events[cur].record(stream)
        drain(1 - cur)
        drain(cur)
    return out  # type: ignore[return-value]


def any_finite_problem(tensors: list[torch.Tensor]) -> list[bool]:
    """Per tensor: True when a floating tensor holds NaN/Inf. On a GPU the checks are reduced
    on the device and read back in ONE sync (the CPU check of a bf16 Llama-8B block took
    ~0.15 s on the H100 machine's host); on the CPU it is the same `isfinite().all()` as before."""
    flags = []
    for t in tensors:
        if t.is_floating_point():
            flags.append(torch.isfinite(t).all())
        else:
            flags.append(None)
    dev = [f for f in flags if f is not None and f.is_cuda]
    host = iter(torch.stack(dev).tolist()) if dev else iter(())
    return [False if f is None else not (next(host) if f.is_cuda else bool(f)) for f in flags]
