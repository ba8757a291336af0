"""Runs inside vLLM's own virtualenv (it imports nothing from quantkit): which CPU kernels exist.

Usage: python vllm_probe_worker.py RESPONSE.json
Loads vLLM's compiled ops the way vLLM itself does (`current_platform.import_kernels()` picks
_C, _C_AVX512 or _C_AVX2 from the CPU), then reports, per op that vLLM's CPU quantization
kernels call, its schema or null when the op is missing. A schema with no arguments
("() -> ()") is a placeholder vLLM registers where the build has no kernel: calling it fails.
Also asks vLLM's own kernel classes whether they are supported here, and runs one tiny FP8
matmul through torch._scaled_mm (the path of vLLM's channel-wise FP8 kernel on CPU).
"""

import json
import os
import sys

# this folder holds quantkit/engines/vllm.py; keep it from shadowing the real vllm package
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

# every torch.ops._C op the CPU quantization kernels of vLLM 0.32 call
# (vllm/model_executor/kernels/linear/{mixed_precision,scaled_mm}/cpu.py, vllm/_custom_ops.py)
OPS = ["cpu_gemm_wna16",  # CPUWNA16LinearKernel: int4 weights (GPTQ, AWQ, compressed-tensors)
       "static_scaled_fp8_quant", "dynamic_scaled_fp8_quant",
       "dynamic_per_token_scaled_fp8_quant",  # ops.scaled_fp8_quant (FP8 per-tensor weights)
       "fp8_scaled_mm_cpu", "cpu_has_amx_fp8",  # the AMX FP8 kernels
       "create_onednn_scaled_mm_handler", "onednn_scaled_mm",  # CPUInt8ScaledMMLinearKernel
       "static_scaled_int8_quant", "dynamic_scaled_int8_quant",
       "int8_scaled_mm_with_quant",  # its AMX variant
       "int4_scaled_mm_cpu"]  # int4 weights x int8 activations: vLLM's int4 path on AMX CPUs


def _schema(ns, name: str):
    if not hasattr(ns, name):
        return None
    try:
        return str(getattr(ns, name).default._schema)
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        return f"? {type(exc).__name__}: {exc}"


def _kernel_supported(module: str, cls: str):
    """[supported, reason] from one of vLLM's kernel classes, or None if it is not there."""
    try:
        import importlib

        ok, why = getattr(importlib.import_module(module), cls).is_supported()
        return [bool(ok), why]
    except Exception as exc:  # noqa: BLE001
        return [False, f"{type(exc).__name__}: {exc}"]


def _fp8_scaled_mm(torch) -> str | None:
    """None when a tiny FP8 x FP8 -> float32 torch._scaled_mm runs on the CPU, else the error."""
    try:
        a = torch.randn(16, 32).to(torch.float8_e4m3fn)
        b = torch.randn(16, 32).to(torch.float8_e4m3fn).t()
        one = torch.ones(1, dtype=torch.float32)
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32)
        return None
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"


def _fp8_vs_bf16_time(torch) -> float | None:
    """How many times slower one FP8 torch._scaled_mm is than the same bf16 matmul here (the
    median of 3): on CPUs where torch has no vectorized FP8 GEMM it runs a scalar reference
    path (measured ~400x on an AMX Xeon), which vLLM then uses for every FP8 Linear."""
    import time

    try:
        a = torch.randn(128, 512).to(torch.float8_e4m3fn)
        b = torch.randn(256, 512).to(torch.float8_e4m3fn).t()
        x, w = a.to(torch.bfloat16), b.to(torch.bfloat16)
        one = torch.ones(1, dtype=torch.float32)

        def median(fn) -> float:
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return sorted(times)[1]

        fp8 = median(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one,
                                              out_dtype=torch.bfloat16))
        return fp8 / max(median(lambda: x @ w), 1e-6)
    except Exception:  # noqa: BLE001 - no FP8 path at all: reported by _fp8_scaled_mm
        return None


