"""Block-at-a-time weights: a meta-device model skeleton filled from the safetensors shards.

Only the module being worked on holds real tensors; a decoder block is read from the shards
right before it is quantized and goes back to the meta device right after, so peak RAM is
about one block instead of the whole model (see quantkit.pipeline.plan for the numbers).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from quantkit.arch import ArchSpec
from quantkit.model_io import check_finite
from quantkit.pipeline.blocks import BlockSource
from quantkit.pipeline.heap import trim_heap
from quantkit.readers import safetensors_header, tensor_files

__all__ = ["ShardReader", "StreamingSource", "skeleton", "stream_plan_ok", "materialise",
           "to_meta"]


class ShardReader:
    """Tensor name -> shard file, read one tensor at a time (index.json when sharded).

    `rename` maps a module-tree name to the shards' own (ArchSpec.checkpoint_name: Mixtral's
    mlp -> block_sparse_moe); every method takes and returns module-tree names.
    """

    def __init__(self, path: Path, rename: Callable[[str], str] | None = None):
        self.path = Path(path)
        files = tensor_files(self.path)  # index and headers validated
        shapes: dict[str, tuple[int, ...]] = {}
        for file in sorted(set(files.values())):
            header, _ = safetensors_header(file)
            shapes.update((k, tuple(h["shape"])) for k, h in header.items() if files.get(k) == file)
        self._file_name = rename or (lambda name: name)
        self.files: dict[str, Path] = files
        self._shapes = shapes

    def __contains__(self, name: str) -> bool:
        return self._file_name(name) in self.files

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[self._file_name(name)]

    def get(self, name: str) -> torch.Tensor:
        return self.get_many([name])[name]

    def get_many(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Copies in RAM. Each shard is opened once per call: a handle kept open keeps its
        mmap, and every page read through it stays in this process's RSS (measured: +1 block
        per block)."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.files[self._file_name(name)], []).append(name)
        out = {}
        for file, group in by_file.items():
            with safe_open(str(file), framework="pt") as f:
                for name in group:
                    out[name] = f.get_tensor(self._file_name(name))
        return out


def skeleton(config, dtype: torch.dtype, trust_remote_code: bool = False):
    """The model with every parameter on `meta` (buffers such as rotary inv_freq stay real)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                 trust_remote_code=trust_remote_code)
    return model.eval()


def _tied(model) -> bool:
    return bool(getattr(model.config, "tie_word_embeddings", False))


def stream_plan_ok(model, reader: ShardReader) -> bool:
    """Every state-dict tensor is in the shards under its own name and shape (else load whole)."""
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and _tied(model) and name not in reader:
            continue
        if name not in reader or reader.shape(name) != tuple(t.shape):
            return False
    return True


def _set(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    if leaf in owner._parameters:
        owner._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
    else:
        owner._buffers[leaf] = value


def materialise(module: torch.nn.Module, prefix: str, reader: ShardReader, dtype: torch.dtype,
                *, root=None) -> None:
    """Read `module`'s state-dict tensors (named prefix + local name) from the shards."""
    names = list(module.state_dict())
    tied = [n for n in names if prefix + n not in reader and prefix + n == "lm_head.weight"
            and root is not None and _tied(root)]
    for name in tied:
        _set(module, name, root.get_input_embeddings().weight)
    values = reader.get_many([prefix + n for n in names if n not in tied])
    for name in names:
        if name not in tied:
            value = values[prefix + name]
            _set(module, name, value.to(dtype) if value.is_floating_point() else value)


def to_meta(module: torch.nn.Module) -> None:
    """Drop the module's weights (shapes stay, so it can be materialised again)."""
    for name, t in module.state_dict().items():
        _set(module, name, torch.empty_like(t, device="meta"))


class StreamingSource(BlockSource):
    """Blocks come from the shards in `dtype` (the in-memory path's load dtype) and go back to meta."""

    def __init__(self, model, reader: ShardReader, spec: ArchSpec, dtype: torch.dtype):
        self.model, self.reader, self.spec, self.dtype = model, reader, spec, dtype

    def load(self, index: int, block: torch.nn.Module) -> None:
        prefix = f"{self.spec.block_path}.{index}."
        trim_heap()
        materialise(block, prefix, self.reader, self.dtype)

    def release(self, index: int, block: torch.nn.Module) -> None:
        to_meta(block)
        trim_heap()

    def embedding(self) -> EmbeddingCast:
        return EmbeddingCast(self.model, self.spec, self.reader, self.dtype)


class EmbeddingCast:
    """Keep the embedding table in the checkpoint's dtype during capture; cast its output to
    the compute dtype (a gather commutes with the cast, so inputs are bit-identical)."""

    def __init__(self, model, spec: ArchSpec, reader: ShardReader, dtype: torch.dtype):
        self.module = model.get_submodule(spec.embed)
        self.prefix = spec.embed + "."
        self.reader, self.dtype = reader, dtype
        self.exact = type(self.module) is torch.nn.Embedding

    def __enter__(self):
        if self.exact:
            _set(self.module, "weight", self.reader.get(self.prefix + "weight"))
            self._hook = self.module.register_forward_hook(
                lambda _m, _a, out: out.to(self.dtype))
        else:
            materialise(self.module, self.prefix, self.reader, self.dtype)
        check_finite((self.prefix + n, p) for n, p in self.module.named_parameters())
        return self

    def __exit__(self, *exc) -> None:
        if self.exact:
            self._hook.remove()
        to_meta(self.module)
