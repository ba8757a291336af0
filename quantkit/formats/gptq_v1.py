"""GPTQ v1 checkpoints (the AutoGPTQ / GPTQModel "gptq" format) -> vLLM `gptq` / `gptq_marlin`.

config.json["quantization_config"]:
  {"quant_method": "gptq", "checkpoint_format": "gptq", "bits": b, "group_size": G or -1,
   "desc_act": bool, "sym": bool, "lm_head": false}

Per quantized Linear (N out, K in, NG = K / G groups, pf = 32 // bits values per int32):

  qweight int32 [K/pf, N]   packed along K (input), least-significant value first:
          bit  31 ........................................... 0
               | q[r*pf+pf-1] | ... | q[r*pf+1] | q[r*pf+0] |      (bits each, column n)
          qweight[r, n] = sum_j q[n, r*pf + j] << (bits * j)
  qzeros  int32 [NG, N/pf]  packed along N the same way, storing ZERO - 1 (the v1 quirk:
          symmetric 4-bit zero 8 is stored as 7, so every word is 0x77777777)
  scales  fp16  [NG, N]
  g_idx   int32 [K]         group of each input column (k // G without act-order)
  bias    [N]               optional, model dtype

Dequantized: W[n, k] = (q[n, k] - zero[g_idx[k], n]) * scales[g_idx[k], n].

vLLM 0.32 facts that shape this writer (vllm/model_executor/layers/quantization/auto_gptq.py,
utils/gptq_utils.py, base_config.py): it loads only symmetric 4/8-bit (the CPU kernel: 4-bit);
it refuses desc_act=True when group_size != -1; and it DROPS `.g_idx` while loading. So a
non-trivial g_idx (act-order without static groups) is written with desc_act=True (vLLM refuses
loudly; quantkit's loader reads it) and never with desc_act=False (which would load silently
wrong). Act-order with static groups keeps g_idx = k // G and desc_act=False.
"""

from __future__ import annotations

from pathlib import Path

import torch

from quantkit.formats.common import (
    FormatRecord,
    FormatWriter,
    linear_tensors,
    load_tensors,
    read_config,
    save_tensors,
    write_config,
)
from quantkit.types import QuantResult, QuantScheme

__all__ = ["GPTQv1Writer", "pack_int32", "unpack_int32", "pack_gptq_v1", "unpack_gptq_v1",
           "read_gptq_v1", "quantization_config", "PACK_BITS"]

