"""FP8 E4M3 checkpoints for vLLM: compressed-tensors `float-quantized` and vLLM's native `fp8`.

Per quantized Linear (N out, K in; B = block size, 128):
  compressed-tensors (written with the compressed-tensors library's config classes)
    weight        float8_e4m3fn [N, K]
    weight_scale  float32 [1] (tensor) | [N, 1] (channel) | [ceil(N/B), ceil(K/B)] (block)
    input_scale   float32 [1]                       static per-tensor inputs only
  vLLM native fp8 (`quant_method: fp8`, config in config.json)
    weight            float8_e4m3fn [N, K]
    weight_scale      float32 []                    per-tensor
    weight_scale_inv  float32 [ceil(N/B), ceil(K/B)] block (the name is vLLM's, the value is
                                                   still amax / 448, a multiplier)
    input_scale       float32 []                    activation_scheme "static" only
Layers the method left in full precision (kind "none") are written as plain weights and listed
in `ignore` / `ignored_layers`. This module also installs the activation rounding the engines
apply (dynamic per-token / per-group / per-tensor, or static) when quantkit evaluates on CPU.
"""

from __future__ import annotations

from pathlib import Path

import torch

from quantkit.errors import ModelLoadError, SchemeMismatch
from quantkit.formats.activations import install_input_quant, quantized_linear_inputs
from quantkit.formats.common import (
    FormatRecord,
    FormatWriter,
    load_tensors,
    read_config,
    save_tensors,
    write_config,
)
from quantkit.formats.modelopt_config import modelopt_activation_plan
from quantkit.types import QuantResult, QuantScheme

__all__ = ["FP8CompressedTensorsWriter", "VllmFP8Writer", "KindDispatch", "FP8Layout",
           "read_float_quantized", "read_vllm_fp8", "dequantize_fp8",
           "prepare_fp8_model", "float_quantized_config", "FP8_ENGINES"]

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)


class FP8Layout:
    """What a set of FP8 results holds, read from the results alone (formats never import
    methods): weight granularity from scheme.group_size, static inputs from extra."""

    def __init__(self, results: dict[str, QuantResult]):
        self.quantized = {n: r for n, r in results.items() if r.scheme.kind == "fp8"}
        self.full = {n: r for n, r in results.items() if r.scheme.kind != "fp8"}
        if not self.quantized:
            raise SchemeMismatch("No FP8-quantized Linear to write.",
                                 "Every layer fell back to full precision; use --scheme dynamic.")
        g = {r.scheme.group_size for r in self.quantized.values()}
        static = {"input_scale" in r.extra for r in self.quantized.values()}
        if len(g) != 1 or len(static) != 1:
            raise SchemeMismatch("FP8 results mix weight granularities or activation schemes.")
        gs = g.pop()
        self.weights = "tensor" if gs == 0 else "channel" if gs in (-1,) else "block"
        self.block = gs if gs > 0 else 128
        self.static = static.pop()

    @property
    def activations(self) -> str:
        return "static" if self.static else "dynamic"


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """float32 codes * scale; [], [1] and [N, 1] broadcast, a block grid is repeated B times."""
    n, k = codes.shape
    s = scale.float()
    if s.numel() > 1 and tuple(s.shape) not in ((n, 1), (n,)):
        s = s.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    elif tuple(s.shape) == (n,):
        s = s[:, None]
    return codes.float() * s


# which engines load each layout (formats.md + TensorRT-LLM's loader, see
# quantkit/engines/trtllm_rules.py)
FP8_ENGINES = {
    ("compressed-tensors", "tensor"): ("vllm",),
    ("compressed-tensors", "channel"): ("vllm", "trtllm"),
    ("compressed-tensors", "block"): ("vllm", "trtllm"),
    ("fp8", "tensor", "dynamic"): ("vllm",),
    ("fp8", "tensor", "static"): ("vllm", "trtllm"),
    ("fp8", "block", "dynamic"): ("vllm", "trtllm"),
}


def _write_full_precision(tensors: dict, layout: FP8Layout, dtype: torch.dtype) -> list[str]:
    for name, r in layout.full.items():
        tensors[f"{name}.weight"] = r.codes.to(dtype)
        if r.bias is not None:
            tensors[f"{name}.bias"] = r.bias.to(dtype)
    return sorted(layout.full)


# ------------------------------------------------------- compressed-tensors float ----

def float_quantized_config(weights: str, activations: str, block: int, ignore: list[str]) -> dict:
    """quantization_config for FP8 / FP8_DYNAMIC / FP8_BLOCK (and the other valid combinations),
    built from the compressed-tensors library's classes so vLLM's parser reads it as its own.
    Static inputs name their observer, static_minmax (llm-compressor's FP8 preset: the running
    max|x| over every calibration token, quantkit's default rule; compressed-tensors has no
    name for the Python-only percentile observer), and the group names its format, as
    llm-compressor 0.14 writes them."""
    from compressed_tensors.quantization import (  # lazy: a slow import, absent on the GPU host
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
    )

    w = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=weights, dynamic=False,
                         block_structure=[block, block] if weights == "block" else None)
    if activations == "static":
        a = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="tensor",
                             dynamic=False, observer="static_minmax")
    elif weights == "block":
        a = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="group",
                             group_size=block, dynamic=True)
    else:
        a = QuantizationArgs(num_bits=8, type="float", symmetric=True,
                             strategy="token" if weights == "channel" else "tensor", dynamic=True)
    cfg = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=w,
                                                     input_activations=a,
                                                     format="float-quantized")},
        ignore=ignore, format="float-quantized", quantization_status="compressed")
    out = cfg.to_dict()
    out["quant_method"] = "compressed-tensors"
    return out


