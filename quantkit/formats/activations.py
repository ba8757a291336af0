"""Linear inputs rounded the way the engine rounds them, for W8A8 artifacts evaluated on CPU.

quantkit's loader dequantizes the stored weights; an engine running W8A8 also quantizes every
quantized Linear's INPUT (FP8 E4M3 or int8) before the GEMM. Forward pre-hooks installed here
do the same rounding, so `quantkit eval` measures W8A8 and not W8A16. The FP8 rounding lives
in `quantkit.formats.fp8`; the int8 one is below, as vLLM's oneDNN CPU path quantizes inputs
(its C++ `dynamic_scaled_int8_quant_impl` / `static_scaled_int8_quant_impl`, symmetric):
dynamic scale = max|x| of the token / 127; q = round-to-nearest-even of x * (1 / scale),
clamped to [-128, 127]; static: the stored per-tensor scale.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ["quantized_linear_inputs", "install_input_quant", "fake_quant_int8_input"]

INT8_MIN, INT8_MAX = -128.0, 127.0


def quantized_linear_inputs(path: Path, weight_dtype: str) -> tuple[set[str], dict[str, torch.Tensor]]:
    """(Linears whose `.weight` is stored as `weight_dtype` (safetensors name: "F8_E4M3", "I8"),
    their `.input_scale` tensors where stored), read from the shards' headers."""
    from safetensors import safe_open

    from quantkit.readers import safetensors_files

    names, scales = set(), {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key.endswith(".weight") and f.get_slice(key).get_dtype() == weight_dtype:
                    names.add(key[: -len(".weight")])
                elif key.endswith(".input_scale"):
                    scales[key[: -len(".input_scale")]] = f.get_tensor(key)
    return names, scales


def install_input_quant(model: torch.nn.Module, plan: dict[str, tuple],
                        fake_quant: Callable) -> int:
    """Forward pre-hooks on the named Linears: plan[name] = (mode, group, scale), passed to
    `fake_quant(x, mode, group, scale)`; returns how many were hooked."""
    mods = dict(model.named_modules())
    module_name = _module_names(model)
    for name, (mode, group, scale) in plan.items():
        def hook(_m, args, mode=mode, group=group, scale=scale):
            return (fake_quant(args[0], mode, group, scale), *args[1:])
        mods[module_name(name)].register_forward_pre_hook(hook)
    return len(plan)


def _module_names(model: torch.nn.Module) -> Callable[[str], str]:
    """Artifact tensor name -> the model's module name (they differ where the checkpoint
    renames modules: Mixtral's block_sparse_moe is transformers 5's mlp)."""
    from quantkit.arch import spec_for_config
    from quantkit.errors import UnsupportedArchitecture

    try:
        return spec_for_config(model.config).module_name
    except (UnsupportedArchitecture, AttributeError):
        return lambda name: name


def fake_quant_int8_input(x: torch.Tensor, mode: str, group: int = 0,
                          scale: torch.Tensor | None = None) -> torch.Tensor:
    """x through symmetric int8 as vLLM's CPU kernels quantize a Linear input: "token"
    (dynamic, one scale per token) or "static" (the stored per-tensor scale); "none": x."""
    if mode == "none":
        return x
    xf = x.float()
    if mode == "static":
        s = scale.float().reshape(())
    elif mode == "token":  # max|x| without an |x| temporary
        s = torch.linalg.vector_norm(xf, float("inf"), dim=-1, keepdim=True) / INT8_MAX
    else:
        raise ValueError(f"int8 input mode {mode!r}: vLLM quantizes int8 inputs per token or "
                         "per tensor (static)")
    s = s.clamp_min(torch.finfo(torch.float32).tiny)  # an all-zero token stays zero
    inv = (1.0 / s.double()).float()  # the kernel multiplies by a float reciprocal
    q = xf * inv  # one full-size temporary, rounded, clamped and rescaled in place
    return q.round_().clamp_(INT8_MIN, INT8_MAX).mul_(s).to(x.dtype)
