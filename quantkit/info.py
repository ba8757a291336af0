"""What an artifact is, read from its files without loading weights: `quantkit info`."""

from __future__ import annotations

from pathlib import Path

from quantkit.formats import detect_format
from quantkit.formats.common import read_safetensors_headers
from quantkit.loader import artifact_meta
from quantkit.readers import read_config_json, safetensors_files

__all__ = ["artifact_info", "nominal_bits_per_weight", "gguf_tensor_types"]

_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
          "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_QUANT_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_g_idx",
                   ".weight_shape", ".qweight", ".qzeros", ".scales", ".g_idx",
                   ".weight_scale_inv", ".input_scale", ".pre_quant_scale",
                   ".weight_global_scale", ".input_global_scale", ".weight_scale_2")


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def artifact_info(path: str | Path) -> dict:
    """Format, method, scheme, size on disk and bits per weight (quantized Linears and overall)."""
    path = Path(path)
    fmt = detect_format(path)
    size = path.stat().st_size if path.is_file() else sum(
        f.stat().st_size for f in path.rglob("*") if f.is_file())
    if fmt == "gguf":
        return _gguf_info(path, size)
    meta = artifact_meta(path) if path.is_dir() else {}
    info = {"path": str(path), "format": fmt, "size_bytes": size,
            "method": meta.get("method", "none" if fmt == "dense" else "unknown"),
            "scheme": meta.get("scheme"), "engines": meta.get("engines", []),
            "source_model": (meta.get("source_model") or {}).get("name_or_path"),
            "calibration": (meta.get("calibration") or {}).get("name")
            or (meta.get("calibration") or {}).get("source")}
    if path.is_dir():
        qcfg = read_config_json(path).get("quantization_config") or {}
        info.update(_bits_per_weight(path, int(qcfg.get("bits") or 4),
                                     read_config_json(path).get("quantization")))
        info["nominal_bits_per_weight"] = nominal_bits_per_weight(meta.get("scheme"))
        info["quantization_config"] = {k: qcfg.get(k) for k in (
            "quant_method", "format", "bits", "group_size", "sym", "quant_algo",
            "activation_scheme", "weight_block_size") if k in qcfg}
    return info


_EMBEDDING_SUFFIXES = ("embed_tokens.weight", "lm_head.weight", "wte.weight", "word_embeddings.weight")
# GGUF tensor names of the token embeddings and the output head (llama.cpp's naming)
_GGUF_EMBEDDINGS = ("token_embd.weight", "output.weight")


def _mlx_bits(mlx: dict | None, base: str) -> int | None:
    """The bits of an MLX packed Linear (its per-layer override or the default), None for a
    checkpoint without MLX's `quantization` entry."""
    if not isinstance(mlx, dict) or "bits" not in mlx:
        return None
    layer = mlx.get(base)
    return int((layer if isinstance(layer, dict) else mlx)["bits"])