PACK_BITS = (2, 4, 8)  # widths that tile an int32 (GPTQ's 3-bit layout is not supported)
_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack unsigned `values` (< 2^bits) along `dim`, pf = 32 // bits per int32, LSB first."""
    pf = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)
    if v.shape[-1] % pf:
        raise ValueError(f"size {v.shape[-1]} along dim {dim} is not a multiple of {pf}")
    if v.numel() and (int(v.min()) < 0 or int(v.max()) >= 1 << bits):
        raise ValueError(f"values out of range for {bits}-bit packing")
    v = v.reshape(*v.shape[:-1], -1, pf)
    shifts = torch.arange(pf, dtype=torch.int64) * bits
    words = (v << shifts).sum(-1)  # < 2^32, fits int64
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # two's complement int32
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def unpack_int32(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of pack_int32: int64 values, `dim` grows by 32 // bits."""
    pf = 32 // bits
    w = words.to(torch.int64).movedim(dim, -1) & 0xFFFFFFFF
    shifts = torch.arange(pf, dtype=torch.int64) * bits
    v = (w[..., None] >> shifts) & ((1 << bits) - 1)
    return v.reshape(*w.shape[:-1], -1).movedim(-1, dim).contiguous()


def pack_gptq_v1(r: QuantResult, scale_dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """qweight / qzeros / scales / g_idx of one QuantResult (codes [N, K], scale/zero [N, NG])."""
    bits = r.scheme.bits
    zero = r.zero if r.zero is not None else torch.full_like(r.scale, 1 << (bits - 1), dtype=torch.int32)
    return {
        "qweight": pack_int32(r.codes.T, bits, dim=0),  # [K, N] -> [K/pf, N]
        "qzeros": pack_int32((zero.T.to(torch.int64) - 1) & ((1 << bits) - 1), bits, dim=1),
        "scales": r.scale.T.to(scale_dtype).contiguous(),
        "g_idx": r.column_groups().to(torch.int32),
    }


def unpack_gptq_v1(t: dict[str, torch.Tensor], bits: int) -> tuple[torch.Tensor, ...]:
    """codes [N, K], zero [N, NG] (true zero, = stored + 1), scale [N, NG], g_idx [K]."""
    codes = unpack_int32(t["qweight"], bits, dim=0).T
    zero = ((unpack_int32(t["qzeros"], bits, dim=1) + 1) & ((1 << bits) - 1)).T
    return codes.contiguous(), zero.contiguous(), t["scales"].T.contiguous(), t["g_idx"].long()


def _has_dynamic_g_idx(results: dict[str, QuantResult]) -> bool:
    """True when some result's g_idx is not k // G (act-order without static groups)."""
    for r in results.values():
        if r.g_idx is not None:
            k = r.codes.shape[1]
            if not torch.equal(r.g_idx.long(), torch.arange(k) // r.scheme.effective_group(k)):
                return True
    return False


def quantization_config(scheme: QuantScheme, desc_act: bool) -> dict:
    return {
        "quant_method": "gptq",
        "checkpoint_format": "gptq",
        "bits": scheme.bits,
        "group_size": -1 if scheme.group_size in (-1, 0) else scheme.group_size,
        "desc_act": desc_act,
        "static_groups": bool(scheme.act_order and not desc_act),
        "sym": scheme.symmetric,
        "lm_head": False,
    }


class GPTQv1Writer(FormatWriter):
    name = "gptq"
    engines = ("vllm",)

    def check(self, scheme: QuantScheme, shapes: dict[str, tuple[int, int]]) -> list[str]:
        """What the format (or vLLM, its engine) cannot take; runs before calibration."""
        problems = []
        if scheme.kind != "int":
            problems.append("GPTQ v1 stores integer weights only")
            return problems
        if scheme.bits not in (4, 8):
            problems.append(f"vLLM's GPTQ loader takes 4 or 8 bits, not {scheme.bits}")
        if not scheme.symmetric:
            problems.append("vLLM 0.32 loads only symmetric GPTQ checkpoints (sym=true); use "
                            "--sym, or --format compressed-tensors for an asymmetric grid")
        pf = 32 // scheme.bits if scheme.bits in PACK_BITS else 1
        for name, (n, k) in shapes.items():
            if n % pf or k % pf:
                problems.append(f"{name} [{n}x{k}] does not pack into int32 ({pf} values per word)")
                break
        return problems

    def write(self, out_dir: Path, *, config: dict, dense: dict[str, torch.Tensor],
              results: dict[str, QuantResult], ignore: list[str], dtype: torch.dtype) -> None:
        scheme = next(iter(results.values())).scheme
        tensors = linear_tensors(dense, results, pack_gptq_v1, dtype)
        save_tensors(out_dir, tensors)
        qcfg = quantization_config(scheme, desc_act=_has_dynamic_g_idx(results))
        write_config(out_dir, {**config, "quantization_config": qcfg})


def read_gptq_v1(path: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A dense state dict (dequantized weights) from a GPTQ v1 artifact."""
    qcfg = read_config(path)["quantization_config"]
    fmt = qcfg.get("checkpoint_format", "gptq")
    if fmt != "gptq":
        raise NotImplementedError(f"GPTQ checkpoint_format {fmt!r} (only v1 'gptq' is read)")
    bits = int(qcfg["bits"])
    raw = load_tensors(path)
    out: dict[str, torch.Tensor] = {}
    for key, t in raw.items():
        if key.endswith(".qweight"):
            base = key[: -len(".qweight")]
            parts = {s[1:]: raw[base + s] for s in _SUFFIXES if base + s in raw}
            if "g_idx" not in parts:  # optional in some writers: then it is k // G
                k = t.shape[0] * (32 // bits)
                parts["g_idx"] = torch.arange(k) // (k // parts["scales"].shape[0])
            codes, zero, scale, g_idx = unpack_gptq_v1(parts, bits)
            w = (codes.float() - zero.float()[:, g_idx]) * scale.float()[:, g_idx]
            out[f"{base}.weight"] = w.to(dtype)
        elif not key.endswith(_SUFFIXES):
            out[key] = t.to(dtype) if t.is_floating_point() else t
    return out


RECORD = FormatRecord("gptq", GPTQv1Writer, read=read_gptq_v1)
