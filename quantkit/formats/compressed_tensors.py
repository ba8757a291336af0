"""compressed-tensors `pack-quantized` (W4A16 / W8A16): what vLLM's compressed-tensors loader reads.

Per quantized Linear (N out, K in, G groups), written through the compressed-tensors library:
  weight_packed      int32 [N, ceil(K*bits/32)]   signed codes + 2^(bits-1), packed along K,
                                                  least-significant first
  weight_scale       model dtype [N, G]
  weight_zero_point  int32 [ceil(N*bits/32), G]   asymmetric only, packed along N
  weight_g_idx       int32 [K]                    act-order only
  weight_shape       int64 [2]
Every Linear must match a target or an ignore entry, else vLLM refuses the checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
)

from quantkit.formats.common import load_tensors, read_config, save_tensors, write_config
from quantkit.types import QuantResult, QuantScheme

__all__ = ["CompressedTensorsWriter", "read_compressed_tensors", "quantization_config"]


def quantization_config(scheme: QuantScheme, ignore: list[str], dynamic_g_idx: bool = True) -> dict:
    """`dynamic_g_idx` False: act-order with static groups (g_idx = k // G) -> actorder "static",
    the only act-order vLLM 0.32 loads (it refuses "group": compressed_tensors.py)."""
    strategy = "channel" if scheme.group_size in (-1, 0) else "group"
    weights = QuantizationArgs(
        num_bits=scheme.bits, type="int", symmetric=scheme.symmetric, strategy=strategy,
        group_size=None if strategy == "channel" else scheme.group_size,
        actorder=(("group" if dynamic_g_idx else "static") if scheme.act_order else None),
        dynamic=False,
    )
    cfg = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
        ignore=ignore, format="pack-quantized", quantization_status="compressed",
    )
    out = cfg.to_dict()
    out["quant_method"] = "compressed-tensors"
    return out


class CompressedTensorsWriter:
    name = "compressed-tensors"
    engines = ("vllm",)

    def check(self, scheme: QuantScheme, shapes: dict[str, tuple[int, int]]) -> list[str]:
        problems = []
        if scheme.kind != "int":
            problems.append("the compressed-tensors pack-quantized writer takes integer schemes")
        if scheme.bits not in (4, 8):
            problems.append(f"vLLM's compressed-tensors WNA16 loads 4 or 8 bits, not {scheme.bits}")
        return problems

    def write(self, out_dir: Path, *, config: dict, dense: dict[str, torch.Tensor],
              results: dict[str, QuantResult], ignore: list[str], dtype: torch.dtype) -> None:
        scheme = next(iter(results.values())).scheme
        tensors = dict(dense)
        offset = 1 << (scheme.bits - 1)
        dynamic_g_idx = any(r.g_idx is not None and not torch.equal(
            r.g_idx.long(), torch.arange(r.codes.shape[1]) // scheme.effective_group(r.codes.shape[1]))
            for r in results.values())
        for name, r in results.items():
            signed = (r.codes.to(torch.int16) - offset).to(torch.int8)
            tensors[f"{name}.weight_packed"] = pack_to_int32(signed, scheme.bits)
            tensors[f"{name}.weight_scale"] = r.scale.to(dtype)
            tensors[f"{name}.weight_shape"] = torch.tensor(r.codes.shape, dtype=torch.int64)
            if not scheme.symmetric:
                zp = (r.zero.to(torch.int16) - offset).to(torch.int8)
                tensors[f"{name}.weight_zero_point"] = pack_to_int32(zp, scheme.bits, packed_dim=0)
            if scheme.act_order and dynamic_g_idx:
                tensors[f"{name}.weight_g_idx"] = r.column_groups().to(torch.int32)
            if r.bias is not None:
                tensors[f"{name}.bias"] = r.bias.to(dtype)
        save_tensors(out_dir, tensors)
        write_config(out_dir, {**config, "quantization_config": quantization_config(scheme, ignore, dynamic_g_idx)})


def read_compressed_tensors(path: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A dense state dict (dequantized weights) from a pack-quantized artifact."""
    qcfg = read_config(path)["quantization_config"]
    if qcfg.get("format") != "pack-quantized":
        raise NotImplementedError(f"compressed-tensors format {qcfg.get('format')!r}")
    w = next(iter(qcfg["config_groups"].values()))["weights"]
    bits, sym = int(w["num_bits"]), bool(w["symmetric"])
    gsize = w.get("group_size") or None
    raw = load_tensors(path)
    out: dict[str, torch.Tensor] = {}
    for key, t in raw.items():
        if not key.endswith(".weight_packed"):
            if not any(key.endswith(s) for s in (".weight_scale", ".weight_zero_point",
                                                 ".weight_shape", ".weight_g_idx")):
                out[key] = t.to(dtype) if t.is_floating_point() else t
            continue
        base = key[: -len(".weight_packed")]
        shape = raw[f"{base}.weight_shape"].tolist()
        q = unpack_from_int32(t, bits, torch.Size(shape)).float()
        scale = raw[f"{base}.weight_scale"].float()
        if f"{base}.weight_g_idx" in raw:
            gi = raw[f"{base}.weight_g_idx"].long()
        else:
            gi = torch.arange(shape[1]) // (gsize or shape[1])
        zero = 0.0
        if not sym:
            zp = unpack_from_int32(raw[f"{base}.weight_zero_point"], bits,
                                   torch.Size([shape[0], scale.shape[1]]), packed_dim=0)
            zero = zp.float()[:, gi]
        out[f"{base}.weight"] = ((q - zero) * scale[:, gi]).to(dtype)
    return out
