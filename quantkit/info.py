"""What an artifact is, read from its files without loading weights: `quantkit info`."""

from __future__ import annotations

from pathlib import Path

from quantkit.formats import detect_format
from quantkit.formats.common import read_safetensors_headers
from quantkit.loader import artifact_meta
from quantkit.readers import read_config_json, safetensors_files

__all__ = ["artifact_info"]

_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
          "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_QUANT_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_g_idx",
                   ".weight_shape", ".qweight", ".qzeros", ".scales", ".g_idx",
                   ".weight_scale_inv", ".input_scale", ".pre_quant_scale")


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
        info.update(_bits_per_weight(path, int(qcfg.get("bits") or 4)))
        info["quantization_config"] = {k: qcfg.get(k) for k in (
            "quant_method", "format", "bits", "group_size", "sym", "quant_algo",
            "activation_scheme", "weight_block_size") if k in qcfg}
    return info


def _bits_per_weight(path: Path, bits: int) -> dict:
    """Bits on disk per original weight, counting scales/zeros/indices of quantized Linears."""
    headers = read_safetensors_headers(path)
    q_bytes = q_params = all_bytes = all_params = 0
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
        if h["dtype"] in ("F8_E4M3", "F8_E5M2") and name.endswith(".weight"):  # FP8 Linears
            q_bytes += nbytes
            q_params += _numel(h["shape"])
            all_params += _numel(h["shape"])
        elif base is not None:
            q_bytes += nbytes
            if name.endswith((".weight_packed", ".qweight")):
                shape = shapes.get(base) or [h["shape"][0] * 32 // bits, h["shape"][1]]
                q_params += _numel(shape)
                all_params += _numel(shape)
        else:
            all_params += _numel(h["shape"])
    out = {"parameters": all_params, "bits_per_weight_model": 8 * all_bytes / max(all_params, 1)}
    if q_params:
        out["bits_per_weight_quantized"] = 8 * q_bytes / q_params
        out["quantized_parameters"] = q_params
    return out



def _gguf_info(path: Path, size: int) -> dict:
    """A GGUF file: quantkit's provenance from its `quantkit.metadata` key (when quantkit wrote
    it), the tensor types it holds and bits per weight over every tensor."""
    from collections import Counter

    from quantkit.formats.gguf import gguf_metadata, read_gguf

    kv, tensors = read_gguf(path)
    meta = gguf_metadata(path, kv)
    params = sum(_numel(t.shape) for t in tensors.values())
    tensor_bytes = sum(int(t.data.nbytes) for t in tensors.values())
    types = Counter(t.qtype.name for t in tensors.values())
    return {"path": str(path), "format": "gguf", "size_bytes": size,
            "method": meta.get("method", "unknown"), "scheme": meta.get("scheme"),
            "engines": ["llama.cpp"],
            "source_model": (meta.get("source_model") or {}).get("name_or_path")
            or kv.get("general.name"),
            "calibration": (meta.get("calibration") or {}).get("name")
            or (meta.get("calibration") or {}).get("source"),
            "architecture": kv.get("general.architecture"),
            "tensor_types": dict(types.most_common()),
            "bits_per_weight_model": 8 * tensor_bytes / max(params, 1)}
