"""`quantkit verify ARTIFACT --engine trtllm`: an artifact against TensorRT-LLM's loader rules.

TensorRT-LLM cannot be installed or run on quantkit's machines, so conformance is a rule check,
read from its 1.x PyTorch backend (cited per rule):
  detection   _torch/model_config.py ModelConfig.from_pretrained: hf_quant_config.json first
              (quantization/modelopt_config.py), else config.json quantization_config
              (load_hf_quant_config: fp8 / compressed-tensors / mxfp4 / nvfp4; no gptq, no awq);
              compressed-tensors groups: models/quant_config_utils.py
  tensors     _torch/modules/linear.py: FP8QDQLinearMethod (scalar weight_scale, optional scalar
              input_scale), FP8RowwiseLinearMethod (weight_scale [N]), FP8BlockScalesLinearMethod
              (weight_scale_inv | weight_scale [ceil(N/128), ceil(K/128)], fused shard offsets
              remapped with ceil(offset / 128)), NVFP4LinearMethod (in_features % 16 == 0,
              weight float4_e2m1x2 [N, K/2], weight_scale float8_e4m3fn [N, K/16] (asserted),
              scalar weight_scale_2 and input_scale, both equal over fused shards (asserted)),
              W4A16NVFP4LinearMethod (the NVFP4 weight tensors, no input_scale: bf16 inputs),
              W4A8MXFP4FP8LinearMethod (weight [N, K/2], weight_scale uint8 E8M0 [N, K/32]
              (asserted uint8); inputs cast to FP8 per tensor at run time), get_quant_method
              (no dense Linear for W4A16_MXFP4: 'unsupported quant mode')
  exclusions  QuantConfig.is_module_excluded_from_quantization: fnmatch on TensorRT-LLM's own
              module names (q/k/v fuse into qkv_proj, gate/up into gate_up_proj)
"""

from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from quantkit.arch import spec_for_config
from quantkit.errors import ModelLoadError, QuantkitError
from quantkit.formats.common import load_tensors, read_safetensors_headers
from quantkit.model_io import load_config
from quantkit.readers import read_config_json, read_json

__all__ = ["verify", "VerifyReport", "Problem", "ENGINES", "NOTE"]

ENGINES = ("trtllm",)
NOTE = ("TensorRT-LLM cannot run on this machine: this is a check of the artifact against "
        "TensorRT-LLM's loader rules (1.x PyTorch backend, as docs/formats.md and "
        "quantkit/engines/trtllm_rules.py cite them), not a load in TensorRT-LLM.")

# tensorrt_llm/quantization/mode.py QuantAlgo values
QUANT_ALGOS = {"W8A16", "W4A16", "W4A16_AWQ", "W4A8_AWQ", "W8A16_GPTQ", "W4A16_GPTQ",
               "W8A8_SQ_PER_CHANNEL", "W8A8_SQ_PER_TENSOR_PLUGIN", "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN",
               "W8A8_SQ_PER_CHANNEL_PER_TENSOR_PLUGIN", "W8A8_SQ_PER_TENSOR_PER_TOKEN_PLUGIN",
               "W4A8_QSERVE_PER_GROUP", "W4A8_QSERVE_PER_CHANNEL", "FP8", "FP8_PER_CHANNEL_PER_TOKEN",
               "FP8_BLOCK_SCALES", "INT8", "MIXED_PRECISION", "NVFP4", "W4A16_NVFP4",
               "W4A8_NVFP4_FP8", "W4A16_MXFP4", "W4A8_MXFP4_FP8", "W4A8_MXFP4_MXFP8", "MXFP8",
               "NVFP4_AWQ", "NO_QUANT"}
CHECKED_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_BLOCK_SCALES", "W4A16_AWQ", "W4A8_AWQ", "NVFP4",
                 "W4A16_NVFP4", "W4A8_MXFP4_FP8")
