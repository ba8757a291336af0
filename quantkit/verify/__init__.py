"""`quantkit verify ARTIFACT --engine E`: the artifact proven in the engine that will serve it.

Three checks (quantkit.verify.tensors has the first two):
  coverage  the artifact against its source model, then against what the engine loaded
            (vLLM: the checkpoint names its loader read and the parameters load_weights
            filled; llama.cpp: the parameter count of the loaded model vs the file's tensors)
  fidelity  every tensor decoded by its format's reader against its source tensor
  parity    next-token log-probs of the engine vs quantkit's torch model of the decoded
            weights on short held-out windows: mean KLD and top-1 agreement within the
            tolerances benchmarks/verify_tolerances.py measured on good artifacts
Engines are a registry (ENGINES): one entry per engine, each filling the engine rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from quantkit.errors import EngineError, ModelLoadError, QuantkitError
from quantkit.verify.report import (
    EXIT_ENGINE_CANNOT_RUN,
    EXIT_VERIFIED,
    EXIT_WRONG,
    Check,
    VerifyResult,
)
from quantkit.verify.tensors import (
    GGUFLayout,
    folds_scales,
    gguf_coverage,
    gguf_fidelity,
    mlx_coverage,
    mlx_type_key,
    safetensors_coverage,
    safetensors_fidelity,
    tolerances,
)

if TYPE_CHECKING:
    from quantkit.engines.capabilities import VllmExperts

__all__ = ["verify", "record_verification", "verification_file", "ENGINES", "VerifyResult", "EXIT_VERIFIED", "EXIT_WRONG",
           "EXIT_ENGINE_CANNOT_RUN", "PARITY_CTX", "PARITY_WINDOWS", "PARITY_TOPK"]

PARITY_CTX, PARITY_WINDOWS = 128, 4  # a few short windows: a verify run costs less than an eval
PARITY_TOPK = 20  # vLLM's default max_logprobs


@dataclass
class _Context:
    """What every engine entry needs: the artifact, its source, and the decoded weights."""
    path: Path
    fmt: str
    config: dict
    meta: dict
    source: Path | None
    decoded: dict[str, torch.Tensor] | None = None  # under the source's names (GGUF too)


@dataclass(frozen=True)
class Engine:
    """One engine: `formats` it serves, `run(ctx, result)` fills the engine rows."""
    formats: tuple[str, ...]
    run: Callable[[_Context, VerifyResult], None]


def _source_path(path: Path, meta: dict, base: str | None) -> Path | None:
    from quantkit.model_io import resolve_model

    if base:
        return Path(base) if Path(base).exists() else resolve_model(base).path
    recorded = (meta.get("source_model") or {})
    for key in ("path", "spec"):
        if recorded.get(key) and Path(recorded[key]).is_dir():
            return Path(recorded[key])
    if recorded.get("spec"):
        try:
            return resolve_model(recorded["spec"]).path
        except QuantkitError:
            return None
    return None


def verify(artifact: str | Path, engine: str, base: str | None = None,
           on_progress: Callable[[str], None] | None = None, *,
           run_engine: bool = True) -> VerifyResult:
    """Coverage, fidelity and parity of `artifact` in `engine` (`run_engine` False: the
    artifact-level checks only)."""
    from quantkit.formats import detect_format
    from quantkit.loader import artifact_meta

    if engine not in ENGINES:
        raise QuantkitError(f"verify knows the engines {', '.join(ENGINES)}, not {engine!r}.")
    say = on_progress or (lambda _s: None)
    path = Path(artifact)
    if not path.exists():
        raise ModelLoadError(f"{path} does not exist.", "Pass the directory or .gguf file "
                                                        "written by `quantkit quantize -o`.")
    fmt = detect_format(path)
    if fmt not in ENGINES[engine].formats:
        raise QuantkitError(f"{engine} does not serve {fmt} artifacts ({path}).",
                            f"{engine} serves: {', '.join(ENGINES[engine].formats)}.")
    if fmt == "gguf":
        from quantkit.formats.gguf import gguf_metadata
        meta, config = gguf_metadata(path), {}
    else:
        from quantkit.readers import read_config_json
        meta, config = artifact_meta(path), read_config_json(path)
    source = _source_path(path, meta, base)
    ctx = _Context(path, fmt, config, meta, source)
    result = VerifyResult(artifact=str(path), engine=engine, format=fmt,
                          source=str(source) if source else None)
    coverage, fidelity = result.check("coverage"), result.check("fidelity")
    result.check("engine load")
    result.check("parity")
    if source is None:
        why = ("no source model: the artifact records none that exists here; pass --base MODEL")
        coverage.skip(why)
        fidelity.skip(why)
    else:
        say("coverage and fidelity against " + str(source))
        (_gguf_tensors if fmt == "gguf" else _safetensors_tensors)(ctx, coverage, fidelity)
    if not run_engine:
        result.check("engine load").skip("not asked")
        result.check("parity").skip("not asked")
        return result
    if not result.ok:  # the artifact itself is wrong: say so now, not after an engine start
        why = "not run: the artifact already fails the checks above (fix those first)"
        result.check("engine load").skip(why)
        result.check("parity").skip(why)
        return result
    say(f"loading in {engine}")
    ENGINES[engine].run(ctx, result)
    return result


def verification_file(artifact: Path) -> Path:
    """Where a verification is kept: quantkit.json of a directory, FILE.verify.json beside a
    GGUF (its metadata lives inside the file, which is not rewritten for this)."""
    artifact = Path(artifact)
    return artifact / "quantkit.json" if artifact.is_dir() else \
        artifact.with_name(artifact.name + ".verify.json")


def record_verification(artifact: Path, result: VerifyResult) -> None:
    """Keep result.summary() as `engine_check` in the artifact's metadata (temp + rename)."""
    import json

    from quantkit.readers import read_json

    target = verification_file(artifact)
    meta = read_json(target, target.name) if target.is_file() else {}
    meta["engine_check"] = result.summary()
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(json.dumps(meta, indent=2))
    tmp.replace(target)


