"""hf_quant_config.json, the file ModelOpt writes and TensorRT-LLM reads, for every ModelOpt
layout quantkit writes (FP8 in modelopt_fp8.py, NVFP4 / MXFP4 in fp4.py, W4A16_AWQ in
modelopt.py).

Why a module of its own: the FP8 and FP4 modules both read and write it, and modelopt_fp8.py's
`--format modelopt` dispatch imports both of them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from quantkit.readers import read_config_json, read_json

__all__ = ["QUANT_CONFIG_FILE", "FUSED_TRTLLM_NAMES", "excluded_modules", "read_hf_quant_config",
           "modelopt_activation_plan"]

QUANT_CONFIG_FILE = "hf_quant_config.json"
# HF shard names -> the one Linear TensorRT-LLM builds for them (llama/mistral/qwen2/qwen3)
FUSED_TRTLLM_NAMES = {("q_proj", "k_proj", "v_proj"): "qkv_proj",
                      ("gate_proj", "up_proj"): "gate_up_proj"}


def excluded_modules(ignore: list[str], dense: dict[str, torch.Tensor], skipped: list[str]) -> list[str]:
    """Unquantized Linears/Embeddings (2-D `.weight`s left dense) + TRT-LLM fused names."""
    names = set(ignore) | set(skipped)
    names |= {k[: -len(".weight")] for k, t in dense.items() if k.endswith(".weight") and t.dim() == 2}
    for shards, fused in FUSED_TRTLLM_NAMES.items():
        for name in skipped:
            parent, _, leaf = name.rpartition(".")
            if leaf == shards[0] and all(f"{parent}.{s}" in skipped for s in shards):
                names.add(f"{parent}.{fused}")
    return sorted(names)


def read_hf_quant_config(path: Path) -> dict:
    """The `quantization` dict of hf_quant_config.json (legacy nested shape) or of the flat shape."""
    f = Path(path) / QUANT_CONFIG_FILE
    if f.is_file():
        raw = read_json(f)
    else:
        raw = read_config_json(path).get("quantization_config") or {}
    if "quantization" in raw:
        return raw["quantization"]
    return {"quant_algo": raw.get("quant_algo"), "exclude_modules": raw.get("ignore") or [],
            "group_size": raw.get("group_size"), "kv_cache_quant_algo": None}


def modelopt_activation_plan(path: Path, has_input_scales: bool) -> tuple[str, int]:
    """(mode, group) of the inputs TensorRT-LLM rounds through FP8 for the checkpoint's
    quant_algo (fake_quant_input's modes; "none": the inputs stay as they are)."""
    algo = read_hf_quant_config(path).get("quant_algo")
    if algo == "FP8":
        return ("static", 0) if has_input_scales else ("tensor", 0)
    if algo == "FP8_PER_CHANNEL_PER_TOKEN":
        return "token", 0
    if algo == "FP8_BLOCK_SCALES":
        return "group", 128
    return "none", 0
