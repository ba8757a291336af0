"""Coverage and fidelity of an artifact against its source model, tensor by tensor.

Coverage: every source tensor is in the artifact (dense, or as its Linear's scheme tensors, or
listed in quantkit.json `removed` with a reason); every artifact tensor comes from a source
tensor; every Linear the config declares quantized carries its scheme's tensors; the ignore
list is exactly what stayed dense.
Fidelity: each tensor decoded by its format's reader (compressed-tensors' unpacker, gguf-py's
`gguf.quants.dequantize`, quantkit's GPTQ v1 / AutoAWQ readers) against its source tensor:
relative RMSE within the bound measured on good artifacts for its type (tolerances.json,
written by benchmarks/verify_tolerances.py). A tensor beyond it is named with the likeliest
cause: a scale off by a factor (the least-squares ratio of decoded to source), or the values of
another source tensor of the same shape (swapped).
"""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path

import numpy as np
import torch

from quantkit.verify.report import Check

__all__ = ["safetensors_coverage", "mlx_coverage", "mlx_type_key", "safetensors_fidelity", "gguf_coverage", "gguf_fidelity",
           "tolerances", "rel_error", "GGUFLayout", "TOLERANCES_FILE", "folds_scales"]

TOLERANCES_FILE = Path(__file__).with_name("tolerances.json")
DENSE_KEY = "dense"  # a tensor stored unquantized (bf16 / f16 / f32 rounding only)
FOLDED_KEY = "dense:folded"  # a dense vector AWQ / SmoothQuant divided by smoothing scales
# scheme tensors per quantized Linear, by how the checkpoint marks it quantized
_MARKERS = {"weight_packed": ("weight_packed", "weight_scale"),
            "qweight": ("qweight", "qzeros", "scales")}
_COMPANIONS = {"weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx",
               "weight_global_scale", "input_global_scale", "input_scale", "input_zero_point",
               "weight_scale_inv", "weight_scale_2", "qweight", "qzeros", "scales", "g_idx",
               "k_scale", "v_scale", "q_scale", "prob_scale"}
_FLOAT = {"BF16", "F16", "F32", "F64"}
# a scale off by more than this factor is named as such (good artifacts: within a few %)
SCALE_RATIO_SLACK = 0.25


def tolerances() -> dict:
    return json.loads(TOLERANCES_FILE.read_text())


def rel_error(decoded: torch.Tensor, source: torch.Tensor) -> tuple[float, float]:
    """(relative RMSE, least-squares ratio decoded / source)."""
    d, s = decoded.double().flatten(), source.double().flatten()
    norm = s.pow(2).sum().clamp_min(1e-30)
    return (float(((d - s).pow(2).sum() / norm).sqrt()), float((d * s).sum() / norm))


def _matches(name: str, patterns: list[str], substring: bool) -> bool:
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], name):
                return True
        elif name == p or fnmatch.fnmatchcase(name, p) or (substring and p in name):
            return True
    return False


def _ignore_list(config: dict, fmt: str) -> tuple[list[str], bool]:
    """(patterns of Linears the config keeps dense, whether they match as substrings)."""
    q = config.get("quantization_config") or {}
    if fmt == "awq":
        return list(q.get("modules_to_not_convert") or []), True
    if fmt == "gptq":
        return ["lm_head"], False
    return list(q.get("ignore") or q.get("ignored_layers") or q.get("modules_to_not_convert")
                or q.get("exclude_modules") or []), fmt == "fp8"


def _required(fmt: str, config: dict, present: set[str]) -> tuple[str, ...]:
    """The scheme tensors every quantized Linear of this artifact must carry."""
    q = config.get("quantization_config") or {}
    if fmt in ("gptq", "awq"):
        return ("qweight", "qzeros", "scales")
    group = next(iter((q.get("config_groups") or {}).values()), {})
    w = group.get("weights") or {}
    if fmt == "compressed-tensors" and "pack-quantized" in str(q.get("format")):
        if w.get("type") == "float":  # nvfp4 / mxfp4
            return ("weight_packed", "weight_scale") + (
                ("weight_global_scale",) if w.get("group_size") == 16 else ())
        return ("weight_packed", "weight_scale", "weight_shape") + (
            () if w.get("symmetric", True) else ("weight_zero_point",))
    return ("weight", "weight_scale_inv" if "weight_scale_inv" in present else "weight_scale")


