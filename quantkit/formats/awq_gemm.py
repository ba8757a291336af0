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

Mixture-of-experts models: every expert's Linears under the checkpoint names vLLM's FusedMoE
loader maps to w13_* / w2_* (`mlp.experts.{e}.gate_proj.qweight`, Mixtral's
`block_sparse_moe.experts.{e}.w1.qweight`, ...), each packed as above; the router stays
unquantized.

`modules_to_not_convert` is read by vLLM 0.32 (auto_awq.py, quant_utils.is_layer_skipped with
match_mode="substring") as SUBSTRINGS of module prefixes: a Linear or an experts module is left
unquantized when any entry occurs anywhere in its name (for vLLM's fused q/k/v and gate/up
Linears, in the names of their parts). A compressed-tensors `re:` pattern matches nothing
there, so the router would be built as a quantized Linear its bf16 weight does not fit; a short
entry such as `mlp.gate` would also skip a dense block's `mlp.gate_proj` (Qwen3-MoE's
mlp_only_layers, DeepSeek-V3's first blocks), built unquantized for packed tensors. So each
kept module is listed by its full name (`model.layers.3.mlp.gate`), and an entry that occurs
in the name of any quantized Linear is refused (not_convert_entries).

Why `zero_point` is always true: vLLM (auto_awq.py) builds a uint4 kernel WITHOUT zero points
when it is false (w = q * s, no offset), while the layout always stores qzeros. A symmetric
scheme is therefore written as zero point 8 everywhere, which both vLLM paths and AutoAWQ read
correctly; the scheme's symmetry stays recorded in quantkit.json.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
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

__all__ = ["AWQGemmWriter", "AWQ_ORDER", "pack_awq", "unpack_awq", "pack_awq_gemm",
           "read_awq_gemm", "quantization_config", "not_convert_entries", "VLLM_FUSED"]

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


# vLLM's fused Linears (packed_modules_mapping): a part's name with this suffix is also
# looked up under the fused name (when the model's mapping lacks it, the fused name alone)
VLLM_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
              "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def _engine_names(quantized: Iterable[str]) -> set[str]:
    """The quantized Linears' names plus the fused names vLLM builds from them."""
    out = set()
    for name in quantized:
        out.add(name)
        head, _, last = name.rpartition(".")
        if last in VLLM_FUSED:
            out.add(f"{head}.{VLLM_FUSED[last]}")
    return out


def not_convert_entries(ignore: list[str], kept: Iterable[str], quantized: Iterable[str]
                        ) -> tuple[list[str], list[str]]:
    """(modules_to_not_convert, problems) for an artifact that keeps `ignore` unquantized.

    `ignore` holds module names and compressed-tensors-style `re:` patterns; `kept` names the
    modules the artifact leaves unquantized (checkpoint names; a pattern becomes every one of
    them it matches, so it is decided by the model's own blocks, dense or MoE), `quantized`
    the quantized Linears. A problem is an entry that vLLM's substring match would also find
    in a quantized Linear's name (or in its fused name): no list can then keep the one and
    quantize the other."""
    entries: list[str] = []
    kept = sorted(set(kept))
    for item in ignore:
        if item.startswith("re:"):
            pattern = re.compile(item[3:])
            entries += [m for m in kept if pattern.match(m) and m not in entries]
        elif item not in entries:
            entries.append(item)
    engine = sorted(_engine_names(quantized))
    problems = []
    for entry in entries:
        hit = next((q for q in engine if entry in q), None)
        if hit is not None:
            problems.append(f"modules_to_not_convert entry {entry!r} is a substring of the "
                            f"quantized {hit!r}, which vLLM would then load unquantized")
    return entries, problems


def quantization_config(scheme: QuantScheme, ignore: list[str]) -> dict:
    return {"quant_method": "awq", "version": "gemm", "bits": scheme.bits,
            "group_size": -1 if scheme.group_size in (-1, 0) else scheme.group_size,
            "zero_point": True, "modules_to_not_convert": list(ignore)}


class AWQGemmWriter(FormatWriter):
    name = "awq"
    engines = ("vllm",)
    checks_modules = True  # modules_to_not_convert is matched by substring

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

    def check_modules(self, ignore: list[str], kept: Iterable[str], quantized: Iterable[str]
                      ) -> list[str]:
        """Whether a modules_to_not_convert list keeps exactly the unquantized modules; runs
        before calibration (names from the config alone)."""
        return not_convert_entries(ignore, kept, quantized)[1]

    def write(self, out_dir: Path, *, config: dict, dense: dict[str, torch.Tensor],
              results: dict[str, QuantResult], ignore: list[str], dtype: torch.dtype) -> None:
        scheme = next(iter(results.values())).scheme
        entries, problems = not_convert_entries(
            ignore, {k.rpartition(".")[0] for k in dense}, results)
        if problems:  # quantize refuses these before any work (check_modules)
            raise ValueError("; ".join(problems))
        tensors = linear_tensors(dense, results, pack_awq_gemm, torch.float16)
        save_tensors(out_dir, tensors)
        write_config(out_dir, {**config, "quantization_config": quantization_config(scheme, entries)})


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


# AutoAWQ GEMM (vLLM awq / awq_marlin); per-expert tensors vLLM's FusedMoE loader reads
RECORD = FormatRecord("awq", AWQGemmWriter, read=read_awq_gemm, stores_experts=lambda spec: True)