def _source_tensors(source: Path, spec=None):
    """{tensor: (dtype, shape)} of the source checkpoint and a reader of one tensor. A
    checkpoint that stores its experts fused (gpt-oss, Llama 4, Granite 4) is seen per expert,
    as every artifact writes them (the fused tensors replaced by their experts' slices)."""
    from quantkit.formats.common import load_tensors, read_safetensors_headers
    from quantkit.pipeline.streaming import ShardReader

    headers = read_safetensors_headers(source)
    tensors = {n: (h["dtype"], h["shape"]) for n, h in headers.items()}
    split: dict[str, tuple[int, ...]] = {}
    if spec is not None and spec.experts is not None and spec.experts.stored_fused:
        sliced = ShardReader(source, spec.checkpoint_name, spec)
        split, fused = sliced.split_experts()
        dtype = next((tensors[n][0] for n in fused if tensors[n][0] in ("BF16", "F16", "F32")), "BF16")
        tensors = {**{n: t for n, t in tensors.items() if n not in fused},
                   **{n: (dtype, list(shape)) for n, shape in split.items()}}
    cache: dict[str, torch.Tensor] = {}

    def source_of(name: str) -> torch.Tensor:
        if name not in cache:
            if name in split:
                cache[name] = sliced.get(spec.module_name(name))
            else:
                cache.update(load_tensors(source, {name}))
        return cache[name].float()
    return tensors, source_of


def _spec(config):
    from quantkit.arch import spec_for_config
    from quantkit.errors import UnsupportedArchitecture

    try:
        return spec_for_config(config)
    except UnsupportedArchitecture:
        return None


def _safetensors_tensors(ctx: _Context, coverage: Check, fidelity: Check) -> None:
    from quantkit.formats import read_dense_state
    from quantkit.formats.common import read_safetensors_headers

    source, source_of = _source_tensors(ctx.source, _spec(ctx.config))
    artifact = read_safetensors_headers(ctx.path)
    if ctx.fmt != "mlx":
        quantized = safetensors_coverage(coverage, artifact, source, ctx.config, ctx.fmt,
                                         ctx.meta.get("removed") or {}, _spec(ctx.config))
    try:
        ctx.decoded = read_dense_state(ctx.path, ctx.fmt)
    except (ModelLoadError, KeyError, ValueError, RuntimeError) as exc:
        # the reader names the missing or misshapen scheme tensor
        why = str(exc) if isinstance(exc, ModelLoadError) else f"{type(exc).__name__}: {exc}"
        fidelity.fail(str(ctx.path), f"{ctx.fmt}'s reader cannot decode it: {why}")
        if ctx.fmt == "mlx":
            mlx_coverage(coverage, artifact, None, source, ctx.config, {})
        return
    if ctx.fmt == "mlx":  # coverage through the reader's names (stacked experts unstacked)
        quantized = mlx_coverage(coverage, artifact, set(ctx.decoded), source, ctx.config,
                                 ctx.meta.get("removed") or {})
    safetensors_fidelity(fidelity, ctx.decoded, source_of, set(source), quantized,
                         folded=folds_scales(ctx.meta))


