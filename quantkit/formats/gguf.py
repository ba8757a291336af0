"""HF checkpoint + quantized results -> one GGUF v3 file that llama.cpp loads.

Layout written (gguf's GGUFWriter; tensor data 32-byte aligned, dims reversed on disk):
  KV   general.* (architecture, name, file_type, quantization_version)
       {arch}.* hyper-parameters from config.json (llama / qwen2 / qwen3 / gemma3 / phi3;
       the optional keys each arch carries are its ArchSpec.gguf_kv, written by _OPTIONAL_KV)
       tokenizer.ggml.* and tokenizer.chat_template (gguf_tokenizer.py)
       quantkit.* provenance (what quantkit.json holds for directory artifacts)
  data token_embd, blk.N.*, output_norm, output (absent when embeddings are tied; names from
       ArchSpec.gguf_tensor, i.e. the gguf package's TensorNameMap for the arch),
       rope_freqs (llama3 rope scaling); norms, biases and 1-D tensors F32 (norms as
       norm_offset + w: Gemma's (1 + w), added in float32 as llama.cpp's
       converter does); quantized weights as the bytes in QuantResult.extra["gguf_bytes"];
       other 2-D weights F16/BF16. Fused Linears (Phi-3's qkv_proj, gate_up_proj) stay fused.
       Mixture of experts (qwen3moe): each block's per-expert Linears stacked into one 3-D
       tensor per projection (ffn_{gate,up,down}_exps, experts on the slowest axis), built
       as it is written; the router ffn_gate_inp F32, as llama.cpp's converter forces it.
       gpt-oss checkpoints in MXFP4 keep their experts' stored bytes at 16-bit types, as
       ggml MXFP4 (as the converter does).
The llama arch wants q/k rows permuted for its rotary layout; that is a row permutation, so
it is applied to encoded rows too (`_permute`).
"""

from __future__ import annotations

import itertools
import json
import math
import struct
from pathlib import Path

import numpy as np
import torch
from gguf import (
    GGML_QUANT_SIZES,
    GGMLQuantizationType,
    GGUFEndian,
    GGUFValueType,
    GGUFWriter,
    LlamaFileType,
)

from quantkit.arch import ArchSpec, gguf_architectures, spec_for_config
from quantkit.errors import SchemeMismatch, UnsupportedArchitecture
from quantkit.formats.common import FormatRecord, FormatWriter
from quantkit.formats.gguf_tokenizer import read_tokenizer
from quantkit.ggml.catalogue import GGUF_TYPES, file_type
from quantkit.ggml.mix import NEVER_QUANTIZED
from quantkit.readers import GGUFTensor, bad_gguf, read_gguf
from quantkit.types import QuantResult, QuantScheme

__all__ = ["GGUFFileWriter", "read_gguf", "gguf_metadata", "GGUFTensor", "gguf_pieces", "gguf_permuted_heads"]

Q = GGMLQuantizationType
# what one tensor adds to a file beyond its data, at most: tensor info (name, dims, type,
# offset), 32-byte alignment, and its entries in quantkit.stats / quantkit.metadata
_PER_TENSOR_OVERHEAD = 768
_METADATA_SLACK = 64 * 1024  # quantkit.metadata's fixed part (command, provenance, versions)


_NUMERIC = {GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
            GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
            GGUFValueType.FLOAT32: "<f4", GGUFValueType.UINT64: "<u8", GGUFValueType.INT64: "<i8",
            GGUFValueType.FLOAT64: "<f8"}


class _FastArrayWriter(GGUFWriter):
    """gguf's GGUFWriter, packing long metadata arrays in one pass instead of per element.

    The stock writer packs each of a vocabulary's ~150K tokens, types and merges through its
    own struct call (0.5 s for SmolLM2, a tenth of its whole Q4_K_M run). Same bytes: strings
    are a little-endian u64 length + UTF-8, numbers little-endian in the array's element type
    (tests/test_gguf.py compares the files both writers make).
    """

    def _pack_val(self, val, vtype, add_vtype, sub_type=None):
        if (vtype != GGUFValueType.ARRAY or self.endianess != GGUFEndian.LITTLE
                or isinstance(val, (str, bytes)) or len(val) < 64):
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        ltype = sub_type if sub_type is not None else GGUFValueType.get_type(val[0])
        if sub_type is None and any(GGUFValueType.get_type(v) is not ltype
                                    for v in {type(v): v for v in val}.values()):
            raise ValueError("All items in a GGUF array should be of the same type")
        if ltype == GGUFValueType.STRING:
            enc = [v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in val]
            lengths = map(struct.Struct("<Q").pack, map(len, enc))
            body = b"".join(itertools.chain.from_iterable(zip(lengths, enc, strict=True)))
        elif ltype in _NUMERIC:
            body = np.asarray(val, dtype=_NUMERIC[ltype]).tobytes()
        else:
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        head = struct.pack("<I", vtype) if add_vtype else b""
        return head + struct.pack("<IQ", ltype, len(val)) + body


def _stored_mxfp4_experts(spec: ArchSpec, config: dict, source_dir: Path | None
                          ) -> dict[tuple[str, int], object]:
    """gpt-oss checkpoints in MXFP4: llama.cpp's converter writes the experts' stored blocks
    as they are, as ggml MXFP4 (whatever its 16-bit --outtype), and so does quantkit at 16-bit
    types. {(GGUF tensor name, expert): make (rows, cols / 32 * 17) uint8}, lazily read."""
    from quantkit.readers import safetensors_header, tensor_files

    es = spec.experts
    quant = config.get("quantization_config") or {}
    if es is None or not es.stored_fused or quant.get("quant_method") != "mxfp4" \
            or source_dir is None:
        return {}
    files = tensor_files(Path(source_dir))
    out = {}
    for name, file in files.items():
        module, _, param = name.rpartition(".")
        split = {f"{es.fused_gate_up}_blocks": (es.gate, es.up),
                 f"{es.fused_down}_blocks": (es.down,)}.get(param)
        if split is None:
            continue
        experts = safetensors_header(file)[0][name]["shape"][0]
        scales = name[: -len("_blocks")] + "_scales"
        for part, linear in enumerate(split):
            gname, _ = spec.gguf_tensor(f"{module}.0.{linear}.weight")
            for e in range(experts):
                out[(gname, e)] = lambda a=(file, name, files[scales], scales, e, part, len(split)): \
                    _ggml_mxfp4(*a, interleaved=es.gate_up_interleaved)
    return out


