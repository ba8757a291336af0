"""ModelOpt W4A16_AWQ and W4A8_AWQ checkpoints for TensorRT-LLM, laid out as nvidia-modelopt
0.47's `export_hf_checkpoint` writes them (checked key for key against it in tests/test_awq.py
and, W4A8_AWQ, tests/test_fp4.py).
ModelOpt FP8 lives in quantkit/formats/modelopt_fp8.py, whose `ModelOptDispatch` serves
`--format modelopt` and hands integer schemes to `ModelOptAWQWriter` here.

  hf_quant_config.json  {"producer": {"name": "modelopt", "version": "0.47.0"},
                         "quantization": {"quant_algo": "W4A16_AWQ", "kv_cache_quant_algo": null,
                          "group_size": G, "has_zero_point": false, "pre_quant_scale": true,
                          "exclude_modules": ["lm_head", "model.embed_tokens"]}}
  config.json           + "quantization_config": {"quant_method": "modelopt",
                          "quant_algo": "W4A16_AWQ", "producer": {...}, "ignore": [...]}

Per quantized Linear (N out, K in), SIGNED int4 q in [-8, 7], no zero point:
  weight           uint8 [N/2, K]  two OUTPUT rows per byte (quant_utils.pack_int4_in_uint8):
                        bit   7      4 3      0
                   byte[i, k] = | q[2i+1, k] | q[2i, k] |      (two's-complement nibbles)
  weight_scale     float32 [N, K/G]
  pre_quant_scale  model dtype [K]  on every Linear TensorRT-LLM loads unfused (o_proj,
                   down_proj): its W4A16_AWQ `load_weights_vanilla` reads it unconditionally.
                   q/k/v and gate/up get none: their scale is folded into the norm before them.
TensorRT-LLM computes y = (x * pre_quant_scale) @ (q * weight_scale)^T, so the Linear's
effective weight is W[n, k] = q[n, k] * weight_scale[n, k // G] * pre_quant_scale[k].

quantkit's symmetric grid (codes c in [0, 15], zero 8, s = absmax / 7.5) is stored as q = c - 8
with weight_scale = s; ModelOpt's own grid uses s = amax / 7. Both are what the kernel reads.

W4A8_AWQ (the same int4 tensors, inputs cast to FP8 E4M3), two float32 scalars more per Linear:
  weight_scale_2   max |q * weight_scale| / 448: TensorRT-LLM's W4A8_AWQ_LinearMethod loads
                   fp16(weight_scale) / weight_scale_2, so the int4 weight dequantizes into FP8
  input_scale      max |x * pre_quant_scale| / 448 over calibration (static per tensor)
  both shared (the max) over q/k/v and gate/up: load_weight_scales_w4a8 asserts one value.
  The engine computes y = e4m3(x * pqs / input_scale) @ e4m3(q * ws / ws2)^T * input_scale * ws2.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from quantkit.arch import spec_for_config
from quantkit.formats.common import (
    FormatWriter,
    load_tensors,
    read_config,
    save_tensors,
    write_config,
)
from quantkit.readers import read_json
from quantkit.types import QuantResult, QuantScheme

__all__ = ["ModelOptAWQWriter", "pack_int4_rows", "unpack_int4_rows", "read_modelopt_awq",
           "hf_quant_config_awq", "MODELOPT_VERSION", "AWQ_ALGO", "W4A8_AWQ_ALGO", "TRTLLM_GROUP_SIZES",
           "prepare_modelopt_w4a8_model"]

MODELOPT_VERSION = "0.47.0"  # the exporter whose layout this mirrors
AWQ_ALGO = "W4A16_AWQ"
W4A8_AWQ_ALGO = "W4A8_AWQ"
TRTLLM_GROUP_SIZES = (64, 128)  # TensorRT-LLM's fine-grained int4 GEMM (finegrained_mixed_dtype_gemm)
_SUFFIXES = (".weight_scale", ".pre_quant_scale", ".weight_scale_2", ".input_scale")


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """Signed int4 [N, K] (values in [-8, 7]) -> uint8 [N/2, K]: row 2i low nibble, 2i+1 high."""
    if q.shape[0] % 2:
        raise ValueError(f"ModelOpt packs two output rows per byte; {q.shape[0]} rows is odd")
    q = q.to(torch.int16)
    if q.numel() and (int(q.min()) < -8 or int(q.max()) > 7):
        raise ValueError("signed int4 values must lie in [-8, 7]")
    lo, hi = q[0::2] & 0xF, q[1::2] & 0xF
    return (lo | (hi << 4)).to(torch.uint8).contiguous()


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4_rows: uint8 [N/2, K] -> int8 [N, K] in [-8, 7]."""
    p = packed.to(torch.int16)
    nib = torch.stack([p & 0xF, (p >> 4) & 0xF], dim=1)  # [N/2, 2, K]
    nib = torch.where(nib >= 8, nib - 16, nib)
    return nib.reshape(-1, packed.shape[1]).to(torch.int8).contiguous()


