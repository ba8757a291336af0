"""compressed-tensors integer formats: what vLLM's compressed-tensors loader reads.

`pack-quantized` (W4A16 / W8A16 weight-only), per quantized Linear (N out, K in, G groups),
written through the compressed-tensors library:
  weight_packed      int32 [N, ceil(K*bits/32)]   signed codes + 2^(bits-1), packed along K,
                                                  least-significant first
  weight_scale       model dtype [N, G]
  weight_zero_point  int32 [ceil(N*bits/32), G]   asymmetric only, packed along N
  weight_g_idx       int32 [K]                    act-order only
  weight_shape       int64 [2]
`int-quantized` (W8A8 int8: llm-compressor's preset W8A8 = per-channel symmetric weights,
dynamic per-token symmetric inputs; or static per-tensor inputs), nothing packed:
  weight             int8 [N, K]                  signed codes (-128..127)
  weight_scale       float32 [N, 1]               the dtype vLLM's CompressedTensorsW8A8Int8
                                                  allocates (llm-compressor writes the model
                                                  dtype, which vLLM upcasts: float32 is exact)
  input_scale        float32 [1]                  static inputs only
Every Linear must match a target or an ignore entry, else vLLM refuses the checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch

from quantkit.errors import ModelLoadError
from quantkit.formats.activations import (
    fake_quant_int8_input,
    install_input_quant,
    quantized_linear_inputs,
)
from quantkit.formats.common import (
    FormatRecord,
    FormatWriter,
    load_tensors,
    read_config,
    save_tensors,
    write_config,
)
from quantkit.formats.fp4 import (
    FP4CompressedTensorsWriter,
    prepare_nvfp4_model,
    read_fp4_pack_quantized,
)
from quantkit.formats.fp8 import (
    FP8CompressedTensorsWriter,
    KindDispatch,
    prepare_fp8_model,
    read_float_quantized,
)
from quantkit.types import QuantResult, QuantScheme

__all__ = ["CompressedTensorsWriter", "read_compressed_tensors", "quantization_config",
           "int_quantized_config", "prepare_int8_model"]


def quantization_config(scheme: QuantScheme, ignore: list[str], dynamic_g_idx: bool = True) -> dict:
    """`dynamic_g_idx` False: act-order with static groups (g_idx = k // G) -> actorder "static",
    the only act-order vLLM 0.32 loads (it refuses "group": compressed_tensors.py)."""
    from compressed_tensors.quantization import (  # lazy: kept out of the calibration's peak RSS
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
    )

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


def int_quantized_config(activations: str, ignore: list[str]) -> dict:
    """quantization_config of int8 W8A8 (`int-quantized`): llm-compressor's preset W8A8 for
    dynamic inputs (per-channel symmetric int8 weights, per-token symmetric int8 inputs), or the
    same weights with static per-tensor inputs; built from the library's own classes. Static
    inputs name their observer: static_minmax, llm-compressor's running min / max, which is
    quantkit's rule (max|x| over every calibration token; not llm-compressor's default for
    static inputs, the moving average it names minmax)."""
    from compressed_tensors.quantization import (  # lazy: kept out of the calibration's peak RSS
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
    )

    weights = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel",
                               dynamic=False)
    if activations == "static":
        inputs = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="tensor",
                                  dynamic=False, observer="static_minmax")
    else:
        inputs = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token",
                                  dynamic=True)
    cfg = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights,
                                                     input_activations=inputs,
                                                     # llm-compressor 0.14 names it per group too
                                                     format="int-quantized")},
        ignore=ignore, format="int-quantized", quantization_status="compressed")
    out = cfg.to_dict()
    out["quant_method"] = "compressed-tensors"
    return out


class CompressedTensorsWriter(FormatWriter):
    name = "compressed-tensors"
    engines = ("vllm",)

    def check(self, scheme: QuantScheme, shapes: dict[str, tuple[int, int]]) -> list[str]:
        problems = []
        if scheme.kind != "int":
            problems.append("the compressed-tensors pack-quantized writer takes integer schemes")
        if scheme.activations:
            if (scheme.bits, scheme.group_size, scheme.symmetric) != (8, -1, True):
                problems.append("int-quantized W8A8 holds symmetric per-channel int8 weights "
                                "(vLLM's CompressedTensorsW8A8Int8)")
            if scheme.activations not in ("dynamic", "static"):
                problems.append(f"int8 inputs are dynamic or static, not {scheme.activations!r}")
        elif scheme.bits not in (4, 8):
            problems.append(f"vLLM's compressed-tensors WNA16 loads 4 or 8 bits, not {scheme.bits}")
        return problems

    def write(self, out_dir: Path, *, config: dict, dense: dict[str, torch.Tensor],
              results: dict[str, QuantResult], ignore: list[str], dtype: torch.dtype) -> None:
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

        scheme = next(iter(results.values())).scheme
        if scheme.activations:
            self._write_w8a8(out_dir, config, dense, results, ignore, dtype)
            return
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


    def _write_w8a8(self, out_dir: Path, config: dict, dense: dict[str, torch.Tensor],
                    results: dict[str, QuantResult], ignore: list[str], dtype: torch.dtype) -> None:
        activations = {r.scheme.activations for r in results.values()}
        if len(activations) != 1 or any(r.scheme.group_size != -1 or r.scheme.bits != 8
                                        for r in results.values()):
            raise ValueError("int-quantized results must all be int8 per-channel with one "
                             "activation scheme")
        static = activations.pop() == "static"
        tensors = dict(dense)
        for name, r in results.items():
            tensors[f"{name}.weight"] = (r.codes.to(torch.int16) - 128).to(torch.int8)
            tensors[f"{name}.weight_scale"] = r.scale.float().reshape(-1, 1).contiguous()
            if static:
                tensors[f"{name}.input_scale"] = r.extra["input_scale"].float().reshape(1)
            if r.bias is not None:
                tensors[f"{name}.bias"] = r.bias.to(dtype)
        save_tensors(out_dir, tensors)
        qcfg = int_quantized_config("static" if static else "dynamic", ignore)
        write_config(out_dir, {**config, "quantization_config": qcfg})


def _companion(raw: dict[str, torch.Tensor], base: str, leaf: str, path: Path) -> torch.Tensor:
    """A packed weight's companion tensor, or an error naming the one that is missing."""
    try:
        return raw[f"{base}.{leaf}"]
    except KeyError:
        raise ModelLoadError(
            f"{path}: {base}.weight_packed has no {base}.{leaf}; the artifact is incomplete "
            "(re-run the quantize command that wrote it)") from None


