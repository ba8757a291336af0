"""Observe one block's KV-cache entries on its calibration inputs (for `--kv-cache fp8`).

Runs after the block's Linears hold their quantized weights, so the keys and values are
those the engine will cache for this artifact; each batch stops as soon as the attention
module has run (the MLP cannot change them).
"""

from __future__ import annotations

import torch

from quantkit.kv_tap import tap_kv
from quantkit.pipeline.capture import BlockInputs

__all__ = ["kv_absmax"]


class _AttentionDone(Exception):
    """Ends a block forward after attention (private: only kv_absmax catches it)."""


def kv_absmax(block: torch.nn.Module, attention: str, inputs: BlockInputs) -> tuple[float, float]:
    """(max |key|, max |value|) over every calibration token, head and channel of `block`'s
    attention, keys taken after k-norm and rotary (what the cache stores)."""
    attn = block.get_submodule(attention)
    amax = [0.0, 0.0]

    def observe(key: torch.Tensor, value: torch.Tensor):
        amax[0] = max(amax[0], float(key.detach().abs().amax()))
        amax[1] = max(amax[1], float(value.detach().abs().amax()))
        return key, value

    def stop(_module, _args, _output):
        raise _AttentionDone

    handles = [tap_kv(attn, observe), attn.register_forward_hook(stop)]
    try:
        with torch.no_grad():
            for h, kw in inputs.batches():
                try:
                    block(h, **kw)
                except _AttentionDone:
                    pass
    finally:
        for handle in handles:
            handle.remove()
    return amax[0], amax[1]