def _gguf_tensors(ctx: _Context, coverage: Check, fidelity: Check) -> None:
    from gguf import GGUFReader

    from quantkit.readers import read_config_json

    ctx.config = read_config_json(ctx.source)
    spec = _spec(ctx.config)
    if spec is None or spec.gguf_arch is None:
        coverage.fail(str(ctx.source), f"quantkit writes no GGUF for model_type "
                                       f"{ctx.config.get('model_type')!r}: no layout to check")
        return
    source, source_of = _source_tensors(ctx.source, spec)
    reader = GGUFReader(str(ctx.path))
    tensors = {t.name: t for t in reader.tensors}
    layout = GGUFLayout(spec, ctx.config, source, source_of)
    gguf_coverage(coverage, tensors, layout, set(source), ctx.config, ctx.meta.get("removed") or {})
    ctx.decoded = gguf_fidelity(fidelity, tensors, layout)
    for name in source:  # what the file does not hold (removed, named by coverage): the source's
        if name not in ctx.decoded and not name.endswith("rotary_emb.inv_freq"):
            ctx.decoded[name] = source_of(name)


# --------------------------------------------------------------------- parity ----

def _windows(tokenizer):
    from quantkit.calibration import load_heldout_text
    from quantkit.eval.logits import PPLConvention, make_windows

    text, _info = load_heldout_text("mixed")
    windows, _bos = make_windows(tokenizer, text, PPLConvention(ctx=PARITY_CTX,
                                                                max_windows=PARITY_WINDOWS))
    return windows


def coarse_kld(ref_logp: torch.Tensor, top: list[list[list[float]]]) -> torch.Tensor:
    """KL(p_ref || p_engine) per position over the engine's top-k tokens plus one bucket for
    the rest of the vocabulary: what vLLM's prompt_logprobs gives. Merging tokens can only
    lower a KL divergence, so this is a lower bound of the full-vocabulary KLD."""
    out = []
    for pos, entries in enumerate(top):
        ids = torch.tensor([int(e[0]) for e in entries])
        q = torch.tensor([e[1] for e in entries], dtype=torch.float64).exp()
        p = ref_logp[pos].double().exp()[ids]
        p_rest = (1 - p.sum()).clamp_min(1e-12)
        q_rest = (1 - q.sum()).clamp_min(1e-12)
        kl = (p * (p.clamp_min(1e-30).log() - q.clamp_min(1e-30).log())).sum()
        out.append(float(kl + p_rest * (p_rest.log() - q_rest.log())))
    return torch.tensor(out).clamp_min(0)


def _parity_bounds(engine: str, key: str, check: Check) -> dict:
    """The measured bounds of `key` (type[:experts kernel]:dtype); for a key never measured
    (another kernel or dtype on another machine) the widest bounds measured for the engine,
    said in the parity row: the verdict then rests on bounds of other kernels."""
    table = tolerances()["parity"][engine]
    check.measured["tolerance_key"] = key
    if key in table:
        return table[key]
    check.measured["tolerance_note"] = (f"no tolerance measured for {key}; the widest one "
                                        f"measured for {engine} applies")
    return {"kld": max(v["kld"] for v in table.values()),
            "top1": min(v["top1"] for v in table.values())}


def _judge_parity(check: Check, kld: torch.Tensor, agree: torch.Tensor, bounds: dict,
                  engine: str) -> None:
    mean_kld, top1 = float(kld.mean()), float(agree.float().mean())
    check.measured.update(mean_kld=mean_kld, top1=top1, positions=int(kld.numel()),
                          bounds=bounds)
    if mean_kld > bounds["kld"]:
        check.fail("model", f"{engine}'s mean KLD vs quantkit's decode {mean_kld:.3g} above "
                            f"{bounds['kld']:.3g}")
    if top1 < bounds["top1"]:
        check.fail("model", f"{engine}'s top-1 agreement with quantkit's decode {top1:.3f} "
                            f"below {bounds['top1']:.3f}")
    note = check.measured.get("tolerance_note")
    check.done(f"{kld.numel()} positions: mean KLD {mean_kld:.3g} (<= {bounds['kld']:.3g}), "
               f"top-1 {top1:.3f} (>= {bounds['top1']:.3f})" + (f" [{note}]" if note else ""))


