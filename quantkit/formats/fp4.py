"""compressed-tensors FP4 formats, as llm-compressor writes them and vLLM's compressed-tensors
loader reads them (CompressedTensorsW4A4Fp4 / W4A16Fp4, W4A16Mxfp4).

`nvfp4-pack-quantized` (presets NVFP4A16 and NVFP4), per quantized Linear (N out, K in):
  weight_packed        uint8 [N, K/2]        two E2M1 codes per byte, the even column in the
                                             low nibble (compressed-tensors `pack_fp4_to_uint8`)
  weight_scale         float8_e4m3fn [N, K/16]
  weight_global_scale  float32 [1]           g = 448 * 6 / max|W| (dequant: q * scale / g)
  input_global_scale   float32 [1]           W4A4 only: 448 * 6 / max|x| over calibration
`mxfp4-pack-quantized` (preset MXFP4A16):
  weight_packed        uint8 [N, K/2]
  weight_scale         uint8 [N, K/32]       E8M0: scale = 2 ** (e - 127)
The quantization_config is built from compressed-tensors' own presets. Checked against
llm-compressor 0.14.0.1 (compressed-tensors 0.19) on a tiny Llama: every tensor name, dtype,
shape and value identical for NVFP4A16 and MXFP4A16; NVFP4 W4A4 identical but for an
input_global_scale one bf16 step off where calibration arithmetic differs (float32 vs bf16).
The config differs only where the library version does: `version`, and empty
`sparsity_config` / `transform_config` ({} there, null from compressed-tensors 0.17 here).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from safetensors import safe_open

import quantkit
from quantkit.e2m1 import E2M1_VALUES, dequantize_fp4, fake_quant_nvfp4
from quantkit.errors import ModelLoadError
from quantkit.formats.activations import install_input_quant, quantized_linear_inputs
from quantkit.formats.common import (
    FormatWriter,
    load_tensors,
    read_config,
    save_tensors,
    write_config,
)
from quantkit.formats.fp8 import fake_quant_input
from quantkit.formats.modelopt_config import QUANT_CONFIG_FILE, excluded_modules
from quantkit.readers import safetensors_files
from quantkit.types import QuantResult, QuantScheme

__all__ = ["FP4CompressedTensorsWriter", "fp4_quantization_config", "read_fp4_pack_quantized",
           "prepare_nvfp4_model", "pack_e2m1", "FP4_FORMATS", "preset_for", "ModelOptNVFP4Writer",
           "read_modelopt_nvfp4", "prepare_modelopt_nvfp4_model", "NVFP4_ALGO",
           "NVFP4A16_ALGO", "MXFP4_ALGO", "MODELOPT_FP4_ALGOS", "modelopt_fp4_algo"]

FP4_FORMATS = {"nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized"}
_PACK_ROWS = 256  # the library's packer holds 8 floats per value: pack a few rows at a time


def preset_for(scheme: QuantScheme) -> str:
    """The compressed-tensors preset a scheme is: NVFP4A16, NVFP4 (W4A4) or MXFP4A16."""
    if scheme.kind == "mxfp4":
        return "MXFP4A16"
    return "NVFP4" if scheme.activations else "NVFP4A16"


def fp4_quantization_config(scheme: QuantScheme, ignore: list[str]) -> dict:
    """quantization_config of an FP4 artifact: the library's preset under target Linear."""
    # compressed-tensors imported on use: a slow import that most commands never need
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme

    preset = preset_name_to_scheme(preset_for(scheme), ["Linear"]).model_dump()
    preset["format"] = FP4_FORMATS[scheme.kind]  # llm-compressor 0.14 names it per group too
    cfg = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(**preset)},
        ignore=ignore, format=FP4_FORMATS[scheme.kind], quantization_status="compressed")
    out = cfg.to_dict()
    out["quant_method"] = "compressed-tensors"
    return out


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] from E2M1 codes [N, K], through compressed-tensors' own packer (a sign-bit
    zero is packed as -0.0, keeping its code)."""
    # compressed-tensors imported on use: a slow import that most commands never need
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8

    values = torch.where(codes >= 8, -E2M1_VALUES[(codes & 7).long()],
                         E2M1_VALUES[(codes & 7).long()])
    return torch.cat([pack_fp4_to_uint8(values[i:i + _PACK_ROWS])
                      for i in range(0, values.shape[0], _PACK_ROWS)])


class FP4CompressedTensorsWriter(FormatWriter):
    name = "compressed-tensors"
    engines = ("vllm",)  # Blackwell GPUs (NVFP4 W4A4) / any vLLM GPU (weight-only via Marlin)

    def check(self, scheme: QuantScheme, shapes: dict[str, tuple[int, int]]) -> list[str]:
        if scheme.kind not in FP4_FORMATS:
            return ["the FP4 writer takes NVFP4 / MXFP4 schemes"]
        if scheme.kind == "mxfp4" and scheme.activations:
            return ["compressed-tensors MXFP4 here is weight-only (MXFP4A16)"]
        bad = sorted(n for n, (_, k) in shapes.items() if k % scheme.group_size)
        if bad:
            return [f"{len(bad)} Linear(s) have an input width that is not a multiple of "
                    f"{scheme.group_size} ({bad[0]} ...)"]
        return []

    def write(self, out_dir: Path, *, config: dict, dense: dict[str, torch.Tensor],
              results: dict[str, QuantResult], ignore: list[str], dtype: torch.dtype) -> None:
        schemes = {r.scheme for r in results.values()}
        if len(schemes) != 1:
            raise ValueError(f"one FP4 scheme per artifact, got {sorted(map(str, schemes))}")
        scheme = schemes.pop()
        tensors = dict(dense)
        for name, r in results.items():
            tensors[f"{name}.weight_packed"] = pack_e2m1(r.codes)
            tensors[f"{name}.weight_scale"] = r.scale.contiguous()
            if scheme.kind == "nvfp4":
                tensors[f"{name}.weight_global_scale"] = r.extra["global_scale"].float().reshape(1)
            if scheme.activations:
                tensors[f"{name}.input_global_scale"] = (
                    r.extra["input_global_scale"].float().reshape(1))
            if r.bias is not None:
                tensors[f"{name}.bias"] = r.bias.to(dtype)
        save_tensors(out_dir, tensors)
        write_config(out_dir, {**config,
                               "quantization_config": fp4_quantization_config(scheme, ignore)})


def read_fp4_pack_quantized(path: Path, dtype: torch.dtype = torch.float32
                            ) -> dict[str, torch.Tensor]:
    """A dense state dict (dequantized weights) of an nvfp4/mxfp4-pack-quantized artifact."""
    # compressed-tensors imported on use: a slow import that most commands never need
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    raw = load_tensors(path)
    out: dict[str, torch.Tensor] = {}
    skip = (".weight_scale", ".weight_global_scale", ".input_global_scale")
    for key, t in raw.items():
        if key.endswith(skip):
            continue
        if not key.endswith(".weight_packed"):
            out[key] = t.to(dtype) if t.is_floating_point() else t
            continue
        base = key[: -len(".weight_packed")]
        scale = raw.get(f"{base}.weight_scale")
        if scale is None:
            raise ModelLoadError(f"{path}: FP4 weight {key} has no weight_scale.",
                                 "The artifact is incomplete; quantize again.")
        n, half = t.shape
        values = unpack_fp4_from_uint8(t, n, half * 2, dtype=torch.float32)
        g = raw.get(f"{base}.weight_global_scale")
        if scale.dtype != torch.uint8 and g is None:
            raise ModelLoadError(f"{path}: NVFP4 weight {key} has no weight_global_scale.",
                                 "The artifact is incomplete; quantize again.")
        out[f"{base}.weight"] = dequantize_fp4(values, scale, g).to(dtype)
    return out


def prepare_nvfp4_model(model: torch.nn.Module, path: Path) -> int:
    """NVFP4 W4A4: each FP4 Linear also rounds its input through NVFP4 under the stored
    input_global_scale (per-16 E4M3 scales computed per call), as the engine does before its
    FP4 GEMM; returns how many Linears were hooked (0 for weight-only artifacts)."""
    qcfg = read_config(path)["quantization_config"]
    if not next(iter(qcfg["config_groups"].values())).get("input_activations"):
        return 0
    scales = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key.endswith(".input_global_scale"):
                    scales[key[: -len(".input_global_scale")]] = f.get_tensor(key)
    plan = {name: ("nvfp4", 16, s) for name, s in sorted(scales.items())}
    return install_input_quant(model, plan, lambda x, _mode, _group, s: fake_quant_nvfp4(x, s))


# ------------------------------------------------------------------ ModelOpt FP4 ----
# TensorRT-LLM's FP4 checkpoints as nvidia-modelopt 0.47's export_hf_checkpoint writes them
# (checked against it on CPU: tests/test_fp4.py), per quantized Linear:
#   weight          uint8 [N, K/2]        the same E2M1 nibbles as compressed-tensors
#   NVFP4 (quant_algo NVFP4 = W4A4, W4A16_NVFP4 = weights only):
#     weight_scale    float8_e4m3fn [N, K/16]
#     weight_scale_2  float32 []            1 / g (ModelOpt multiplies where compressed-tensors
#                                           divides: amax / (448 * 6))
#     input_scale     float32 []            NVFP4 only: 1 / input_global_scale
#   MXFP4:
#     weight_scale    uint8 [N, K/32]       E8M0 exponents, as compressed-tensors stores them
# hf_quant_config.json: quant_algo, group_size (16 / 32), exclude_modules; q/k/v and gate/up
# share weight_scale_2 and input_scale (TensorRT-LLM fuses them), as quantkit's results do.
# MXFP4: ModelOpt 0.47 writes quant_algo "mxfp4" (lower case) for MXFP4_DEFAULT_CFG and
# MXFP4_MLP_WEIGHT_ONLY_CFG alike; TensorRT-LLM's QuantAlgo has no such member (QuantAlgo("mxfp4")
# raises ValueError) and no dense weight-only MXFP4 Linear (W4A16_MXFP4 is MoE-only:
# linear.get_quant_method raises 'unsupported quant mode'). Its dense MXFP4 Linear is
# W4A8MXFP4FP8LinearMethod: the same two tensors, inputs cast to FP8 per tensor at run time
# (dynamic, no input_scale), which is what ModelOpt's W4A8_MXFP4_FP8_CFG exports. quantkit
# writes that quant_algo, W4A8_MXFP4_FP8, with ModelOpt's tensors byte for byte.

NVFP4_ALGO = "NVFP4"
NVFP4A16_ALGO = "W4A16_NVFP4"
MXFP4_ALGO = "W4A8_MXFP4_FP8"


def modelopt_fp4_algo(scheme: QuantScheme) -> str:
    """The ModelOpt quant_algo quantkit writes for an FP4 scheme."""
    if scheme.kind == "mxfp4":
        return MXFP4_ALGO
    return NVFP4_ALGO if scheme.activations else NVFP4A16_ALGO


class ModelOptNVFP4Writer(FormatWriter):
    """ModelOpt NVFP4 (W4A4), W4A16_NVFP4 and MXFP4 (W4A8_MXFP4_FP8) for TensorRT-LLM."""

    name = "modelopt"
    engines: tuple[str, ...] = ("trtllm",)

    def check(self, scheme: QuantScheme, shapes: dict[str, tuple[int, int]]) -> list[str]:
        if scheme.kind not in FP4_FORMATS:
            return ["the ModelOpt FP4 writer takes NVFP4 / MXFP4 schemes"]
        return FP4CompressedTensorsWriter().check(scheme, shapes)

    def write(self, out_dir: Path, *, config: dict, dense: dict[str, torch.Tensor],
              results: dict[str, QuantResult], ignore: list[str], dtype: torch.dtype) -> None:
        schemes = {r.scheme for r in results.values()}
        if len(schemes) != 1:
            raise ValueError(f"one FP4 scheme per artifact, got {sorted(map(str, schemes))}")
        scheme = schemes.pop()
        algo = modelopt_fp4_algo(scheme)
        if algo == MXFP4_ALGO:
            warnings.warn("ModelOpt MXFP4 is written as quant_algo W4A8_MXFP4_FP8: TensorRT-LLM's "
                          "only dense MXFP4 Linear casts the inputs to FP8 per tensor at run time "
                          "(quantkit eval emulates that); it has no weight-only MXFP4 Linear.",
                          stacklevel=2)
        tensors = dict(dense)
        for name, r in results.items():
            tensors[f"{name}.weight"] = pack_e2m1(r.codes)
            tensors[f"{name}.weight_scale"] = r.scale.contiguous()
            if scheme.kind == "nvfp4":
                tensors[f"{name}.weight_scale_2"] = (
                    1.0 / r.extra["global_scale"].double()).float().reshape(())
            if scheme.activations:
                tensors[f"{name}.input_scale"] = (
                    1.0 / r.extra["input_global_scale"].double()).float().reshape(())
            if r.bias is not None:
                tensors[f"{name}.bias"] = r.bias.to(dtype)
        quant = {"quant_algo": algo, "kv_cache_quant_algo": None, "group_size": scheme.group_size,
                 "exclude_modules": excluded_modules(list(ignore), dense, [])}
        hf_quant = {"producer": {"name": "quantkit", "version": quantkit.__version__},
                    "quantization": quant}
        inline: dict = {}
        if scheme.kind == "nvfp4":  # ModelOpt's inline mirror has config_groups for NVFP4 only
            fp4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
            group = {"input_activations": dict(fp4)} if scheme.activations else {}
            inline["config_groups"] = {"group_0": {**group, "weights": dict(fp4),
                                                   "targets": ["Linear"]}}
        inline.update({"ignore": quant["exclude_modules"], "quant_algo": algo,
                       "producer": hf_quant["producer"], "quant_method": "modelopt"})
        save_tensors(out_dir, tensors)
        (out_dir / QUANT_CONFIG_FILE).write_text(json.dumps(hf_quant, indent=4))
        write_config(out_dir, {**config, "quantization_config": inline})


# quant_algo values read as ModelOpt FP4 ("mxfp4": what ModelOpt 0.47 itself writes for MXFP4)
MODELOPT_FP4_ALGOS = (NVFP4_ALGO, NVFP4A16_ALGO, MXFP4_ALGO, "mxfp4")


def read_modelopt_nvfp4(path: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A dense state dict of a ModelOpt FP4 checkpoint (uint8 `.weight` + scales): NVFP4 /
    W4A16_NVFP4 (E4M3 weight_scale, weight_scale_2) or MXFP4 (uint8 E8M0 weight_scale)."""
    # compressed-tensors imported on use: a slow import that most commands never need
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    raw = load_tensors(path)
    out: dict[str, torch.Tensor] = {}
    for key, t in raw.items():
        if key.endswith((".weight_scale", ".weight_scale_2", ".input_scale")):
            continue
        base = key[: -len(".weight")]
        if key.endswith(".weight") and t.dtype == torch.uint8:
            scale, s2 = raw.get(f"{base}.weight_scale"), raw.get(f"{base}.weight_scale_2")
            mx = scale is not None and scale.dtype == torch.uint8
            if scale is None or (s2 is None and not mx):
                raise ModelLoadError(f"{path}: FP4 weight {key} lacks weight_scale(_2).",
                                     "The checkpoint is incomplete; export it again.")
            n, half = t.shape
            values = unpack_fp4_from_uint8(t, n, half * 2, dtype=torch.float32)
            g = None if mx else 1.0 / s2.double().reshape(1)
            out[key] = dequantize_fp4(values, scale, g).to(dtype)
        else:
            out[key] = t.to(dtype) if t.is_floating_point() else t
    return out


def prepare_modelopt_nvfp4_model(model: torch.nn.Module, path: Path, algo: str = NVFP4_ALGO) -> int:
    """The engine's Linear inputs: NVFP4 rounds them through NVFP4 under 1 / input_scale;
    W4A8_MXFP4_FP8 casts them to FP8 E4M3 with one dynamic scale per tensor
    (W4A8MXFP4FP8LinearMethod's quantize_e4m3_per_tensor); W4A16_NVFP4 leaves them alone."""
    if algo == MXFP4_ALGO:
        names, _ = quantized_linear_inputs(path, "U8")
        plan = {n: ("tensor", 0, None) for n in sorted(names)}
        return install_input_quant(model, plan, fake_quant_input)
    if algo != NVFP4_ALGO:
        return 0
    scales = {k[: -len(".input_scale")]: t for k, t in load_tensors(path).items()
              if k.endswith(".input_scale")}
    plan = {n: ("nvfp4", 16, (1.0 / s.double()).float().reshape(1))
            for n, s in sorted(scales.items())}
    return install_input_quant(model, plan, lambda x, _mode, _group, s: fake_quant_nvfp4(x, s))
