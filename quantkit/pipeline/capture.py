"""Catch the inputs of the first decoder block for every calibration batch.

A pre-hook on block 0 records (hidden_states, kwargs) and raises a private sentinel, so the
rest of the model never runs (AutoAWQ's Catcher idea, without catching broad exceptions).
"""

from __future__ import annotations

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

    def to(self, device: torch.device | str, offload: bool = False) -> BlockInputs:
        """On `device`; with `offload` the hidden states go to (pinned) host memory instead
        and only the keyword arguments (masks, rotary tables: small) move to `device`."""
        move = lambda v: v.to(device) if torch.is_tensor(v) else (  # noqa: E731
            tuple(t.to(device) if torch.is_tensor(t) else t for t in v) if isinstance(v, tuple) else v)
        hidden = [to_host(h) for h in self.hidden] if offload else [h.to(device) for h in self.hidden]
        return BlockInputs(hidden, [{k: move(v) for k, v in kw.items()} for kw in self.kwargs],
                           torch.device(device) if offload else None)

    def with_hidden(self, hidden: list[torch.Tensor]) -> BlockInputs:
        """The same kwargs and placement with new hidden states (a block's outputs)."""
        return BlockInputs(hidden, self.kwargs, self.device)

    def batches(self) -> Iterator[tuple[torch.Tensor, dict]]:
        """(hidden states on the compute device, kwargs) for every batch, in order."""
        hidden = self.hidden if self.device is None else batches_on_device(self.hidden, self.device)
        yield from zip(hidden, self.kwargs, strict=True)


def capture_block_inputs(model, blocks: torch.nn.ModuleList, batches, dtype: torch.dtype) -> BlockInputs:
    captured = BlockInputs()

    def pre_hook(_module, args, kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        kw = {k: v for k, v in kwargs.items() if k not in ("past_key_values", "past_key_value")}
        kw["use_cache"] = False
        captured.hidden.append(hidden.detach().to(dtype))
        captured.kwargs.append(kw)
        raise _Captured

    handle = blocks[0].register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        with torch.no_grad():
            for ids in batches:
                try:
                    model(input_ids=ids, use_cache=False)
                except _Captured:
                    pass
    finally:
        handle.remove()
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