FUSED = {"q_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
         "k_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
         "v_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
         "gate_proj": ("gate_up_proj", ("gate_proj", "up_proj")),
         "up_proj": ("gate_up_proj", ("gate_proj", "up_proj"))}
FLOAT = ("BF16", "F16", "F32")
FP8 = "F8_E4M3"
BLOCK_DEFAULT_EXCLUDE = ["*kv_b_proj*", "*k_b_proj*", "*eh_proj"]
HINT_TRTLLM = ("For TensorRT-LLM write FP8 with `quantkit quantize MODEL --method fp8 --format "
               "modelopt` (any --scheme), or compressed-tensors with --scheme dynamic "
               "(FP8_DYNAMIC) or --scheme block (FP8_BLOCK)")


@dataclass
class Problem:
    where: str
    what: str
    why: str
    fix: str = ""

    def render(self) -> str:
        out = f"  - {self.where}: {self.what}\n      TensorRT-LLM rule: {self.why}"
        return out + (f"\n      fix: {self.fix}" if self.fix else "")


@dataclass
class VerifyReport:
    artifact: str
    engine: str
    detected: str = "nothing"
    quant_algo: str | None = None
    exclude_modules: list[str] = field(default_factory=list)
    checked: dict[str, int] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    disclaimer: str = NOTE

    @property
    def conformant(self) -> bool:
        return not self.problems

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def fail(self, where: str, what: str, why: str, fix: str = "") -> None:
        self.problems.append(Problem(where, what, why, fix))

    def to_dict(self) -> dict:
        return {**asdict(self), "conformant": self.conformant}

    def render(self) -> str:
        lines = [f"quantkit verify {self.artifact} --engine {self.engine}", self.disclaimer,
                 f"config TensorRT-LLM would detect: {self.detected}",
                 f"quant_algo: {self.quant_algo}",
                 f"exclude_modules: {self.exclude_modules}"]
        if self.checked:
            lines.append("Linears checked: " + ", ".join(f"{v} {k}" for k, v in self.checked.items()))
        lines += [f"note: {n}" for n in self.notes]
        if self.conformant:
            lines.append("RESULT: conformant (every rule above holds)")
        else:
            lines.append(f"RESULT: NOT conformant, {len(self.problems)} problem(s):")
            lines += [p.render() for p in self.problems]
        return "\n".join(lines)


# ------------------------------------------------------------------ detection ----