_SCHEME_ONLY = _COMPANIONS - {"input_scale", "k_scale", "v_scale", "q_scale", "prob_scale"}


def _linears(source: dict[str, tuple[str, list[int]]], spec) -> list[str]:
    """Source modules vLLM builds as Linears: 2-D `.weight`s other than the embeddings."""
    skip = {spec.embed} if spec is not None else {"model.embed_tokens"}
    return [n[:-7] for n, (_, shape) in source.items()
            if n.endswith(".weight") and len(shape) == 2 and n[:-7] not in skip
            and "embed" not in n and "norm" not in n]


def _missing_sources(check: Check, source, stored, tied: bool, removed: dict[str, str]) -> None:
    """Name every source tensor the artifact lacks (`stored(name)` False): not a rotary
    buffer, not a head tied to the embeddings, not listed in quantkit.json `removed`."""
    for name in source:
        if stored(name) or name.endswith("rotary_emb.inv_freq") or \
                (name == "lm_head.weight" and tied):
            continue
        if name in removed:
            check.measured.setdefault("removed", {})[name] = removed[name]
            continue
        check.fail(name, "is in the source model but not in the artifact (neither dense nor "
                         "quantized, and not listed as removed)")


def safetensors_coverage(check: Check, artifact: dict[str, dict], source: dict[str, tuple[str, list]],
                         config: dict, fmt: str, removed: dict[str, str], spec) -> dict[str, str]:
    """Coverage of a safetensors artifact; returns {quantized module: its type key}."""
    art = {n: h["dtype"] for n, h in artifact.items()}
    by_module: dict[str, set[str]] = {}
    for n in art:
        module, _, suffix = n.rpartition(".")
        by_module.setdefault(module, set()).add(suffix)
    tied = bool(config.get("tie_word_embeddings"))
    ignore, substring = _ignore_list(config, fmt)
    quantized: dict[str, str] = {}
    type_key = _type_key(config, fmt)
    for module in _linears(source, spec):
        present = by_module.get(module, set())
        weight = art.get(f"{module}.weight")
        ignored = _matches(module, ignore, substring)
        if not (present & _SCHEME_ONLY or (weight is not None and weight not in _FLOAT)):
            if f"{module}.weight" not in art:
                continue  # reported as a missing source tensor below
            if not ignored and not (module == "lm_head"):
                check.fail(module, "stayed dense but the quantization config does not ignore it: "
                                   "the engine builds a quantized Linear and finds no scheme "
                                   "tensors for it")
            continue
        if ignored:
            check.fail(module, f"is stored quantized but the config's ignore list {ignore} "
                               "keeps it dense: the engine reads codes as weights")
        missing = [s for s in _required(fmt, config, present) if s not in present]
        if missing:
            check.fail(module, f"declared quantized but has no {', '.join(missing)} "
                               "(deleted from its shard?)")
        quantized[module] = type_key
    _missing_sources(check, source, lambda n: n in art or n.rpartition(".")[0] in quantized,
                     tied, removed)
    for name in art:
        module, _, suffix = name.rpartition(".")
        if name in source or (module in quantized and suffix in _COMPANIONS):
            continue
        if suffix in ("k_scale", "v_scale", "q_scale", "prob_scale", "input_scale"):
            continue  # KV-cache / activation scales of attention or Linears
        check.fail(name, "matches no tensor of the source model (renamed?): the engine would "
                         "skip it or refuse the load")
    n_dense = sum(1 for n in art if n in source)
    check.done(f"{len(source)} source tensors: {len(quantized)} Linears quantized "
               f"({type_key}), {n_dense} dense; ignore list {ignore}")
    return quantized


