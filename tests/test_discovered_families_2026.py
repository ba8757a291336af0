"""The rest of the 2026 text families through discovery (quantkit.arch.discover): Qwen3-Next,
DeepSeek-V3.2, Gemma 4, Llama 4, Nemotron-H, Granite 4 hybrid, MiniMax-M2, Ministral 3.

Same pattern as test_discovered_families.py: tiny random models from transformers' own config
and model classes, saved as a user's checkpoint, SmolLM2's tokenizer beside them. Per family:
GPTQ (calibrated through the model's real forward: Gated DeltaNet and Mamba2 recurrences, routed
experts) and, where cheap, RTN and FP8; every source tensor is in the artifact (quantized, or
dense under its own name), every dense Linear is in the ignore list, the Linears vLLM 0.32
builds without a quantization method stay dense, and the artifact loads back with quantkit's
loader and predicts near the source.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from test_discovered_families import _QUANT_SUFFIXES, _quantize, _tensor_names, base_linears
from tiny_models import smollm_dir

from quantkit.arch import ARCHS, spec_for_config
from quantkit.loader import load_artifact

_COMMON = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=49152, tie_word_embeddings=False)
_MOE = dict(num_experts_per_tok=2)
# (config class, model class, settings, methods): GPTQ everywhere; RTN and FP8 where the
# family brings a layout of its own (hybrid mixers, ungated experts, MLA's indexer)
FAMILIES = {
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(intermediate_size=512, moe_intermediate_size=256, num_experts=4,
                        head_dim=64, num_hidden_layers=4, **_MOE), ("gptq", "rtn", "fp8")),
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM",
                     dict(num_key_value_heads=4, n_routed_experts=4, moe_intermediate_size=256,
                          intermediate_size=512, first_k_dense_replace=1, n_group=2,
                          topk_group=1, **_MOE), ("gptq", "rtn")),
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM",
               dict(intermediate_size=512, head_dim=64), ("gptq", "rtn", "fp8")),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM",
               dict(intermediate_size=256, intermediate_size_mlp=512, num_local_experts=4,
                    interleave_moe_layer_step=2, **_MOE), ("gptq",)),
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM",
                   dict(num_hidden_layers=4, hybrid_override_pattern="ME*-", mamba_num_heads=8,
                        mamba_head_dim=64, ssm_state_size=16, n_groups=2, n_routed_experts=4,
                        moe_intermediate_size=256, moe_shared_expert_intermediate_size=256,
                        intermediate_size=512, head_dim=64, **_MOE), ("gptq", "rtn", "fp8")),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
                         dict(intermediate_size=256, shared_intermediate_size=512,
                              num_local_experts=4, mamba_n_heads=8, mamba_d_head=64,
                              mamba_d_state=16, mamba_n_groups=2, num_hidden_layers=2,
                              layer_types=["mamba", "attention"], **_MOE), ("gptq", "rtn")),
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM",
                   dict(intermediate_size=256, rotary_dim=32, num_local_experts=4, head_dim=64,
                        **_MOE), ("gptq",)),
    "ministral3": ("Ministral3Config", "Ministral3ForCausalLM",
                   dict(intermediate_size=512, head_dim=64), ("fp8", "rtn", "gptq")),
}

# the random tiny Gemma 4 is far more sensitive than the others: FP8 (no calibration at all)
# reaches only 0.945, RTN int4 0.77, GPTQ from 4 samples 0.62-0.68 (0.75 from 32); a dropped
# tensor or a wrong per-layer input is near 0
_FLOOR = {"gemma4": {"fp8": 0.92, "rtn": 0.6, "gptq": 0.5}}


def _make(out: Path, family: str) -> Path:
    config_cls, model_cls, kwargs, _ = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**_COMMON, **kwargs})
    torch.manual_seed(3)
    model = getattr(transformers, model_cls)(config).to(torch.bfloat16)
    model.save_pretrained(out)
    for f in smollm_dir().iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


def _stored_fused(spec, src: Path) -> dict[str, list[str]]:
    """Fused 3-D expert tensors of the source -> the per-expert Linears they become."""
    es = spec.experts
    if es is None or not es.stored_fused:
        return {}
    out = {}
    for f in src.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            for name in st.keys():
                module = spec.module_name(name)
                for which, param in (("up", es.fused_gate_up), ("down", es.fused_down)):
                    tail = f".{es.module}.{param}"
                    if module.endswith(tail):
                        block = module[: -len(tail)] + "."
                        out[name] = [block + spec.checkpoint_name(es.linear(w, e)) for e in
                                     range(st.get_slice(name).get_shape()[0])
                                     for w in (es.inputs if which == "up" else ("down",))]
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("discovered2026")
    return {f: _make(root / f, f) for f in FAMILIES}


def test_no_table_row_names_these_families():
    known = {c for spec in ARCHS for c in spec.hf_classes}
    assert not known & {cls for _, cls, _, _ in FAMILIES.values()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_2026_family_quantizes_keeping_every_tensor(family, models, tmp_path):
    """Every source tensor survives each method (Mamba2's conv1d / A_log / D / dt_bias and
    gated norm, Gated DeltaNet's, Gemma 4's per-layer embeddings, routers: dense under their
    own names), every dense Linear is in the ignore list, and the artifact predicts what the
    model predicts."""
    src = models[family]
    source = _tensor_names(src)
    spec = spec_for_config(transformers.AutoConfig.from_pretrained(src))
    # the Linears under the checkpoint's names (Nemotron-H's backbone.*, as the artifact and
    # vLLM spell them), and the per-expert ones the checkpoint stores
    linears = {spec.checkpoint_name(n) for n, _ in base_linears(src)} | {
        n.rsplit(".", 1)[0] for n in source if ".experts." in n and n.endswith(".weight")}
    # Llama 4 and Granite 4 checkpoints store the routed experts fused (3-D); the artifact
    # writes them per expert, the names vLLM's llama4.py / granitemoehybrid.py expert mappings
    # read for quantized checkpoints (experts.{e}.gate_proj, ...): those source tensors are
    # replaced by their experts' Linears
    fused = _stored_fused(spec, src)
    linears |= {x for per_expert in fused.values() for x in per_expert}
    base = load_artifact(src)
    ids = torch.randint(10, 40000, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = base.model(ids).logits.float()
    for method in FAMILIES[family][3]:
        out = _quantize(src, tmp_path / method, method)
        written = _tensor_names(out)
        quantized = {n.rsplit(".", 1)[0] for n in written if n.endswith(_QUANT_SUFFIXES)}
        missing = {n for n in source if n not in written and n.rsplit(".", 1)[0] not in quantized
                   and not (n in fused and set(fused[n]) <= quantized)}
        assert not missing, (method, sorted(missing)[:5])
        assert quantized and quantized <= linears, sorted(quantized - linears)[:5]
        ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
        dense = {n.rsplit(".", 1)[0] for n in written if n.endswith(".weight")
                 and n.rsplit(".", 1)[0] in linears} - quantized
        for name in dense:
            assert any(name == i or (i.startswith("re:") and re.match(i[3:], name))
                       for i in ignore), (name, ignore)
        # what vLLM 0.32 builds without a quantization method stays dense, in every block
        for rel in spec.dense_linears:
            assert not any(q.endswith("." + rel) for q in quantized), rel
        with torch.no_grad():
            got = load_artifact(out).model(ids).logits.float()
        cos = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0).item()
        print(f"{family} {method}: logits cosine {cos:.4f}, {len(quantized)} Linears quantized")
        assert cos > _FLOOR.get(family, {}).get(method, 0.97 if method == "fp8" else 0.75), \
            (method, cos)


@pytest.mark.engine
def test_2026_families_in_vllm(models, tmp_path):
    """Gemma 4 (dense int4) generates in real vLLM; Qwen3-Next's quantized experts get vLLM's
    exact refusal where its int4 MoE CPU kernel is missing (the probe says which)."""
    from vllm_checks import vllm_runs

    from quantkit.engines.vllm import run_vllm
    from quantkit.errors import EngineError

    prompt = [{"prompt": "The capital of France is", "max_tokens": 4}]
    gemma = _quantize(models["gemma4"], tmp_path / "gemma4", "rtn")
    if vllm_runs("int4"):
        assert len(run_vllm(gemma, generate=prompt, max_model_len=128)["generate"][0]) > 0
    else:
        with pytest.raises(EngineError) as e:
            run_vllm(gemma, generate=prompt, max_model_len=128)
        assert "object has no attribute 'cpu_gemm_wna16'" in str(e.value) + e.value.log
    nxt = _quantize(models["qwen3_next"], tmp_path / "qwen3_next", "rtn")
    if vllm_runs("int4", moe=True):
        assert len(run_vllm(nxt, generate=prompt, max_model_len=128)["generate"][0]) > 0
    else:
        with pytest.raises(EngineError) as e:
            run_vllm(nxt, generate=prompt, max_model_len=128)
        assert "No WNA16 MoE backend supports the deployment configuration." in str(e.value)
