"""The built-in real model: built offline once, tokenizer identical to the GGUF's own vocabulary."""

from __future__ import annotations

import llama_cpp
import torch

from quantkit.builtin_models import builtin_gguf_path, ensure_builtin, gguf_special_ids
from quantkit.model_io import load_tokenizer

TEXT = ("The capital of France is Paris. In 1999, 12345 people wrote `def f(x): return x**2`!\n\n"
        "  Indented line\twith tab, émigré café, 東京, emoji 🙂 <|im_start|>user\nhi<|im_end|>")


def test_cached_build_is_reused(smollm_path):
    assert ensure_builtin("smollm2-135m") == smollm_path
    assert (smollm_path / "model.safetensors").stat().st_size > 200e6  # bf16, 135M params


def test_tokenizer_matches_gguf_vocabulary(smollm_path):
    tok = load_tokenizer(smollm_path)
    gguf = str(builtin_gguf_path("smollm2-135m"))
    vocab = llama_cpp.Llama(model_path=gguf, vocab_only=True, verbose=False)
    ref = vocab.tokenize(TEXT.encode(), add_bos=False, special=True)
    assert tok(TEXT, add_special_tokens=False)["input_ids"] == ref
    # what `tokenizer(text)` adds by default equals llama.cpp's add_bos behaviour
    assert tok(TEXT)["input_ids"] == vocab.tokenize(TEXT.encode(), add_bos=True, special=True)
    ids = gguf_special_ids(builtin_gguf_path("smollm2-135m"))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        ids["bos"], ids["eos"], ids["padding"]) == (vocab.token_bos(), vocab.token_eos(), 2)
    assert tok.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]


def test_base_model_answers(smollm_path):
    from quantkit.loader import load_artifact

    lm = load_artifact(smollm_path)
    ids = lm.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = lm.model.generate(ids, max_new_tokens=4, do_sample=False)
    assert "Paris" in lm.tokenizer.decode(out[0, ids.shape[1]:])
