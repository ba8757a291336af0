"""ModelOpt FP8 checkpoints for TensorRT-LLM: `hf_quant_config.json` + the inline copy in
config.json, laid out exactly as nvidia-modelopt 0.47's `export_hf_checkpoint` writes them.

  hf_quant_config.json  {"producer": {...}, "quantization": {"quant_algo": ALGO,
                          "kv_cache_quant_algo": null, "exclude_modules": [...]}}
  config.json           + "quantization_config": the compressed-tensors-style mirror ModelOpt's
                          `convert_hf_quant_config_format` writes (config_groups for FP8 only)
Per quantized Linear (N out, K in):
  ALGO FP8                        weight fp8 [N, K], weight_scale f32 [], input_scale f32 []
                                  (input_scale absent = dynamic per-tensor inputs)
  ALGO FP8_PER_CHANNEL_PER_TOKEN  weight fp8 [N, K], weight_scale f32 [N]; inputs dynamic/token
  ALGO FP8_BLOCK_SCALES           weight fp8 [N, K], weight_scale f32 [ceil(N/128), ceil(K/128)];
                                  inputs dynamic per 1x128 group (ModelOpt's own block export,
                                  "fp8_pb_wo", fails on CPU; TensorRT-LLM canonicalizes that
                                  name to FP8_BLOCK_SCALES, which every 1.x release parses)
exclude_modules lists every unquantized Linear/Embedding (sorted, as ModelOpt does) and, for a
fused group left in full precision, also TensorRT-LLM's fused name (qkv_proj, gate_up_proj):
its exclusion match runs on its own module names.
The W4A16_AWQ layout lives in quantkit/formats/modelopt.py (the AWQ backend); `ModelOptDispatch`
serves `--format modelopt` for both, by scheme kind.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import quantkit
from quantkit.errors import ModelLoadError, SchemeMismatch
from quantkit.formats.common import (
    FormatRecord,
    FormatWriter,
    load_tensors,
    save_tensors,
    write_config,
)
from quantkit.formats.fp4 import MODELOPT_FP4_ALGOS, ModelOptNVFP4Writer, read_modelopt_nvfp4
from quantkit.formats.fp8 import FP8Layout, KindDispatch, dequantize_fp8, prepare_fp8_model
from quantkit.formats.modelopt import ModelOptAWQWriter, read_modelopt_awq
from quantkit.formats.modelopt_config import (
    QUANT_CONFIG_FILE,
    excluded_modules,
    read_hf_quant_config,
)
from quantkit.types import QuantResult, QuantScheme

__all__ = ["ModelOptFP8Writer", "ModelOptDispatch", "read_modelopt", "quant_algo_for",
           "inline_quantization_config"]

FP8_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_BLOCK_SCALES")


def quant_algo_for(weights: str, activations: str, block: int = 128) -> str:
    """The ModelOpt quant_algo of an FP8 layout, or a precise refusal."""
    if weights == "tensor":
        return "FP8"
    if weights == "channel":
        if activations == "static":
            raise SchemeMismatch(
                "ModelOpt FP8_PER_CHANNEL_PER_TOKEN quantizes inputs per token at run time; a "
                "static input scale has no place in it.",
                "Use --scheme dynamic (channel weights, per-token inputs) or --scheme static "
                "(per-tensor weights and inputs, quant_algo FP8).")
        return "FP8_PER_CHANNEL_PER_TOKEN"
    if block != 128:
        raise SchemeMismatch(f"TensorRT-LLM's FP8_BLOCK_SCALES takes 128x128 blocks, not {block}.",
                             "Use block_size 128.")
    return "FP8_BLOCK_SCALES"


def inline_quantization_config(hf_quant: dict) -> dict:
    """config.json's quantization_config, as ModelOpt's convert_hf_quant_config_format builds it."""
    q = hf_quant["quantization"]
    out: dict = {}
    if q["quant_algo"] == "FP8":
        out["config_groups"] = {"group_0": {
            "input_activations": {"dynamic": False, "num_bits": 8, "type": "float"},
            "weights": {"dynamic": False, "num_bits": 8, "type": "float"},
            "targets": ["Linear"]}}
    out["ignore"] = q.get("exclude_modules") or []
    out["quant_algo"] = q["quant_algo"]
    out["producer"] = hf_quant["producer"]
    out["quant_method"] = "modelopt"
    return out


class ModelOptFP8Writer(FormatWriter):
    name = "modelopt"
    engines: tuple[str, ...] = ("trtllm",)

    def check(self, scheme: QuantScheme, shapes: dict[str, tuple[int, int]]) -> list[str]:
        if scheme.kind != "fp8":
            return ["the ModelOpt FP8 writer takes FP8 schemes"]
        if scheme.group_size not in (0, -1, 128):
            return [f"TensorRT-LLM's FP8_BLOCK_SCALES takes 128x128 blocks, not {scheme.group_size}"]
        return []

    def write(self, out_dir: Path, *, config: dict, dense: dict[str, torch.Tensor],
              results: dict[str, QuantResult], ignore: list[str], dtype: torch.dtype) -> None:
        lay = FP8Layout(results)
        algo = quant_algo_for(lay.weights, lay.activations, lay.block)
        tensors = dict(dense)
        for name, r in lay.full.items():
            tensors[f"{name}.weight"] = r.codes.to(dtype)
            if r.bias is not None:
                tensors[f"{name}.bias"] = r.bias.to(dtype)
        for name, r in lay.quantized.items():
            tensors[f"{name}.weight"] = r.codes
            scale = r.scale.float()
            tensors[f"{name}.weight_scale"] = (scale.reshape(()) if lay.weights == "tensor" else
                                               scale.reshape(-1) if lay.weights == "channel" else
                                               scale).contiguous()
            if lay.static:
                tensors[f"{name}.input_scale"] = r.extra["input_scale"].float().reshape(())
            if r.bias is not None:
                tensors[f"{name}.bias"] = r.bias.to(dtype)
        quant = {"quant_algo": algo, "kv_cache_quant_algo": None}
        if algo == "FP8_BLOCK_SCALES":
            quant["group_size"] = lay.block
        quant["exclude_modules"] = excluded_modules(list(ignore), dense, sorted(lay.full))
        hf_quant = {"producer": {"name": "quantkit", "version": quantkit.__version__},
                    "quantization": quant}
        save_tensors(out_dir, tensors)
        (out_dir / QUANT_CONFIG_FILE).write_text(json.dumps(hf_quant, indent=4))
        write_config(out_dir, {**config, "quantization_config": inline_quantization_config(hf_quant)})


def ModelOptDispatch() -> KindDispatch:  # noqa: N802 (a factory that reads like the class it builds)
    """`--format modelopt`: FP8 schemes here, NVFP4 / MXFP4 in quantkit/formats/fp4.py, integer
    (W4A16_AWQ) in quantkit/formats/modelopt.py."""
    return KindDispatch("modelopt", {"fp8": ModelOptFP8Writer, "nvfp4": ModelOptNVFP4Writer,
                                     "mxfp4": ModelOptNVFP4Writer}, ModelOptAWQWriter)


# --------------------------------------------------------------------------- reading ----

def read_modelopt(path: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Dense state dict of a ModelOpt checkpoint: FP8 here, W4A16_AWQ via formats/modelopt.py."""
    algo = read_hf_quant_config(path).get("quant_algo")
    if algo in MODELOPT_FP4_ALGOS:
        return read_modelopt_nvfp4(path, dtype)
    if algo not in FP8_ALGOS:
        return read_modelopt_awq(path, dtype)
    raw = load_tensors(path)
    out: dict[str, torch.Tensor] = {}
    for key, t in raw.items():
        if key.endswith((".weight_scale", ".weight_scale_inv", ".input_scale")):
            continue
        if key.endswith(".weight") and t.dtype == torch.float8_e4m3fn:
            base = key[: -len(".weight")]
            scale = raw.get(f"{base}.weight_scale", raw.get(f"{base}.weight_scale_inv"))
            if scale is None:
                raise ModelLoadError(f"FP8 weight {key} has no weight_scale.")
            out[key] = dequantize_fp8(t, scale, 128).to(dtype)
        else:
            out[key] = t.to(dtype) if t.is_floating_point() else t
    return out


def _prepare(model: torch.nn.Module, path: Path) -> None:
    from quantkit.formats.fp4 import MODELOPT_FP4_ALGOS, prepare_modelopt_nvfp4_model

    algo = read_hf_quant_config(path).get("quant_algo")
    if algo in MODELOPT_FP4_ALGOS:
        prepare_modelopt_nvfp4_model(model, path, algo)
    elif algo == "W4A8_AWQ":  # int4 weights, FP8 static inputs (x * pre_quant_scale)
        from quantkit.formats.modelopt import prepare_modelopt_w4a8_model

        prepare_modelopt_w4a8_model(model, path)
    else:
        prepare_fp8_model(model, path, "modelopt")


# TensorRT-LLM: FP8 here, NVFP4 in formats/fp4.py, W4A16_AWQ / W4A8_AWQ in formats/modelopt.py
RECORD = FormatRecord("modelopt", ModelOptDispatch, read=read_modelopt, prepare=_prepare,
                      kv_cache=True)