def mlx_coverage(check: Check, artifact: dict[str, dict], decoded: set[str] | None,
                 source: dict[str, tuple[str, list]], config: dict,
                 removed: dict[str, str]) -> dict[str, str]:
    """Coverage of an MLX affine artifact (no ignore list: a Linear is quantized where it
    stores uint32 codes with `.scales` and `.biases`, as mlx_lm.load decides); `decoded`: the
    tensor names formats/mlx.read_mlx gives back (stacked SwitchGLU experts under their
    per-expert names; None where the reader failed: the packed tensors are checked alone).
    Returns {quantized module (per-expert names): its type key}."""
    q = config.get("quantization") or {}
    quantized: dict[str, str] = {}
    for name, head in artifact.items():
        base, _, suffix = name.rpartition(".")
        if suffix in ("scales", "biases") and f"{base}.weight" not in artifact:
            check.fail(name, "has no packed weight beside it (deleted from its shard?)")
        if suffix != "weight" or head["dtype"] != "U32":
            continue
        layer = q.get(base) if isinstance(q.get(base), dict) else q
        key = mlx_type_key(layer)
        wanted = ("scales", "biases") if key.startswith("int") else ("scales",)  # float modes
        missing = [s for s in wanted if f"{base}.{s}" not in artifact]
        if missing:
            check.fail(base, f"stores packed codes but no {', '.join(missing)} "
                             "(deleted from its shard?)")
        if ".switch_mlp." in base:  # one stacked tensor per projection: every expert's Linear
            block, _, proj = base.partition(".switch_mlp.")
            for n in decoded or ():
                if n.startswith(f"{block}.experts.") and n.endswith(".weight") and \
                        n.rpartition(".")[0].rsplit(".", 1)[-1] in (proj, _MLX_MIXTRAL.get(proj)):
                    quantized[n[: -len(".weight")]] = key
        else:
            quantized[base] = key
    if decoded is None:
        check.done(f"{len(quantized)} packed Linears checked (the reader could not decode the rest)")
        return quantized
    _missing_sources(check, source, decoded.__contains__,
                     bool(config.get("tie_word_embeddings")), removed)
    for name in sorted(decoded - set(source)):
        check.fail(name, "matches no tensor of the source model (renamed?): mlx_lm.load's strict "
                         "load would refuse it")
    check.done(f"{len(source)} source tensors: {len(quantized)} Linears quantized "
               f"({', '.join(sorted(set(quantized.values()))) or '-'}), "
               f"{sum(1 for n in decoded if n in source) - len(quantized)} dense")
    return quantized


def mlx_type_key(params: dict) -> str:
    """The tolerance key of MLX quantization parameters: int4 (affine), ..., float4 (the
    mxfp4 / nvfp4 modes: the key safetensors FP4 artifacts have)."""
    mode = params.get("mode", "affine")
    if mode == "affine":
        return f"int{int(params.get('bits') or 4)}"
    return "float4" if mode.endswith("fp4") else str(mode)


# mlx-lm's SwitchGLU projection names -> Mixtral's per-expert ones (formats/mlx.py)
_MLX_MIXTRAL = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


def _type_key(config: dict, fmt: str) -> str:
    """The tolerance key of a safetensors artifact's quantized Linears: int4, int8, float8, ..."""
    q = config.get("quantization_config") or {}
    if fmt in ("gptq", "awq"):
        return f"int{int(q.get('bits') or 4)}"
    if fmt in ("fp8", "modelopt"):
        algo = str(q.get("quant_algo") or "fp8").lower()
        return "float4" if "fp4" in algo else "float8"
    group = next(iter((q.get("config_groups") or {}).values()), {})
    w = group.get("weights") or {}
    return f"{w.get('type', 'int')}{int(w.get('num_bits') or 4)}"


def _fidelity(check: Check, decoded: dict[str, torch.Tensor], source_of, pairs: dict[str, str],
              kinds: dict[str, str], tol: dict[str, float], label) -> None:
    """Compare every decoded tensor named in `pairs` (decoded name -> source name) with its
    source; `kinds` gives each one's tolerance key. Worst per kind goes in `measured`."""
    by_shape: dict[tuple, list[str]] = {}
    for dec_name, src_name in pairs.items():
        by_shape.setdefault(tuple(decoded[dec_name].shape), []).append(src_name)
    worst: dict[str, float] = {}
    for dec_name, src_name in pairs.items():
        d, kind = decoded[dec_name], kinds[dec_name]
        s = source_of(src_name)
        if tuple(d.shape) != tuple(s.shape):
            check.fail(label(dec_name), f"decodes to shape {list(d.shape)}, its source "
                                        f"{src_name} is {list(s.shape)}")
            continue
        err, ratio = rel_error(d, s)
        worst[kind] = max(worst.get(kind, 0.0), err)
        bound = tol.get(kind)
        if bound is None:
            check.measured.setdefault("no_tolerance", []).append(kind)
            continue
        if err <= bound:
            continue
        why = f"relative RMSE {err:.3g} vs its source {src_name}, above {bound:.3g} ({kind})"
        swapped = next((o for o in by_shape.get(tuple(d.shape), [])
                        if o != src_name and rel_error(d, source_of(o))[0] <= bound), None)
        if swapped is not None:
            why += f"; it holds the values of {swapped} (swapped?)"
        elif ratio > SCALE_RATIO_SLACK and abs(ratio - 1) > SCALE_RATIO_SLACK:
            why += f"; it decodes to {ratio:.2f}x its source: a scale is off"
        else:
            why += "; it does not resemble its source"
        check.fail(label(dec_name), why)
    check.measured["worst_rel_rmse"] = worst
    check.done(f"{len(pairs)} tensors decoded and compared; worst relative RMSE per type: "
               + ", ".join(f"{k} {v:.3g} (bound {tol.get(k, float('nan')):.3g})"
                           for k, v in sorted(worst.items())))


