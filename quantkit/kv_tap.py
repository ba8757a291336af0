"""The key/value states an attention layer hands to its KV cache, reached where the cache is.

transformers' attention modules call `past_key_values.update(key, value, layer_idx)` with the
keys after k-norm and rotary and the values as v_proj gives them: exactly what an engine
stores in its KV cache. A forward pre-hook swaps the module's `past_key_values` for a stand-in
whose `update` runs `fn(key, value)` first (observe or round), then the real cache if there is
one. llm-compressor 0.14 (compressed-tensors' `QuantizedKVCache`) reaches them the same way.
Used by the calibration pipeline (observe) and by quantkit's loader (round to FP8); neither
methods/ nor formats/ own it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

__all__ = ["tap_kv", "KVFn"]

KVFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class _CacheStandIn:
    """What the attention module sees as its cache: `fn`, then the real cache (if any)."""

    def __init__(self, fn: KVFn, cache: Any | None):
        self._fn = fn
        self._cache = cache

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        key_states, value_states = self._fn(key_states, value_states)
        if self._cache is not None:
            return self._cache.update(key_states, value_states, *args, **kwargs)
        return key_states, value_states

    def __getattr__(self, name: str):  # anything else a model reads from its cache
        cache = self.__dict__.get("_cache")
        if cache is None:
            raise AttributeError(name)
        return getattr(cache, name)


def _cache_kwarg(module: torch.nn.Module) -> str:
    params = inspect.signature(module.forward).parameters
    return "past_key_values" if "past_key_values" in params else "past_key_value"


def tap_kv(attention: torch.nn.Module, fn: KVFn) -> RemovableHandle:
    """Run `fn(key, value)` on every key/value `attention` writes to its cache; remove the
    returned handle to stop."""
    name = _cache_kwarg(attention)

    def pre_hook(_module, args, kwargs):
        kwargs[name] = _CacheStandIn(fn, kwargs.get(name))
        return args, kwargs

    return attention.register_forward_pre_hook(pre_hook, with_kwargs=True)