def hf_quant_config_awq(group_size: int, exclude: list[str], algo: str = AWQ_ALGO) -> dict:
    return {"producer": {"name": "modelopt", "version": MODELOPT_VERSION},
            "quantization": {"quant_algo": algo, "kv_cache_quant_algo": None,
                             "group_size": group_size, "has_zero_point": False,
                             "pre_quant_scale": True, "exclude_modules": exclude}}


def _unfused_linears(config: dict, names: list[str]) -> set[str]:
    """Linears whose input does not come straight from a norm: TensorRT-LLM wants a
    pre_quant_scale on them (the balance Linears of AwqGroups whose prev is a norm are fused)."""
    spec = spec_for_config(config)
    linears = set(spec.block_linears)
    after_norm = {b for g in spec.awq_groups if g.prev not in linears for b in g.balance}
    block = re.compile(re.escape(spec.block_path) + r"\.\d+\.")
    return {n for n in names if block.sub("", n, count=1) not in after_norm}


class ModelOptAWQWriter(FormatWriter):
    name = "modelopt"
    engines = ("tensorrt-llm",)

    def check(self, scheme: QuantScheme, shapes: dict[str, tuple[int, int]]) -> list[str]:
        """What the layout (or TensorRT-LLM's kernel) cannot hold; runs before calibration."""
        if scheme.kind != "int":
            return ["ModelOpt W4A16_AWQ stores integer weights (FP8 has its own writer)"]
        problems = []
        if scheme.bits != 4:
            problems.append(f"ModelOpt W4A16_AWQ is 4-bit only, not {scheme.bits}")
        if not scheme.symmetric:
            problems.append("ModelOpt W4A16_AWQ has no zero point (signed int4): use --sym")
        if scheme.group_size not in TRTLLM_GROUP_SIZES:
            problems.append(f"TensorRT-LLM's int4 group GEMM takes group size 64 or 128, not "
                            f"{scheme.group_size}")
        if scheme.act_order:
            problems.append("ModelOpt W4A16_AWQ has no g_idx, so no act-order")
        if scheme.activations not in (None, "fp8"):
            problems.append(f"ModelOpt int4 inputs are bf16 (W4A16_AWQ) or FP8 (W4A8_AWQ), not "
                            f"{scheme.activations!r}")
        for name, (n, _k) in shapes.items():
            if n % 2:
                problems.append(f"{name} has {n} outputs; two rows are packed per byte")
                break
        return problems

    def write(self, out_dir: Path, *, config: dict, dense: dict[str, torch.Tensor],
              results: dict[str, QuantResult], ignore: list[str], dtype: torch.dtype) -> None:
        scheme = next(iter(results.values())).scheme
        if not scheme.symmetric or scheme.bits != 4:
            raise ValueError("ModelOpt W4A16_AWQ takes symmetric 4-bit results")
        w4a8 = scheme.activations == "fp8"
        tensors = dict(dense)
        needs_pqs = _unfused_linears(config, list(results))
        for name, r in results.items():
            k = r.codes.shape[1]
            if r.g_idx is not None and not torch.equal(r.g_idx.long(), torch.arange(k) // scheme.group_size):
                raise ValueError(f"{name}: ModelOpt W4A16_AWQ has no g_idx (act-order)")
            if r.zero is not None and not torch.all(r.zero == 8):
                raise ValueError(f"{name}: zero points other than 8 cannot be stored as signed int4")
            tensors[f"{name}.weight"] = pack_int4_rows(r.codes.to(torch.int16) - 8)
            tensors[f"{name}.weight_scale"] = r.scale.float().contiguous()
            pqs = r.extra.get("pre_quant_scale")
            if pqs is not None and name not in needs_pqs:
                raise ValueError(f"{name}: TensorRT-LLM ignores pre_quant_scale on fused q/k/v and "
                                 "gate/up; fold it into the norm before them")
            if name in needs_pqs:
                tensors[f"{name}.pre_quant_scale"] = (pqs if pqs is not None else torch.ones(k)).to(dtype)
            if w4a8:
                for key in ("weight_scale_2", "input_scale"):
                    if key not in r.extra:
                        raise ValueError(f"{name}: W4A8_AWQ results need extra[{key!r}]")
                    tensors[f"{name}.{key}"] = r.extra[key].float().reshape(())
            if r.bias is not None:
                tensors[f"{name}.bias"] = r.bias.to(dtype)
        exclude = sorted(set(ignore) | {n[: -len(".weight")] for n, t in dense.items()
                                        if n.endswith("embed_tokens.weight")})
        algo = W4A8_AWQ_ALGO if w4a8 else AWQ_ALGO
        hf = hf_quant_config_awq(scheme.group_size, exclude, algo)
        save_tensors(out_dir, tensors)
        (out_dir / "hf_quant_config.json").write_text(json.dumps(hf, indent=4))
        qcfg = {"quant_method": "modelopt", "quant_algo": algo, "producer": hf["producer"],
                "ignore": exclude}
        write_config(out_dir, {**config, "quantization_config": qcfg})


def read_modelopt_awq(path: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A dense state dict from a W4A16_AWQ / W4A8_AWQ checkpoint: each Linear's effective
    weight q * weight_scale * pre_quant_scale (ModelOpt's exports and quantkit's alike);
    W4A8_AWQ: e4m3(q * fp16(weight_scale) / weight_scale_2) * weight_scale_2 * pre_quant_scale,
    the FP8 weight TensorRT-LLM's kernel multiplies."""
    cfg = read_config(path)
    hf_file = Path(path) / "hf_quant_config.json"
    quant = read_json(hf_file)["quantization"] if hf_file.is_file() else cfg.get(
        "quantization_config", {})
    if quant.get("quant_algo") not in (AWQ_ALGO, W4A8_AWQ_ALGO):
        raise NotImplementedError(f"ModelOpt quant_algo {quant.get('quant_algo')!r} (this reader: "
                                  f"{AWQ_ALGO}, {W4A8_AWQ_ALGO})")
    raw = load_tensors(path)
    out: dict[str, torch.Tensor] = {}
    for key, t in raw.items():
        base = key[: -len(".weight")] if key.endswith(".weight") else None
        if base is not None and t.dtype == torch.uint8 and base + ".weight_scale" in raw:
            q = unpack_int4_rows(t).float()  # [N, K]
            s = raw[base + ".weight_scale"].float()  # [N, K/G]
            s2 = raw.get(base + ".weight_scale_2")
            if s2 is not None:  # W4A8: the kernel's FP8 weight, fp16(s) / s2 as it loads it
                s2 = s2.float()
                s = (s.half() / s2).float()
            w = q * s.repeat_interleave(q.shape[1] // s.shape[1], dim=1)
            if s2 is not None:
                w = w.to(torch.float8_e4m3fn).float() * s2
            if base + ".pre_quant_scale" in raw:
                w = w * raw[base + ".pre_quant_scale"].float()[None, :]
            out[key] = w.to(dtype)
        elif not key.endswith(_SUFFIXES):
            out[key] = t.to(dtype) if t.is_floating_point() else t
    return out


def prepare_modelopt_w4a8_model(model: torch.nn.Module, path: Path) -> int:
    """W4A8_AWQ inputs as TensorRT-LLM computes them: x * pre_quant_scale cast to FP8 E4M3 under
    the static input_scale (static_quantize_e4m3_per_tensor); the reader folded pre_quant_scale
    into the weight, so the hook hands back the rounded input divided by it again."""
    from quantkit.formats.activations import install_input_quant

    raw = load_tensors(path)
    plan = {k[: -len(".input_scale")]: ("static", 0, t.float())
            for k, t in raw.items() if k.endswith(".input_scale")}
    pqs = {n: raw[f"{n}.pre_quant_scale"].float() for n in plan if f"{n}.pre_quant_scale" in raw}

    hooked = 0
    for name, (mode, group, scale) in plan.items():
        p = pqs.get(name)

        def fq(x, _mode, _group, s, p=p):
            xf = x.float() * (p if p is not None else 1)
            q = (xf / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
            return (q / (p if p is not None else 1)).to(x.dtype)
        hooked += install_input_quant(model, {name: (mode, group, scale)}, fq)
    return hooked
