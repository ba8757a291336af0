"""Calibration activations held in host memory while the blocks run on a GPU.

Why: the hidden states of every calibration batch are the largest thing on the GPU after the
first block (128 x 2048 tokens of Llama-3.1-8B: 2 GiB per copy, and a block's inputs and
outputs are alive together). Offloaded, they wait in pinned host memory and only the batch
being computed (plus the next one, already on its way) is on the GPU: a batch's copy to the
GPU runs on a side stream while the previous batch computes, and each output goes back to the
host on another side stream while the next batch computes, so the copies hide behind the
block's arithmetic instead of adding to it. Values are copied bit for bit: a run gives the
same results offloaded or not.

Without CUDA (or for tensors already on the compute device) nothing is copied or pinned, so
the CPU path is unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

__all__ = ["to_host", "batches_on_device", "HostSink"]


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of `t`, page-locked when CUDA is there (needed for asynchronous copies)."""
    pin = torch.cuda.is_available()
    if t.device.type == "cpu":
        return t.pin_memory() if pin and not t.is_pinned() else t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
    out.copy_(t)
    return out


def _side_stream(device: torch.device, which: str) -> torch.cuda.Stream:
    """One reused copy stream per device and direction (streams are cheap but not free)."""
    key = (device.index if device.index is not None else torch.cuda.current_device(), which)
    stream = _STREAMS.get(key)
    if stream is None:
        stream = _STREAMS[key] = torch.cuda.Stream(device)
    return stream


_STREAMS: dict[tuple[int, str], torch.cuda.Stream] = {}


def batches_on_device(hidden: list[torch.Tensor], device: torch.device) -> Iterator[torch.Tensor]:
    """Each host tensor of `hidden` on `device`, the next one's copy started before this one
    is handed out (so it overlaps the caller's work on this one). Two batches are on the GPU
    at a time. On a CPU `device` the tensors are yielded as they are."""
    device = torch.device(device)
    if device.type != "cuda":
        yield from hidden
        return
    compute = torch.cuda.current_stream(device)
    copier = _side_stream(device, "h2d")

    def start(h: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        dst = torch.empty(h.shape, dtype=h.dtype, device=device)  # on the compute stream
        copier.wait_stream(compute)  # dst may be memory that queued kernels still use
        with torch.cuda.stream(copier):
            dst.copy_(h, non_blocking=True)
            done = torch.cuda.Event()
            done.record(copier)
        return dst, done

    ahead = start(hidden[0]) if hidden else None
    for i in range(len(hidden)):
        dst, done = ahead
        ahead = start(hidden[i + 1]) if i + 1 < len(hidden) else None
        compute.wait_event(done)
        yield dst
        del dst


class HostSink:
    """Collects a block's outputs in pinned host memory, each copied back on a side stream
    while the next batch computes. `close()` waits for the last copy: after it the host
    tensors may be read by the CPU (a checkpoint) or copied to the GPU again."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.outputs: list[torch.Tensor] = []
        self._stream = _side_stream(self.device, "d2h") if self.device.type == "cuda" else None

    def put(self, out: torch.Tensor) -> None:
        if self._stream is None or not out.is_cuda:
            self.outputs.append(to_host(out) if out.is_cuda else out)
            return
        host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # out is computed
        with torch.cuda.stream(self._stream):
            host.copy_(out, non_blocking=True)
        out.record_stream(self._stream)  # its memory is not reused before the copy is done
        self.outputs.append(host)

    def close(self) -> list[torch.Tensor]:
        if self._stream is not None:
            self._stream.synchronize()
        return self.outputs
