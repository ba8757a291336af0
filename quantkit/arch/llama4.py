"""Llama 4 (text): carried by discovery (MoE blocks every interleave_moe_layer_step-th layer,
each with a shared expert beside routed experts that the checkpoint stores fused, (E, in, out));
GGUF as llama.cpp's converter writes it, under its llama4 architecture: no q/k row permutation
(Llama 4's RoPE rotates interleaved pairs, as llama.cpp's), the experts per projection as 3-D
ffn_{gate,up,down}_exps (split and transposed from the fused tensors), the router ffn_gate_inp
F32, llama3 RoPE scaling as rope_freqs, the dense MLP's width (intermediate_size_mlp) as
feed_forward_length and the experts' (intermediate_size) as expert_feed_forward_length.

llama.cpp's llama4 loader (src/models/llama4.cpp) fixes what transformers reads from the config:
chunked attention of 8192 tokens on 3 layers of 4 and full attention without RoPE on every 4th
(n_no_rope_layer_step 4), the NoPE layers' attention-temperature tuning with floor 8192 and
scale 0.1, L2 q/k norms on the RoPE layers unless the model has 128 experts, and MoE blocks at
every interleave_moe_layer_step-th layer. A config that sets any of these otherwise would run
another function in llama.cpp: refused (_check).
"""

from __future__ import annotations

from quantkit.errors import UnsupportedArchitecture

# what llama.cpp's llama4 graph hard-codes (the file has no key for it)
_CHUNK, _NOPE_STEP, _FLOOR, _SCALE = 8192, 4, 8192, 0.1


def _check(config: dict) -> None:
    n = int(config["num_hidden_layers"])
    experts = int(config.get("num_local_experts") or 0)
    step = int(config.get("interleave_moe_layer_step") or 1)
    rope = [int((i + 1) % _NOPE_STEP != 0) for i in range(n)]
    found = []
    if config.get("no_rope_layers") not in (None, [], rope):
        found.append(f"no_rope_layers {config['no_rope_layers']} (llama.cpp: every "
                     f"{_NOPE_STEP}th layer without RoPE)")
    types = ["chunked_attention" if r else "full_attention" for r in rope]
    if config.get("layer_types") not in (None, types):
        found.append(f"layer_types {config['layer_types']} (llama.cpp: {types})")
    if config.get("attention_chunk_size", _CHUNK) != _CHUNK:
        found.append(f"attention_chunk_size {config['attention_chunk_size']} (llama.cpp: {_CHUNK})")
    if (config.get("attn_temperature_tuning", True) is not True
            or config.get("floor_scale", _FLOOR) != _FLOOR
            or abs(float(config.get("attn_scale", _SCALE)) - _SCALE) > 1e-9):
        found.append("attention temperature tuning other than llama.cpp's (on, floor_scale "
                     f"{_FLOOR}, attn_scale {_SCALE})")
    if bool(config.get("use_qk_norm", True)) != (experts != 128):
        found.append(f"use_qk_norm={config.get('use_qk_norm', True)} with {experts} experts "
                     "(llama.cpp applies the L2 q/k norm exactly when there are not 128)")
    moe = list(range(step - 1, n, step))
    if config.get("moe_layers") not in (None, moe):
        found.append(f"moe_layers {config['moe_layers']} (llama.cpp: every {step}th layer, {moe})")
    if found:
        raise UnsupportedArchitecture(
            f"Llama 4 with {'; '.join(found)} would compute another function in llama.cpp, "
            "whose llama4 graph fixes these.",
            "Use a safetensors format (compressed-tensors) with quantkit (llama.cpp's "
            "convert_hf_to_gguf.py converts it, silently computing the other function).")


GGUF = {
    "llama4_text": dict(gguf_arch="llama4", gguf_check=_check, gguf_rope_types=("llama3",),
                        gguf_attention_bias=False, gguf_feed_forward=("intermediate_size_mlp",),
                        gguf_kv=("vocab_size", "rope_dimension_count", "head_dim_if_set",
                                 "expert_count", "expert_used_count",
                                 "expert_feed_forward_length_intermediate",
                                 "interleave_moe_layer_step")),
}
