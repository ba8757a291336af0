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

import os
from collections.abc import Iterator

import torch

__all__ = ["to_host", "batches_on_device", "HostSink", "fast_pinned_memory", "reserve_pinned"]

_PINNED_SETTING: str | None = None


def fast_pinned_memory() -> str | None:
    """Make torch page-lock new host memory with several threads (cudaHostRegister) instead
    of one cudaHostAlloc call; returns the setting made (None: left as it was).

    Why: the offloaded hidden states are new pinned memory twice in the first block (the
    captured inputs and that block's outputs: 2 GiB each on Llama-3.1-8B shapes, 128 x 2048
    tokens), and one cudaHostAlloc thread pinned 2 GiB in 1.0-1.4 s, 8 register threads in
    0.29 s, 16 in 0.23 s (benchmarks/gpu_pinned_alloc.py on an H200 host with 16 cores).
    A process-wide setting of torch's host allocator, made once; left alone where the user's
    PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF already names a pinned_ option.
    """
    global _PINNED_SETTING
    if _PINNED_SETTING is not None or not torch.cuda.is_available():
        return _PINNED_SETTING
    user = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    if "pinned_" in user:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = 1 << (min(16, max(cores, 1)).bit_length() - 1)  # a power of two, as torch asks
    setting = f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{threads}"
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        setter = torch.cuda.memory._set_allocator_settings
    setter(setting)
    _PINNED_SETTING = setting
    return setting


def reserve_pinned(shapes: list[tuple[int, ...]], dtype: torch.dtype, copies: int) -> None:
    """Page-lock now `copies` host tensors of each shape and hand them back to torch's pinned
    memory cache, where the first offloaded block's requests of the same sizes find them.

    Why: quantize() waits seconds for the NaN/Inf scan of a cold checkpoint with the main
    thread idle; pinned memory got there is not got inside the first block, which needs two
    sets of hidden states (its captured inputs and its outputs: 4 GiB on Llama-3.1-8B shapes,
    128 x 2048 tokens). Later blocks reuse the same cached memory.
    """
    if not torch.cuda.is_available():
        return
    fast_pinned_memory()
    held = [torch.empty(shape, dtype=dtype, pin_memory=True) for shape in shapes
            for _ in range(copies)]
    del held


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
