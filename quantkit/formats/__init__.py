"""Bytes on disk, one module per format. Formats never import quantkit.methods.

A writer has `name`, `engines`, `check(scheme, shapes) -> problems` (run before any
calibration) and `write(out_dir, config=, dense=, results=, ignore=, dtype=)`.
A reader turns an artifact directory back into a dense state dict.
"""

from __future__ import annotations

from pathlib import Path

import torch

from quantkit.errors import ModelLoadError, SchemeMismatch

__all__ = ["get_writer", "detect_format", "read_dense_state", "prepare_model", "WRITERS"]

WRITERS = ("compressed-tensors", "gptq", "gguf", "fp8", "modelopt", "awq")


def get_writer(name: str):
    if name == "compressed-tensors":  # pack-quantized for int schemes, float-quantized for fp8,
        # nvfp4/mxfp4-pack-quantized for FP4
        from quantkit.formats.compressed_tensors import CompressedTensorsWriter
        from quantkit.formats.fp4 import FP4CompressedTensorsWriter
        from quantkit.formats.fp8 import FP8CompressedTensorsWriter, KindDispatch

        return KindDispatch(name, {"fp8": FP8CompressedTensorsWriter,
                                   "nvfp4": FP4CompressedTensorsWriter,
                                   "mxfp4": FP4CompressedTensorsWriter}, CompressedTensorsWriter)
    if name == "fp8":  # vLLM's native quant_method "fp8"
        from quantkit.formats.fp8 import VllmFP8Writer

        return VllmFP8Writer()
    if name == "modelopt":  # TensorRT-LLM: FP8 here, W4A16_AWQ in formats/modelopt.py
        from quantkit.formats.modelopt_fp8 import ModelOptDispatch

        return ModelOptDispatch()
    if name == "gptq":
        from quantkit.formats.gptq_v1 import GPTQv1Writer

        return GPTQv1Writer()
    if name == "gguf":
        from quantkit.formats.gguf import GGUFFileWriter

        return GGUFFileWriter()
    if name == "awq":  # AutoAWQ GEMM (vLLM awq / awq_marlin)
        from quantkit.formats.awq_gemm import AWQGemmWriter

        return AWQGemmWriter()
    raise SchemeMismatch(f"Unknown format {name!r}.", f"Choose one of: {', '.join(WRITERS)}.")


def detect_format(path: Path) -> str:
    """'dense', 'compressed-tensors', ... from an artifact directory's config."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return "gguf"
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"{path} is not a quantkit artifact or model directory (no config.json).",
                             "Pass the directory written by `quantkit quantize -o`.")
    if (path / "hf_quant_config.json").is_file():  # ModelOpt; TensorRT-LLM checks it first too
        return "modelopt"
    from quantkit.readers import read_config_json

    qcfg = read_config_json(path).get("quantization_config")
    if not qcfg:
        return "dense"
    method = qcfg.get("quant_method")
    if method == "compressed-tensors":
        return "compressed-tensors"
    if method == "gptq":
        return "gptq"
    if method in ("fp8", "modelopt"):
        return method
    if method == "awq":
        return "awq"
    raise ModelLoadError(f"{path}: quantization_config quant_method {method!r} is not readable yet.",
                         f"quantkit reads: dense, {', '.join(WRITERS)}.")


def read_dense_state(path: Path, fmt: str, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The artifact's weights, dequantized; KV-cache scales are left out (prepare_model
    applies them)."""
    from quantkit.formats.kv_cache import is_kv_scale

    state = _read_dense_state(path, fmt, dtype)
    return {k: t for k, t in state.items() if not is_kv_scale(k)}


def _read_dense_state(path: Path, fmt: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    if fmt == "compressed-tensors":
        from quantkit.formats.common import read_config
        from quantkit.formats.compressed_tensors import read_compressed_tensors

        ct_format = read_config(path)["quantization_config"].get("format")
        if ct_format == "float-quantized":
            from quantkit.formats.fp8 import read_float_quantized

            return read_float_quantized(path, dtype)
        if ct_format in ("nvfp4-pack-quantized", "mxfp4-pack-quantized"):
            from quantkit.formats.fp4 import read_fp4_pack_quantized

            return read_fp4_pack_quantized(path, dtype)
        return read_compressed_tensors(path, dtype)
    if fmt in ("fp8", "modelopt"):
        from quantkit.formats.fp8 import read_vllm_fp8
        from quantkit.formats.modelopt_fp8 import read_modelopt

        return (read_vllm_fp8 if fmt == "fp8" else read_modelopt)(path, dtype)
    if fmt == "gptq":
        from quantkit.formats.gptq_v1 import read_gptq_v1

        return read_gptq_v1(path, dtype)
    if fmt == "awq":
        from quantkit.formats.awq_gemm import read_awq_gemm

        return read_awq_gemm(path, dtype)
    raise ModelLoadError(f"No dense reader for format {fmt!r}.")


def prepare_model(model: torch.nn.Module, path: Path, fmt: str) -> None:
    """Run-time behaviour beyond the stored weights: W8A8 / W4A4 artifacts round Linear inputs
    the way the engine does (FP8 E4M3, int8 or NVFP4; dynamic or static scales), so CPU eval
    measures what runs; artifacts with KV-cache scales round keys and values through FP8 as
    they enter the cache."""
    if fmt in ("compressed-tensors", "fp8", "modelopt"):
        from quantkit.formats.kv_cache import prepare_kv_cache

        prepare_kv_cache(model, path)
    _prepare_activations(model, path, fmt)


def _prepare_activations(model: torch.nn.Module, path: Path, fmt: str) -> None:
    if fmt == "compressed-tensors":
        from quantkit.formats.common import read_config

        ct_format = read_config(path)["quantization_config"].get("format")
        if ct_format == "int-quantized":  # int8 W8A8: inputs rounded through int8
            from quantkit.formats.compressed_tensors import prepare_int8_model

            prepare_int8_model(model, path)
            return
        if ct_format == "nvfp4-pack-quantized":  # W4A4: inputs rounded through NVFP4
            from quantkit.formats.fp4 import prepare_nvfp4_model

            prepare_nvfp4_model(model, path)
            return
        if ct_format != "float-quantized":
            return
    elif fmt == "modelopt":
        from quantkit.formats.modelopt_fp8 import read_hf_quant_config

        algo = read_hf_quant_config(path).get("quant_algo")
        from quantkit.formats.fp4 import MODELOPT_FP4_ALGOS, prepare_modelopt_nvfp4_model

        if algo in MODELOPT_FP4_ALGOS:
            prepare_modelopt_nvfp4_model(model, path, algo)
            return
        if algo == "W4A8_AWQ":  # int4 weights, FP8 static inputs (x * pre_quant_scale)
            from quantkit.formats.modelopt import prepare_modelopt_w4a8_model

            prepare_modelopt_w4a8_model(model, path)
            return
    elif fmt != "fp8":
        return
    from quantkit.formats.fp8 import prepare_fp8_model

    prepare_fp8_model(model, path, fmt)