def _ggml_mxfp4(blocks_file: Path, blocks_name: str, scales_file: Path, scales_name: str,
                expert: int, part: int, parts: int, interleaved: bool) -> np.ndarray:
    """One expert's rows of a checkpoint MXFP4 tensor as ggml block_mxfp4 (E8M0 byte, then 16
    bytes: element j in byte j's low nibble, j + 16 in its high nibble), from the checkpoint's
    blocks (element 2j low, 2j + 1 high) and scales. `part` of `parts` picks gate or up rows
    of a fused gate_up (even / odd rows when interleaved, else halves)."""
    from safetensors import safe_open

    with safe_open(str(blocks_file), framework="pt") as f:
        blocks = f.get_slice(blocks_name)[expert]
    with safe_open(str(scales_file), framework="pt") as f:
        scales = f.get_slice(scales_name)[expert]
    if parts > 1:
        rows = blocks.shape[0] // parts
        pick = slice(part, None, parts) if interleaved else slice(part * rows, (part + 1) * rows)
        blocks, scales = blocks[pick], scales[pick]
    codes = torch.stack((blocks & 15, blocks >> 4), -1).flatten(-2)  # (rows, G, 32)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat((scales[..., None], qs), -1).flatten(-2).contiguous().numpy()


# 2-D weights the converter always writes as F32, whatever --outtype (base.py forces the MoE
# router, ffn_gate_inp, and the shared expert's one-row gate, ffn_gate_inp_shexp, to F32;
# llama-quantize never quantizes either: the router by name, the gate as one-row, 1-D in ggml)
_F32_WEIGHTS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")


class _TensorList:
    """The GGUF's tensors in file order, each made only when it is written.

    A routed expert's weights arrive as one 2-D slice per expert (HF's per-expert Linears);
    llama.cpp wants one 3-D tensor per block and projection, experts stacked on the slowest
    axis (torch (E, rows, cols), GGUF ne [cols, rows, E]). The stack of one such tensor is
    built right before its bytes go to the file and dropped right after, so writing holds one
    block's tensor at a time beside the per-expert pieces, never a second copy of the model.
    """

    def __init__(self):
        self._entries: dict[str, tuple[Q, dict[int | None, object]]] = {}

    def add(self, gname: str, expert: int | None, make, qtype: Q) -> None:
        kind, parts = self._entries.setdefault(gname, (qtype, {}))
        if kind != qtype or expert in parts:
            raise UnsupportedArchitecture(
                f"GGUF tensor {gname} gets {'expert ' + str(expert) if expert is not None else 'a tensor'} "
                f"twice or with two types ({kind.name}, {qtype.name}).",
                "Every expert of a block must be quantized to one type, once.")
        parts[expert] = make

    def _array(self, parts: dict) -> np.ndarray:
        if None in parts:
            return parts[None]()
        if sorted(parts) != list(range(len(parts))):
            raise UnsupportedArchitecture(f"Experts {sorted(parts)} are not 0..{len(parts) - 1}.")
        return np.stack([parts[e]() for e in range(len(parts))])

    def write(self, w: GGUFWriter) -> None:
        shapes = {}
        for gname, (qtype, parts) in self._entries.items():
            first = parts[min(parts, key=lambda e: -1 if e is None else e)]()
            shape = first.shape if None in parts else (len(parts), *first.shape)
            nbytes = first.nbytes * (1 if None in parts else len(parts))
            raw = None if first.dtype in (np.float32, np.float16) else qtype
            w.add_tensor_info(gname, shape, first.dtype, nbytes, raw_dtype=raw)
            shapes[gname] = nbytes
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for gname, (_, parts) in self._entries.items():
            array = self._array(parts)
            if array.nbytes != shapes[gname]:
                raise UnsupportedArchitecture(f"GGUF tensor {gname}: experts of unequal sizes.")
            w.write_tensor_data(array)


def gguf_permuted_heads(spec: ArchSpec, config: dict) -> dict[str, int]:
    """{GGUF base name: heads} of the tensors llama.cpp's rotary row order applies to (q/k of
    archs with ArchSpec.gguf_permute_qk)."""
    if not spec.gguf_permute_qk:
        return {}
    n_head = config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads") or n_head
    out = {}
    for i in range(config.get("num_hidden_layers") or len(config["layers_block_type"])):
        out[f"blk.{i}.attn_q"], out[f"blk.{i}.attn_k"] = n_head, n_kv
    return out


def gguf_pieces(spec: ArchSpec, config: dict, name: str, t: torch.Tensor,
                permute: dict[str, int]) -> list[tuple[str, int | None, torch.Tensor]]:
    """The GGUF tensors one checkpoint tensor becomes, as the converter lays them out:
    [(GGUF name, expert index or None, values)]. A split Linear (ArchSpec.split_pieces:
    deepseek2's kv_b_proj per head, qwen3next's in_proj_qkvz rows) gives its pieces; q/k rows
    in llama.cpp's rotary order (`permute`: gguf_permuted_heads); norm offsets and the arch's
    value transforms (ArchSpec.gguf_transform); bare names (ArchSpec.gguf_bare). The writer
    stores these values (dense tensors) and verify compares a file with them."""
    pieces = [(name, t)]
    module, _, suffix = name.rpartition(".")
    prefix = spec.block_path + "."
    bid, _, rel = module[len(prefix):].partition(".") if module.startswith(prefix) else ("", "", "")
    if suffix == "weight" and rel and spec.gguf_split(rel):
        pieces = [(f"{base.format(bid=int(bid))}.weight", piece)
                  for base, piece in spec.split_pieces(rel, t, config)]
    out = []
    for piece_name, piece in pieces:
        slot = spec.gguf_tensor(piece_name) if not piece_name.startswith("blk.") else \
            (piece_name, None)
        if slot is None:
            raise UnsupportedArchitecture(
                f"Cannot express tensor {piece_name} in GGUF for architecture {spec.gguf_arch}.",
                "Only the tensors of a plain decoder (embeddings, attention, MLP, norms, "
                "routers and experts) map.")
        gname, expert = slot
        base = gname.rsplit(".", 1)[0]
        if base in permute:
            piece = _permute(piece, permute[base])
        if gname.endswith("norm.weight") and spec.norm_offset:
            piece = piece.float() + spec.norm_offset
        if spec.gguf_transform is not None:
            piece = spec.gguf_transform(gname, piece, config)
        if gname.endswith(".weight") and base.rpartition(".")[2] in spec.gguf_bare:
            gname = base  # the writer stores it as a float tensor: F32
        out.append((gname, expert, piece))
    return out