# ---------------------------------------------------------------------- vLLM ----

def _vllm_scheme(ctx: _Context) -> tuple[object, VllmExperts | None]:
    """(the scheme for vllm_cannot_run, what vLLM's MoE kernel must take for the experts or
    None without experts)"""
    from quantkit.engines.capabilities import vllm_artifact_moe
    from quantkit.verify.tensors import _type_key

    moe = vllm_artifact_moe(ctx.path)
    scheme = ctx.meta.get("scheme")
    if scheme:
        return scheme, moe
    key = _type_key(ctx.config, ctx.fmt)
    q = ctx.config.get("quantization_config") or {}
    group = next(iter((q.get("config_groups") or {}).values()), {})
    dynamic = bool((group.get("input_activations") or {}).get("dynamic", False))
    return {"int4": "int4", "int8": "int8-w8a8" if group.get("input_activations") else "int8",
            "float8": "fp8-dynamic" if dynamic else "fp8-static"}.get(key, key), moe


def _run_vllm(ctx: _Context, result: VerifyResult) -> None:
    from quantkit.engines.capabilities import vllm_cannot_run, vllm_capabilities
    from quantkit.engines.vllm import run_vllm

    load, parity = result.check("engine load"), result.check("parity")
    caps = vllm_capabilities()
    result.engine_version = f"vLLM {caps.version}" if getattr(caps, "version", None) else "vLLM"
    scheme, experts = _vllm_scheme(ctx)
    reason = (vllm_cannot_run(scheme, experts=experts)
              if ctx.config.get("quantization_config") else None)
    if reason:
        result.engine_cannot_run = reason
        load.skip(f"vLLM cannot run this scheme here: {reason}")
        parity.skip(f"vLLM cannot run this scheme here: {reason}")
        result.notes.append("checked without vLLM: coverage against the source and the config, "
                            "fidelity of every tensor; not checked: what vLLM loads, parity")
        return
    from quantkit.model_io import load_tokenizer

    tokenizer = load_tokenizer(ctx.path)
    windows = _windows(tokenizer)
    try:
        resp = run_vllm(ctx.path, score=windows.tolist(), score_topk=PARITY_TOPK,
                        track_weights=True, max_model_len=PARITY_CTX + 8, timeout=900)
    except EngineError as exc:
        load.fail(str(ctx.path), f"vLLM refused the load: {exc}")
        parity.skip("vLLM did not load the artifact")
        return
    result.engine_version = f"vLLM {resp['vllm_version']}"
    result.dtype = resp.get("dtype", "")
    weights = resp.get("weights") or {}
    result.kernel = "; ".join(f"{k} x{v}" for k, v in (weights.get("kernels") or {}).items())
    _vllm_coverage(load, weights, ctx)
    if ctx.decoded is None and ctx.source is None:
        parity.skip("no source model to build quantkit's reference from")
    _vllm_parity(parity, ctx, windows, resp["score"], result)


def _vllm_coverage(check: Check, weights: dict, ctx: _Context) -> None:
    from quantkit.formats.common import read_safetensors_headers

    given = set(weights.get("given") or [])
    stored = set(read_safetensors_headers(ctx.path))
    for name in sorted(stored - given):
        check.fail(name, "is in the artifact but vLLM's weight loader never read it")
    if weights.get("loaded") is None:
        check.measured["note"] = "the model's load_weights reports no names: unfilled not checked"
    packed = weights.get("packed") or {}
    for param in weights.get("unfilled") or []:
        module, _, leaf = param.rpartition(".")
        parent, _, last = module.rpartition(".")
        names = [f"{parent}.{s}.{leaf}" for s in packed.get(last, [])] or [param]
        check.fail(param, "vLLM left this parameter at its initial value: no checkpoint tensor "
                          f"filled it (checkpoint names: {', '.join(names)})")
    check.done(f"vLLM read {len(given)} of the artifact's {len(stored)} tensors and filled "
               f"{len(weights.get('params') or []) - len(weights.get('unfilled') or [])} of "
               f"{len(weights.get('params') or [])} parameters")


