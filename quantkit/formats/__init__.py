"""Bytes on disk, one module per format. Formats never import quantkit.methods.

A writer has `name`, `engines`, `check(scheme, shapes) -> problems` (run before any
calibration) and `write(out_dir, config=, dense=, results=, ignore=, dtype=)`.
A reader turns an artifact directory back into a dense state dict.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from quantkit.errors import ModelLoadError, SchemeMismatch

__all__ = ["get_writer", "detect_format", "read_dense_state", "WRITERS"]

WRITERS = ("compressed-tensors", "gptq")


def get_writer(name: str):
    if name == "compressed-tensors":
        from quantkit.formats.compressed_tensors import CompressedTensorsWriter

        return CompressedTensorsWriter()
    if name == "gptq":
        from quantkit.formats.gptq_v1 import GPTQv1Writer

        return GPTQv1Writer()
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
    qcfg = json.loads(cfg_file.read_text()).get("quantization_config")
    if not qcfg:
        return "dense"
    method = qcfg.get("quant_method")
    if method == "compressed-tensors":
        return "compressed-tensors"
    if method == "gptq":
        return "gptq"
    raise ModelLoadError(f"{path}: quantization_config quant_method {method!r} is not readable yet.",
                         f"quantkit reads: dense, {', '.join(WRITERS)}.")


def read_dense_state(path: Path, fmt: str, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    if fmt == "compressed-tensors":
        from quantkit.formats.compressed_tensors import read_compressed_tensors

        return read_compressed_tensors(path, dtype)
    if fmt == "gptq":
        from quantkit.formats.gptq_v1 import read_gptq_v1

        return read_gptq_v1(path, dtype)
    raise ModelLoadError(f"No dense reader for format {fmt!r}.")