def _detect(path: Path, config: dict, rep: VerifyReport) -> dict | None:
    """Mirror ModelConfig.from_pretrained; returns {"algo", "exclude", "source"} or None."""
    qfile = path / "hf_quant_config.json"
    if qfile.is_file():
        raw = read_json(qfile)
        if "quantization" in raw:
            q = raw["quantization"]
            rep.detected = "hf_quant_config.json (ModelOpt, nested 'quantization' shape)"
        elif str(raw.get("quant_method", "")).startswith("modelopt") or (
                (raw.get("producer") or {}).get("name") == "modelopt"):
            q = {"quant_algo": raw.get("quant_algo"), "exclude_modules": raw.get("ignore") or [],
                 "group_size": raw.get("group_size"), "kv_cache_quant_algo": None}
            rep.detected = "hf_quant_config.json (ModelOpt, flat shape)"
        else:
            rep.detected = "hf_quant_config.json, unreadable"
            rep.fail("hf_quant_config.json", "neither a 'quantization' wrapper nor a modelopt marker",
                     "modelopt_config.parse_modelopt_quant_config raises 'Not a ModelOpt quant config'",
                     "write it with --format modelopt")
            return None
        algo = q.get("quant_algo")
        if algo == "fp8_pb_wo":
            rep.notes.append("quant_algo fp8_pb_wo is canonicalized to FP8_BLOCK_SCALES by recent "
                             "TensorRT-LLM only; older 1.x releases raise on it")
            algo = "FP8_BLOCK_SCALES"
        if algo is not None and algo not in QUANT_ALGOS:
            mx = str(algo).lower() == "mxfp4"  # what nvidia-modelopt 0.47 writes for MXFP4
            rep.fail("hf_quant_config.json", f"quant_algo {algo!r} is not a QuantAlgo",
                     "QuantAlgo(json['quant_algo']) raises ValueError" + (
                         " (read_modelopt_quant_config aliases only fp8_pb_wo; the MXFP4 "
                         "members are W4A16_MXFP4, W4A8_MXFP4_FP8, W4A8_MXFP4_MXFP8)" if mx else ""),
                     "write `--method mxfp4 --format modelopt` (quant_algo W4A8_MXFP4_FP8)" if mx
                     else "")
            return None
        kv = q.get("kv_cache_quant_algo")
        if kv is not None and kv not in QUANT_ALGOS:
            rep.fail("hf_quant_config.json", f"kv_cache_quant_algo {kv!r} is not a QuantAlgo",
                     "QuantAlgo(json['kv_cache_quant_algo']) raises ValueError")
        exclude = list(q.get("exclude_modules") or [])
        if algo == "FP8_BLOCK_SCALES" and (q.get("group_size") or 128) != 128:
            rep.fail("hf_quant_config.json", f"group_size {q.get('group_size')}",
                     "FP8_BLOCK_SCALES kernels use 128x128 weight blocks and 1x128 input groups")
        inline = config.get("quantization_config") or {}
        if inline and inline.get("quant_method") == "modelopt" and inline.get("quant_algo") != q.get("quant_algo"):
            rep.notes.append(f"config.json's inline quant_algo {inline.get('quant_algo')!r} differs "
                             "from hf_quant_config.json's; TensorRT-LLM warns and uses the file")
        return {"algo": algo, "exclude": exclude}
    qcfg = config.get("quantization_config")
    if not qcfg:
        rep.detected = "no quantization config: an unquantized checkpoint"
        return {"algo": None, "exclude": []}
    method = qcfg.get("quant_method")
    rep.detected = f"config.json quantization_config (quant_method {method!r})"
    extra_ignore = list(qcfg.get("modules_to_not_convert") or []) + list(
        qcfg.get("ignored_layers") or []) + list(qcfg.get("ignore") or [])
    if str(method).startswith("modelopt"):
        rep.notes.append("inline ModelOpt config without hf_quant_config.json: only recent "
                         "TensorRT-LLM releases read it; older ones need the file")
        return {"algo": qcfg.get("quant_algo"), "exclude": list(qcfg.get("ignore") or [])}
    if method == "fp8":
        block = qcfg.get("weight_block_size")
        if not (block or qcfg.get("activation_scheme") == "static"):
            rep.fail("config.json", "vLLM-style fp8 with dynamic activations and per-tensor weights",
                     "load_hf_quant_config maps quant_method fp8 only when weight_block_size is set "
                     "or activation_scheme is 'static'; otherwise quant_algo stays None and the FP8 "
                     "weights are loaded into bf16 Linears without their scales",
                     "use --scheme block or --scheme static with --format fp8, or --format modelopt")
            return None
        if block and tuple(block) != (128, 128):
            rep.fail("config.json", f"weight_block_size {block}",
                     "assert 'FP8_BLOCK_SCALES only supports block_size=(128,128)'")
            return None
        if not block:
            rep.notes.append("activation_scheme 'static' maps to FP8_BLOCK_SCALES: the per-tensor "
                             "weight_scale is broadcast over every 128x128 block and input_scale "
                             "is not used by the GEMM (inputs are quantized per 1x128 group)")
        return {"algo": "FP8_BLOCK_SCALES", "exclude": extra_ignore + BLOCK_DEFAULT_EXCLUDE}
    if method == "compressed-tensors":
        return _detect_compressed_tensors(qcfg, extra_ignore, rep)
    if method in ("gptq", "awq"):
        rep.fail("config.json", f"quant_method {method!r}",
                 f"load_hf_quant_config has no branch for {method}: quant_algo stays None, every "
                 "Linear is built unquantized and expects a bf16 `weight`, which this checkpoint "
                 f"replaces with packed {method.upper()} tensors (qweight/qzeros/scales)",
                 HINT_TRTLLM + "; for int4 use --method awq --format modelopt --sym (W4A16_AWQ)")
        return None
    rep.fail("config.json", f"quant_method {method!r}",
             "TensorRT-LLM reads fp8, compressed-tensors, mxfp4, mxfp8, nvfp4 and ModelOpt configs")
    return None