class FP8CompressedTensorsWriter(FormatWriter):
    name = "compressed-tensors"
    engines: tuple[str, ...] = ("vllm",)

    def check(self, scheme: QuantScheme, shapes: dict[str, tuple[int, int]]) -> list[str]:
        if scheme.kind != "fp8":
            return ["the compressed-tensors float-quantized writer takes FP8 schemes"]
        weights = "tensor" if scheme.group_size == 0 else "channel" if scheme.group_size == -1 else "block"
        self.engines = FP8_ENGINES[("compressed-tensors", weights)]
        return []

    def write(self, out_dir: Path, *, config: dict, dense: dict[str, torch.Tensor],
              results: dict[str, QuantResult], ignore: list[str], dtype: torch.dtype) -> None:
        lay = FP8Layout(results)
        self.engines = FP8_ENGINES[("compressed-tensors", lay.weights)]
        tensors = dict(dense)
        skipped = _write_full_precision(tensors, lay, dtype)
        for name, r in lay.quantized.items():
            tensors[f"{name}.weight"] = r.codes
            tensors[f"{name}.weight_scale"] = r.scale.float().reshape(
                (1,) if lay.weights == "tensor" else tuple(r.scale.shape)).contiguous()
            if lay.static:
                tensors[f"{name}.input_scale"] = r.extra["input_scale"].float().reshape(1)
            if r.bias is not None:
                tensors[f"{name}.bias"] = r.bias.to(dtype)
        save_tensors(out_dir, tensors)
        qcfg = float_quantized_config(lay.weights, lay.activations, lay.block,
                                      list(ignore) + skipped)
        write_config(out_dir, {**config, "quantization_config": qcfg})


