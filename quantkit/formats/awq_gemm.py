"""AutoAWQ GEMM checkpoints (`quant_method: awq`, `version: gemm`) -> vLLM `awq` / `awq_marlin`.

config.json["quantization_config"] (transformers-style keys, what vLLM's AutoAWQConfig reads):
  {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": G, "zero_point": true,
   "modules_to_not_convert": [...]}

Per quantized Linear (N out, K in, NG = K / G groups), AutoAWQ's WQLinear_GEMM.from_linear:

  qweight int32 [K, N/8]   packed along N (the OUTPUT dim), 8 nibbles per word, interleaved:
          bit  31    28 27    24 23    20 19    16 15    12 11     8 7      4 3      0
               | q[c*8+7]| q[c*8+5]| q[c*8+3]| q[c*8+1]| q[c*8+6]| q[c*8+4]| q[c*8+2]| q[c*8+0]|
          i.e. nibble i (bits 4i..4i+3) of word c holds column c*8 + ORDER[i],
          ORDER = [0, 2, 4, 6, 1, 3, 5, 7]   (row k of qweight = input column k)
  qzeros  int32 [NG, N/8]  the zero points packed exactly the same way; TRUE zeros (no -1)
  scales  fp16  [NG, N]
  bias    fp16  [N]        optional

Dequantized: W[n, k] = (q[k, n] - z[k // G, n]) * scales[k // G, n].

Why `zero_point` is always true: vLLM (auto_awq.py) builds a uint4 kernel WITHOUT zero points
when it is false (w = q * s, no offset), while the layout always stores qzeros. A symmetric
scheme is therefore written as zero point 8 everywhere, which both vLLM paths and AutoAWQ read
correctly; the scheme's symmetry stays recorded in quantkit.json.
"""

from __future__ import annotations

from pathlib import Path

import torch

from quantkit.formats.common import (
    linear_tensors,
    load_tensors,
    read_config,
    save_tensors,
    write_config,
)
from quantkit.types import QuantResult, QuantScheme

__all__ = ["AWQGemmWriter", "AWQ_ORDER", "pack_awq", "unpack_awq", "pack_awq_gemm",
           "read_awq_gemm", "quantization_config"]

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column ORDER[i] of its 8
_SUFFIXES = (".qweight", ".qzeros", ".scales")


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[R, C] unsigned 4-bit values -> int32 [R, C/8] in AWQ's interleaved nibble order."""
    v = values.to(torch.int64)
    if v.shape[-1] % 8:
        raise ValueError(f"AWQ packs 8 columns per int32; {v.shape[-1]} is not a multiple of 8")
    if v.numel() and (int(v.min()) < 0 or int(v.max()) > 15):
        raise ValueError("AWQ packing takes 4-bit values in [0, 15]")
    v = v.reshape(*v.shape[:-1], -1, 8)[..., list(AWQ_ORDER)]
    words = (v << (torch.arange(8, dtype=torch.int64) * 4)).sum(-1)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # two's complement
    return words.to(torch.int32).contiguous()


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_awq: int32 [R, C/8] -> int64 [R, C]."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    nib = (w[..., None] >> (torch.arange(8, dtype=torch.int64) * 4)) & 0xF  # nibble i
    out = torch.empty_like(nib)
    out[..., list(AWQ_ORDER)] = nib  # column ORDER[i] <- nibble i
    return out.reshape(*w.shape[:-1], -1).contiguous()


def pack_awq_gemm(r: QuantResult) -> dict[str, torch.Tensor]:
    """qweight / qzeros / scales of one 4-bit QuantResult (codes [N, K], scale/zero [N, NG])."""
    if r.g_idx is not None and not torch.equal(
            r.g_idx.long(), torch.arange(r.codes.shape[1]) // r.scheme.effective_group(r.codes.shape[1])):
        raise ValueError(f"{r.name}: AWQ GEMM has no g_idx; act-order results cannot be stored")
    if r.extra.get("pre_quant_scale") is not None:
        raise ValueError(f"{r.name}: AWQ GEMM cannot store a pre_quant_scale (use --format modelopt)")
    zero = r.zero if r.zero is not None else torch.full_like(r.scale, 8, dtype=torch.int32)
    return {
        "qweight": pack_awq(r.codes.T),  # [K, N] -> [K, N/8]
        "qzeros": pack_awq(zero.T),  # [NG, N] -> [NG, N/8]
        "scales": r.scale.T.to(torch.float16).contiguous(),
    }


def quantization_config(scheme: QuantScheme, ignore: list[str]) -> dict:
    return {"quant_method": "awq", "version": "gemm", "bits": scheme.bits,
            "group_size": -1 if scheme.group_size in (-1, 0) else scheme.group_size,
            "zero_point": True, "modules_to_not_convert": list(ignore)}


class AWQGemmWriter:
    name = "awq"
    engines = ("vllm",)

    def check(self, scheme: QuantScheme, shapes: dict[str, tuple[int, int]]) -> list[str]:
        """What the layout cannot hold; runs before calibration."""
        if scheme.kind != "int":
            return ["AutoAWQ GEMM stores integer weights only"]
        problems = []
        if scheme.bits != 4:
            problems.append(f"AutoAWQ GEMM packs 4-bit weights only, not {scheme.bits}")
        if scheme.act_order:
            problems.append("AutoAWQ GEMM has no g_idx, so no act-order")
        for name, (n, _k) in shapes.items():
            if n % 8:
                problems.append(f"{name} has {n} outputs, not a multiple of 8 (8 nibbles per int32)")
                break
        return problems

    def write(self, out_dir: Path, *, config: dict, dense: dict[str, torch.Tensor],
              results: dict[str, QuantResult], ignore: list[str], dtype: torch.dtype) -> None:
        scheme = next(iter(results.values())).scheme
        tensors = linear_tensors(dense, results, pack_awq_gemm, torch.float16)
        save_tensors(out_dir, tensors)
        write_config(out_dir, {**config, "quantization_config": quantization_config(scheme, ignore)})


def read_awq_gemm(path: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A dense state dict (dequantized weights) from an AutoAWQ GEMM artifact."""
    qcfg = read_config(path)["quantization_config"]
    if str(qcfg.get("version", "gemm")).lower() != "gemm" or int(qcfg.get("bits", 4)) != 4:
        raise NotImplementedError(f"AWQ version {qcfg.get('version')!r} / bits {qcfg.get('bits')} "
                                  "(only 4-bit GEMM is read)")
    raw = load_tensors(path)
    out: dict[str, torch.Tensor] = {}
    for key, t in raw.items():
        if key.endswith(".qweight"):
            base = key[: -len(".qweight")]
            q = unpack_awq(t).float()  # [K, N]
            z = unpack_awq(raw[base + ".qzeros"]).float()  # [NG, N]
            s = raw[base + ".scales"].float()  # [NG, N]
            gi = torch.arange(q.shape[0]) // (q.shape[0] // s.shape[0])
            out[f"{base}.weight"] = ((q - z[gi]) * s[gi]).T.contiguous().to(dtype)
        elif not key.endswith(_SUFFIXES):
            out[key] = t.to(dtype) if t.is_floating_point() else t
    return out
