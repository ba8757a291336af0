"""Bytes on disk, one module per format. Formats never import quantkit.methods.

Each format module exports `RECORD`, its `FormatRecord` (quantkit.formats.common): the writer,
the dense reader, the run-time preparation, its KV-cache and MoE abilities. A writer has
`name`, `engines`, `check(scheme, shapes) -> problems` (run before any calibration) and
`write(out_dir, config=, dense=, results=, ignore=, dtype=)`. The registry imports a format's
module when that format is asked for (compressed-tensors loads slowly).
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch

from quantkit.errors import ModelLoadError, SchemeMismatch
from quantkit.formats.common import FormatRecord

__all__ = ["get_writer", "format_record", "detect_format", "read_dense_state", "prepare_model",
           "WRITERS", "DEFAULT_FORMAT", "FORMAT_CHOICES", "kv_cache_formats"]

# format name -> the module that registers it, in the registry's order (errors list them so)
_MODULES = {"compressed-tensors": "compressed_tensors", "gptq": "gptq_v1", "gguf": "gguf",
            "fp8": "fp8", "modelopt": "modelopt_fp8", "awq": "awq_gemm",
            "mlx": "mlx"}
WRITERS = tuple(_MODULES)
DEFAULT_FORMAT = WRITERS[0]
# the formats as --format's help and its refusals list them
FORMAT_CHOICES = "compressed-tensors, gptq, awq, fp8, modelopt, gguf, mlx"


def format_record(name: str) -> FormatRecord:
    """The record registered under `name`."""
    if name not in _MODULES:
        raise SchemeMismatch(f"Unknown format {name!r}.", f"Choose one of: {', '.join(WRITERS)}.")
    return importlib.import_module(f"quantkit.formats.{_MODULES[name]}").RECORD


def kv_cache_formats() -> tuple[str, ...]:
    """The formats whose engines load KV-cache scales from them."""
    return tuple(name for name in WRITERS if format_record(name).kv_cache)


def get_writer(name: str):
    return format_record(name).writer()


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

    config = read_config_json(path)
    from quantkit.formats.mlx import is_mlx_config

    if is_mlx_config(config):  # mlx-lm's `quantization` (its quantization_config has no method)
        return "mlx"
    qcfg = config.get("quantization_config")
    if not qcfg:
        return "dense"
    method = qcfg.get("quant_method")
    if method in _MODULES and format_record(method).read is not None:  # its own quant_method
        return method
    raise ModelLoadError(f"{path}: quantization_config quant_method {method!r} is not readable yet.",
                         f"quantkit reads: dense, {', '.join(WRITERS)}.")


def read_dense_state(path: Path, fmt: str, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The artifact's weights, dequantized; KV-cache scales are left out (prepare_model
    applies them)."""
    from quantkit.formats.kv_cache import is_kv_scale

    state = _read_dense_state(path, fmt, dtype)
    return {k: t for k, t in state.items() if not is_kv_scale(k)}


def _read_dense_state(path: Path, fmt: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    read = format_record(fmt).read if fmt in _MODULES else None
    if read is None:
        raise ModelLoadError(f"No dense reader for format {fmt!r}.")
    return read(path, dtype)


def prepare_model(model: torch.nn.Module, path: Path, fmt: str) -> None:
    """Run-time behaviour beyond the stored weights: W8A8 / W4A4 artifacts round Linear inputs
    the way the engine does (FP8 E4M3, int8 or NVFP4; dynamic or static scales), so CPU eval
    measures what runs; artifacts with KV-cache scales round keys and values through FP8 as
    they enter the cache."""
    if fmt not in _MODULES:
        return
    record = format_record(fmt)
    if record.kv_cache:
        from quantkit.formats.kv_cache import prepare_kv_cache

        prepare_kv_cache(model, path)
    if record.prepare is not None:
        record.prepare(model, path)
