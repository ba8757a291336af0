"""MLX affine checkpoints (what `mlx_lm.load` reads): integer weights for Apple-silicon users.

Per quantized Linear (N out, K in, G = K / group_size groups, b bits):
  <linear>.weight  uint32 [N, K*b/32]  codes packed along K as `mx.quantize` packs them: one
                   little-endian bit stream per row, value k in bits [k*b, (k+1)*b)
                   (for b = 2, 4, 8: 32/b values per word, least significant first; for
                   b = 3, 6: values straddle words, 32 values per 3 / 6 words)
  <linear>.scales  model dtype [N, G]
  <linear>.biases  model dtype [N, G]
  <linear>.bias    model dtype [N]      optional (the Linear's own bias)
Dequantized (mx.dequantize): W[n, k] = scales[n, g] * q[n, k] + biases[n, g], g = k // group.

quantkit's grid is W = (q - z) * s. Requests that choose no grid are quantized on the
asymmetric one (RECORD.symmetric = False), and since `biases` is a free float the asymmetric
grid here has float zero points (RECORD.float_zero: QuantScheme.float_zero): each group's
(s, z) is fitted by least squares on its codes (RTN and AWQ: codes rounded and (s, z) refitted
in turn; GPTQ: its codes kept, (s, z) refitted against its Hessian), biases = -s * z rounded
once to the model dtype. `--sym` gives z = 2^(b-1) and biases = -scales * z with s first
rounded to the model dtype (MLX keeps no float32 scale), as for any integer z.

Mixture-of-experts blocks: mlx-lm's SwitchGLU keeps every expert of one projection stacked,
`<block>.switch_mlp.<proj>.weight` uint32 [E, N, K*b/32], `.scales` / `.biases` [E, N, G];
per-expert names (`mlp.experts.{e}.gate_proj`, Mixtral's `block_sparse_moe.experts.{e}.w1`)
are stacked here, because not every model's sanitize() stacks packed experts (qwen3_moe's
stacks `.weight` only). Routers stay dense.

config.json: `quantization` {"group_size", "bits"} (mlx-lm's default for every packed
Linear) plus `{<module path>: {"group_size", "bits"}}` for a Linear that differs (mixed
bits), and `quantization_config` the same dict, as `mlx_lm convert` writes it.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from quantkit.e2m1 import e2m1_decode
from quantkit.formats.common import (
    FormatRecord,
    FormatWriter,
    load_tensors,
    read_config,
    save_tensors,
    write_config,
)
from quantkit.types import QuantResult, QuantScheme

__all__ = ["MLXWriter", "mlx_lm_config", "pack_mlx", "unpack_mlx", "mlx_tensors", "read_mlx", "is_mlx_config",
           "MLX_BITS", "MLX_GROUPS", "switch_name"]

MLX_BITS = (2, 3, 4, 6, 8)  # affine widths of mlx 0.32 that mlx-lm's convert offers
MLX_GROUPS = (32, 64, 128)
_SUFFIXES = (".scales", ".biases")
# per-expert projection -> mlx-lm's SwitchGLU name (Mixtral's w1 / w2 / w3 as its sanitize maps)
_EXPERT = re.compile(r"^(?P<block>.+)\.experts\.(?P<e>\d+)\.(?P<proj>\w+)$")
_MIXTRAL = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_MIXTRAL_BACK = {v: k for k, v in _MIXTRAL.items()}
# transformers' text-only model_type -> mlx-lm's module for it (mlx_lm/models/<type>.py, 0.32.2:
# qwen3_5.py reads a config without text_config as the text config itself)
_MLX_MODEL_TYPES = {"qwen3_5_text": "qwen3_5"}
_NUM_EXPERTS_TYPES = ("qwen3_moe", "qwen2_moe", "olmoe")  # mlx-lm's ModelArgs name num_experts
# MLX 0.32's float modes quantkit writes -> their group size (mx.quantize's table); NVFP4 without
# a tensor scale: nn.QuantizedLinear takes none (only mlx-lm's SwitchGLU experts hold one)
_FP4_MODES = {"mxfp4": 32, "nvfp4": 16}


def pack_mlx(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., K] unsigned codes (< 2^bits) -> uint32 [..., K*bits/32], mx.quantize's bit stream."""
    v = codes.to(torch.int64)
    k = v.shape[-1]
    if (k * bits) % 32:
        raise ValueError(f"{k} values of {bits} bits do not fill whole uint32 words")
    if v.numel() and (int(v.min()) < 0 or int(v.max()) >= 1 << bits):
        raise ValueError(f"codes out of range for {bits} bits")
    bit = torch.arange(bits, dtype=torch.int64)
    stream = ((v[..., None] >> bit) & 1).reshape(*v.shape[:-1], -1, 32)  # bit j of the stream
    words = (stream << torch.arange(32, dtype=torch.int64)).sum(-1)
    return words.to(torch.uint32)


