"""Llama-like decoders: llama, mistral, qwen2, qwen3 (the common block layout, unchanged).

They differ only in how llama.cpp stores them: the llama arch (also Mixtral's, mixtral.py)
permutes q/k rows for its rotary layout and reads llama3 RoPE factors.
"""

from __future__ import annotations

from collections.abc import Callable

from quantkit.arch.spec import ArchSpec


def _llama_cpp_llama_70b(get: Callable) -> bool:
    """llama.cpp's llama arch calls 80 layers 70B with grouped-query attention (65B without)."""
    heads = get("num_attention_heads")
    return get("num_hidden_layers") == 80 and heads != (get("num_key_value_heads") or heads)


def _llama_cpp_qwen2_70b(get: Callable) -> bool:
    """llama.cpp's qwen2 arch calls 80 layers 70B."""
    return get("num_hidden_layers") == 80


# llama.cpp's llama architecture as the converter writes it (llama, mistral, mixtral)
LLAMA_CPP_LLAMA = dict(gguf_arch="llama", gguf_permute_qk=True, gguf_rope_types=("llama3",),
                       gguf_70b=_llama_cpp_llama_70b)

SPECS = (
    ArchSpec("llama", ("LlamaForCausalLM",), ("llama",), attention_v=True, **LLAMA_CPP_LLAMA),
    ArchSpec("mistral", ("MistralForCausalLM",), ("mistral",), attention_v=True,
             **LLAMA_CPP_LLAMA),
    ArchSpec("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), attention_v=True, gguf_arch="qwen2",
             gguf_70b=_llama_cpp_qwen2_70b),
    # llama.cpp's qwen3 graph has no q/k/v/o biases
    ArchSpec("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), attention_v=True, gguf_arch="qwen3",
             gguf_attention_bias=False),
)