def _result_pieces(spec: ArchSpec, results: dict[str, QuantResult], config: dict):
    """(name, result) of every GGUF tensor the results hold. A split Linear's result
    (ArchSpec.gguf_split) carries its pieces in split_bases order: extra "gguf_piece{i}_bytes"
    ((heads,) rows, row bytes), "gguf_piece{i}_type", "gguf_piece{i}_wanted_type"; each comes
    out under its GGUF name."""
    prefix = spec.block_path + "."
    for name, res in results.items():
        bid, _, rel = name[len(prefix):].partition(".") if name.startswith(prefix) else ("", "", "")
        if not spec.gguf_split(rel):
            yield name, res
            continue
        for i, base in enumerate(spec.split_bases(rel, config)):
            data, qtype = res.extra[f"gguf_piece{i}_bytes"], res.extra[f"gguf_piece{i}_type"]
            block, type_size = GGML_QUANT_SIZES[Q(int(qtype))]
            piece = QuantResult(  # codes: the piece's [rows, row width] (per head), no storage
                name=base.format(bid=int(bid)), scheme=res.scheme,
                codes=torch.zeros((), dtype=torch.uint8).expand(
                    data.shape[-2], data.shape[-1] // type_size * block),
                scale=res.scale, loss=res.loss,
                extra={"gguf_bytes": data, "gguf_type": qtype,
                       "gguf_wanted_type": res.extra[f"gguf_piece{i}_wanted_type"]})
            yield piece.name, piece


def _permute(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's rotary row order: per head, interleaved halves -> (pairs) along rows."""
    rows = t.shape[0]
    return t.reshape(n_head, 2, rows // n_head // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)


def _rope_factors_llama3(p: dict, head_dim: int) -> np.ndarray:
    """rope_freqs for rope_type "llama3": per frequency 1, factor, or the smooth blend."""
    base = p.get("rope_theta", 10000.0)
    factor = p.get("factor", 8.0)
    lo, hi = p.get("low_freq_factor", 1.0), p.get("high_freq_factor", 4.0)
    old_ctx = p.get("original_max_position_embeddings", 8192)
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old_ctx / hi:
            out.append(1.0)
        elif wavelen > old_ctx / lo:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _check_config(spec: ArchSpec, config: dict) -> None:
    """Refuse configs whose behaviour GGUF (as written here) would not reproduce."""
    if spec.gguf_arch is None:
        why = ""
        if spec.gguf_unwritten:
            from gguf import MODEL_ARCH_NAMES

            why = (f" llama.cpp's converter writes it as its {spec.gguf_unwritten} architecture, "
                   + ("which the gguf package quantkit runs with does not have (no tensor name "
                      "can come from its TensorNameMap)." if spec.gguf_unwritten not in
                      MODEL_ARCH_NAMES.values() else "which quantkit does not write yet."))
        raise UnsupportedArchitecture(f"No GGUF writer for architecture {spec.name}.{why}",
                                      f"GGUF export supports: {', '.join(gguf_architectures())}.")
    rope = GGUFFileWriter._rope(config)
    rtype = rope.get("rope_type", "").lower()
    ok = {"", "default", "linear", "yarn"} | set(spec.gguf_rope_types)
    if rtype not in ok:
        raise UnsupportedArchitecture(f"RoPE scaling {rtype!r} is not written by quantkit's GGUF "
                                      f"writer for {spec.gguf_arch}.", f"Supported: {sorted(ok)}.")
    pattern = spec.gguf_swa_pattern
    if pattern and config.get("layer_types"):
        want = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                for i in range(config["num_hidden_layers"])]
        if list(config["layer_types"]) != want:
            raise UnsupportedArchitecture(
                f"layer_types {config['layer_types']} differ from llama.cpp's {spec.gguf_arch} "
                f"pattern (every {({2: '2nd'}).get(pattern, f'{pattern}th')} layer global).",
                "llama.cpp would run other layers with sliding-window attention; use another format.")
    if config.get("use_sliding_window"):
        raise UnsupportedArchitecture("Sliding-window attention is not written to GGUF by quantkit.")
    if config.get("attention_bias") and not spec.gguf_attention_bias:
        raise UnsupportedArchitecture(f"{spec.gguf_arch} with attention biases has no llama.cpp layout.")
    if spec.gguf_check is not None:
        spec.gguf_check(config)


def _check_mtp(spec: ArchSpec, config: dict, source_dir: Path) -> None:
    """MTP layers go into llama.cpp's GGUF as extra nextn blocks where its converter writes
    them for the arch (ArchSpec.gguf_nextn_key); elsewhere a file without them would silently
    lose the model's speculative decoding: refused before any work."""
    from quantkit.model_io import mtp_tensor_names

    mtp = mtp_tensor_names(source_dir, config, spec.block_path)
    if not mtp:
        return
    if spec.gguf_nextn_key is None:
        from quantkit.arch.gguf_names import gguf_has_nextn

        why = spec.gguf_no_mtp or (
            f"the gguf package quantkit runs with names no nextn (MTP) tensors for "
            f"{spec.gguf_arch}" if not gguf_has_nextn(spec.gguf_arch) else
            f"quantkit does not write {spec.gguf_arch}'s nextn (MTP) blocks yet")
        raise UnsupportedArchitecture(
            f"The checkpoint holds {len(mtp)} multi-token-prediction (MTP) tensors (e.g. "
            f"{mtp[0]}): {why}, and a GGUF without them would drop them silently.",
            "Use --format compressed-tensors (it keeps the MTP layers), or convert a copy of "
            "the checkpoint without its MTP tensors, knowing that speculative decoding with "
            "them is then lost.")
    if spec.gguf_nextn_layers(config) == 0:
        raise UnsupportedArchitecture(
            f"The checkpoint holds {len(mtp)} MTP tensors (e.g. {mtp[0]}) but config.json's "
            f"{spec.gguf_nextn_key} says 0 nextn blocks (or is absent): quantkit counts the "
            "nextn blocks of a GGUF from the config.",
            f"Set {spec.gguf_nextn_key} to the number of MTP blocks the checkpoint holds.")


def _special_tokens(spec: ArchSpec, tok) -> None:
    """The arch's special tokens by their text (ArchSpec.gguf_special_tokens), each kind only
    where the tokenizer's own files did not set it, as the converter's
    SpecialVocab._set_special_token; a token the vocabulary lacks is refused (the converter's
    vocabulary path fails on it)."""
    if not spec.gguf_special_tokens:
        return
    ids = {t: i for i, t in enumerate(tok.tokens)}
    missing = [text for _, text in spec.gguf_special_tokens if text not in ids]
    if missing:
        raise UnsupportedArchitecture(
            f"The tokenizer has no {', '.join(missing)}: llama.cpp's {spec.gguf_arch} "
            "vocabulary sets its special tokens from them (its converter fails without).",
            "Use the model's own tokenizer files.")
    for kind, text in spec.gguf_special_tokens:
        tok.special.special_token_ids.setdefault(kind, ids[text])


class GGUFFileWriter(FormatWriter):
    name = "gguf"
    engines = ("llama.cpp",)
    single_file = True  # the pipeline hands write() a file path, and no side files are written
    embeds_source = True  # tokenizer and config go into the file's metadata
    sizes_overhead = True
    mtp_as_blocks = True  # nextn blocks, quantized as llama-quantize quantizes them

    def check(self, scheme: QuantScheme, shapes: dict[str, tuple[int, int]]) -> list[str]:
        problems = []
        if scheme.kind != "kquant":
            problems.append(f"GGUF stores kquant schemes (--method gguf), not {scheme.kind!r}")
        if (scheme.gguf_type or "").lower() not in GGUF_TYPES:
            problems.append(f"gguf_type {scheme.gguf_type!r} is not one of {', '.join(GGUF_TYPES)}")
        return problems

    def check_source(self, source_dir: Path, config) -> None:
        """Architecture, RoPE and tokenizer must be expressible before any work is done."""
        cfg = config if isinstance(config, dict) else config.to_dict()
        spec = spec_for_config(cfg)
        _check_config(spec, cfg)
        _check_mtp(spec, cfg, Path(source_dir))
        tok = read_tokenizer(source_dir, cfg.get("vocab_size"))
        _special_tokens(spec, tok)
        self._tokenizer = (Path(source_dir), tok)

    def write(self, out_file: Path, *, config: dict, dense: dict[str, torch.Tensor],
              results: dict[str, QuantResult], ignore: list[str] | None = None,
              dtype: torch.dtype | None = None, scheme: QuantScheme | None = None,
              meta: dict | None = None, source_dir: Path | None = None) -> None:
        spec = spec_for_config(config)
        _check_config(spec, config)
        gtype = ((scheme.gguf_type if scheme else None) or "f16").lower()
        if gtype not in GGUF_TYPES:
            raise SchemeMismatch(f"gguf_type {gtype!r} is not one of {', '.join(GGUF_TYPES)}.")
        ftype, dense_2d = file_type(gtype)
        stored = _stored_mxfp4_experts(spec, config, source_dir) if gtype in ("bf16", "f16") \
            else {}
        if stored:  # the converter's file type when experts stay MXFP4 (LlamaFileType)
            ftype = int(LlamaFileType.MOSTLY_MXFP4_MOE)
        w = _FastArrayWriter(str(out_file), spec.gguf_arch)
        self._metadata(w, spec, config, ftype, meta)
        if source_dir is not None:
            cached = getattr(self, "_tokenizer", None)
            tok = cached[1] if cached and cached[0] == Path(source_dir) else \
                read_tokenizer(Path(source_dir), config.get("vocab_size"))
            _special_tokens(spec, tok)
            tok.add_to(w)
        permute = gguf_permuted_heads(spec, config)
        tensors = _TensorList()
        notes, stats = [], {}
        for name, res in _result_pieces(spec, results, config):
            slot = spec.gguf_tensor(name + ".weight") if not name.startswith("blk.") else \
                (name + ".weight", None)
            if slot is None:
                raise UnsupportedArchitecture(f"Cannot express quantized tensor {name} in GGUF.")
            gname, expert = slot
            if slot in stored:  # the checkpoint's own MXFP4 bytes, as the converter writes them
                tensors.add(gname, expert, stored[slot], Q.MXFP4)
                if res.bias is not None:
                    dense = {**dense, name + ".bias": res.bias}
                continue
            qtype = Q(int(res.extra["gguf_type"]))
            data = res.extra["gguf_bytes"]
            if gname[:-len(".weight")] in permute:
                data = _permute(data, permute[gname[:-len(".weight")]])
            tensors.add(gname, expert, lambda d=data: d.numpy(), qtype)
            wanted = Q(int(res.extra.get("gguf_wanted_type", res.extra["gguf_type"])))
            note = f"{gname}: {wanted.name} -> {qtype.name} (row width {res.shape[1]})"
            if wanted != qtype and note not in notes:
                notes.append(note)
            stats[gname if expert is None else f"{gname}[{expert}]"] = {
                "type": qtype.name, "rel_error": res.loss,
                **({"fallback": res.fallback} if getattr(res, "fallback", None) else {})}
            if res.bias is not None:
                dense = {**dense, name + ".bias": res.bias}
        pieces = ((gname, expert, t) for name, t in dense.items()
                  for gname, expert, t in gguf_pieces(spec, config, name, t, permute))
        for gname, expert, t in pieces:
            if (gname, expert) in stored:
                tensors.add(gname, expert, stored[(gname, expert)], Q.MXFP4)
                continue
            # llama-quantize writes every tensor with ggml's dimensions, trailing 1s dropped:
            # a one-row gate (ffn_gate_inp_shexp, [n_embd, 1] in the converter's file) is 1-D
            # in its output
            while gtype not in ("bf16", "f16", "f32") and t.dim() > 1 and t.shape[0] == 1:
                t = t[0]
            if (t.dim() <= 1 or gname.endswith("_norm.weight") or not gname.endswith(".weight")
                    or gname.endswith(_F32_WEIGHTS)):
                tensors.add(gname, expert, lambda t=t: t.float().numpy(), Q.F32)
            elif dense_2d == Q.BF16 or (t.dtype == torch.bfloat16 and any(
                    n in gname for n in NEVER_QUANTIZED)):  # as llama-quantize keeps it
                tensors.add(gname, expert, lambda t=t: t.to(torch.bfloat16).contiguous()
                            .view(torch.uint8).numpy(), Q.BF16)
            else:
                tensors.add(gname, expert, lambda t=t: t.to(torch.float16).numpy(), Q.F16)
        rope = self._rope(config)
        if rope.get("rope_type", "").lower() == "llama3" and "llama3" in spec.gguf_rope_types:
            factors = _rope_factors_llama3(rope, self._head_dim(config))
            tensors.add("rope_freqs.weight", None, lambda: factors, Q.F32)
        elif rope.get("rope_type", "").lower() == "proportional":
            factors = _rope_factors_proportional(config)
            tensors.add("rope_freqs.weight", None, lambda: factors, Q.F32)
        if notes:
            w.add_array("quantkit.fallbacks", notes)
        if stats:
            w.add_string("quantkit.stats", json.dumps(stats))
        tensors.write(w)
        w.close()

    # ------------------------------------------------------------------ metadata
    @staticmethod
    def _rope(config: dict, layer_type: str = "full_attention") -> dict:
        """RoPE parameters (of the global layers where each layer type has its own: Gemma 3)."""
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        if isinstance(rope.get(layer_type), dict):
            rope = dict(rope[layer_type])
        elif any(isinstance(v, dict) for v in rope.values()):
            return {}
        rope.setdefault("rope_type", rope.get("type", ""))
        if "rope_theta" not in rope and config.get("rope_theta") is not None:
            rope["rope_theta"] = config["rope_theta"]
        return rope

    @staticmethod
    def _head_dim(config: dict) -> int:
        return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]

    def overhead_bytes(self, config, float_values: int, n_tensors: int) -> int:
        """Bytes a file will hold beyond its weight matrices (an upper estimate, for a size
        budget chosen before writing): the metadata and tokenizer keys as packed, the 1-D
        tensors (F32), and per tensor its info, alignment and quantkit.* entries."""
        cfg = config if isinstance(config, dict) else config.to_dict()
        spec = spec_for_config(cfg)
        w = _FastArrayWriter(None, spec.gguf_arch)
        self._metadata(w, spec, cfg, 0, None)
        cached = getattr(self, "_tokenizer", None)
        if cached is not None:
            cached[1].add_to(w)
        kv = sum(len(w._pack_val(k, GGUFValueType.STRING, add_vtype=False))
                 + len(w._pack_val(v.value, v.type, add_vtype=True, sub_type=v.sub_type))
                 for k, v in w.kv_data[0].items())
        return 24 + kv + 4 * float_values + n_tensors * _PER_TENSOR_OVERHEAD + _METADATA_SLACK

    def _metadata(self, w: GGUFWriter, spec: ArchSpec, config: dict, ftype: int | None,
                  meta: dict | None) -> None:
        w.add_type("model")
        src = (meta or {}).get("source_model", {})
        w.add_name(str(config.get("_model_name_or_path") or config.get("_name_or_path")
                       or src.get("name_or_path") or spec.name))
        w.add_block_count(spec.gguf_block_count(config))  # the nextn (MTP) blocks included
        w.add_context_length(config.get("max_position_embeddings") or 2048)
        w.add_embedding_length(config["hidden_size"])
        ff = next((config[k] for k in spec.gguf_feed_forward if config.get(k) is not None), None)
        if ff is not None:
            w.add_feed_forward_length(int(ff))
        w.add_head_count(config["num_attention_heads"])
        # MLA runs as multi-query attention over the latent in llama.cpp: one KV head
        w.add_head_count_kv(1 if "mla" in spec.gguf_kv else
                            config.get("num_key_value_heads") or config["num_attention_heads"])
        rope = self._rope(config)
        if rope.get("rope_theta") is not None:
            w.add_rope_freq_base(float(rope["rope_theta"]))
        w.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
        for key in spec.gguf_kv:
            _OPTIONAL_KV[key](w, config)
        rtype, factor = rope.get("rope_type", "").lower(), rope.get("factor")
        if rtype == "linear" and factor:
            w.add_rope_scaling_type(_rope_scaling("LINEAR"))
            w.add_rope_scaling_factor(float(factor))
        elif rtype == "yarn" and factor:
            w.add_rope_scaling_type(_rope_scaling("YARN"))
            w.add_rope_scaling_factor(float(factor))
            w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
            # the converter's optional YaRN keys, each written when the config sets it
            for key, add in (("extrapolation_factor", w.add_rope_scaling_yarn_ext_factor),
                             ("attention_factor", w.add_rope_scaling_yarn_attn_factor),
                             ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                             ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
                value = rope.get(key, rope.get("attn_factor") if key == "attention_factor" else None)
                if value is not None:
                    add(float(value))
        if ftype is not None:
            w.add_file_type(ftype)
        w.add_quantization_version(2)
        if meta:
            w.add_string("quantkit.version", str(meta.get("quantkit_version", "")))
            w.add_string("quantkit.method", str(meta.get("method", "")))
            w.add_string("quantkit.metadata", json.dumps(meta, default=str))


def _rope_dims(config: dict) -> int:
    rope = GGUFFileWriter._rope(config)
    part = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    return int(part * GGUFFileWriter._head_dim(config))


def _head_dim_lengths(w: GGUFWriter, config: dict) -> None:
    w.add_key_length(GGUFFileWriter._head_dim(config))
    w.add_value_length(GGUFFileWriter._head_dim(config))


def _swa_rope_base(w: GGUFWriter, config: dict) -> None:
    theta = GGUFFileWriter._rope(config, "sliding_attention").get("rope_theta")
    if theta is not None:
        w.add_rope_freq_base_swa(float(theta))


def _orig_ctx(w: GGUFWriter, config: dict) -> None:
    rope = GGUFFileWriter._rope(config)
    w.add_rope_scaling_orig_ctx_len(int(rope.get("original_max_position_embeddings")
                                        or config["original_max_position_embeddings"]))


def _softcap(w: GGUFWriter, config: dict) -> None:
    if config.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(float(config["final_logit_softcapping"]))


def _mla(w: GGUFWriter, c: dict) -> None:
    """Multi-head latent attention as llama.cpp's deepseek2 reads it: the cached latent is
    the key (kv_lora_rank + rope dims) and the value (kv_lora_rank); the *_mla lengths are
    the decompressed heads'."""
    if c.get("q_lora_rank"):
        w.add_q_lora_rank(int(c["q_lora_rank"]))
    kv_lora, rope = int(c["kv_lora_rank"]), int(c["qk_rope_head_dim"])
    w.add_kv_lora_rank(kv_lora)
    w.add_key_length(kv_lora + rope)
    w.add_value_length(kv_lora)
    w.add_key_length_mla(int(c["qk_nope_head_dim"]) + rope)
    w.add_value_length_mla(int(c["v_head_dim"]))
    w.add_rope_dimension_count(rope)


def _expert_groups(w: GGUFWriter, c: dict) -> None:
    if c.get("n_group") is not None:
        w.add_expert_group_count(int(c["n_group"]))
    if c.get("topk_group") is not None:
        w.add_expert_group_used_count(int(c["topk_group"]))


def _expert_shared(w: GGUFWriter, c: dict) -> None:
    w.add_expert_shared_count(int(c.get("n_shared_experts") or 0))
    if c.get("routed_scaling_factor") is not None:
        w.add_expert_weights_scale(float(c["routed_scaling_factor"]))
    if c.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)


def _expert_shared_glm(w: GGUFWriter, c: dict) -> None:
    """GLM-4.5's shared experts and routing scale / renormalisation, each written where the
    config sets it (False too), as the converter's Glm4MoeModel."""
    if c.get("n_shared_experts") is not None:
        w.add_expert_shared_count(int(c["n_shared_experts"]))
    if c.get("routed_scaling_factor") is not None:
        w.add_expert_weights_scale(float(c["routed_scaling_factor"]))
    if c.get("norm_topk_prob") is not None:
        w.add_expert_weights_norm(bool(c["norm_topk_prob"]))


def _yarn_log_mul(w: GGUFWriter, c: dict) -> None:
    mscale_all = GGUFFileWriter._rope(c).get("mscale_all_dim")
    if mscale_all is not None:  # the converter's 0.1 x (llama.cpp divides it back out)
        w.add_rope_scaling_yarn_log_mul(0.1 * float(mscale_all))


def _gating(name: str):
    from gguf import ExpertGatingFuncType

    return getattr(ExpertGatingFuncType, name)


def _gemma4_head_dim_full(c: dict) -> int:
    """Gemma 4's global layers' head size: global_head_dim, else the per_layer_config entry of
    the first full-attention layer that sets one (as the converter reads it)."""
    if c.get("global_head_dim"):
        return int(c["global_head_dim"])
    types = c.get("layer_types") or []
    for idx, layer in (c.get("per_layer_config") or {}).items():
        if int(idx) < len(types) and types[int(idx)] == "full_attention" and "head_dim" in layer:
            return int(layer["head_dim"])
    raise UnsupportedArchitecture("Gemma 4 config names no head size for its global layers "
                                  "(global_head_dim or per_layer_config).")


def _gemma4_layers(w: GGUFWriter, c: dict) -> None:
    """Gemma 4's per-layer-type sizes: global layers' head size (rotated in full, their
    proportional RoPE leaving pairs out through rope_freqs), the sliding layers' own head size
    and partial rotation, the sliding pattern, per-layer input width, KV-shared layers."""
    full, swa = _gemma4_head_dim_full(c), int(c["head_dim"])
    w.add_key_length(full)
    w.add_value_length(full)
    w.add_shared_kv_layers(int(c.get("num_kv_shared_layers") or 0))
    w.add_embedding_length_per_layer_input(int(c.get("hidden_size_per_layer_input") or 0))
    w.add_sliding_window_pattern([t == "sliding_attention" for t in c["layer_types"]])
    w.add_key_length_swa(swa)
    w.add_value_length_swa(swa)
    w.add_rope_dimension_count(full)
    part = GGUFFileWriter._rope(c, "sliding_attention").get("partial_rotary_factor", 1.0)
    w.add_rope_dimension_count_swa(int(swa * part))


def _gated_deltanet(w: GGUFWriter, c: dict) -> None:
    """Qwen3.5 / Qwen3-Next linear attention as llama.cpp's qwen35 / qwen3next read it: the
    SSM sizes, which layers are recurrent, and the full layers' partial RoPE width."""
    w.add_ssm_conv_kernel(int(c["linear_conv_kernel_dim"]))
    w.add_ssm_state_size(int(c["linear_key_head_dim"]))
    w.add_ssm_group_count(int(c["linear_num_key_heads"]))
    w.add_ssm_time_step_rank(int(c["linear_num_value_heads"]))
    w.add_ssm_inner_size(int(c["linear_value_head_dim"]) * int(c["linear_num_value_heads"]))
    if c.get("layer_types") is not None:
        # {arch}.attention.recurrent_layers (the gguf package 0.19 has no add_ method for it)
        w.add_array(f"{w.arch}.attention.recurrent_layers",
                    [t == "linear_attention" for t in c["layer_types"]])
    w.add_full_attention_interval(int(c.get("full_attention_interval", 4)))
    part = GGUFFileWriter._rope(c).get("partial_rotary_factor",
                                       c.get("partial_rotary_factor", 0.25))
    w.add_rope_dimension_count(int(GGUFFileWriter._head_dim(c) * part))


def _drop_key(w: GGUFWriter, key: str) -> None:
    """Leave out a common key the converter does not write for this arch."""
    w.kv_data[0].pop(key.format(arch=w.arch), None)


def _mamba2(w: GGUFWriter, c: dict, heads: int, head_dim: int, groups: int, state: int,
            conv: int) -> None:
    """Mamba2 mixers as llama.cpp's mamba-base reads them (the converter's GraniteHybrid
    keys): conv kernel, inner size (heads x head size), state size, heads as the time-step
    rank, groups of B/C."""
    w.add_ssm_conv_kernel(conv)
    w.add_ssm_state_size(state)
    w.add_ssm_group_count(groups)
    w.add_ssm_inner_size(heads * head_dim)
    w.add_ssm_time_step_rank(heads)


def _nemotron_h(w: GGUFWriter, c: dict) -> None:
    """Nemotron-H as llama.cpp's nemotron_h_moe reads it: per layer 0 KV heads and 0 FFN
    length mark a Mamba2 layer, KV heads an attention layer, the experts' width a MoE layer;
    no RoPE (rope finetuned false, context 2^20 as the converter writes it); its one
    LayerNorm epsilon (llama.cpp uses it for the RMSNorms as well, no RMS key)."""
    kinds = [{"linear_attention": "mamba", "full_attention": "attention"}.get(k, k)
             for k in c["layers_block_type"]]
    _drop_key(w, "{arch}.attention.layer_norm_rms_epsilon")
    w.add_context_length(2 ** 20)
    w.add_vocab_size(int(c["vocab_size"]))
    w.add_rope_dimension_count(int(c["head_dim"]))
    w.add_key_length(int(c["head_dim"]))
    w.add_value_length(int(c["head_dim"]))
    w.add_layer_norm_eps(float(c["layer_norm_epsilon"]))
    w.add_head_count_kv([int(c["num_key_value_heads"]) if k == "attention" else 0 for k in kinds])
    w.add_feed_forward_length([int(c["moe_intermediate_size"]) if k == "moe" else 0 for k in kinds])
    _mamba2(w, c, int(c["mamba_num_heads"]), int(c["mamba_head_dim"]), int(c["n_groups"]),
            int(c["ssm_state_size"]), int(c["conv_kernel"]))
    w.add_rope_scaling_finetuned(False)
    w.add_expert_count(int(c["n_routed_experts"]))
    w.add_expert_used_count(int(c["num_experts_per_tok"]))
    w.add_expert_group_count(int(c.get("n_group") or 1))
    w.add_expert_group_used_count(int(c.get("topk_group") or 1))
    w.add_expert_feed_forward_length(int(c["moe_intermediate_size"]))
    w.add_expert_shared_feed_forward_length(int(c["moe_shared_expert_intermediate_size"]))
    w.add_expert_shared_count(int(c["n_shared_experts"]))
    w.add_expert_weights_norm(bool(c["norm_topk_prob"]))
    w.add_expert_weights_scale(float(c["routed_scaling_factor"]))


def _granite_hybrid(w: GGUFWriter, c: dict) -> None:
    """Granite 4 hybrid as llama.cpp's granitehybrid reads it: Granite's multipliers (each
    where the config sets one), the experts and the shared expert's width, per layer 0 KV
    heads for a Mamba2 layer (either layer_types spelling), the Mamba2 sizes, and no RoPE
    (rope finetuned false, context 2^20, as the converter writes a hybrid)."""
    for key, add in (("attention_multiplier", w.add_attention_scale),
                     ("embedding_multiplier", w.add_embedding_scale),
                     ("residual_multiplier", w.add_residual_scale),
                     ("logits_scaling", w.add_logit_scale)):
        if c.get(key):
            add(float(c[key]))
    w.add_expert_count(int(c["num_local_experts"]))
    w.add_expert_used_count(int(c["num_experts_per_tok"]))
    w.add_expert_shared_feed_forward_length(int(c["shared_intermediate_size"]))
    w.add_head_count_kv([int(c["num_key_value_heads"]) if k in ("attention", "full_attention")
                         else 0 for k in c["layer_types"]])
    _mamba2(w, c, int(c["mamba_n_heads"]), int(c["mamba_d_head"]), int(c["mamba_n_groups"]),
            int(c["mamba_d_state"]), int(c["mamba_d_conv"]))
    w.add_rope_scaling_finetuned(False)
    w.add_context_length(2 ** 20)


def _rope_factors_proportional(config: dict) -> np.ndarray:
    """rope_freqs of Gemma 4's global layers ("proportional" RoPE rotates the first
    partial_rotary_factor of each half): 1 for the rotated pairs, 1e30 (no rotation) after."""
    full = _gemma4_head_dim_full(config)
    n_rot = int(full * GGUFFileWriter._rope(config)["partial_rotary_factor"] / 2)
    return np.asarray([1.0] * n_rot + [1e30] * (full // 2 - n_rot), dtype=np.float32)


# ArchSpec.gguf_kv key -> how that {arch}.* key is written (as llama.cpp's converter does)
_OPTIONAL_KV = {
    "vocab_size": lambda w, c: w.add_vocab_size(c["vocab_size"]),
    "rope_dimension_count": lambda w, c: w.add_rope_dimension_count(_rope_dims(c)),
    "head_dim_if_set": lambda w, c: c.get("head_dim") and _head_dim_lengths(w, c),
    "head_dim": _head_dim_lengths,
    "rope_freq_base_swa": _swa_rope_base,
    "sliding_window": lambda w, c: w.add_sliding_window(int(c["sliding_window"])),
    "sliding_window_or_0": lambda w, c: w.add_sliding_window(int(c.get("sliding_window") or 0)),
    "final_logit_softcapping": _softcap,
    "rope_scaling_original_context": _orig_ctx,
    "expert_count": lambda w, c: w.add_expert_count(
        _first(c, "num_local_experts", "num_experts", "n_routed_experts")),
    "mla": _mla,
    "expert_groups": _expert_groups,
    "leading_dense_block_count": lambda w, c: w.add_leading_dense_block_count(
        int(c.get("first_k_dense_replace") or 0)),
    "expert_shared": _expert_shared,
    "expert_shared_glm": _expert_shared_glm,
    # how many nextn (MTP) blocks follow the trunk's, whenever the config sets it (GLM-4.5)
    "nextn_if_set": lambda w, c: c.get("num_nextn_predict_layers") is not None
    and w.add_nextn_predict_layers(int(c["num_nextn_predict_layers"])),
    # transformers' DeepseekV3TopkRouter always scores with a sigmoid; llama.cpp's deepseek2
    # takes softmax when the key is absent (DeepSeek-V2 files), and llama.cpp's converter
    # writes it only from a config's scoring_func, which DeepseekV3Config lacks
    "expert_gating_sigmoid": lambda w, c: w.add_expert_gating_func(_gating("SIGMOID")),
    "yarn_log_mul": _yarn_log_mul,
    # mistral3 (Ministral 3): the converter writes mscale_all_dim as it is
    "yarn_log_mul_mscale": lambda w, c: w.add_rope_scaling_yarn_log_mul(
        float(GGUFFileWriter._rope(c)["mscale_all_dim"])),
    "attn_temperature_scale": lambda w, c: w.add_attn_temperature_scale(
        float(GGUFFileWriter._rope(c)["llama_4_scaling_beta"])),
    # which layers use sliding-window attention, from layer_types (OLMo 3: llama.cpp's olmo2
    # reads it per layer; without layer_types OLMo 3's default, every 4th layer global)
    "sliding_window_pattern": lambda w, c: w.add_sliding_window_pattern(
        [t == "sliding_attention" for t in c["layer_types"]] if c.get("layer_types") else
        [(i + 1) % 4 != 0 for i in range(c["num_hidden_layers"])]),
    "gemma4_layers": _gemma4_layers,
    "gated_deltanet": _gated_deltanet,
    "nemotron_h": _nemotron_h,
    "granite_hybrid": _granite_hybrid,
    "mrope_sections": lambda w, c: w.add_rope_dimension_sections(
        list(GGUFFileWriter._rope(c).get("mrope_section") or [11, 11, 10, 0])),
    "expert_used_count": lambda w, c: w.add_expert_used_count(int(c["num_experts_per_tok"])),
    "expert_feed_forward_length": lambda w, c: w.add_expert_feed_forward_length(
        int(c["moe_intermediate_size"])),
    # Qwen2-MoE's line (Qwen3.5-MoE, Qwen3-Next): the shared expert's width, when set
    "expert_shared_feed_forward_length": lambda w, c: c.get("shared_expert_intermediate_size")
    is not None and w.add_expert_shared_feed_forward_length(int(c["shared_expert_intermediate_size"])),
    # Llama 4: which layers are MoE (llama.cpp: every n-th)
    "interleave_moe_layer_step": lambda w, c: w.add_interleave_moe_layer_step(
        int(c["interleave_moe_layer_step"])),
    # MiniMax-M2's RoPE width: its checkpoints' rotary_dim, else partial_rotary_factor x head_dim
    "rotary_dim": lambda w, c: w.add_rope_dimension_count(
        int(c["rotary_dim"]) if c.get("rotary_dim") else _rope_dims(c)),
    # gpt-oss: its experts are intermediate_size wide
    "expert_feed_forward_length_intermediate": lambda w, c: w.add_expert_feed_forward_length(
        int(c["intermediate_size"])),
}


def _first(config: dict, *keys: str) -> int:
    """The first of `keys` set in config (transformers 5 writes num_experts as num_local_experts)."""
    return int(next(config[k] for k in keys if config.get(k)))


def _rope_scaling(name: str):
    from gguf import RopeScalingType

    return getattr(RopeScalingType, name)


# ---------------------------------------------------------------------- reading
def gguf_metadata(path: str | Path, kv: dict | None = None) -> dict:
    """quantkit's provenance stored in a GGUF (`quantkit.metadata`), {} when another tool wrote
    it; `kv` is read_gguf's when the caller has it. llama-quantize copies every key of its
    input, so a file it made from a quantkit BF16 GGUF still holds that file's metadata: when
    general.file_type is not the one quantkit wrote for the recorded gguf_type, the metadata
    is inherited, not this file's, and {} is returned."""
    kv = kv if kv is not None else read_gguf(path)[0]
    raw = kv.get("quantkit.metadata")
    if raw is None:
        return {}
    try:
        meta = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        meta = None
    if not isinstance(meta, dict):
        raise bad_gguf(Path(path), "its quantkit.metadata key is not a JSON object")
    gguf_type = str((meta.get("scheme") or {}).get("gguf_type") or "").lower()
    if gguf_type in GGUF_TYPES:
        written = {file_type(gguf_type)[0]}
        if gguf_type in ("bf16", "f16"):  # experts kept MXFP4 (gpt-oss): the converter's ftype
            written.add(int(LlamaFileType.MOSTLY_MXFP4_MOE))
        ftype = kv.get("general.file_type")
        if (None if ftype is None else int(ftype)) not in written:
            return {}  # inherited from the input of another tool's rewrite
    return meta


# llama.cpp's 3-D ffn_*_exps, for the architectures with GGUF expert names (an arch with no
# GGUF layout at all is refused by check_source, which says why)
RECORD = FormatRecord(
    "gguf", GGUFFileWriter,
    stores_experts=lambda spec: spec.gguf_arch is None
    or spec.gguf_slot(spec.experts.linear("down", 0)) is not None)