def read_float_quantized(path: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    qcfg = read_config(path)["quantization_config"]
    w = next(iter(qcfg["config_groups"].values()))["weights"]
    block = (w.get("block_structure") or [128, 128])[0]
    return _dequantized_state(load_tensors(path), "weight_scale", block, dtype)


def _dequantized_state(raw: dict[str, torch.Tensor], scale_name: str, block: int,
                       dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, t in raw.items():
        if key.endswith((".weight_scale", ".weight_scale_inv", ".input_scale")):
            continue
        if key.endswith(".weight") and t.dtype == torch.float8_e4m3fn:
            base = key[: -len(".weight")]
            scale = raw.get(f"{base}.{scale_name}")
            if scale is None:
                raise ModelLoadError(f"FP8 weight {key} has no {scale_name}.")
            out[key] = dequantize_fp8(t, scale, block).to(dtype)
        else:
            out[key] = t.to(dtype) if t.is_floating_point() else t
    return out


# ------------------------------------------------------------------ vLLM native fp8 ----

class VllmFP8Writer(FormatWriter):
    name = "fp8"
    engines: tuple[str, ...] = ("vllm",)

    def check(self, scheme: QuantScheme, shapes: dict[str, tuple[int, int]]) -> list[str]:
        if scheme.kind != "fp8":
            return ["vLLM's native fp8 format takes FP8 schemes (--method fp8)"]
        if scheme.group_size == -1:
            return ["vLLM's native fp8 format has per-tensor or 128x128 block weight scales, no "
                    "per-channel ones: write FP8_DYNAMIC with --format compressed-tensors, or use "
                    "--scheme static / --scheme block with --format fp8"]
        return []

    def write(self, out_dir: Path, *, config: dict, dense: dict[str, torch.Tensor],
              results: dict[str, QuantResult], ignore: list[str], dtype: torch.dtype) -> None:
        lay = FP8Layout(results)
        if lay.weights == "channel":
            raise SchemeMismatch(self.check(QuantScheme(kind="fp8", group_size=-1), {})[0] + ".")
        self.engines = FP8_ENGINES[("fp8", lay.weights, lay.activations)]
        tensors = dict(dense)
        skipped = _write_full_precision(tensors, lay, dtype)
        for name, r in lay.quantized.items():
            tensors[f"{name}.weight"] = r.codes
            if lay.weights == "block":
                tensors[f"{name}.weight_scale_inv"] = r.scale.float().contiguous()
            else:
                tensors[f"{name}.weight_scale"] = r.scale.float().reshape(())
            if lay.static:
                tensors[f"{name}.input_scale"] = r.extra["input_scale"].float().reshape(())
            if r.bias is not None:
                tensors[f"{name}.bias"] = r.bias.to(dtype)
        save_tensors(out_dir, tensors)
        qcfg: dict = {"quant_method": "fp8", "activation_scheme": lay.activations,
                      "ignored_layers": list(ignore) + skipped}
        if lay.weights == "block":
            qcfg["weight_block_size"] = [lay.block, lay.block]
        write_config(out_dir, {**config, "quantization_config": qcfg})


def read_vllm_fp8(path: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    qcfg = read_config(path)["quantization_config"]
    block = qcfg.get("weight_block_size")
    return _dequantized_state(load_tensors(path), "weight_scale_inv" if block else "weight_scale",
                              (block or [128])[0], dtype)


# ------------------------------------------------------- one format name, two kinds ----

class KindDispatch(FormatWriter):
    """One `--format` name served by two writers, picked by the scheme's kind (int / fp8).

    `check` sees the scheme before any work; `write` sees the results (a kind "none" result is
    a full-precision fallback and does not decide)."""

    def __init__(self, name: str, by_kind: dict[str, object], default) -> None:
        self.name, self._by_kind, self._default = name, by_kind, default
        self._chosen, self._key = None, None

    def _pick(self, kind: str):
        key = kind if kind in self._by_kind else "*"
        if self._key != key:
            self._chosen, self._key = (self._by_kind.get(kind) or self._default)(), key
        return self._chosen

    @property
    def engines(self) -> tuple[str, ...]:
        return tuple(self._chosen.engines) if self._chosen is not None else ()

    def check(self, scheme: QuantScheme, shapes: dict[str, tuple[int, int]]) -> list[str]:
        return self._pick(scheme.kind).check(scheme, shapes)

    def write(self, out_dir: Path, **kw) -> None:
        kinds = {r.scheme.kind for r in kw["results"].values()} - {"none"}
        self._pick("fp8" if "fp8" in kinds else next(iter(kinds), "int")).write(out_dir, **kw)

    def __getattr__(self, item):  # what FormatWriter does not declare, of the chosen writer
        if item.startswith("_") or self.__dict__.get("_chosen") is None:
            raise AttributeError(item)
        return getattr(self._chosen, item)


# ------------------------------------------------------------- activations on CPU ----

def _activation_plan(path: Path, fmt: str) -> tuple[str, int, str]:
    """(mode, group, scale tensor suffix) the engine applies to FP8 Linear inputs."""
    cfg = read_config(path).get("quantization_config") or {}
    if fmt == "compressed-tensors":
        a = next(iter(cfg["config_groups"].values())).get("input_activations") or {}
        if not a:
            return "none", 0, ""
        if not a.get("dynamic"):
            return "static", 0, "input_scale"
        return {"token": ("token", 0, ""), "group": ("group", int(a.get("group_size") or 128), ""),
                "tensor": ("tensor", 0, "")}[a.get("strategy", "tensor")]
    if fmt == "fp8":
        if cfg.get("activation_scheme") == "static":
            return "static", 0, "input_scale"
        block = cfg.get("weight_block_size")
        return ("group", int(block[1]), "") if block else ("tensor", 0, "")
    raise ValueError(fmt)


def fake_quant_input(x: torch.Tensor, mode: str, group: int = 128,
                     scale: torch.Tensor | None = None) -> torch.Tensor:
    """x rounded through E4M3 the way the engine quantizes a Linear input (no-op for none)."""
    if mode == "none":
        return x
    xf = x.float()
    if mode == "static":
        s = scale.float()
    elif mode == "tensor":
        s = (xf.abs().amax() / FP8_MAX).clamp_min(1e-12)
    elif mode == "token":
        s = (xf.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    else:  # per token, per `group` consecutive input columns
        k = xf.shape[-1]
        pad = (-k) % group
        xp = torch.nn.functional.pad(xf, (0, pad)).unflatten(-1, (-1, group))
        s = (xp.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
        q = (xp / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s
        return q.flatten(-2)[..., :k].to(x.dtype)
    q = (xf / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s
    return q.to(x.dtype)


def prepare_fp8_model(model: torch.nn.Module, path: Path, fmt: str) -> int:
    """Make quantkit's CPU model compute what the engine computes: weights were dequantized by
    the reader; here each FP8 Linear also rounds its input through E4M3."""
    names, scales = quantized_linear_inputs(path, "F8_E4M3")
    if fmt == "modelopt":
        mode, group = modelopt_activation_plan(path, bool(scales))
    else:
        mode, group, _ = _activation_plan(path, fmt)
    plan = {n: (mode, group, scales.get(n)) for n in sorted(names)}
    if mode == "static" and any(s is None for _, _, s in plan.values()):
        raise ModelLoadError(f"{path}: static FP8 activations but some Linears lack input_scale.")
    return install_input_quant(model, plan, fake_quant_input)


# vLLM's native quant_method "fp8"
RECORD = FormatRecord("fp8", VllmFP8Writer, read=read_vllm_fp8,
                      prepare=lambda model, path: prepare_fp8_model(model, path, "fp8"),
                      kv_cache=True)
