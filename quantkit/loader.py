"""quantkit's own loader: any artifact quantkit writes (or a dense HF dir) as a torch model.

Quantized weights are dequantized, so eval sees exactly the values stored on disk.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quantkit.arch import spec_for_config
from quantkit.errors import UnsupportedArchitecture
from quantkit.formats import detect_format, prepare_model, read_dense_state
from quantkit.model_io import (
    load_config,
    load_model,
    load_tokenizer,
    resolve_model,
)
from quantkit.pipeline.experts import linearize_experts
from quantkit.readers import read_json
from quantkit.transformers_lean import model_class

__all__ = ["LoadedModel", "load_artifact", "artifact_meta"]

META_FILE = "quantkit.json"


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    path: Path
    format: str
    meta: dict = field(default_factory=dict)


def artifact_meta(path: Path) -> dict:
    f = Path(path) / META_FILE
    return read_json(f, META_FILE) if f.is_file() else {}


def load_artifact(spec: str | Path, dtype: torch.dtype = torch.float32, *,
                  tokenizer=None) -> LoadedModel:
    """A model alias, dense HF directory or quantkit artifact, ready for eval on CPU.
    `tokenizer`: the artifact's, when the caller loaded it already (it is not read again)."""
    path = Path(spec)
    if not path.exists():
        path = resolve_model(str(spec)).path
    fmt = detect_format(path)
    tok = tokenizer if tokenizer is not None else load_tokenizer(path)
    if fmt == "dense":
        return LoadedModel(load_model(path, dtype=dtype), tok, path, fmt, artifact_meta(path))
    model = model_from_state(path, read_dense_state(path, fmt, dtype), dtype, where="artifact")
    prepare_model(model, path, fmt)  # e.g. FP8: inputs rounded to E4M3 as the engine does
    model.eval()
    return LoadedModel(model, tok, path, fmt, artifact_meta(path))


def model_from_state(path: Path, state: dict[str, torch.Tensor],
                     dtype: torch.dtype = torch.float32, *, where: str = "state") -> torch.nn.Module:
    """The model of `path`'s config.json with `state`'s weights (checkpoint names; MoE experts
    per expert, as quantkit's artifacts and verify's GGUF decode hold them), in eval mode."""
    config = copy.deepcopy(load_config(path))
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = model_class(config).from_config(config, dtype=dtype)
    spec = _per_expert_linears(model, config)
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    if spec is not None and spec.checkpoint_renames:  # Mixtral's block_sparse_moe -> mlp
        state = {spec.module_name(k): v for k, v in state.items()}
    head, embed = (spec.lm_head, spec.embed) if spec is not None else ("lm_head", "model.embed_tokens")
    if getattr(config, "tie_word_embeddings", False) and f"{head}.weight" not in state:
        state[f"{head}.weight"] = state[f"{embed}.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if "rotary_emb" not in m]
    if missing or unexpected:
        raise ValueError(f"{where} {path} does not match its config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    model.tie_weights()
    _rebuild_meta_buffers(model)
    model.eval()
    return model


def _per_expert_linears(model, config):
    """MoE artifacts store per-expert Linears (the names vLLM loads): give the model those
    modules instead of transformers 5's fused 3-D experts (quantkit.pipeline.experts).
    Returns the architecture's row (None where quantkit has none)."""
    try:
        spec = spec_for_config(config)
    except UnsupportedArchitecture:
        return None  # quantkit did not write it; a dense model loads as it is
    linearize_experts(model, spec)
    return spec


def _rebuild_meta_buffers(model) -> None:
    """Non-persistent buffers (rotary inv_freq, Gemma's embed_scale) are not in the
    checkpoint: rebuild them on CPU (a module with a config anew; any other by the model's own
    _init_weights, with its loaded parameters set aside so that only the buffers change)."""
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if not any(b.is_meta for b in child.buffers(recurse=False)):
                continue
            if hasattr(child, "config"):
                setattr(parent, child_name, type(child)(child.config))
                continue
            params = dict(child.named_parameters(recurse=False))
            for name, b in list(child.named_buffers(recurse=False)):
                if b.is_meta:
                    child._buffers[name] = torch.empty_like(b, device="cpu")
            for name, prm in params.items():
                child._parameters[name] = torch.nn.Parameter(torch.empty_like(prm, device="meta"),
                                                             requires_grad=prm.requires_grad)
            try:
                model._init_weights(child)
            finally:
                child._parameters.update(params)
