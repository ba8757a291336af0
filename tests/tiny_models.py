"""Tiny random models of real architectures, built in the tests (no Hub)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

ARCH_CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
}

# family-specific config values: Gemma 3 with a short sliding window (so calibration text
# crosses it) and llama.cpp's attention scale (1/sqrt(head_dim)); tests build it with 6
# layers so that its default pattern has one global layer (block 5)
FAMILY_DEFAULTS = {"gemma3_text": dict(sliding_window=32)}

# mixture-of-experts defaults (make_tiny_model's `moe` overrides them)
MOE_DEFAULTS = {"qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                                  norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
               # Mixtral's experts are intermediate_size wide (make_tiny_model's intermediate)
               "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
               # gpt-oss: experts intermediate_size wide; a sliding window the calibration
               # text crosses, on alternating layers (its default layer_types)
               "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=32),
               # DeepSeek-V3: 1 dense block then MoE, 4 routed experts in 2 groups (top-1
               # group), one shared expert; MLA widths at K-quant multiples of 256 where
               # llama.cpp's rules allow (qk_nope 128 makes attn_k_b fall back, as in V3)
               "deepseek_v3": dict(n_routed_experts=4, num_experts_per_tok=2, n_group=2,
                                   topk_group=1, n_shared_experts=1, moe_intermediate_size=256,
                                   first_k_dense_replace=1, q_lora_rank=256, kv_lora_rank=256,
                                   qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                                   head_dim=64, routed_scaling_factor=2.5, norm_topk_prob=True)}


def smollm_dir() -> Path:
    from quantkit.model_io import resolve_model

    return resolve_model("smollm2-135m").path


def smollm_truncated(out: Path, layers: int = 2) -> Path:
    """SmolLM2-135M's first `layers` decoder blocks with its embeddings, norm and tokenizer:
    a small model with real weights (greedy choices have margins a random model lacks)."""
    import transformers

    src = smollm_dir()
    config = transformers.AutoConfig.from_pretrained(src)
    config.num_hidden_layers = layers
    model = transformers.AutoModelForCausalLM.from_pretrained(src, config=config,
                                                              dtype=torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation")):
            shutil.copy(f, out / f.name)
    return out


def make_tiny_model(out: Path, arch: str = "llama", *, hidden: int = 256, intermediate: int = 512,
                    layers: int = 2, heads: int = 4, kv_heads: int = 2, vocab: int | None = None,
                    seed: int = 0, tokenizer: bool = True, dtype=torch.bfloat16,
                    tie: bool = False, moe: dict | None = None) -> Path:
    """Save a seeded random model of `arch` with SmolLM2's tokenizer (so text tokenizes for real)."""
    import transformers

    cfg_cls, model_cls = (getattr(transformers, n) for n in ARCH_CONFIGS[arch])
    src = smollm_dir()
    vocab = vocab or 49152
    kwargs = dict(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                  max_position_embeddings=1024, tie_word_embeddings=tie, bos_token_id=1,
                  eos_token_id=2, pad_token_id=2)
    if arch in ("qwen3", "qwen3_moe", "gemma3_text", "gpt_oss"):
        kwargs["head_dim"] = hidden // heads
    if arch == "gemma3_text":
        kwargs.update(query_pre_attn_scalar=hidden // heads,
                      sliding_window=FAMILY_DEFAULTS[arch]["sliding_window"])
    if arch == "gpt_oss":  # YaRN's factor 32 over its original 4096 positions, as configured
        kwargs["max_position_embeddings"] = 131072
    if arch in MOE_DEFAULTS:
        kwargs.update({**MOE_DEFAULTS[arch], **(moe or {})})
    config = cfg_cls(**kwargs)
    config.architectures = [model_cls.__name__]
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype)
    with torch.no_grad():  # realistic scale: default init gives tiny std, make it ~0.02-0.05
        for _name, p in model.named_parameters():
            if p.ndim in (2, 3):  # 3-D: transformers 5's fused MoE experts
                p.normal_(0, 0.04)
            elif arch == "gpt_oss" and not _name.endswith("norm.weight"):  # biases, sinks
                p.normal_(0, 0.04)
        for name, b in model.named_buffers():  # DeepSeek's router bias (zeros at init)
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.05, 0.05)
    out.mkdir(parents=True, exist_ok=True)
    if arch == "gpt_oss":  # experts on the MXFP4 grid, as OpenAI's checkpoints hold them
        _round_experts_to_mxfp4(model)
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer:
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (src / f).exists():
                shutil.copy2(src / f, out / f)
    return out


def tensor_headers(path: Path) -> dict[str, tuple[str, list[int]]]:
    """Every tensor of an artifact's safetensors files: name -> (dtype, shape), read from
    the headers only."""
    from safetensors import safe_open

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                sl = sf.get_slice(k)
                out[k] = (sl.get_dtype(), list(sl.get_shape()))
    return out


def _mxfp4_of(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks uint8 (E, out, in/32, 16), E8M0 scales uint8 (E, out, in/32)) of gpt-oss fused
    experts `w` (E, in, out): OpenAI's checkpoint layout (rows = output channels, 32 inputs
    per block, element 2j in byte j's low nibble, 2j+1 in its high nibble)."""
    from quantkit.e2m1 import quantize_mxfp4

    e, k, n = w.shape
    codes, scales = quantize_mxfp4(w.transpose(1, 2).reshape(e * n, k).float())
    pairs = codes.reshape(e, n, k // 32, 16, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4), scales.reshape(e, n, k // 32)


def _round_experts_to_mxfp4(model) -> None:
    """Put every gpt-oss expert weight on the MXFP4 grid (exact in bf16), in place."""
    from quantkit.e2m1 import dequantize_fp4, e2m1_decode

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                blocks, scales = _mxfp4_of(p.data)
                codes = torch.stack((blocks & 15, blocks >> 4), -1).flatten(-3)
                e, n, k = codes.shape
                w = dequantize_fp4(e2m1_decode(codes.reshape(e * n, k)), scales.reshape(e * n, -1))
                # + 0.0: no -0.0 (a sign-bit zero code), which writing MXFP4 again would
                # store as +0, so both checkpoints hold the very same bits
                p.copy_(w.reshape(e, n, k).transpose(1, 2).to(p.dtype) + 0.0)


def write_gpt_oss_mxfp4(src: Path, out: Path) -> Path:
    """`src` (a tiny gpt-oss saved by make_tiny_model) in OpenAI's checkpoint layout: experts
    as MXFP4 `*_blocks` / `*_scales`, the rest as it is, config quant_method mxfp4."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        for k in f.keys():
            t = f.get_tensor(k)
            if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
                tensors[k + "_blocks"], tensors[k + "_scales"] = _mxfp4_of(t)
            else:
                tensors[k] = t
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy2(f, out / f.name)
    return out