def _detect_compressed_tensors(qcfg: dict, exclude: list[str], rep: VerifyReport) -> dict | None:
    groups = qcfg.get("config_groups") or {}
    if len(groups) != 1:
        rep.fail("config.json", f"{len(groups)} config_groups",
                 "several groups are MIXED_PRECISION and need module-name targets; empty raises "
                 "'config_groups is empty'")
        return None
    g = next(iter(groups.values()))
    w, a = g.get("weights") or {}, g.get("input_activations")
    where = f"config.json config_groups ({qcfg.get('format')})"
    if w.get("num_bits") == 8 and w.get("type", "float") == "float":
        strategy = w.get("strategy")
        a_strategy = (a or {}).get("strategy")
        if strategy == "channel" and a_strategy == "token":
            return {"algo": "FP8_PER_CHANNEL_PER_TOKEN", "exclude": exclude, "ct": True}
        if strategy == "block" and a_strategy == "group" and (a or {}).get("group_size") == 128:
            return {"algo": "FP8_BLOCK_SCALES", "exclude": exclude, "ct": True}
        if strategy in ("channel", "block"):
            rep.fail(where, f"FP8 {strategy} weights with {a_strategy} inputs",
                     f"_quant_config_from_config_group raises 'Unsupported inputs_quant_strategy: "
                     f"{a_strategy}.' (channel needs token inputs, block needs group-128 inputs)",
                     HINT_TRTLLM)
            return None
        static = " with static per-tensor inputs (the FP8 preset)" if a and not a.get("dynamic") else ""
        rep.fail(where, f"FP8 {strategy}-wise weights{static}",
                 f"_quant_config_from_config_group raises 'Unsupported weights_quant_strategy: "
                 f"{strategy}. Supported strategies: 'channel', 'block'.' - TensorRT-LLM takes "
                 "per-tensor FP8 only from ModelOpt (quant_algo FP8) or vLLM fp8 static configs",
                 "use --scheme dynamic (FP8_DYNAMIC: channel weights, per-token inputs) or --scheme "
                 "block with compressed-tensors, or keep --scheme static and write --format modelopt")
        return None
    bits, kind = w.get("num_bits"), w.get("type", "int")
    if (bits, kind) == (4, "float"):  # NVFP4 / MXFP4: TensorRT-LLM has a branch; quantkit no rules
        rep.fail(where, f"compressed-tensors FP4 ({qcfg.get('format')})",
                 "TensorRT-LLM maps compressed-tensors NVFP4/MXFP4 groups, but quantkit's checker "
                 "has tensor rules only for ModelOpt's NVFP4 layout (NVFP4LinearMethod)",
                 "for TensorRT-LLM write `quantkit quantize MODEL --method nvfp4 --scheme w4a4 "
                 "--format modelopt` (quant_algo NVFP4), which this checks")
        return None
    rep.fail(where, f"{kind}{bits} weights, {'weight-only' if not a else 'with activations'} "
             f"(strategy {w.get('strategy')}, group_size {w.get('group_size')})",
             "compressed-tensors is accepted only for FP8 channel+token, FP8 block+group-128, NVFP4 "
             f"and MXFP4: an {kind} {bits}-bit group has no branch in _quant_config_from_config_group"
             + (" (it reads input_activations['strategy'], which a weight-only scheme lacks)"
                if not a else ""),
             HINT_TRTLLM + "; for int4 use --method awq --format modelopt --sym (W4A16_AWQ)")
    return None


