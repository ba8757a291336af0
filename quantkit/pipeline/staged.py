"""One block forward per block for true-sequential methods (GPTQ).

True-sequential order quantizes q/k/v, then o, then gate/up, then down, each from inputs made
with the Linears before it already quantized. Replaying the block from its start for every
group costs ~3.2 block forwards on llama shapes, plus the forward that makes the block's
outputs. Here every calibration batch runs its forward ONCE, in its own thread, and all of
them pause at the entry of each sequential group: the caller quantizes the group from all
batches' inputs, then lets them go on, now through the quantized weights.

The threads never run at the same time (a baton passes between the caller and one worker), so
batches run in the same order with the same kernels as the replay path, and the statistics
and results are bitwise the same; only the number of forwards changes. The cost is memory:
every batch's activations at the pause point are alive at once (one hidden state plus the
down_proj input per token; `quantkit plan` counts them).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from quantkit.pipeline.capture import BlockInputs

__all__ = ["StagedForward"]


class _Aborted(Exception):
    """Raised inside a paused worker when the caller gives up on the block."""


class _Worker:
    """One batch's block forward in a thread that runs only while the caller waits on it."""

    def __init__(self, owner: StagedForward, block: torch.nn.Module, hidden: torch.Tensor,
                 kwargs: dict, num_threads: int):
        self._owner, self._block, self._hidden, self._kwargs = owner, block, hidden, kwargs
        self._num_threads = num_threads
        self._resume = threading.Semaphore(0)
        self._yielded = threading.Semaphore(0)
        self.paused_at: int | None = None  # the group whose entry this batch waits at
        self.group_input: torch.Tensor | None = None  # the input every member of that group reads
        self.output: torch.Tensor | None = None
        self.error: BaseException | None = None
        self.done = False
        self.abort = False
        self.thread = threading.Thread(target=self._main, daemon=True, name="quantkit-staged")
        self.thread.start()

    def _main(self) -> None:
        self._resume.acquire()
        try:
            if self.abort:
                raise _Aborted
            # thread-local torch state: intra-op threads, current CUDA device, grad mode
            torch.set_num_threads(self._num_threads)
            if self._hidden.is_cuda:
                torch.cuda.set_device(self._hidden.device)
            self._owner._local.worker = self
            with torch.no_grad():
                out = self._block(self._hidden, **self._kwargs)
            self.output = out[0] if isinstance(out, tuple) else out
        except _Aborted:
            pass
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, who re-raises it
            self.error = exc
        finally:
            self._hidden = self._kwargs = None
            self.group_input = None
            self.done = True
            self._yielded.release()

    def pause(self, group: int, x: torch.Tensor) -> None:
        """In the worker: wait at `group`'s entry until the caller says go."""
        self.paused_at, self.group_input = group, x
        self._yielded.release()
        self._resume.acquire()
        if self.abort:
            raise _Aborted

    def step(self) -> None:
        """In the caller: let the worker run to its next pause or its end."""
        self._resume.release()
        self._yielded.acquire()
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        if not self.done:
            self.abort = True
            self._resume.release()
        self.thread.join()


class StagedForward:
    """Runs `block` on every batch of `inputs`, pausing all batches at each group's entry.

    Use: `for g in range(len(groups)): xs = run.advance(g); ...quantize group g...`, then
    `run.finish()` for the block outputs. Members of one group must read one input tensor
    (ArchSpec.sequential's rule), which is checked as the forward goes.
    """

    def __init__(self, block: torch.nn.Module, groups: Sequence[Sequence[str]], inputs: BlockInputs):
        self._local = threading.local()
        self._groups = [tuple(g) for g in groups]
        modules = dict(block.named_modules())
        self._handles = []
        for gi, group in enumerate(self._groups):
            for name in group:
                if name in modules:
                    self._handles.append(modules[name].register_forward_pre_hook(self._hook(gi, name)))
        threads = torch.get_num_threads()
        self._workers = [_Worker(self, block, h, kw, threads)
                         for h, kw in zip(inputs.hidden, inputs.kwargs, strict=True)]

    def _hook(self, group: int, name: str):
        def hook(_module, args):
            worker = getattr(self._local, "worker", None)
            if worker is None:  # a forward of the caller's own (not one of the staged batches)
                return None
            x = args[0]
            if worker.paused_at != group:
                if worker.paused_at is not None and group < worker.paused_at:
                    raise RuntimeError(f"{name} ran after a later sequential group: the "
                                       "ArchSpec's sequential order does not match the block")
                worker.pause(group, x)
            elif x is not worker.group_input:
                raise RuntimeError(
                    f"{name} reads a different input than the first Linear of its sequential "
                    f"group {self._groups[group]}: ArchSpec.sequential groups must share one input")
            return None
        return hook

    def advance(self, group: int) -> list[torch.Tensor]:
        """Run every batch to `group`'s entry; the inputs its Linears will read, per batch."""
        xs = []
        for worker in self._workers:
            worker.step()
            if worker.done or worker.paused_at != group:
                raise RuntimeError(
                    f"the block finished a forward without running sequential group "
                    f"{self._groups[group]}: the ArchSpec does not match this block")
            xs.append(worker.group_input)
        return xs

    def finish(self) -> list[torch.Tensor]:
        """Run every batch to the end of the block; its outputs, per batch."""
        outs = []
        for worker in self._workers:
            worker.step()
            if not worker.done:
                raise RuntimeError(f"a sequential group ran twice in one block forward: "
                                   f"{self._groups[worker.paused_at]}")
            outs.append(worker.output)
            worker.output = None
        self.close()
        return outs

    def close(self) -> None:
        """Stop the workers and drop them. Why: each worker points back at this object (a
        reference cycle), so what they held waited for Python's cyclic collector, and
        with their outputs that was one more block's hidden states per block until a
        collection ran (CLI GPTQ of SmolLM2 on 64 x 512 tokens: RSS +75 MB per block,
        peak 2.86 GiB; 2.16 GiB with the workers and their outputs dropped)."""
        for worker in self._workers:
            worker.stop()
        self._workers = []
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> StagedForward:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
