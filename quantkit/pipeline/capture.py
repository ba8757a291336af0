"""Catch the inputs of the first decoder block for every calibration batch, and the keyword
arguments of every block.

Block 0's hidden states and every block's kwargs are recorded while each block's forward is
swapped for a pass-through (no block computes); the last block raises a private sentinel, so
the norm and head never run (AutoAWQ's Catcher idea, without catching broad exceptions).
Every block's kwargs, not only block 0's: Gemma 3 gives its sliding-window and global layers
their own masks and rotary tables (the values are shared, not copied, where blocks agree).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from quantkit.pipeline.offload import HostSink, batches_on_device, to_host

__all__ = ["BlockInputs", "capture_block_inputs", "run_block"]


class _Captured(Exception):
    pass


@dataclass
class BlockInputs:
    """Hidden states per batch plus the keyword arguments the block was called with.

    `device` is set when the hidden states are offloaded (quantkit.pipeline.offload): they
    live in host memory and `batches()` copies them to `device` one batch ahead of use.
    """

    hidden: list[torch.Tensor] = field(default_factory=list)
    kwargs: list[dict] = field(default_factory=list)
    device: torch.device | None = None
    # kwargs per batch of every block (block index -> batches); `kwargs` is the current block's
    block_kwargs: list[list[dict]] = field(default_factory=list)
    block: int = 0

    def to(self, device: torch.device | str, offload: bool = False) -> BlockInputs:
        """On `device`; with `offload` the hidden states go to (pinned) host memory instead
        and only the keyword arguments (masks, rotary tables: small) move to `device`
        (a tensor shared by several blocks moves once)."""
        moved: dict[int, torch.Tensor] = {}

        def one(t):
            if torch.is_tensor(t) and id(t) not in moved:
                moved[id(t)] = t.to(device)
            return moved[id(t)] if torch.is_tensor(t) else t

        move = lambda v: tuple(one(t) for t in v) if isinstance(v, tuple) else one(v)  # noqa: E731
        hidden = [to_host(h) for h in self.hidden] if offload else [h.to(device) for h in self.hidden]
        per_block = [[{k: move(v) for k, v in kw.items()} for kw in kws]
                     for kws in (self.block_kwargs or [self.kwargs])]
        index = self.block if self.block_kwargs else 0
        return BlockInputs(hidden, per_block[index], torch.device(device) if offload else None,
                           per_block if self.block_kwargs else [], index)

    def head(self, n: int) -> BlockInputs:
        """The first n batches only (a cheaper forward for a method's measurements)."""
        return BlockInputs(self.hidden[:n], self.kwargs[:n], self.device, self.block_kwargs, self.block)

    def with_hidden(self, hidden: list[torch.Tensor], block: int | None = None) -> BlockInputs:
        """The same placement with new hidden states (a block's outputs), and the kwargs of
        `block` (default: the current block's)."""
        block = self.block if block is None else block
        kwargs = self.block_kwargs[block] if self.block_kwargs and block < len(self.block_kwargs) \
            else self.kwargs
        return BlockInputs(hidden, kwargs, self.device, self.block_kwargs, block)

    def batches(self) -> Iterator[tuple[torch.Tensor, dict]]:
        """(hidden states on the compute device, kwargs) for every batch, in order."""
        hidden = self.hidden if self.device is None else batches_on_device(self.hidden, self.device)
        yield from zip(hidden, self.kwargs, strict=True)


def capture_block_inputs(model, blocks: torch.nn.ModuleList, batches, dtype: torch.dtype) -> BlockInputs:
    captured = BlockInputs(block_kwargs=[[] for _ in blocks])
    last = len(blocks) - 1

    def pass_through(index: int):
        # positional arguments after the hidden states (Gemma 4 passes each block its
        # per_layer_input so) are kept under their parameter names: blocks are replayed as
        # block(hidden, **kwargs)
        names = list(inspect.signature(type(blocks[index]).forward).parameters)[2:]

        def forward(*args, **kwargs):
            hidden = args[0] if args else kwargs.pop("hidden_states")
            kwargs.update(zip(names, args[1:], strict=False))
            kw = {k: v for k, v in kwargs.items() if k not in ("past_key_values", "past_key_value")}
            kw["use_cache"] = False
            if index == 0:
                captured.hidden.append(hidden.detach().to(dtype))
            captured.block_kwargs[index].append(kw)
            if index == last:
                raise _Captured
            return hidden
        return forward

    for i, block in enumerate(blocks):  # an instance attribute shadows the class's forward
        block.forward = pass_through(i)
    try:
        with torch.no_grad():
            for ids in batches:
                try:
                    model(input_ids=ids, use_cache=False)
                except _Captured:
                    pass
    finally:
        for block in blocks:
            del block.forward
    captured.kwargs = captured.block_kwargs[0]
    return captured


def run_block(block: torch.nn.Module, inputs: BlockInputs) -> list[torch.Tensor]:
    """Outputs of `block` for every cached batch (tuple outputs reduced to hidden states);
    in host memory, copied back while the next batch runs, when the inputs are offloaded."""
    sink = HostSink(inputs.device) if inputs.device is not None else None
    outs = []
    with torch.no_grad():
        for h, kw in inputs.batches():
            out = block(h, **kw)
            out = out[0] if isinstance(out, tuple) else out
            if sink is not None:
                sink.put(out)
            else:
                outs.append(out)
    return sink.close() if sink is not None else outs