@torch.no_grad()
def _reference_logits(ctx: _Context, windows: torch.Tensor) -> torch.Tensor:
    """log-softmax of quantkit's own torch model of the artifact's decoded weights."""
    if ctx.fmt == "gguf":  # the source's model, its weights the file's decoded ones
        from quantkit.loader import model_from_state

        model = model_from_state(ctx.source, dict(ctx.decoded or {}))
    else:
        from quantkit.loader import load_artifact

        model = load_artifact(ctx.path).model
    return torch.log_softmax(model(input_ids=windows, use_cache=False).logits.float(), dim=-1)


def _reference_or_fail(check: Check, ctx: _Context, windows: torch.Tensor) -> torch.Tensor | None:
    """_reference_logits, or None with the parity row failed when quantkit's own decoder
    cannot build the model."""
    try:
        return _reference_logits(ctx, windows)
    except QuantkitError as exc:
        check.fail(str(ctx.path), f"quantkit's own decoder cannot build the reference: {exc}")
        return None


def _vllm_parity(check: Check, ctx: _Context, windows: torch.Tensor, scored: list[dict],
                 result: VerifyResult) -> None:
    ref = _reference_or_fail(check, ctx, windows)
    if ref is None:
        return
    klds, agree = [], []
    for w, row in enumerate(scored):
        # prompt_logprobs at position i: the distribution of token i given tokens < i
        top = row["top"][1:]
        klds.append(coarse_kld(ref[w, :-1], top))
        agree.append(torch.tensor([t == int(a) for t, a in
                                   zip(row["top1"][1:], ref[w, :-1].argmax(-1), strict=True)]))
    _judge_parity(check, torch.cat(klds), torch.cat(agree),
                  _parity_bounds("vllm", _vllm_parity_key(ctx, result), check), "vLLM")


def _vllm_parity_key(ctx: _Context, result: VerifyResult) -> str:
    """The tolerance key of a vLLM run: type:dtype for Linears (int4:bfloat16), with the
    experts' kernel between where vLLM ran quantized experts through a fused-MoE kernel
    (int4:CPUExpertsInt4:bfloat16: on AMX it computes in int8, W4A8), so a machine whose vLLM
    picks another kernel finds no measured bound of another kernel's."""
    experts = sorted({part for k in result.kernel.split("; ")
                      for part in k.rsplit(" x", 1)[0].split(" / ")[1:] if "Experts" in part})
    return ":".join([_type_key_of(ctx), *experts, result.dtype])


def _type_key_of(ctx: _Context) -> str:
    from quantkit.verify.tensors import _type_key

    return _type_key(ctx.config, ctx.fmt) if ctx.config.get("quantization_config") else "dense"


# ----------------------------------------------------------------- llama.cpp ----

def _run_llamacpp(ctx: _Context, result: VerifyResult) -> None:
    from gguf import GGUFReader

    from quantkit.engines.llamacpp import LlamaCppModel, _llama_cpp, llama_cpp_version

    load, parity = result.check("engine load"), result.check("parity")
    result.engine_version = llama_cpp_version()
    try:
        model = LlamaCppModel(ctx.path, n_ctx=PARITY_CTX, logits_all=True)
    except EngineError as exc:
        load.fail(str(ctx.path), str(exc))
        parity.skip("llama.cpp did not load the file")
        return
    try:
        reader = GGUFReader(str(ctx.path))
        in_file = sum(int(t.n_elements) for t in reader.tensors)
        loaded = int(_llama_cpp().llama_model_n_params(model.llm.model))
        types = sorted({t.tensor_type.name for t in reader.tensors})
        result.kernel = "ggml CPU: " + ", ".join(types)
        result.dtype = "f32 activations"
        if loaded != in_file:
            load.fail(str(ctx.path), f"llama.cpp's model holds {loaded} parameters, the file's "
                                     f"{len(reader.tensors)} tensors {in_file}")
        load.done(f"llama.cpp loaded {len(reader.tensors)} tensors, {loaded} parameters "
                  "(all of the file's)")
        if ctx.decoded is None:
            parity.skip("no source model: quantkit's reference needs its architecture")
            return
        _llamacpp_parity(parity, ctx, model, result)
    finally:
        model.close()


