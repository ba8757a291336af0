"""FP8 KV-cache scales on disk, as each engine's loader reads them, and their rounding at eval.

One scale per attention layer for keys and one for values (x_cached = fp8_e4m3(x / scale)):
  compressed-tensors (vLLM; the layout llm-compressor 0.14 writes)
    {attn}.k_scale, {attn}.v_scale     model dtype [1]
    quantization_config.kv_cache_scheme = QuantizationArgs(num_bits 8, type float,
                                          strategy tensor, symmetric, static; observer null)
  vLLM native fp8 (`quant_method: fp8`, whose Fp8KVCacheMethod loads them; no config key)
    {attn}.k_scale, {attn}.v_scale     float32 []
  ModelOpt (TensorRT-LLM; nvidia-modelopt 0.47's export_hf_checkpoint)
    {attn}.k_proj.k_scale, {attn}.v_proj.v_scale   float32 []
    hf_quant_config.json quantization.kv_cache_quant_algo = "FP8"; config.json
    quantization_config.kv_cache_scheme = {"dynamic": false, "num_bits": 8, "type": "float"}
vLLM 0.32 maps every one of these names onto `{attn}.attn.k_scale` / `.v_scale`
(model_loader/weight_utils.py: maybe_remap_kv_scale_name). GPTQ / AutoAWQ configs give
attention layers no KV-cache method in vLLM and GGUF has no such tensors: those formats are
refused (quantkit.pipeline.quantize.check_kv_cache).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["declares_fp8_kv_cache", "kv_scale_tensors", "add_kv_cache_config", "is_kv_scale",
           "read_kv_scales", "fake_quant_kv", "prepare_kv_cache", "ct_kv_cache_scheme"]

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
_MODELOPT_KV_SCHEME = {"dynamic": False, "num_bits": 8, "type": "float"}


def ct_kv_cache_scheme() -> dict:
    """compressed-tensors' kv_cache_scheme for per-tensor static FP8, from the library's own
    QuantizationArgs (observer null, as llm-compressor 0.14 saves it)."""
    from compressed_tensors.quantization import QuantizationArgs

    args = QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False,
                            symmetric=True).model_dump()
    args["observer"] = None
    return args


def kv_scale_tensors(format_name: str, scales: dict[str, tuple[float, float]],
                     dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors that carry `scales` ({attention module: (k_scale, v_scale)}) in `format_name`."""
    out = {}
    for attn, (k, v) in scales.items():
        if format_name == "compressed-tensors":
            out[f"{attn}.k_scale"] = torch.tensor([k], dtype=dtype)
            out[f"{attn}.v_scale"] = torch.tensor([v], dtype=dtype)
        elif format_name == "fp8":
            out[f"{attn}.k_scale"] = torch.tensor(k, dtype=torch.float32)
            out[f"{attn}.v_scale"] = torch.tensor(v, dtype=torch.float32)
        elif format_name == "modelopt":
            out[f"{attn}.k_proj.k_scale"] = torch.tensor(k, dtype=torch.float32)
            out[f"{attn}.v_proj.v_scale"] = torch.tensor(v, dtype=torch.float32)
        else:
            raise ValueError(f"format {format_name} carries no KV-cache scales")
    return out


def _insert_after(d: dict, after: str, key: str, value) -> dict:
    """`d` with `key` placed right after `after` (the reference writers' key order)."""
    out = {}
    for k, v in d.items():
        if k != key:
            out[k] = v
        if k == after:
            out[key] = value
    if key not in out:
        out[key] = value
    return out


def add_kv_cache_config(out_dir: Path, format_name: str) -> None:
    """Declare the FP8 KV cache in the config files `format_name`'s loaders read."""
    out_dir = Path(out_dir)
    cfg_file = out_dir / "config.json"
    cfg = json.loads(cfg_file.read_text())
    qcfg = cfg.get("quantization_config") or {}
    if format_name == "compressed-tensors":
        qcfg = _insert_after(qcfg, "ignore", "kv_cache_scheme", ct_kv_cache_scheme())
    elif format_name == "modelopt":
        hf_file = out_dir / "hf_quant_config.json"
        hf = json.loads(hf_file.read_text())
        hf["quantization"] = _insert_after(hf["quantization"], "quant_algo",
                                           "kv_cache_quant_algo", "FP8")
        hf_file.write_text(json.dumps(hf, indent=4))
        qcfg = _insert_after(qcfg, "quant_algo", "kv_cache_scheme", dict(_MODELOPT_KV_SCHEME))
    elif format_name != "fp8":  # vLLM's Fp8Config always loads k/v scales: nothing to declare
        raise ValueError(f"format {format_name} carries no KV-cache scales")
    cfg["quantization_config"] = qcfg
    cfg_file.write_text(json.dumps(cfg, indent=2))


def declares_fp8_kv_cache(path: Path) -> bool:
    """Whether an artifact directory declares FP8 KV-cache scales (any of the three layouts)."""
    path = Path(path)
    if not path.is_dir() or not (path / "config.json").is_file():
        return False
    from quantkit.readers import read_config_json

    meta = path / "quantkit.json"
    if meta.is_file() and (json.loads(meta.read_text()).get("kv_cache") or {}):
        return True
    if (read_config_json(path).get("quantization_config") or {}).get("kv_cache_scheme"):
        return True
    hf = path / "hf_quant_config.json"
    return hf.is_file() and json.loads(hf.read_text()).get("quantization", {}).get(
        "kv_cache_quant_algo") == "FP8"


def is_kv_scale(name: str) -> bool:
    return name.endswith((".k_scale", ".v_scale"))


def _attention_of(name: str) -> tuple[str, str]:
    """('model.layers.0.self_attn', 'k') from any of the three layouts' tensor names."""
    base, which = name[: -len("_scale")].rsplit(".", 1)
    if base.endswith((".k_proj", ".v_proj")):  # ModelOpt
        base = base.rsplit(".", 1)[0]
    return base, which


def read_kv_scales(path: Path) -> dict[str, tuple[float, float]]:
    """{attention module: (k_scale, v_scale)} stored in an artifact ({} without any)."""
    from safetensors import safe_open

    from quantkit.readers import safetensors_files

    found: dict[str, dict[str, float]] = {}
    for file in safetensors_files(Path(path)):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if is_kv_scale(key):
                    attn, which = _attention_of(key)
                    found.setdefault(attn, {})[which] = float(f.get_tensor(key).float().reshape(-1)[0])
    return {a: (s["k"], s["v"]) for a, s in found.items() if "k" in s and "v" in s}


def fake_quant_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x as the engine reads it back from an FP8 E4M3 cache: x / scale rounded to E4M3
    (nearest, saturated at +-448), times scale."""
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale
    return q.to(x.dtype)


def prepare_kv_cache(model: torch.nn.Module, path: Path) -> int:
    """Round every attention layer's keys and values through FP8 with the artifact's scales,
    as they enter the cache (quantkit.kv_tap); returns how many layers were hooked."""
    from quantkit.kv_tap import tap_kv

    scales = read_kv_scales(path)
    mods = dict(model.named_modules())
    for attn, (k, v) in scales.items():
        if attn not in mods:
            from quantkit.errors import ModelLoadError

            raise ModelLoadError(f"{path}: KV-cache scales for {attn}, which the model lacks.")
        tap_kv(mods[attn], lambda key, value, k=k, v=v: (fake_quant_kv(key, k),
                                                          fake_quant_kv(value, v)))
    return len(scales)