def _bits_per_weight(path: Path, bits: int, mlx: dict | None = None) -> dict:
    """Bits on disk per original weight, counting scales/zeros/indices of quantized Linears;
    also with the embeddings and output head added (they stay unquantized in these formats).
    `mlx`: config.json's `quantization` of an MLX checkpoint, whose packed Linears store
    uint32 `.weight` codes beside `.scales` (and `.biases`)."""
    headers = read_safetensors_headers(path)
    q_bytes = q_params = all_bytes = all_params = emb_bytes = emb_params = 0
    from safetensors import safe_open

    shapes = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key.endswith(".weight_shape"):
                    shapes[key[: -len(".weight_shape")]] = f.get_tensor(key).tolist()
    for name, h in headers.items():
        nbytes = h["data_offsets"][1] - h["data_offsets"][0]
        all_bytes += nbytes
        base = next((name[: -len(s)] for s in _QUANT_SUFFIXES if name.endswith(s)), None)
        stem = name.rpartition(".")[0]
        mlx_bits = _mlx_bits(mlx, stem) if f"{stem}.scales" in headers else None
        if mlx_bits and h["dtype"] == "U32" and name.endswith(".weight"):  # MLX packed codes
            q_bytes += nbytes
            packed = h["shape"]
            n = _numel(packed[:-1]) * packed[-1] * 32 // mlx_bits
            q_params += n
            all_params += n
        elif mlx_bits and name.endswith(".biases"):
            q_bytes += nbytes
        elif h["dtype"] in ("F8_E4M3", "F8_E5M2", "I8") and name.endswith(".weight"):  # FP8 / int8 W8A8
            q_bytes += nbytes
            q_params += _numel(h["shape"])
            all_params += _numel(h["shape"])
        elif base is not None:
            q_bytes += nbytes
            if name.endswith((".weight_packed", ".qweight")):
                if h["dtype"] == "U8":  # FP4: two E2M1 codes per byte along K
                    shape = [h["shape"][0], h["shape"][1] * 2]
                else:
                    shape = shapes.get(base) or [h["shape"][0] * 32 // bits, h["shape"][1]]
                q_params += _numel(shape)
                all_params += _numel(shape)
        else:
            all_params += _numel(h["shape"])
            if name.endswith(_EMBEDDING_SUFFIXES):
                emb_bytes += nbytes
                emb_params += _numel(h["shape"])
    out = {"parameters": all_params, "bits_per_weight_model": 8 * all_bytes / max(all_params, 1)}
    if q_params:
        out["bits_per_weight_quantized"] = 8 * q_bytes / q_params
        out["quantized_parameters"] = q_params
        out["bits_per_weight_with_embeddings"] = 8 * (q_bytes + emb_bytes) / (q_params + emb_params)
    return out


def nominal_bits_per_weight(scheme: dict | None) -> float | None:
    """What a scheme's label promises per weight: int N group G -> N + 16/G (a 16-bit scale
    per group, + N/G for asymmetric zeros); fp8 -> 8; a GGUF preset -> llama.cpp's figure for
    its mix. The effective bits of a real file differ when tensors fall back to other types."""
    if not scheme:
        return None
    if scheme.get("kind") == "kquant" or scheme.get("gguf_type"):
        from quantkit.ggml.catalogue import bits_per_weight

        return bits_per_weight(scheme.get("gguf_type"))
    if scheme.get("kind") == "fp8":
        return 8.0
    if scheme.get("kind") in ("nvfp4", "mxfp4"):  # E2M1 + one 8-bit scale (E4M3 / E8M0) per group
        return 4 + 8 / scheme["group_size"]
    bits, group = scheme.get("bits"), scheme.get("group_size")
    if not isinstance(bits, int):
        return None
    if group in (-1, 0, None):
        return float(bits)
    if scheme.get("float_zero"):  # MLX: a float bias per group in the model dtype
        return bits + 32 / group
    return bits + 16 / group + (0 if scheme.get("symmetric", True) else bits / group)


def gguf_tensor_types(tensors: dict) -> dict[str, dict]:
    """{GGML type: {tensors, params, bytes, bits_per_weight, share}} over every tensor of a
    GGUF file, most weights first; share = that type's part of all weights."""
    types: dict[str, dict] = {}
    for t in tensors.values():
        row = types.setdefault(t.qtype.name, {"tensors": 0, "params": 0, "bytes": 0})
        row["tensors"] += 1
        row["params"] += _numel(t.shape)
        row["bytes"] += int(t.data.nbytes)
    total = sum(r["params"] for r in types.values()) or 1
    for r in types.values():
        r["bits_per_weight"] = 8 * r["bytes"] / max(r["params"], 1)
        r["share"] = r["params"] / total
    return dict(sorted(types.items(), key=lambda kv: -kv[1]["params"]))


def _gguf_bits(tensors: dict) -> dict:
    """Effective bits per weight from the stored tensor types: the block Linears (what the
    safetensors formats quantize), the same plus token embeddings and output head, everything."""
    def bits(names: list[str]) -> tuple[float | None, int]:
        params = sum(_numel(tensors[n].shape) for n in names)
        nbytes = sum(int(tensors[n].data.nbytes) for n in names)
        return (8 * nbytes / params if params else None), params

    linears = [n for n, t in tensors.items()
               if n.startswith("blk.") and n.endswith(".weight") and len(t.shape) >= 2]
    embeddings = [n for n in _GGUF_EMBEDDINGS if n in tensors]
    q_bits, q_params = bits(linears)
    emb_bits, _ = bits(linears + embeddings)
    all_bits, all_params = bits(list(tensors))
    out = {"parameters": all_params, "bits_per_weight_model": all_bits}
    if q_bits is not None:
        out.update(bits_per_weight_quantized=q_bits, quantized_parameters=q_params,
                   bits_per_weight_with_embeddings=emb_bits)
    return out


def _auto_types(allocation: dict) -> dict:
    """What `--gguf-type auto` chose (from the file's quantkit.metadata): the budget and each
    tensor's type, in llama.cpp's tensor order."""
    return {"target": allocation.get("target"), "budget_bytes": allocation.get("budget_bytes"),
            "chosen_bytes": allocation.get("chosen_bytes"), "fixed": allocation.get("fixed", {}),
            "type_counts": allocation.get("type_counts", {}),
            "tensors": {n: t["type"] for n, t in (allocation.get("tensors") or {}).items()}}


def _file_type_name(value) -> str | None:
    """llama.cpp's name of a GGUF's general.file_type ('q4_k_m', 'iq4_xs', 'bf16' ...): what a
    file that quantkit did not write says of itself (llama-quantize's ftype)."""
    from gguf import LlamaFileType

    try:
        ft = LlamaFileType(int(value) & ~int(LlamaFileType.GUESSED))
    except (TypeError, ValueError):
        return None
    return ft.name.removeprefix("MOSTLY_").removeprefix("ALL_").lower()


def _gguf_info(path: Path, size: int) -> dict:
    """A GGUF file: quantkit's provenance from its `quantkit.metadata` key (when quantkit wrote
    it), the tensor types it holds and the bits per weight they add up to."""
    from quantkit.formats.gguf import gguf_metadata, read_gguf

    kv, tensors = read_gguf(path)
    meta = gguf_metadata(path, kv)
    return {"path": str(path), "format": "gguf", "size_bytes": size,
            "method": meta.get("method", "unknown"), "scheme": meta.get("scheme"),
            **({"gguf_file_type": ft} if (ft := _file_type_name(kv.get("general.file_type"))) else {}),
            "engines": ["llama.cpp"],
            "source_model": (meta.get("source_model") or {}).get("name_or_path")
            or kv.get("general.name"),
            "calibration": (meta.get("calibration") or {}).get("name")
            or (meta.get("calibration") or {}).get("source"),
            "architecture": kv.get("general.architecture"),
            "tensor_types": gguf_tensor_types(tensors),
            **({"auto_types": _auto_types(meta["gguf_auto"])} if meta.get("gguf_auto") else {}),
            "nominal_bits_per_weight": nominal_bits_per_weight(meta.get("scheme")),
            **_gguf_bits(tensors)}