# -------------------------------------------------------------------- tensors ----

def _excluded(name: str, patterns: list[str]) -> str | None:
    """The pattern that excludes TensorRT-LLM's module for HF Linear `name` (ancestors too)."""
    parent, _, leaf = name.rpartition(".")
    trt = f"{parent}.{FUSED[leaf][0]}" if leaf in FUSED else name
    parts = trt.split(".")
    for i in range(len(parts), 0, -1):
        cand = ".".join(parts[:i])
        for p in patterns:
            if p.startswith("re:") and re.fullmatch(p[3:], cand) or fnmatch.fnmatchcase(cand, p):
                return p
    return None


def _linears(path: Path, config: dict, headers: dict) -> dict[str, tuple[int, int] | None]:
    """Every decoder Linear the model builds -> [N, K] (from the config when quantkit knows the
    architecture, else the 2-D `.weight`s of the checkpoint)."""
    try:
        # imported on use: the quantize pipeline loads every method and writer, which the
        # tensor checks never need
        from quantkit.pipeline.quantize import linear_shapes

        spec = spec_for_config(config)
        cfg = load_config(path)
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
        return dict(linear_shapes(cfg, spec))
    except QuantkitError:
        out = {}
        for k, h in headers.items():
            if k.endswith(".weight") and len(h["shape"]) == 2 and "embed" not in k and "lm_head" not in k:
                out[k[: -len(".weight")]] = None
        return out


def _check_linear(name: str, shape: tuple[int, int] | None, algo: str, headers: dict,
                  ct: bool, group_size: int | None, rep: VerifyReport) -> None:
    w = headers.get(f"{name}.weight")
    if w is None:
        rep.fail(name, "no `weight` tensor", "every quantized Linear loads `weight` "
                 "(load_weights_vanilla_helper asserts 'weight' in weights)")
        return
    n, k = shape or (w["shape"][0], w["shape"][1])
    if algo in ("W4A16_AWQ", "W4A8_AWQ"):
        _check_awq(name, n, k, w, headers, group_size, rep, algo)
        return
    if algo in ("NVFP4", "W4A16_NVFP4"):
        _check_nvfp4(name, n, k, w, headers, rep, with_input_scale=algo == "NVFP4")
        return
    if algo == "W4A8_MXFP4_FP8":
        _check_mxfp4(name, n, k, w, headers, rep)
        return
    if w["dtype"] != FP8 or w["shape"] != [n, k]:
        rep.fail(name, f"weight {w['dtype']} {w['shape']}",
                 f"{algo} creates weight as float8_e4m3fn [{n}, {k}] and copies the checkpoint into it")
    scale_name = "weight_scale"
    if algo != "FP8" and f"{name}.weight_scale_inv" in headers:
        scale_name = "weight_scale_inv"
    s = headers.get(f"{name}.{scale_name}")
    if s is None:
        rep.fail(name, "no weight_scale", f"{algo} loads `weight_scale`"
                 + (" or `weight_scale_inv`" if algo != "FP8" else ""))
        return
    numel = math.prod(s["shape"])
    if s["dtype"] != "F32":
        rep.note(f"{scale_name} stored as {s['dtype']}: copy_weight casts it to float32")
    if algo == "FP8":
        if numel != 1:
            rep.fail(name, f"{scale_name} shape {s['shape']}",
                     "FP8QDQLinearMethod reads one per-tensor scale (reshape([]))")
    elif algo == "FP8_PER_CHANNEL_PER_TOKEN":
        if s["shape"] == [n, 1] and ct:
            rep.note("channel weight_scale is [N, 1], the compressed-tensors layout "
                     "(docs/formats.md: TensorRT-LLM reads llm-compressor FP8_DYNAMIC); "
                     "ModelOpt writes [N]")
        elif s["shape"] != [n]:
            rep.fail(name, f"{scale_name} shape {s['shape']}",
                     f"FP8RowwiseLinearMethod copies it into a float32 [{n}] parameter")
    else:
        grid = [math.ceil(n / 128), math.ceil(k / 128)]
        if numel == 1:
            rep.note("per-tensor weight_scale values are broadcast over the 128x128 scale grid")
        elif s["shape"] != grid and not (len(s["shape"]) == 4 and [s["shape"][0], s["shape"][2]] == grid):
            rep.fail(name, f"{scale_name} shape {s['shape']}",
                     f"FP8BlockScalesLinearMethod copies it into a float32 {grid} "
                     "(ceil(N/128), ceil(K/128)) parameter")
    i = headers.get(f"{name}.input_scale")
    if i is not None and math.prod(i["shape"]) != 1:
        rep.fail(name, f"input_scale shape {i['shape']}", "input_scale is one per-tensor value")