def unpack_mlx(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack_mlx: uint32 [..., W] -> int64 codes [..., W*32/bits]."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    stream = ((w[..., None] >> torch.arange(32, dtype=torch.int64)) & 1)
    stream = stream.reshape(*w.shape[:-1], -1, bits)
    return (stream << torch.arange(bits, dtype=torch.int64)).sum(-1)


def _check_result(r: QuantResult) -> None:
    """What MLX's affine layout cannot hold, for a result in hand."""
    k = r.codes.shape[1]
    if r.g_idx is not None and not torch.equal(
            r.g_idx.long(), torch.arange(k) // r.scheme.effective_group(k)):
        raise ValueError(f"{r.name}: MLX has no g_idx; act-order results need static groups")
    if r.extra.get("pre_quant_scale") is not None:
        raise ValueError(f"{r.name}: MLX cannot store a pre_quant_scale")


def mlx_tensors(r: QuantResult, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """weight / scales / biases of one QuantResult on MLX's grid (codes [N, K], scale [N, G]);
    MXFP4 / NVFP4 (mx.quantize's modes "mxfp4" / "nvfp4"): the E2M1 codes packed as 4-bit
    values, the E8M0 exponents or the E4M3 scales' bytes as uint8 scales, no biases."""
    if r.scheme.kind == "mxfp4":
        return {"weight": pack_mlx(r.codes, 4), "scales": r.scale.to(torch.uint8).contiguous()}
    if r.scheme.kind == "nvfp4":
        if r.scheme.tensor_scale:
            raise ValueError(f"{r.name}: MLX's QuantizedLinear keeps no NVFP4 tensor scale")
        return {"weight": pack_mlx(r.codes, 4),
                "scales": r.scale.to(torch.float8_e4m3fn).view(torch.uint8).contiguous()}
    _check_result(r)
    bits = r.scheme.bits
    zero = r.zero if r.zero is not None else torch.full_like(r.scale, 1 << (bits - 1),
                                                             dtype=torch.int32)
    scales = r.scale.to(dtype)
    # an integer z: -s_dtype * z (0 stays a level of the stored grid); a fitted float z (the
    # float-zero grid): the fitted bias -s * z itself, rounded once to the dtype
    biases = (-(r.scale.float() if zero.is_floating_point() else scales.float())
              * zero.float()).to(dtype)
    return {"weight": pack_mlx(r.codes, bits), "scales": scales.contiguous(),
            "biases": biases.contiguous()}


def switch_name(name: str) -> tuple[str, int] | None:
    """(stacked SwitchGLU name, expert index) of a per-expert Linear; None for other Linears."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    proj = _MIXTRAL.get(m["proj"], m["proj"])
    return f"{m['block']}.switch_mlp.{proj}", int(m["e"])


def _layer_params(r: QuantResult) -> dict:
    params = {"group_size": r.scheme.effective_group(r.codes.shape[1]), "bits": r.scheme.bits}
    return {**params, "mode": r.scheme.kind} if r.scheme.kind in _FP4_MODES else params


def mlx_lm_config(config: dict) -> dict:
    """`config` plus the transformers-4 keys mlx-lm 0.32's ModelArgs require where a
    transformers 5 config holds them elsewhere: `rope_theta` (5 keeps it in rope_parameters;
    a non-default rope also as `rope_scaling`) and Qwen MoE's `num_experts` (5 writes
    num_local_experts). Keys already there are kept. A text-only config whose model_type
    mlx-lm has no module for is named by the module that reads it (_MLX_MODEL_TYPES)."""
    out = dict(config)
    out["model_type"] = _MLX_MODEL_TYPES.get(out.get("model_type"), out.get("model_type"))
    rope = out.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" not in out and "rope_theta" in rope:
        out["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type", "default") != "default" and out.get("rope_scaling") is None:
            out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if out.get("model_type") in _NUM_EXPERTS_TYPES and "num_experts" not in out \
            and "num_local_experts" in out:
        out["num_experts"] = out["num_local_experts"]
    return out


class MLXWriter(FormatWriter):
    name = "mlx"
    engines = ("mlx",)

    def check(self, scheme: QuantScheme, shapes: dict[str, tuple[int, int]]) -> list[str]:
        """What MLX's affine quantization cannot take; runs before calibration."""
        if scheme.kind in _FP4_MODES:  # mx.quantize(mode=...): 4 bits, fixed groups
            group = _FP4_MODES[scheme.kind]
            return [] if scheme.group_size == group and not scheme.activations else [
                f"MLX's {scheme.kind} mode is weight-only with groups of {group}"]
        if scheme.kind != "int":
            return [f"MLX stores affine integer, mxfp4 or nvfp4 weights, not {scheme.kind}"]
        problems = []
        if scheme.bits not in MLX_BITS:
            problems.append(f"MLX affine quantization takes {', '.join(map(str, MLX_BITS))} bits, "
                            f"not {scheme.bits}")
        if scheme.group_size not in MLX_GROUPS:
            problems.append(f"MLX affine quantization takes group size "
                            f"{', '.join(map(str, MLX_GROUPS))}, not {scheme.group_size}")
        # act-order is fine while groups stay k // group (GPTQ's static groups, the only
        # act-order the CLI makes); a permuted g_idx is refused by _check_result at write
        if scheme.activations:
            problems.append("MLX's affine layout is weight-only")
        for name, (_n, k) in shapes.items():
            if scheme.group_size in MLX_GROUPS and k % scheme.group_size:
                problems.append(f"{name} has {k} inputs, not a multiple of the group size "
                                f"{scheme.group_size}")
                break
        return problems

    def write(self, out_dir: Path, *, config: dict, dense: dict[str, torch.Tensor],
              results: dict[str, QuantResult], ignore: list[str], dtype: torch.dtype) -> None:
        tensors = dict(dense)
        default = _layer_params(next(iter(results.values())))
        layers: dict[str, dict[str, int]] = {}
        stacked: dict[str, dict[int, QuantResult]] = {}
        for name, r in results.items():
            switch = switch_name(name)
            if switch is not None:
                stacked.setdefault(switch[0], {})[switch[1]] = r
                continue
            for key, t in mlx_tensors(r, dtype).items():
                tensors[f"{name}.{key}"] = t
            if r.bias is not None:
                tensors[f"{name}.bias"] = r.bias.to(dtype)
            layers[name] = _layer_params(r)
        for name, experts in stacked.items():
            order = sorted(experts)
            if order != list(range(len(order))):
                raise ValueError(f"{name}: experts {order} are not 0..E-1; SwitchGLU stacks all")
            params = {tuple(_layer_params(experts[e]).items()) for e in order}
            if len(params) != 1:
                raise ValueError(f"{name}: experts differ in bits / group size; SwitchGLU stacks "
                                 "one packed tensor per projection")
            if any(experts[e].bias is not None for e in order):
                raise ValueError(f"{name}: expert Linears with a bias are not stacked yet")
            parts = [mlx_tensors(experts[e], dtype) for e in order]
            for key in parts[0]:
                tensors[f"{name}.{key}"] = torch.stack([p[key] for p in parts])
            layers[name] = _layer_params(experts[order[0]])
        quantization: dict = dict(default)
        for name, params in sorted(layers.items()):  # mixed bits: mlx-lm reads these by path
            if params != default:
                quantization[name] = params
        save_tensors(out_dir, tensors)
        out_config = mlx_lm_config({k: v for k, v in config.items() if k != "quantization_config"})
        write_config(out_dir, {**out_config, "quantization": quantization,
                               "quantization_config": quantization})


def is_mlx_config(config: dict) -> bool:
    """An mlx-lm affine checkpoint: `quantization` with bits and group size, no quant_method."""
    q = config.get("quantization")
    return isinstance(q, dict) and "bits" in q and "group_size" in q \
        and q.get("mode", "affine") in ("affine", *_FP4_MODES)


def read_mlx(path: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A dense state dict from an MLX affine artifact: scales * q + biases computed as
    mx.dequantize computes it on the CPU (each operation rounded to the scales' dtype; tests/
    test_mlx.py checks it bit for bit), then cast to `dtype`; stacked experts are written back
    under their per-expert names."""
    cfg = read_config(path)
    if not is_mlx_config(cfg):
        raise NotImplementedError(f"{path}: not an MLX affine checkpoint")
    raw = load_tensors(path)
    out: dict[str, torch.Tensor] = {}
    for key, t in raw.items():
        if key.endswith(_SUFFIXES):
            continue
        base = key[: -len(".weight")] if key.endswith(".weight") else None
        if base is None or f"{base}.scales" not in raw:
            out[key] = t.to(dtype) if t.is_floating_point() else t
            continue
        scales = raw[f"{base}.scales"]
        groups = scales.shape[-1]
        layer = cfg["quantization"].get(base)
        params = layer if isinstance(layer, dict) else cfg["quantization"]
        group = int(params["group_size"])
        bits = t.shape[-1] * 32 // (groups * group)
        q = unpack_mlx(t, bits)
        q = q.reshape(*q.shape[:-1], groups, -1)
        mode = params.get("mode", "affine")
        if mode in _FP4_MODES:  # E2M1 value * 2^(E8M0 - 127) or * its E4M3 scale, exact
            step = torch.exp2(scales.float() - 127) if mode == "mxfp4" else \
                scales.view(torch.float8_e4m3fn).float()
            w = e2m1_decode(q) * step[..., None]
            w = w.reshape(*t.shape[:-1], -1).to(dtype)
        else:
            # MLX's arithmetic, in the stored dtype: scales * q rounded to it, then + biases
            # rounded again (s * q of a bf16 / fp16 scale and a code <= 255 is exact in float32)
            biases = raw[f"{base}.biases"]
            sq = (scales.float()[..., None] * q.float()).to(scales.dtype)
            w = (sq.float() + biases.float()[..., None]).to(scales.dtype)
            w = w.reshape(*t.shape[:-1], -1).to(dtype)
        if ".switch_mlp." in base:
            block, _, proj = base.partition(".switch_mlp.")
            if block.endswith("block_sparse_moe"):  # Mixtral's checkpoint names
                proj = _MIXTRAL_BACK[proj]
            for e in range(w.shape[0]):
                out[f"{block}.experts.{e}.{proj}.weight"] = w[e].contiguous()
        else:
            out[f"{base}.weight"] = w
    return out


# MoE families whose mlx-lm model (mlx_lm/models/<type>.py) keeps experts as SwitchGLU
# `switch_mlp.{gate,up,down}_proj` under the block the checkpoint names (read in mlx-lm 0.32.2;
# tests/test_mlx.py loads qwen3_moe)
MLX_SWITCH_FAMILIES = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral")


def _stores_experts(spec) -> bool:
    return any(t in MLX_SWITCH_FAMILIES for t in spec.model_types)


# asymmetric unless asked: `biases` is a free float per group, and a symmetric grid leaves
# levels unused in every group whose weights are not centred on zero; the zero points are
# fitted floats; GPTQ takes act-order unless told not to (static groups, which MLX stores):
# both measured on SmolLM2 4-bit g64, benchmarks/mlx_vs_mlxlm.py; NVFP4 without the tensor
# scale nn.QuantizedLinear does not hold
RECORD = FormatRecord("mlx", MLXWriter, read=read_mlx, stores_experts=_stores_experts,
                      symmetric=False, float_zero=True, act_order=True, fp4_tensor_scale=False)
