"""Gemma 4 (text): carried by discovery (per-layer inputs, layer scalars, sliding/global
layers with their own head sizes); GGUF as llama.cpp's converter writes it, under its gemma4
architecture: per-layer-type head and RoPE sizes, the sliding pattern from layer_types, and
the global layers' "proportional" RoPE as rope_freqs (1 for the rotated pairs, 1e30 for the
rest). RMSNorms store w itself (Gemma 4's norms multiply by w, not 1 + w)."""

from __future__ import annotations

from quantkit.arch.gguf_names import refuse_gguf


def _check(config: dict) -> None:
    """Refuse the Gemma 4 variants whose GGUF layout quantkit does not write (each would need
    per-layer arrays or tensors the tests have not compared with the converter's)."""
    unsupported = {
        "enable_moe_block": "the MoE block (router scale, per-expert scales)",
        "attention_k_eq_v": "keys shared with values (attention_k_eq_v)",
        "use_double_wide_mlp": "double-wide MLPs of the KV-shared layers",
        "num_global_key_value_heads": "global layers with their own KV head count",
        "num_kv_shared_layers": "KV-shared layers",
    }
    found = [why for key, why in unsupported.items() if config.get(key)]
    per_layer = config.get("vocab_size_per_layer_input")
    if config.get("hidden_size_per_layer_input") and per_layer not in (None, config["vocab_size"]):
        # llama.cpp's gemma4 loader wants per_layer_token_embd n_vocab rows (check_tensor_dims)
        found.append(f"a per-layer vocabulary of {per_layer} rows beside {config['vocab_size']} "
                     "tokens (llama.cpp loads only equal ones)")
    refuse_gguf("Gemma 4", found, yet=True)


def _per_layer_embeds(get) -> tuple[int, int] | None:
    """embed_tokens_per_layer: one row per per-layer vocabulary entry, every layer's input
    (None: a Gemma 4 without per-layer inputs)."""
    if not get("hidden_size_per_layer_input"):
        return None
    return (int(get("vocab_size_per_layer_input")),
            int(get("hidden_size_per_layer_input")) * int(get("num_hidden_layers")))


GGUF = {
    "gemma4_text": dict(gguf_arch="gemma4", gguf_rope_types=("proportional",), gguf_check=_check,
                        gguf_outer_embeds=(("model.embed_tokens_per_layer", _per_layer_embeds),),
                        gguf_kv=("rope_freq_base_swa", "sliding_window", "gemma4_layers",
                                 "final_logit_softcapping")),
}
