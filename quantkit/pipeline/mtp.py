"""Multi-token-prediction (MTP) layers: kept in every artifact, dense by default, or, with
--quantize-mtp, their Linears quantized like the trunk's.

Why a module of its own: transformers drops the MTP tensors when it loads the model (GLM-4.5
and DeepSeek-V3's nextn blocks `model.layers.{num_hidden_layers + i}.*`, Qwen3.5 / Qwen3-Next's
`mtp.*`), so the block loop never sees them; they are copied from the source shards one
tensor at a time, under the checkpoint's own names (the names vLLM's `*_mtp.py` loaders read).
Dense MTP Linears are named one by one in the ignore list, so vLLM builds them unquantized.
transformers gives no forward for an MTP block, so a calibrated method's MTP Linears are
rounded to nearest (RTN) in the same integer scheme; quantkit.json says so.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from quantkit.arch import ArchSpec
from quantkit.errors import SchemeMismatch
from quantkit.readers import tensor_files
from quantkit.types import BlockContext, Quantizer, QuantResult, QuantScheme

__all__ = ["MtpLayers", "find_mtp", "mtp_quantizer", "quantize_mtp", "MTP_HINT"]

MTP_HINT = "Drop --quantize-mtp (the MTP layers then stay dense, as the checkpoint has them)."
# an MTP block's own prefix: nextn blocks are numbered after the trunk's; Qwen's mtp.layers.i
# vLLM's fused Linears and their checkpoint parts (its models' packed_modules_mapping)
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
          "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa")}
_QWEN_BLOCK = re.compile(r"^((?:model\.)?mtp\.layers\.\d+)\.(.+)$")


@dataclass
class MtpLayers:
    """The MTP tensors of a checkpoint (checkpoint names) and the shards that hold them."""

    names: list[str]
    files: dict[str, Path]
    block_path: str
    quantized: dict[str, QuantResult] = field(default_factory=dict)

    def blocks(self) -> list[str]:
        """The MTP decoder blocks' prefixes (model.layers.46, mtp.layers.0)."""
        return sorted({b for b, _ in map(self._split, self.names) if b})

    def _split(self, name: str) -> tuple[str | None, str]:
        """(block prefix, name relative to it), or (None, name) outside any MTP block."""
        m = _QWEN_BLOCK.match(name)
        if m:
            return m.group(1), m.group(2)
        prefix = self.block_path + "."
        if name.startswith(prefix):
            bid, _, rel = name[len(prefix):].partition(".")
            return f"{self.block_path}.{bid}", rel
        return None, name

    def linears_like(self, trunk: Iterable[str]) -> list[str]:
        """MTP module names whose name inside their block is one the trunk quantized
        (`trunk`: quantized module names, checkpoint spelling): attention, MLP, experts
        under the trunk's expert layout. eh_proj / fc / shared_head stay dense: vLLM builds
        them without a quantization method, as the trunk's head."""
        prefix = re.compile(rf"^{re.escape(self.block_path)}\.\d+\.")
        rel = {prefix.sub("", n) for n in trunk}
        out = []
        for name in self.names:
            block, inner = self._split(name)
            if block and name.endswith(".weight") and inner[: -len(".weight")] in rel:
                out.append(name[: -len(".weight")])
        return out

    def block_weights(self, router: str | None) -> dict[str, tuple[int, ...]]:
        """Module name -> shape of every MTP weight matrix but the routers (`router`: the
        block-relative router module): what llama-quantize quantizes in a nextn block (its
        attention, MLP, experts, eh_proj, embed_tokens, shared_head), planned and quantized
        as the trunk's when the format stores MTP layers as blocks (GGUF)."""
        shapes = self.shapes()
        out = {}
        for name in self.names:
            block, inner = self._split(name)
            if block is None or not name.endswith(".weight") or len(shapes[name]) != 2:
                continue
            if router is not None and inner == f"{router}.weight":
                continue
            out[name[: -len(".weight")]] = shapes[name]
        return out

    def block_index(self, block: str, fallback: int) -> int:
        """The decoder-block number of an MTP block numbered after the trunk's
        (model.layers.46 -> 46), else `fallback`."""
        tail = block[len(self.block_path) + 1:] if block.startswith(self.block_path + ".") else ""
        return int(tail) if tail.isdigit() else fallback

    def dense_linears(self, shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
        """Module names of the MTP 2-D weights left dense (embeddings excepted): the exact
        names vLLM's compressed-tensors ignore matching reads (routed experts by expert 0's
        gate/up/down, every other Linear by its own prefix)."""
        dense = [n[: -len(".weight")] for n in self.names
                 if n.endswith(".weight") and len(shapes[n]) == 2 and "embed_tokens" not in n
                 and n[: -len(".weight")] not in self.quantized]
        # vLLM's glm4_moe_mtp.py / deepseek_mtp.py classes carry no packed_modules_mapping,
        # so vLLM matches their fused Linears' own names (qkv_proj, gate_up_proj) against the
        # ignore list: name those too when every part is dense
        kept = set(dense)
        for parent in sorted({m.rpartition(".")[0] for m in dense
                              if not re.search(r"\.experts\.\d+\.", m)}):  # FusedMoE: by part
            for fused, parts in _FUSED.items():
                if all(f"{parent}.{p}" in kept for p in parts):
                    dense.append(f"{parent}.{fused}")
        return dense

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The stored tensors, byte for byte, each shard opened once."""
        by_file: dict[Path, list[str]] = {}
        for n in names:
            by_file.setdefault(self.files[n], []).append(n)
        out = {}
        for file, group in by_file.items():
            with safe_open(str(file), framework="pt") as f:
                for n in group:
                    out[n] = f.get_tensor(n).clone()  # the clone lets the mmap go
        return out

    def shapes(self) -> dict[str, tuple[int, ...]]:
        from quantkit.readers import safetensors_header

        out: dict[str, tuple[int, ...]] = {}
        for file in sorted(set(self.files[n] for n in self.names)):
            header, _ = safetensors_header(file)
            out.update((k, tuple(h["shape"])) for k, h in header.items() if k in self.files
                       and self.files[k] == file and k in set(self.names))
        return out

    def record(self, method: str | None) -> dict:
        """quantkit.json's "mtp" entry."""
        return {"tensors": len(self.names), "blocks": self.blocks(),
                "quantized": sorted(self.quantized),
                **({"method": method} if method else {}),
                "dense": "kept as stored in the source shards, named in the ignore list"}


def find_mtp(source_dir: Path, raw_config: dict, spec: ArchSpec) -> MtpLayers | None:
    """The checkpoint's MTP layers, or None when it has none."""
    from quantkit.model_io import mtp_tensor_names

    block_path = spec.checkpoint_name(spec.block_path + ".")[:-1]
    names = mtp_tensor_names(source_dir, raw_config, block_path)
    if not names:
        return None
    files = tensor_files(Path(source_dir))
    return MtpLayers(names=names, files={n: files[n] for n in names}, block_path=block_path)


def mtp_quantizer(quantizer: Quantizer, scheme: QuantScheme, mtp: MtpLayers | None,
                  format_name: str, single_file: bool, as_blocks: bool = False) -> Quantizer:
    """The method the MTP Linears get under --quantize-mtp: the run's own when it reads no
    calibration, else RTN in the same integer scheme. Refusals before any work."""
    if mtp is None:
        raise SchemeMismatch("--quantize-mtp: the checkpoint has no multi-token-prediction "
                             "(MTP) tensors (no mtp.* and no blocks past num_hidden_layers).",
                             "Drop --quantize-mtp.")
    if as_blocks:
        raise SchemeMismatch(f"--quantize-mtp: format {format_name} always quantizes the MTP "
                             "layers as further blocks of the trunk (llama.cpp's nextn blocks, "
                             "as llama-quantize does).", "Drop --quantize-mtp.")
    if single_file:
        raise SchemeMismatch(f"--quantize-mtp: format {format_name} does not store MTP layers.",
                             "Use --format compressed-tensors, or drop --quantize-mtp.")
    from quantkit.pipeline.towers import stand_in_quantizer

    return stand_in_quantizer(quantizer, scheme, "--quantize-mtp", "transformers gives no "
                              "forward for the MTP layers, so they get no calibration", MTP_HINT)


def quantize_mtp(mtp: MtpLayers, modules: list[str], quantizer: Quantizer,
                 scheme: QuantScheme) -> dict[str, QuantResult]:
    """Quantize the MTP Linears `modules` (checkpoint module names), one MTP block at a
    time, from their stored weights; results keyed by module name (also kept in mtp)."""
    by_block: dict[str, list[str]] = {}
    for m in modules:
        by_block.setdefault(mtp._split(m + ".weight")[0], []).append(m)
    names = set(mtp.names)
    for order, (block, group) in enumerate(sorted(by_block.items())):
        index = mtp.block_index(block, order)  # the block's own number where it has one
        wanted = [m + s for m in group for s in (".weight", ".bias") if m + s in names]
        tensors = mtp.read(wanted)
        linears = {}
        for m in group:
            w = tensors[m + ".weight"].float()
            lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=m + ".bias" in tensors)
            lin.weight.data = w
            if lin.bias is not None:
                lin.bias.data = tensors[m + ".bias"].float()
            linears[m[len(block) + 1:]] = lin
        ctx = BlockContext(index=index, block=torch.nn.ModuleDict(), linears=linears, stats={},
                           scheme=scheme, inputs=[], rerun=_no_rerun)
        with torch.no_grad():
            for rel, res in quantizer.quantize_block(ctx).items():
                mtp.quantized[f"{block}.{rel}"] = res
    return mtp.quantized


def _no_rerun(*_args, **_kwargs):
    raise RuntimeError("MTP blocks are quantized without calibration inputs")
