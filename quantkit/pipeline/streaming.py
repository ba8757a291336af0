"""Block-at-a-time weights: a meta-device model skeleton filled from the safetensors shards.

Only the module being worked on holds real tensors; a decoder block is read from the shards
right before it is quantized and goes back to the meta device right after, so peak RAM is
about one block instead of the whole model (see quantkit.pipeline.plan for the numbers).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open

from quantkit.arch import ArchSpec
from quantkit.model_io import check_finite
from quantkit.pipeline.blocks import BlockSource
from quantkit.pipeline.heap import trim_heap
from quantkit.readers import safetensors_header, tensor_files
from quantkit.transformers_lean import model_class

__all__ = ["ShardReader", "StreamingSource", "skeleton", "stream_plan_ok", "materialise",
           "to_meta", "block_tensor"]


class ShardReader:
    """Tensor name -> shard file, read one tensor at a time (index.json when sharded).

    `rename` maps a module-tree name to the shards' own (ArchSpec.checkpoint_name: Mixtral's
    mlp -> block_sparse_moe); every method takes and returns module-tree names.
    """

    def __init__(self, path: Path, rename: Callable[[str], str] | None = None,
                 spec: ArchSpec | None = None):
        self.path = Path(path)
        files = tensor_files(self.path)  # index and headers validated
        shapes: dict[str, tuple[int, ...]] = {}
        for file in sorted(set(files.values())):
            header, _ = safetensors_header(file)
            shapes.update((k, tuple(h["shape"])) for k, h in header.items() if files.get(k) == file)
        self._file_name = rename or (lambda name: name)
        self.files: dict[str, Path] = files
        self._shapes = shapes
        # per-expert tensor name -> (fused experts prefix, expert index), for checkpoints that
        # store the experts fused (gpt-oss): sliced (and MXFP4-decoded) as they are read
        self._sliced: dict[str, tuple[str, int]] = {}
        self._fused_stored: set[str] = set()  # the shards' names of those fused tensors
        if spec is not None and spec.experts is not None and spec.experts.stored_fused:
            self._index_fused_experts(spec)

    def _index_fused_experts(self, spec: ArchSpec) -> None:
        es = spec.experts
        for name in list(self._shapes):
            module_name = spec.module_name(name)  # Granite's input_linear -> experts.gate_up_proj
            for suffix in ("", "_blocks"):
                tail = f".{es.module}.{es.fused_gate_up}{suffix}"
                if not module_name.endswith(tail):
                    continue
                prefix = module_name[: -len(tail)] + f".{es.module}."
                # the shards' fused tensors these experts come from (MXFP4: blocks and scales)
                parts = (suffix, "_scales", "_bias") if suffix else ("", "_bias")
                for param in (es.fused_gate_up, es.fused_down):
                    stored = (self._file_name(prefix + param + part) for part in parts)
                    self._fused_stored.update(n for n in stored if n in self.files)
                shape = self._shapes[name]
                if suffix:  # MXFP4 blocks (E, out, in/32, 16): rows are output channels
                    n, rows, hidden = shape[0], shape[1], shape[2] * shape[3] * 2
                elif es.fused_transposed:  # (E, in, out)
                    n, hidden, rows = shape
                else:
                    n, rows, hidden = shape
                inter = rows // len(es.inputs)
                out = {getattr(es, w): (inter, hidden) for w in es.inputs}
                out[es.down] = (hidden, inter)
                for e in range(n):
                    for linear, wshape in out.items():
                        self._virtual(f"{prefix}{e}.{linear}.weight", wshape, prefix, e)
                        if es.bias:
                            self._virtual(f"{prefix}{e}.{linear}.bias", wshape[:1], prefix, e)
        self._experts = es

    def split_experts(self) -> tuple[dict[str, tuple[int, ...]], set[str]]:
        """({per-expert tensor, by the shards' spelling: its shape}, the fused tensors of the
        shards they are sliced from): what a reader of a fused-expert checkpoint sees instead."""
        return ({self._file_name(n): self._shapes[self._file_name(n)] for n in self._sliced},
                set(self._fused_stored))

    def _virtual(self, name: str, shape: tuple[int, ...], prefix: str, e: int) -> None:
        self._sliced[name] = (prefix, e)
        self._shapes[self._file_name(name)] = shape

    def __contains__(self, name: str) -> bool:
        return name in self._sliced or self._file_name(name) in self.files

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[self._file_name(name)]

    def _read_sliced(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Per-expert tensors from the fused ones, each fused tensor read (and decoded) once."""
        from quantkit.e2m1 import dequantize_mxfp4_blocks
        from quantkit.pipeline.experts import expert_tensors

        es = self._experts
        by_prefix: dict[str, list[str]] = {}
        for name in names:
            by_prefix.setdefault(self._sliced[name][0], []).append(name)
        out = {}
        for prefix, group in by_prefix.items():
            fused = {}
            for param in (es.fused_gate_up, es.fused_down):
                stored = prefix + param
                if stored in self:
                    fused[param] = self.get(stored)
                else:  # MXFP4 (E, out, in): to the in-memory (E, in, out) transformers decodes to
                    parts = self.get_many([stored + "_blocks", stored + "_scales"])
                    w = dequantize_mxfp4_blocks(parts[stored + "_blocks"], parts[stored + "_scales"])
                    fused[param] = w.transpose(1, 2) if es.fused_transposed else w
                if es.bias:
                    fused[param + "_bias"] = self.get(stored + "_bias")
            cache: dict[int, dict[str, torch.Tensor]] = {}
            for name in group:
                e = self._sliced[name][1]
                if e not in cache:
                    cache[e] = expert_tensors(es, fused, e)
                out[name] = cache[e][name[len(f"{prefix}{e}."):]]
        return out

    def get(self, name: str) -> torch.Tensor:
        return self.get_many([name])[name]

    def get_many(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Copies in RAM. Each shard is opened once per call: a handle kept open keeps its
        mmap, and every page read through it stays in this process's RSS (measured: +1 block
        per block). safetensors (0.8) hands out tensors that live IN the shard's mmap, and
        one such tensor keeps the whole mapping, with every page read or written through it:
        a block's 1 KiB norm weights, kept for the artifact, held that block's 7 MB of
        SmolLM2 pages (its GPTQ write-back made them private copies), +7 MB per block, ~200
        MiB of the 64 x 512-token GPTQ run's peak RSS. Hence the clone: the mapping goes
        with the handle."""
        sliced = [n for n in names if n in self._sliced]
        out = self._read_sliced(sliced) if sliced else {}
        by_file: dict[Path, list[str]] = {}
        for name in names:
            if name in self._sliced:
                continue
            by_file.setdefault(self.files[self._file_name(name)], []).append(name)
        for file, group in by_file.items():
            with safe_open(str(file), framework="pt") as f:
                for name in group:
                    out[name] = f.get_tensor(self._file_name(name)).clone()
        return out


def block_tensor(spec: ArchSpec) -> Callable[[str], bool]:
    """Whether a checkpoint tensor belongs to a decoder block: the block loop checks those
    for NaN/Inf as it reads them (blocks.quantize_blocks), as load_model does when the model
    is loaded whole."""
    blocks = spec.block_path + "."
    return lambda name: spec.module_name(name).startswith(blocks)


def skeleton(config, dtype: torch.dtype, trust_remote_code: bool = False):
    """The model with every parameter on `meta` (buffers such as rotary inv_freq stay real)."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = model_class(config).from_config(config, dtype=dtype,
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


def _read_values(names: list[str], prefix: str, reader: ShardReader,
                 dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors prefix + name from the shards, floats cast to `dtype` (keyed by name)."""
    values = reader.get_many([prefix + n for n in names])
    return {n: v.to(dtype) if v.is_floating_point() else v
            for n, v in ((n, values[prefix + n]) for n in names)}


def materialise(module: torch.nn.Module, prefix: str, reader: ShardReader, dtype: torch.dtype,
                *, root=None, values: dict[str, torch.Tensor] | None = None) -> None:
    """Read `module`'s state-dict tensors (named prefix + local name) from the shards, or take
    them from `values` (what _read_values gave for the same names, read ahead)."""
    names = list(module.state_dict())
    tied = [n for n in names if prefix + n not in reader and prefix + n == "lm_head.weight"
            and root is not None and _tied(root)]
    for name in tied:
        _set(module, name, root.get_input_embeddings().weight)
    if values is None:
        values = _read_values([n for n in names if n not in tied], prefix, reader, dtype)
    for name in names:
        if name not in tied:
            _set(module, name, values[name])


def to_meta(module: torch.nn.Module) -> None:
    """Drop the module's weights (shapes stay, so it can be materialised again)."""
    for name, t in module.state_dict().items():
        _set(module, name, torch.empty_like(t, device="meta"))


class StreamingSource(BlockSource):
    """Blocks come from the shards in `dtype` (the in-memory path's load dtype) and go back to meta.

    With `read_ahead`, block i+1's tensors are read by a worker thread while block i computes
    (one more block in host memory). Why: on a GPU the blocks compute in about the time the
    disk takes to deliver them, and read in turn the two added up; the worker waits on the
    disk and on copies that release the GIL. The values are the same either way. Off on the
    CPU, where the block loop is compute-bound and host memory is what the plan counts.
    """

    def __init__(self, model, reader: ShardReader, spec: ArchSpec, dtype: torch.dtype,
                 read_ahead: bool = False):
        self.model, self.reader, self.spec, self.dtype = model, reader, spec, dtype
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="quantkit-read") \
            if read_ahead else None
        self._ahead: tuple[int, Future] | None = None

    def _prefix(self, index: int) -> str:
        return f"{self.spec.block_path}.{index}."

    def load(self, index: int, block: torch.nn.Module) -> None:
        trim_heap()
        ahead, self._ahead = self._ahead, None
        values = ahead[1].result() if ahead is not None and ahead[0] == index else None
        materialise(block, self._prefix(index), self.reader, self.dtype, values=values)
        if self._pool is None:
            return
        blocks = self.model.get_submodule(self.spec.block_path)
        if index + 1 < len(blocks):
            names = list(blocks[index + 1].state_dict())
            self._ahead = (index + 1, self._pool.submit(
                _read_values, names, self._prefix(index + 1), self.reader, self.dtype))
        else:
            self.close()

    def close(self) -> None:
        """Stop the read-ahead worker (a read in flight is dropped)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool, self._ahead = None, None

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
        # the decoder's other modules outside the blocks that the capture forward runs before
        # block 0 (Gemma 4's per-layer embeddings and their projection); the final norm and
        # head never run there (the capture stops at the last block)
        owner_path = spec.block_path.rpartition(".")[0]
        owner = model.get_submodule(owner_path) if owner_path else model
        skip = {spec.block_path, spec.embed, spec.final_norm, spec.lm_head}
        self.others = [(m, f"{n}.") for n, m in (
            (f"{owner_path}.{c}" if owner_path else c, child) for c, child in owner.named_children())
            if n not in skip and any(True for _ in m.state_dict())]

    def __enter__(self):
        for module, prefix in self.others:
            materialise(module, prefix, self.reader, self.dtype)
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
        for module, _ in self.others:
            to_meta(module)