def folds_scales(meta: dict) -> bool:
    """Whether the artifact's method folded smoothing scales into its dense vectors (AWQ, and
    int8 with --smoothquant: a norm's weight divided by the scales its Linears took), so those
    stay near their source only within the fold's own measured bound (FOLDED_KEY)."""
    options = meta.get("method_options") or {}
    return meta.get("method") == "awq" or options.get("smoothquant") is not None


def safetensors_fidelity(check: Check, decoded: dict[str, torch.Tensor], source_of,
                         source_names: set[str], quantized: dict[str, str],
                         folded: bool = False) -> None:
    tol = tolerances()["rel_rmse"]
    pairs, kinds = {}, {}
    for name, t in decoded.items():
        if name not in source_names or not t.is_floating_point():
            continue
        module = name.rpartition(".")[0]
        pairs[name] = name
        if module in quantized and name.endswith(".weight"):
            kinds[name] = quantized[module]
        else:  # a folded artifact's vectors (norm weights) carry its smoothing scales
            kinds[name] = FOLDED_KEY if folded and t.dim() == 1 else DENSE_KEY
    _fidelity(check, decoded, source_of, pairs, kinds, tol, lambda n: n)


# ----------------------------------------------------------------------------- GGUF ----

class GGUFLayout:
    """The GGUF tensors a source model becomes, through the writer's own layout function
    (formats.gguf.gguf_pieces: splits, q/k row order, value transforms, bare names, experts
    stacked): what coverage and fidelity compare a file with, and the map back from a file's
    tensors to the source's names for the parity model."""

    def __init__(self, spec, config: dict, source_names, source_of):
        from quantkit.errors import UnsupportedArchitecture
        from quantkit.formats.gguf import gguf_permuted_heads, gguf_pieces

        self._spec, self._config, self._source_of = spec, config, source_of
        self._pieces_of = gguf_pieces
        self._permute = gguf_permuted_heads(spec, config)
        self.parts: dict[str, dict[int | None, tuple[str, torch.Tensor]]] = {}
        for src in sorted(source_names):
            try:
                pieces = gguf_pieces(spec, config, src, source_of(src), self._permute)
            except UnsupportedArchitecture:
                continue  # coverage names it: no GGUF tensor
            for gname, expert, values in pieces:
                self.parts.setdefault(gname, {})[expert] = (src, values)
        self.sources = {src for parts in self.parts.values() for src, _ in parts.values()}
        self._pieces = {}  # source -> how many GGUF tensors it is split into
        for parts in self.parts.values():
            for src in {src for src, _ in parts.values()}:
                self._pieces[src] = self._pieces.get(src, 0) + 1

    def label(self, gname: str) -> str:
        """The source tensor(s) a GGUF tensor holds: one name, the experts' pattern, and the
        piece's GGUF name where the source is split into several."""
        srcs = sorted({src for src, _ in self.parts[gname].values()})
        label = srcs[0] if len(srcs) == 1 else re.sub(r"\.experts\.\d+\.", ".experts.*.", srcs[0])
        return label if self._pieces[srcs[0]] == 1 else f"{label} (its piece {gname})"

    def expected(self, gname: str) -> torch.Tensor:
        parts = self.parts[gname]
        if None in parts:
            return parts[None][1].float()
        return torch.stack([parts[e][1].float() for e in sorted(parts)])

    def to_source(self, decoded: dict[str, torch.Tensor], float_types: set[str]
                  ) -> tuple[dict[str, torch.Tensor], list[str]]:
        """The decoded file under the source's names and layout: each source tensor's
        positions followed through gguf_pieces (a tensor of its own indices, 4k + 1/4, goes
        through the same splits and permutations). A tensor whose values the layout
        transforms (norm offsets, -exp(A_log)) is stored as floats: the source's own values
        stand for it. Returns (state, sources that could not be mapped back)."""
        state: dict[str, torch.Tensor] = {}
        unmapped = []
        for src in sorted(self.sources):
            s = self._source_of(src)
            index = (torch.arange(s.numel(), dtype=torch.float64) * 4 + 0.25).reshape(s.shape)
            flat = torch.full((s.numel(),), float("nan"))
            exact = True
            for gname, expert, pos in self._pieces_of(self._spec, self._config, src, index,
                                                      self._permute):
                if gname not in decoded:
                    exact = False
                    continue
                got = decoded[gname] if expert is None else decoded[gname][expert]
                k = (pos.double().flatten() - 0.25) / 4
                if got.numel() != k.numel() or not bool((k == k.round()).all()) or \
                        bool(((k < 0) | (k >= s.numel())).any()):
                    exact = False
                    break
                flat[k.long()] = got.flatten().float()
            if exact and not bool(flat.isnan().any()):
                state[src] = flat.reshape(s.shape)
            elif all(g in float_types for g, _e, _p in self._pieces_of(
                    self._spec, self._config, src, s, self._permute)):
                state[src] = s.float()
            else:
                unmapped.append(src)
        return state, unmapped