def _check_awq(name, n, k, w, headers, group_size, rep, algo: str = "W4A16_AWQ") -> None:
    """ModelOpt W4A16_AWQ per formats.md: weight uint8 [N/2, K], weight_scale [N, K/G];
    pre_quant_scale [K] on every Linear loaded unfused (load_weights_vanilla reads it
    unconditionally). W4A8_AWQ also: scalar weight_scale_2 and input_scale
    (load_weight_scales_w4a8 multiplies them into alpha), pre_quant_scale in the model dtype
    (asserted)."""
    g = group_size or 128
    leaf = name.rpartition(".")[2]
    p = headers.get(f"{name}.pre_quant_scale")
    if leaf not in FUSED and (p is None or p["shape"] != [k]):
        rep.fail(name, f"pre_quant_scale {None if p is None else p['shape']}",
                 f"{algo} load_weights_vanilla reads weights['pre_quant_scale'] [{k}] "
                 "unconditionally on a Linear it loads unfused")
    if algo == "W4A8_AWQ":
        for key in ("weight_scale_2", "input_scale"):
            t = headers.get(f"{name}.{key}")
            if t is None or math.prod(t["shape"]) != 1:
                rep.fail(name, f"{key} {None if t is None else t['shape']}",
                         "load_weight_scales_w4a8 reads one scalar each of input_scale and "
                         "weight_scale_2 (alpha = input_scale * weight_scale_2)")
        if p is not None and p["dtype"] not in ("BF16", "F16"):
            rep.note("W4A8_AWQ asserts pre_quant_scale.dtype == the model dtype (bf16 / fp16)")
    if w["dtype"] != "U8" or w["shape"] != [n // 2, k]:
        rep.fail(name, f"weight {w['dtype']} {w['shape']}",
                 f"W4A16_AWQ packs two signed int4 rows per uint8: weight U8 [{n // 2}, {k}]")
    s = headers.get(f"{name}.weight_scale")
    if s is None or s["shape"] != [n, k // g]:
        rep.fail(name, f"weight_scale {None if s is None else s['shape']}",
                 f"W4A16_AWQ reads weight_scale [{n}, {k // g}] (group_size {g})")


def _check_nvfp4(name, n, k, w, headers, rep, with_input_scale: bool = True) -> None:
    """NVFP4LinearMethod: packed E2M1 pairs, E4M3 scales per 16, scalar global scales
    (W4A16_NVFP4: weight_scale_2 only; its inputs stay in bf16)."""
    if k % 16:
        rep.fail(name, f"in_features {k}", "create_weights asserts in_features % 16 == 0")
        return
    if w["dtype"] != "U8" or w["shape"] != [n, k // 2]:
        rep.fail(name, f"weight {w['dtype']} {w['shape']}",
                 f"NVFP4 creates weight as float4_e2m1x2 [{n}, {k // 2}] (two E2M1 per byte)")
    s = headers.get(f"{name}.weight_scale")
    if s is None or s["dtype"] != FP8 or s["shape"] != [n, k // 16]:
        got = None if s is None else f"{s['dtype']} {s['shape']}"
        rep.fail(name, f"weight_scale {got}", "load_weight_scales asserts float8_e4m3fn; "
                 f"block_scale_interleave takes [{n}, {k // 16}] (one scale per 16 inputs)")
    scalars = [("weight_scale_2", "amax_w / (448 * 6)")]
    if with_input_scale:
        scalars.append(("input_scale", "amax_x / (448 * 6)"))
    elif f"{name}.input_scale" in headers:
        rep.note("input_scale stored in a W4A16_NVFP4 checkpoint: weight-only Linears ignore it")
    for key, what in scalars:
        t = headers.get(f"{name}.{key}")
        if t is None or math.prod(t["shape"]) != 1:
            rep.fail(name, f"{key} {None if t is None else t['shape']}",
                     f"load_weight_scales reads one scalar {key} ({what}); alpha = input_scale * "
                     "weight_scale_2")


def _check_mxfp4(name, n, k, w, headers, rep) -> None:
    """W4A8MXFP4FP8LinearMethod: packed E2M1 pairs, uint8 E8M0 scales per 32, no input_scale."""
    if k % 32:
        rep.fail(name, f"in_features {k}", "create_weights asserts in_features % 32 == 0")
        return
    if w["dtype"] != "U8" or w["shape"] != [n, k // 2]:
        rep.fail(name, f"weight {w['dtype']} {w['shape']}",
                 f"W4A8_MXFP4_FP8 creates weight as float4_e2m1x2 [{n}, {k // 2}]")
    s = headers.get(f"{name}.weight_scale")
    if s is None or s["dtype"] != "U8" or s["shape"] != [n, k // 32]:
        got = None if s is None else f"{s['dtype']} {s['shape']}"
        rep.fail(name, f"weight_scale {got}", "load_weight_scales asserts uint8 (E8M0); "
                 f"block_scale_interleave takes [{n}, {k // 32}] (one scale per 32 inputs)")


def _scalars(path: Path, names: list[str]) -> list[float | None]:
    """Values of one-element tensors (fused-shard global scales), read from the shards."""
    found = load_tensors(path, set(names))
    return [float(found[n].float().reshape(-1)[0]) if n in found else None for n in names]


def _check_fused(linears: dict, algo: str, headers: dict, quantized: set[str], rep: VerifyReport,
                 path: Path | None = None) -> None:
    """Shards TensorRT-LLM fuses: one precision for all, consistent input scales, and for
    FP8_BLOCK_SCALES every shard but the last a multiple of 128 rows."""
    seen = set()
    for name in linears:
        parent, _, leaf = name.rpartition(".")
        if leaf not in FUSED or (parent, FUSED[leaf][0]) in seen:
            continue
        seen.add((parent, FUSED[leaf][0]))
        members = [f"{parent}.{s}" for s in FUSED[leaf][1] if f"{parent}.{s}" in linears]
        q = [m in quantized for m in members]
        fused = f"{parent}.{FUSED[leaf][0]}"
        if any(q) and not all(q):
            rep.fail(fused, f"only {[m for m in members if m in quantized]} are quantized",
                     f"{', '.join(s for s in FUSED[leaf][1])} load into ONE Linear ({fused}) with "
                     "one quant method", "quantize or exclude the whole group")
            continue
        if not all(q):
            continue
        if algo == "FP8":
            has = [f"{m}.input_scale" in headers for m in members]
            if any(has) and not all(has):
                rep.fail(fused, "input_scale on some shards only",
                         "rescale_fused_weights takes the max of every shard's input_scale "
                         "(uninitialized for shards without one)")
        if algo in ("NVFP4", "W4A16_NVFP4", "W4A8_AWQ") and path is not None:
            for key in ("weight_scale_2", "input_scale"):
                vals = _scalars(path, [f"{m}.{key}" for m in members])
                if None not in vals and len(set(vals)) > 1:
                    rep.fail(fused, f"{key} differs over the shards: {vals}",
                             f"{algo} load_weight_scales asserts 'The {key} should be same for all "
                             "the weights'", "share one global scale per fused group")
        if algo == "FP8_BLOCK_SCALES":
            bad = [m for m in members[:-1] if linears[m] and linears[m][0] % 128]
            if bad:
                rep.fail(fused, f"shard rows {[linears[m][0] for m in bad]} not multiples of 128 "
                         f"({', '.join(bad)})",
                         "load_weights_fused_*: shard offsets are remapped to the scale grid with "
                         "ceil(offset / 128), so a shard that ends mid-block shifts its neighbours' "
                         "scales", "use --scheme dynamic (per-channel) for this model")


def verify(artifact: str | Path, engine: str = "trtllm") -> VerifyReport:
    """Check `artifact` against `engine`'s loader rules (only trtllm is implemented)."""
    if engine not in ENGINES:
        raise QuantkitError(f"verify knows the loader rules of {', '.join(ENGINES)}, not {engine!r}.",
                            "vLLM and llama.cpp run here: load the artifact in them instead.")
    path = Path(artifact)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} is not a Hugging Face model directory (no config.json).",
                             "TensorRT-LLM's LLM(model=dir) takes an HF directory.")
    config = read_config_json(path)
    headers = read_safetensors_headers(path)  # corrupt shards are an input error, checked first
    rep = VerifyReport(artifact=str(path), engine=engine)
    found = _detect(path, config, rep)
    if found is None:
        return rep
    algo = rep.quant_algo = found["algo"]
    rep.exclude_modules = found["exclude"]
    linears = _linears(path, config, headers)
    if algo is None:
        fp8 = [k for k, h in headers.items() if h["dtype"] == FP8]
        if fp8:
            rep.fail(fp8[0], f"{len(fp8)} FP8 tensors in an unquantized checkpoint",
                     "without a quant config every Linear is bf16")
        rep.checked = {"unquantized": len(linears)}
        return rep
    if algo not in CHECKED_ALGOS:
        rep.fail("quant_algo", f"{algo} has no tensor rules in this checker",
                 f"quantkit verifies {', '.join(CHECKED_ALGOS)}")
        return rep
    group_size = None
    qfile = path / "hf_quant_config.json"
    if qfile.is_file():
        group_size = (read_json(qfile).get("quantization") or {}).get("group_size")
    quantized: set[str] = set()
    for name, shape in linears.items():
        pattern = _excluded(name, rep.exclude_modules)
        w = headers.get(f"{name}.weight")
        if pattern is not None:
            if w is not None and w["dtype"] not in FLOAT:
                rep.fail(name, f"excluded by {pattern!r} but stores weight as {w['dtype']}",
                         "an excluded module is built as a bf16 Linear; FP8 codes would be cast "
                         "without their scale", "store it in bf16 or drop it from exclude_modules")
            continue
        if w is not None and w["dtype"] in FLOAT:
            parent, _, leaf = name.rpartition(".")
            trt = f"{parent}.{FUSED[leaf][0]}" if leaf in FUSED else name
            rep.fail(name, f"unquantized ({w['dtype']}) but not excluded",
                     f"TensorRT-LLM matches exclude_modules against {trt!r}; unmatched it builds "
                     f"an {algo} Linear that needs FP8 weights and scales",
                     f"add {trt!r} to exclude_modules")
            continue
        quantized.add(name)
        _check_linear(name, shape, algo, headers, bool(found.get("ct")), group_size, rep)
    _check_fused(linears, algo, headers, quantized, rep, path)
    lm = headers.get("lm_head.weight")
    if lm is not None and lm["dtype"] not in FLOAT:
        rep.fail("lm_head", f"weight {lm['dtype']}", "the LM head is built unquantized")
    rep.checked = {algo: len(quantized), "excluded (bf16)": len(linears) - len(quantized)}
    return rep