def read_compressed_tensors(path: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A dense state dict (dequantized weights) from a pack-quantized or int-quantized artifact."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    qcfg = read_config(path)["quantization_config"]
    if qcfg.get("format") == "int-quantized":
        return _read_int_quantized(path, dtype)
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
        shape = _companion(raw, base, "weight_shape", path).tolist()
        q = unpack_from_int32(t, bits, torch.Size(shape)).float()
        scale = _companion(raw, base, "weight_scale", path).float()
        if f"{base}.weight_g_idx" in raw:
            gi = raw[f"{base}.weight_g_idx"].long()
        else:
            gi = torch.arange(shape[1]) // (gsize or shape[1])
        zero = 0.0
        if not sym:
            zp = unpack_from_int32(_companion(raw, base, "weight_zero_point", path), bits,
                                   torch.Size([shape[0], scale.shape[1]]), packed_dim=0)
            zero = zp.float()[:, gi]
        out[f"{base}.weight"] = ((q - zero) * scale[:, gi]).to(dtype)
    return out


def _read_int_quantized(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    raw = load_tensors(path)
    out: dict[str, torch.Tensor] = {}
    for key, t in raw.items():
        if key.endswith((".weight_scale", ".input_scale")):
            continue
        if key.endswith(".weight") and t.dtype == torch.int8:
            scale = raw.get(key + "_scale")
            if scale is None:
                raise ModelLoadError(f"int8 weight {key} has no weight_scale.")
            out[key] = (t.float() * scale.float().reshape(-1, 1)).to(dtype)
        else:
            out[key] = t.to(dtype) if t.is_floating_point() else t
    return out


def prepare_int8_model(model: torch.nn.Module, path: Path) -> int:
    """Each int8 Linear of an int-quantized artifact also rounds its input through int8 as
    vLLM does (dynamic per token, or the stored static per-tensor scale); returns how many."""
    qcfg = read_config(path)["quantization_config"]
    a = next(iter(qcfg["config_groups"].values())).get("input_activations") or {}
    if not a:
        return 0
    mode = "token" if a.get("dynamic") else "static"
    names, scales = quantized_linear_inputs(path, "I8")
    plan = {n: (mode, 0, scales.get(n)) for n in sorted(names)}
    if mode == "static" and any(s is None for _, _, s in plan.values()):
        raise ModelLoadError(f"{path}: static int8 activations but some Linears lack input_scale.")
    return install_input_quant(model, plan, fake_quant_int8_input)


def _writer() -> KindDispatch:
    """pack-quantized for int schemes, float-quantized for fp8, nvfp4/mxfp4-pack-quantized for
    FP4."""
    return KindDispatch("compressed-tensors", {"fp8": FP8CompressedTensorsWriter,
                                               "nvfp4": FP4CompressedTensorsWriter,
                                               "mxfp4": FP4CompressedTensorsWriter},
                        CompressedTensorsWriter)


def _read(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    ct_format = read_config(path)["quantization_config"].get("format")
    if ct_format == "float-quantized":
        return read_float_quantized(path, dtype)
    if ct_format in ("nvfp4-pack-quantized", "mxfp4-pack-quantized"):
        return read_fp4_pack_quantized(path, dtype)
    return read_compressed_tensors(path, dtype)


def _prepare(model: torch.nn.Module, path: Path) -> None:
    ct_format = read_config(path)["quantization_config"].get("format")
    if ct_format == "int-quantized":  # int8 W8A8: inputs rounded through int8
        prepare_int8_model(model, path)
    elif ct_format == "nvfp4-pack-quantized":  # W4A4: inputs rounded through NVFP4
        prepare_nvfp4_model(model, path)
    elif ct_format == "float-quantized":
        prepare_fp8_model(model, path, "compressed-tensors")


RECORD = FormatRecord("compressed-tensors", _writer, read=_read, prepare=_prepare, kv_cache=True,
                      stores_experts=lambda spec: True)
