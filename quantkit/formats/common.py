"""Safetensors shards and config.json: the bytes every HF-style format shares."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from quantkit.readers import read_config_json, safetensors_files, safetensors_headers

__all__ = ["save_tensors", "load_tensors", "read_config", "write_config", "read_safetensors_headers",
           "linear_tensors", "SHARD_BYTES", "FormatRecord"]

SHARD_BYTES = 4 * 1024**3


def save_tensors(out_dir: Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None,
                 shard_bytes: int = SHARD_BYTES) -> list[str]:
    """model.safetensors, or model-0000i-of-0000n.safetensors + index when larger than a shard."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    meta = {"format": "pt", **(metadata or {})}
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / "model.safetensors"), metadata=meta)
        return ["model.safetensors"]
    names, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / fname), metadata=meta)
        names.append(fname)
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return names


def load_tensors(path: Path, names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor (or those in `names`) of all safetensors shards in a directory."""
    out: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if names is None or key in names:
                    out[key] = f.get_tensor(key)
    return out


def read_config(path: Path) -> dict:
    return read_config_json(path)


def write_config(out_dir: Path, config: dict) -> None:
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def read_safetensors_headers(path: Path) -> dict[str, dict]:
    """dtype / shape / offsets of every tensor in a directory's shards, without reading data."""
    return safetensors_headers(path)


def linear_tensors(dense: dict[str, torch.Tensor], results: dict, pack, bias_dtype: torch.dtype
                   ) -> dict[str, torch.Tensor]:
    """`dense` plus, for every quantized Linear, the tensors `pack(result)` names (suffix ->
    tensor) and its bias in `bias_dtype`: the tensor map of one artifact."""
    tensors = dict(dense)
    for name, r in results.items():
        for key, t in pack(r).items():
            tensors[f"{name}.{key}"] = t
        if r.bias is not None:
            tensors[f"{name}.bias"] = r.bias.to(bias_dtype)
    return tensors


def _stores_no_experts(_spec) -> bool:
    return False


@dataclass(frozen=True)
class FormatRecord:
    """Everything the conductor and the readers know about one artifact format.

    `writer()` builds its writer; `read(path, dtype)` its weights dequantized (None: no dense
    reader); `prepare(model, path)` the run-time behaviour beyond the weights (inputs rounded
    the way the engine does); `kv_cache`: the engine loads k/v scales from it;
    `stores_experts(spec)`: its tensor names for a mixture-of-experts model are verified
    (what the engine's MoE loader reads); `symmetric`: the integer grid of a request that
    did not choose one (--sym / --asym not given: QuantizeRequest.symmetric_auto). MLX's
    affine grid keeps a float bias per group, so it takes the asymmetric grid; every other
    format the symmetric one. `float_zero`: the format stores that bias as a free float, so an
    asymmetric scheme for it gets QuantScheme.float_zero (zero points fitted, not rounded).
    `act_order`: GPTQ's column order for a request that chose none (act_order_auto: no
    --act-order / --no-act-order); on for MLX, whose groups stay static under it.
    `fp4_tensor_scale`: the format stores NVFP4's FP32 scale per tensor (QuantScheme.
    tensor_scale); MLX's QuantizedLinear keeps none."""

    name: str
    writer: Callable[[], Any]
    read: Callable[[Path, torch.dtype], dict[str, torch.Tensor]] | None = None
    prepare: Callable[[torch.nn.Module, Path], None] | None = None
    kv_cache: bool = False
    stores_experts: Callable[[Any], bool] = _stores_no_experts
    symmetric: bool = True
    float_zero: bool = False
    act_order: bool = False
    fp4_tensor_scale: bool = True


class FormatWriter:
    """An artifact format's writer. Every writer derives from this class; each hook the
    pipeline reads is declared here with its default, so the pipeline reads attributes
    directly and a writer overrides only what it changes."""

    name: str = ""
    engines: tuple[str, ...] = ()  # the engines the artifact is meant for
    # one file (GGUF): write() gets a file path, and the run's metadata goes inside the file
    single_file: bool = False
    # the artifact embeds the source's tokenizer and config: check_source checks them (and
    # loads the tokenizer) before any work
    embeds_source: bool = False
    # an ignore list matched by substring (AutoAWQ's modules_to_not_convert): check_modules
    # must see every module the artifact keeps unquantized
    checks_modules: bool = False
    # overhead_bytes knows what the file holds besides the weight matrices (a whole-file
    # size budget needs it before any data is read)
    sizes_overhead: bool = False
    # MTP layers are stored as further decoder blocks whose weight matrices the method
    # quantizes as the trunk's (llama.cpp's nextn blocks, as llama-quantize treats them),
    # not as dense tensors beside the quantized trunk
    mtp_as_blocks: bool = False

    def check(self, scheme, shapes: dict[str, tuple[int, int]]) -> list[str]:
        """Problems with storing `scheme` for these Linear shapes, before any calibration."""
        return []

    def check_modules(self, ignore: list[str], kept, quantized) -> list[str]:
        """Problems with naming the kept modules apart from the quantized ones."""
        return []

    def check_source(self, source_dir: Path, config) -> None:
        """Refuse a source whose tokenizer or config the artifact cannot embed."""

    def overhead_bytes(self, config, float_values: int, n_tensors: int) -> int:
        """Bytes of the file besides the weight matrices."""
        return 0

    def write(self, out_dir: Path, **kw) -> None:
        raise NotImplementedError
