"""Finding and loading models: aliases, local HF directories, Hub ids.

Safety defaults: safetensors only (pickle needs allow_pickle), no remote code unless asked.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from quantkit.builtin_models import BUILTIN_MODELS, ensure_builtin
from quantkit.errors import BadWeights, ModelLoadError
from quantkit.readers import INDEX_FILE, read_config_json, tensor_files
from quantkit.transformers_lean import causal_lm_class, model_class, trim_transformers_extras

__all__ = ["mtp_tensor_names", "ModelSource", "resolve_model", "load_config", "load_model", "load_tokenizer",
           "check_finite", "TOKENIZER_FILES", "PROCESSOR_FILES"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja",
                   "added_tokens.json", "generation_config.json")
# a vision-language checkpoint's processor (image / video preprocessing, its chat template):
# engines build the multimodal model's input processing from them
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json",
                   "video_preprocessor_config.json", "chat_template.json")


@dataclass
class ModelSource:
    spec: str  # what the user typed
    path: Path  # local directory with config.json
    alias: str | None = None


def resolve_model(spec: str, *, allow_pickle: bool = False, on_progress=None) -> ModelSource:
    """Alias -> built-in model; existing path -> local dir; otherwise a Hub id."""
    if spec in BUILTIN_MODELS:
        return ModelSource(spec, ensure_builtin(spec, on_progress=on_progress), alias=spec)
    p = Path(spec).expanduser()
    if p.exists():
        _check_local_dir(p, allow_pickle=allow_pickle)
        return ModelSource(spec, p.resolve())
    if spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise ModelLoadError(
            f"Model {spec!r} is neither a built-in alias, an existing directory, nor a Hub id.",
            f"Built-in aliases: {', '.join(BUILTIN_MODELS)}. A Hub id looks like 'org/name'.",
        )
    return ModelSource(spec, _fetch_hub(spec, allow_pickle=allow_pickle))


def _fetch_hub(repo_id: str, *, allow_pickle: bool) -> Path:
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
        if allow_pickle:
            patterns += ["*.bin", "*.pt"]
        path = Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=offline))
    except Exception as exc:  # hub errors come in many classes; all mean "not here"
        why = "HF_HUB_OFFLINE is set and it is not in the local Hugging Face cache" if offline \
            else f"the Hub could not be reached or has no such repo ({type(exc).__name__})"
        raise ModelLoadError(
            f"Cannot fetch Hub model {repo_id!r}: {why}.",
            "Download it on a machine with Hub access (huggingface-cli download) and pass the "
            "local directory instead, or use a built-in alias such as smollm2-135m.",
        ) from exc
    _check_local_dir(path, allow_pickle=allow_pickle)
    return path


def _check_local_dir(path: Path, *, allow_pickle: bool) -> None:
    if not path.is_dir():
        raise ModelLoadError(f"{path} is not a directory.",
                             "Pass a Hugging Face model directory (config.json + *.safetensors).")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json.", "Is this a Hugging Face model directory?")
    read_config_json(path)
    shards = sorted(path.glob("*.safetensors"))
    pickles = sorted(path.glob("*.bin")) + sorted(path.glob("*.pt"))
    if not shards and not (path / INDEX_FILE).exists():
        if pickles and not allow_pickle:
            raise ModelLoadError(
                f"{path} holds only pickle weights ({pickles[0].name}); quantkit loads safetensors only.",
                "Pickle files can run code when loaded. If you trust them, pass --allow-pickle.",
            )
        if not pickles:
            raise ModelLoadError(f"{path} has no weights (*.safetensors missing).",
                                 "The directory must contain model.safetensors or its shards.")
        return
    tensor_files(path)  # every header, the index and its shard paths, validated


def __getattr__(name: str):
    """`quantkit.model_io.AutoModelForCausalLM`: causal_lm_class(), for a fork server's preload
    list ("module:attr" is imported and read before any fork: tests/cli_runner.py)."""
    if name == "AutoModelForCausalLM":
        return causal_lm_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_config(path: Path, *, trust_remote_code: bool = False):
    trim_transformers_extras()
    from transformers import AutoConfig

    read_config_json(path)  # not JSON / binary / not an object: a clear error before transformers
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ModelLoadError(f"Cannot read the config of {path}: {exc}",
                             "Architectures with custom code need --trust-remote-code.") from exc


_META_MODEL: tuple[str, object] | None = None


def meta_model(config):
    """The model of `config` with every tensor on the meta device, built once per config.

    For reading shapes and parameter counts only (callers must not change it): building one
    runs transformers' whole init (~0.15 s), and quantize needs the shapes twice.
    """
    global _META_MODEL
    key = config.to_json_string() if hasattr(config, "to_json_string") else repr(config)
    if _META_MODEL is None or _META_MODEL[0] != key:
        with torch.device("meta"):
            _META_MODEL = (key, model_class(config).from_config(config))
    return _META_MODEL[1]


def load_tokenizer(path: Path, *, trust_remote_code: bool = False):
    trim_transformers_extras()
    from transformers import AutoTokenizer

    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ModelLoadError(
            f"No tokenizer in {path} (tokenizer.json / tokenizer.model / vocab.json missing).",
            "Copy the tokenizer files of the original model into this directory.",
        )
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ModelLoadError(f"Cannot load the tokenizer of {path}: {exc}") from exc


def load_model(path: Path, *, dtype: torch.dtype = torch.float32, allow_pickle: bool = False,
               trust_remote_code: bool = False, check_weights: bool = True):
    """A dense transformers model on CPU; weights are checked for NaN/Inf."""
    _check_local_dir(path, allow_pickle=allow_pickle)
    try:
        model = model_class(read_config_json(path)).from_pretrained(
            path, dtype=dtype, use_safetensors=not allow_pickle or None,
            trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ModelLoadError(f"Cannot load model weights from {path}: {exc}") from exc
    # transformers' MXFP4 dequantizer (gpt-oss checkpoints) yields bf16 experts whatever
    # dtype was asked for: one dtype for every tensor, as for any other checkpoint (only
    # there: other models may keep some tensors in float32 on purpose)
    quant = read_config_json(path).get("quantization_config") or {}
    if isinstance(quant, dict) and quant.get("quant_method") == "mxfp4":
        model.to(dtype)
    model.eval()
    if check_weights:
        check_finite(model.named_parameters())
    return model


def check_finite(named_tensors) -> None:
    """Refuse NaN/Inf weights, naming the first bad tensor (quantizing them spreads garbage)."""
    for name, t in named_tensors:
        if not t.is_floating_point() or t.numel() == 0:
            continue
        # NaN or Inf anywhere makes the float32 sum non-finite: one fast reduction per tensor
        # (isfinite on bf16 runs much slower on CPU); only a non-finite sum, which finite
        # values can also give by overflowing, needs the exact element check.
        if torch.isfinite(t.sum(dtype=torch.float32)) or torch.isfinite(t).all():
            continue
        bad = int((~torch.isfinite(t)).sum())
        raise BadWeights(
            f"Tensor {name} contains {bad} NaN/Inf values; refusing to quantize.",
            "The checkpoint is damaged or was saved after a diverged step; fix it first.",
        )


def mtp_tensor_names(source_dir: Path, config: dict, block_path: str) -> list[str]:
    """The checkpoint's multi-token-prediction (MTP) tensors, sorted: `mtp.*` (Qwen3.5 /
    Qwen3-Next, `mtp_num_hidden_layers`) or the blocks past num_hidden_layers (GLM-4.5 and
    DeepSeek-V3 nextn layers, `num_nextn_predict_layers`). transformers drops them when it
    loads the model, so only the shards tell; every format and method asks this one
    function."""
    source_dir = Path(source_dir)
    if not source_dir.is_dir() or not any(source_dir.glob("*.safetensors")):
        return []
    text = config.get("text_config") or {}
    n_layer = config.get("num_hidden_layers", text.get("num_hidden_layers"))
    prefix = block_path + "."
    out = []
    for name in tensor_files(source_dir):
        bid = name[len(prefix):].partition(".")[0] if name.startswith(prefix) else ""
        if name.startswith(("mtp.", "model.mtp.")) or (
                n_layer is not None and bid.isdigit() and int(bid) >= int(n_layer)):
            out.append(name)
    return sorted(out)
