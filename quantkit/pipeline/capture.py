"""Catch the inputs of the first decoder block for every calibration batch.

A pre-hook on block 0 records (hidden_states, kwargs) and raises a private sentinel, so the
rest of the model never runs (AutoAWQ's Catcher idea, without catching broad exceptions).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["BlockInputs", "capture_block_inputs", "run_block"]


class _Captured(Exception):
    pass


@dataclass
class BlockInputs:
    """Hidden states per batch plus the keyword arguments the block was called with."""

    hidden: list[torch.Tensor] = field(default_factory=list)
    kwargs: list[dict] = field(default_factory=list)

    def to(self, device: torch.device | str) -> BlockInputs:
        move = lambda v: v.to(device) if torch.is_tensor(v) else (  # noqa: E731
            tuple(t.to(device) if torch.is_tensor(t) else t for t in v) if isinstance(v, tuple) else v)
        return BlockInputs([h.to(device) for h in self.hidden],
                           [{k: move(v) for k, v in kw.items()} for kw in self.kwargs])


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
    """Outputs of `block` for every cached batch (tuple outputs reduced to hidden states)."""
    outs = []
    with torch.no_grad():
        for h, kw in zip(inputs.hidden, inputs.kwargs, strict=True):
            out = block(h, **kw)
            outs.append(out[0] if isinstance(out, tuple) else out)
    return outs