def gguf_decode(tensor) -> torch.Tensor:
    """gguf-py's reference dequantizer, to the tensor's row-major shape."""
    from gguf.quants import dequantize

    arr = dequantize(tensor.data, tensor.tensor_type)
    shape = [int(x) for x in reversed(tensor.shape.tolist())]
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).reshape(shape)


def gguf_coverage(check: Check, tensors: dict, layout: GGUFLayout, source_names,
                  config: dict, removed: dict[str, str]) -> None:
    tied = bool(config.get("tie_word_embeddings"))
    for name in sorted(source_names):
        if name in layout.sources or name.endswith("rotary_emb.inv_freq"):
            continue
        if name == "lm_head.weight" and tied:
            continue
        if name in removed:
            continue
        check.fail(name, "is in the source model but has no GGUF tensor")
    for g in tensors:
        if g not in layout.parts and g != "rope_freqs.weight":
            check.fail(g, "matches no tensor of the source model (renamed?)")
    for g in layout.parts:
        if g not in tensors and not (g == "output.weight" and tied):
            check.fail(g, f"source tensor {layout.label(g)} maps to it but the file has no "
                          "such tensor")
    types: dict[str, int] = {}
    for t in tensors.values():
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    check.measured["types"] = types
    check.done(f"{len(tensors)} GGUF tensors ({', '.join(f'{v} {k}' for k, v in sorted(types.items()))}) "
               f"for {len(source_names)} source tensors")


def gguf_fidelity(check: Check, tensors: dict, layout: GGUFLayout) -> dict[str, torch.Tensor]:
    """Fidelity of every GGUF tensor against the source in the file's layout; returns the
    decoded state under the source's names and layout for the parity model."""
    tol = tolerances()["rel_rmse"]
    decoded, pairs, kinds, expected = {}, {}, {}, {}
    floats = {"F32", "F16", "BF16"}
    for g, t in tensors.items():
        if g not in layout.parts:
            continue
        want = layout.expected(g)
        got = gguf_decode(t)
        if got.numel() == want.numel():  # llama-quantize drops trailing 1-dims (a 1-row gate)
            got = got.reshape(want.shape)
        decoded[g] = got
        label = layout.label(g)
        pairs[g], expected[label] = label, want
        kinds[g] = t.tensor_type.name.lower() if t.tensor_type.name not in floats else DENSE_KEY
    _fidelity(check, decoded, expected.__getitem__, pairs, kinds, tol, lambda n: n)
    float_types = {g for g, t in tensors.items() if t.tensor_type.name in floats}
    state, unmapped = layout.to_source(decoded, float_types)
    for src in unmapped:
        check.fail(src, "its GGUF tensors do not map back to its layout (the parity model "
                        "would miss it)")
    return state