def main(resp_path: str) -> None:
    import torch
    import vllm
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    ns = torch.ops._C
    loaded = sorted({os.path.basename(line.split()[-1]) for line in open("/proc/self/maps")
                     if "/vllm/_C" in line})  # which build vLLM picked for this CPU
    out = {"vllm_version": vllm.__version__, "torch_version": torch.__version__,
           "platform": type(current_platform).__name__, "kernel_libraries": loaded,
           "ops": {name: _schema(ns, name) for name in OPS},
           "fp8_scaled_mm_error": _fp8_scaled_mm(torch),
           "fp8_vs_bf16_time": _fp8_vs_bf16_time(torch)}
    # vLLM's CPUWNA16 kernel runs int4 checkpoints as W4A8 (activations rounded to int8 per
    # token) where torch reports AMX and VLLM_CPU_INT4_W4A8 is on (its default)
    try:
        out["amx_tile"] = bool(torch.cpu._is_amx_tile_supported())
    except Exception:  # noqa: BLE001 - an older torch: no AMX path either
        out["amx_tile"] = False
    # whether vLLM's torch runs bf16 GEMMs natively here (oneDNN with AMX or AVX512-BF16);
    # elsewhere it emulates them, slower than float32 (quantkit then runs vLLM in float32)
    try:
        out["bf16_native"] = bool(torch.backends.mkldnn.is_available() and (
            out["amx_tile"] or torch.cpu._is_avx512_bf16_supported()))
    except Exception:  # noqa: BLE001 - an older torch: treat bf16 as emulated
        out["bf16_native"] = False
    try:
        from vllm.model_executor.kernels.linear.mixed_precision import cpu as wna16

        out["wna16_weight_types"] = [str(t) for t in wna16._CPUWNA16_SUPPORTED_QUANT_TYPES]
    except Exception as exc:  # noqa: BLE001
        out["wna16_weight_types"] = f"? {type(exc).__name__}: {exc}"
    # FP8 KV cache: vLLM's CPU attention backend picks its ISA per layer and refuses an FP8
    # cache there (cpu_attn.py: _get_attn_isa); asked with a head size it takes (64)
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        _get_attn_isa(torch.bfloat16, 32, 64, "fp8")
        out["fp8_kv_cache_error"] = None
    except Exception as exc:  # noqa: BLE001 - vLLM's own refusal is the answer
        out["fp8_kv_cache_error"] = f"{type(exc).__name__}: {exc}"
    # vLLM's int4 fused-MoE CPU experts (CPUExpertsInt4): whether they run here, and which of
    # vLLM's routing methods they take (the others: "No WNA16 MoE backend supports ...")
    try:
        from vllm.model_executor.layers.fused_moe.config import RoutingMethodType
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsInt4

        out["moe_int4_device"] = bool(CPUExpertsInt4._supports_current_device())
        out["moe_int4_routing"] = [m.name for m in RoutingMethodType
                                   if CPUExpertsInt4._supports_routing_method(m, None, None)]
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation

        out["moe_int4_activations"] = [a.value for a in MoEActivation
                                       if CPUExpertsInt4._supports_activation(a)]
        # Llama 4 multiplies the routing weight into the experts' input: CPUExpertsInt4.apply
        # raises for that (a check inside apply, not a supports_* method: read from its source)
        import inspect
        import re

        said = "".join(re.findall(r'"([^"]*)"', inspect.getsource(CPUExpertsInt4.apply)))
        out["moe_int4_weight_on_input"] = "does not support apply_router_weight_on_input" \
            not in said  # its message's string literals, joined
    except Exception as exc:  # noqa: BLE001
        out["moe_int4_routing"] = f"? {type(exc).__name__}: {exc}"
    scaled = "vllm.model_executor.kernels.linear.scaled_mm.cpu"
    out["kernels"] = {name: _kernel_supported(scaled, name) for name in (
        "CPUInt8ScaledMMLinearKernel", "CPUFp8PerTensorScaledMMLinearKernel",
        "CPUFp8BlockScaledMMKernel", "CPUFP8W8A8ScaledMMLinearKernel")}
    # FP4 Linears: vLLM's own kernel choice (what a load calls per layer), by scheme
    try:
        from vllm.model_executor.kernels.linear import (
            init_mxfp4_linear_kernel,
            init_nvfp4_linear_kernel,
        )

        choices = {"nvfp4_w4a16": lambda: init_nvfp4_linear_kernel(use_a16=True),
                   "nvfp4_w4a4": init_nvfp4_linear_kernel,
                   "mxfp4_w4a16": init_mxfp4_linear_kernel}
    except Exception as exc:  # noqa: BLE001
        choices = {}
        out["kernels"]["fp4"] = [False, f"{type(exc).__name__}: {exc}"]
    for key, choose in choices.items():
        try:
            out["kernels"][f"choice:{key}"] = [True, type(choose()).__name__]
        except Exception as exc:  # noqa: BLE001 - vLLM's own refusal is the answer
            out["kernels"][f"choice:{key}"] = [False, " ".join(f"{type(exc).__name__}: {exc}".split())]
    json.dump(out, open(resp_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1])