def _llamacpp_parity(check: Check, ctx: _Context, model, result: VerifyResult) -> None:
    from quantkit.model_io import load_tokenizer

    windows = _windows(load_tokenizer(ctx.source))
    ref = _reference_or_fail(check, ctx, windows)
    if ref is None:
        return
    klds, agree = [], []
    for w in range(windows.shape[0]):
        eng = torch.log_softmax(torch.from_numpy(model.logits(windows[w].tolist())).float(), -1)
        r = ref[w, :-1]
        e = eng[:-1]
        klds.append((r.exp() * (r - e)).sum(-1).clamp_min(0))
        agree.append(r.argmax(-1) == e.argmax(-1))
    _judge_parity(check, torch.cat(klds), torch.cat(agree),
                  _parity_bounds("llamacpp", "gguf:f32", check), "llama.cpp")


# ---------------------------------------------------------------- TensorRT-LLM ----

def _run_trtllm(ctx: _Context, result: VerifyResult) -> None:
    """TensorRT-LLM cannot run here: its loader rules (engines.trtllm_rules) fill the load row."""
    from quantkit.engines.trtllm_rules import NOTE
    from quantkit.engines.trtllm_rules import verify as rules

    load = result.check("engine load")
    rep = rules(ctx.path, "trtllm")
    result.engine_version = "TensorRT-LLM 1.x loader rules (not run)"
    result.kernel = rep.quant_algo or ""
    for p in rep.problems:
        load.fail(p.where, f"{p.what} (TensorRT-LLM rule: {p.why})")
    load.done(f"loader rules: {rep.detected}; quant_algo {rep.quant_algo}")
    result.engine_cannot_run = NOTE
    result.check("parity").skip("TensorRT-LLM cannot run on this machine")


# ------------------------------------------------------------------------ MLX ----

def _run_mlx(ctx: _Context, result: VerifyResult) -> None:
    """mlx_lm.load (strict: every stored tensor read into a parameter and every parameter
    filled, or it refuses), each packed Linear built as MLX's quantized layer, then parity of
    its logits (quantized layers through mx.dequantize, mlx_worker.py says why) against
    quantkit's model of the decoded weights."""
    from quantkit.engines.mlx import MLXScorer
    from quantkit.formats.common import read_safetensors_headers
    from quantkit.model_io import load_tokenizer

    load, parity = result.check("engine load"), result.check("parity")
    try:
        scorer = MLXScorer(ctx.path, dequantize=True)
    except EngineError as exc:
        load.fail(str(ctx.path), f"mlx-lm refused the load: {exc}")
        parity.skip("mlx-lm did not load the artifact")
        return
    try:
        info = scorer.info
        result.engine_version = f"mlx {info['mlx_version']}, mlx-lm {info['mlx_lm_version']}"
        result.dtype = info.get("dtype", "")
        packed = [n for n, h in read_safetensors_headers(ctx.path).items()
                  if n.endswith(".scales")]
        mode = (ctx.config.get("quantization") or {}).get("mode", "affine")
        result.kernel = f"mx.dequantize x{info['quantized_layers']} ({mode})"
        if info["quantized_layers"] != len(packed):
            load.fail(str(ctx.path), f"mlx-lm built {info['quantized_layers']} quantized layers "
                                     f"from {len(packed)} packed tensors")
        load.done(f"mlx_lm.load (strict) read every tensor; {info['quantized_layers']} quantized "
                  f"layers, one per packed tensor")
        windows = _windows(load_tokenizer(ctx.path))
        ref = _reference_or_fail(parity, ctx, windows)
        if ref is None:
            return
        eng = torch.log_softmax(scorer.logits(windows).float(), dim=-1)
    finally:
        scorer.close()
    r, e = ref[:, :-1], eng[:, :-1]
    kld = (r.exp() * (r - e)).sum(-1).clamp_min(0).flatten()
    agree = (r.argmax(-1) == e.argmax(-1)).flatten()
    _judge_parity(parity, kld, agree, _parity_bounds("mlx", f"{_mlx_type_key(ctx)}:{result.dtype}",
                                                     parity), "MLX")


def _mlx_type_key(ctx: _Context) -> str:
    return mlx_type_key(ctx.config.get("quantization") or {})


_SAFETENSORS = ("dense", "compressed-tensors", "gptq", "awq", "fp8", "modelopt")
ENGINES: dict[str, Engine] = {
    "vllm": Engine(_SAFETENSORS, _run_vllm),
    "llamacpp": Engine(("gguf",), _run_llamacpp),
    "trtllm": Engine(_SAFETENSORS, _run_trtllm),
    "mlx": Engine(("mlx",), _run_mlx),
}
