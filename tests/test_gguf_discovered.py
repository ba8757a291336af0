"""GGUF for families carried by discovery (no ArchSpec row): quantkit's file against llama.cpp's.

Per family (tiny random model from transformers' own classes, widths multiples of 256 so
K-quants apply, SmolLM2's tokenizer): quantkit's BF16 GGUF equals what llama.cpp's own
convert_hf_to_gguf.py writes for the same directory, tensor for tensor and key for key
(general.* provenance excepted, and what the family's entry names); its Q4_K_M equals
llama_model_quantize of the converter's file, type and byte for byte; real llama.cpp loads it
and generates.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from discovered_families import make_model
from gguf_reference import (
    assert_generates,
    assert_same_as_llama_quantize,
    assert_same_gguf,
    convert_with_llama_cpp,
    gguf_contents,
)

from quantkit.pipeline.quantize import QuantizeRequest, quantize
from quantkit.types import QuantScheme

pytest.importorskip("llama_cpp")

# family -> (config class, model class, config settings, GGUF architecture, KV prefixes the
# comparison leaves out, converter options)
FAMILIES = {
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(intermediate_size=512), "olmo2", (), ()),
    # the converter's mistral3 (LlamaModel's vocabulary path) writes SmolLM2's byte-level BPE
    # tokenizer.json as a SentencePiece-style "llama" vocabulary (pre "default", scores, no
    # merges); quantkit writes it as every byte-level BPE tokenizer: gpt2 with merges, pre
    # "smollm", which llama.cpp tokenizes as transformers does
    "ministral3": ("Ministral3Config", "Ministral3ForCausalLM", dict(intermediate_size=512),
                   "mistral3", ("tokenizer.",), ()),
    # the converter's gemma4 writes every vocabulary as its own "gemma4" SentencePiece-style
    # one (LlamaHfVocab: scores, no merges, add_bos true); quantkit writes SmolLM2's
    # byte-level BPE as gpt2 with merges, as for every such tokenizer
    # (llama.cpp's gemma4 wants as many per-layer embedding rows as tokens, as real Gemma 4
    # has; the config class's default 262144 would be refused)
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM",
               dict(intermediate_size=512, head_dim=64, vocab_size_per_layer_input=49152),
               "gemma4", ("tokenizer.",), ()),
    # one Gated DeltaNet layer, one gated full-attention layer; as many value heads as key
    # heads; no MTP tensors in a tiny transformers checkpoint, so the converter runs with
    # --no-mtp (without it, it asserts MTP layers exist)
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
                dict(intermediate_size=512, head_dim=64, linear_num_value_heads=16,
                     layer_types=["linear_attention", "full_attention"]),
                "qwen35", (), ("--no-mtp",)),
    # Qwen3.5's two layers with MoE blocks (4 routed experts, a shared expert and its one-row
    # gate): experts stacked as llama.cpp's 3-D ffn_*_exps, router and shared gate F32
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                    dict(moe_intermediate_size=256, shared_expert_intermediate_size=256,
                         num_experts=4, num_experts_per_tok=2, head_dim=64,
                         linear_num_value_heads=16,
                         layer_types=["linear_attention", "full_attention"]),
                    "qwen35moe", (), ("--no-mtp",)),
    # scoring_func and rotary_dim as MiniMax's checkpoints carry them (the converter reads
    # both; transformers' config keeps them as given)
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM",
                   dict(intermediate_size=256, rotary_dim=32, num_local_experts=4,
                        num_experts_per_tok=2, head_dim=64, scoring_func="sigmoid"),
                   "minimax-m2", (), ()),
    # 4 layers: MoE in 1 and 3 (interleave step 2), layer 3 without RoPE (llama.cpp's every
    # 4th); llama3 RoPE scaling as Llama 4 Scout's config has it (rope_freqs)
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM",
               dict(intermediate_size=256, intermediate_size_mlp=512, num_local_experts=4,
                    interleave_moe_layer_step=2, head_dim=64, num_hidden_layers=4,
                    rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=16.0,
                                         low_freq_factor=1.0, high_freq_factor=1.0,
                                         original_max_position_embeddings=8192)),
               "llama4", (), ()),
    # one Gated DeltaNet layer, one gated full-attention layer, MoE blocks; the config's
    # 16 key heads and 32 value heads (the converter regroups in_proj_qkvz per key head)
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(intermediate_size=512, moe_intermediate_size=256,
                        shared_expert_intermediate_size=256, num_experts=4, num_experts_per_tok=2,
                        head_dim=64, layer_types=["linear_attention", "full_attention"]),
                   "qwen3next", (), ("--no-mtp",)),
    # two value heads per key head, as Qwen3.5's own checkpoints have (16 / 32 by default):
    # the converter reorders the value heads grouped -> tiled, ssm_out's columns included,
    # which quantkit does before rounding
    "qwen3_5_tiled": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
                      dict(intermediate_size=512, head_dim=64, linear_num_key_heads=8,
                           linear_num_value_heads=16,
                           layer_types=["linear_attention", "full_attention"]),
                      "qwen35", (), ("--no-mtp",)),
    # a Mamba2 layer, an attention layer, a MoE layer (relu^2 experts, one shared expert);
    # the Mamba2 widths as tests/discovered_families.py has them (32 heads of 16, in_proj's
    # 1120 rows suit vLLM's CPU int4 kernel; its 256-wide rows and out_proj's 512 suit K-quants)
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM",
                   dict(layers_block_type=["linear_attention", "full_attention", "moe"],
                        mamba_num_heads=32, mamba_head_dim=16, ssm_state_size=16, n_groups=2,
                        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                        moe_shared_expert_intermediate_size=256, intermediate_size=512,
                        head_dim=64),
                   "nemotron_h_moe", (), ()),
    # a Mamba2 layer, then an attention layer, each with its MoE and shared expert; the
    # Mamba2 widths as for Nemotron-H (mamba_expand 2: llama.cpp's loader asserts it)
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
                         dict(intermediate_size=256, shared_intermediate_size=512,
                              num_local_experts=4, num_experts_per_tok=2, mamba_n_heads=32,
                              mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2,
                              num_hidden_layers=2, layer_types=["mamba", "attention"]),
                         "granitehybrid", (), ()),
}
# config.json as the family's own checkpoints spell it: transformers 5 saves Granite 4's
# layer_types as "linear_attention" / "full_attention", which the converter (llama-cpp-python
# 0.3.36) reads as no attention layer at all (0 KV heads everywhere, a file llama.cpp cannot
# load); Granite 4's config.json on the Hub says "mamba" / "attention", which it reads
CONFIG_JSON = {"granitemoehybrid": {"layer_types": ["mamba", "attention"]}}


def _norms_off_one(model: torch.nn.Module) -> None:
    """Norms off 1.0, so an offset or a wrong norm shows in the bytes; the routers'
    score-correction biases (MiniMax-M2's buffers) off 0 too."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(0.1 * torch.randn_like(b))


def _make(out: Path, family: str) -> Path:
    import json

    config_cls, model_cls, kwargs = FAMILIES[family][:3]
    src = make_model(out, config_cls, model_cls, kwargs, seed=5, prepare=_norms_off_one)
    if family in CONFIG_JSON:
        config = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**config, **CONFIG_JSON[family]}))
    return src


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """family -> its tiny checkpoint, built once per session on first use (read-only: a test
    that edits one works on a copy)."""
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = _make(tmp_path_factory.mktemp("gguf-tiny") / family, family)
        return built[family]
    return get


def _gguf(src: Path, out: Path, gguf_type: str) -> Path:
    quantize(QuantizeRequest(model=str(src), method="gguf", out=out, format="gguf",
                             scheme=QuantScheme(kind="kquant", gguf_type=gguf_type),
                             method_options={"gguf_type": gguf_type}, resume=False))
    return out


# family -> (an MoE block, its tensors beyond routed experts and router: GGUF type, shape)
MOE_TENSORS = {
    "qwen3_5_moe": (0, {"ffn_gate_inp_shexp.weight": ("F32", [256, 1]),
                        "ffn_up_shexp.weight": ("BF16", [256, 256]),
                        "ffn_down_shexp.weight": ("BF16", [256, 256])}),
    "minimax_m2": (0, {"exp_probs_b.bias": ("F32", [4])}),
    "qwen3_next": (0, {"ffn_gate_inp_shexp.weight": ("F32", [256, 1]),
                       "ffn_gate_shexp.weight": ("BF16", [256, 256])}),
    "llama4": (1, {"ffn_up_shexp.weight": ("BF16", [256, 256]),
                   "ffn_down_shexp.weight": ("BF16", [256, 256])}),
}


@pytest.mark.engine
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gguf_equals_llama_cpp_converter_and_quantize(family, tiny, tmp_path):
    """BF16 = convert_hf_to_gguf.py's file (tensors: names, types, shapes, bytes; keys), Q4_K_M
    = llama_model_quantize of that file, and llama.cpp generates from quantkit's Q4_K_M."""
    arch, skip, options = FAMILIES[family][3:]
    src = tiny(family)
    ref = convert_with_llama_cpp(src, tmp_path / "ref.bf16.gguf", extra=options)
    ours = _gguf(src, tmp_path / "ours.bf16.gguf", "bf16")
    kv, tensors = assert_same_gguf(ours, ref, skip=skip)
    assert f"{arch}.block_count" in kv and "blk.1.attn_q.weight" in tensors
    if family == "nemotron_h":  # the Mamba2 layer's and the MoE layer's tensors
        assert {"blk.0.ssm_a", "blk.0.ssm_d", "blk.0.ssm_in.weight", "blk.0.ssm_conv1d.weight",
                "blk.0.ssm_norm.weight", "blk.0.ssm_out.weight", "blk.2.ffn_up_exps.weight",
                "blk.2.ffn_down_exps.weight", "blk.2.ffn_up_shexp.weight",
                "blk.2.exp_probs_b.bias"} <= set(tensors)
    if family == "granitemoehybrid":  # Mamba2 tensors; the fused gate/up cut in two
        assert {"blk.0.ssm_a", "blk.0.ssm_d", "blk.0.ssm_in.weight", "blk.0.ssm_norm.weight",
                "blk.1.ffn_gate_exps.weight", "blk.1.ffn_up_exps.weight",
                "blk.1.ffn_gate_shexp.weight", "blk.1.ffn_up_shexp.weight"} <= set(tensors)
        assert kv["granitehybrid.attention.head_count_kv"] == [0, 2]
    if family.startswith("qwen3_5"):  # the Gated DeltaNet layer's tensors, as the converter writes them
        assert {"blk.0.ssm_a", "blk.0.ssm_conv1d.weight", "blk.0.ssm_dt.bias",
                "blk.0.ssm_norm.weight", "blk.0.attn_qkv.weight", "blk.0.ssm_out.weight"} <= set(tensors)
    if family == "qwen3_next":  # in_proj_qkvz regrouped and split, in_proj_ba as it is
        assert tensors["blk.0.attn_qkv.weight"][:2] == ("BF16", [256, 8192])
        assert tensors["blk.0.attn_gate.weight"][:2] == ("BF16", [256, 4096])
        assert tensors["blk.0.ssm_ba.weight"][:2] == ("BF16", [256, 64])
    if family == "llama4":  # llama3 RoPE scaling: the frequency factors, one table
        assert tensors["rope_freqs.weight"][:2] == ("F32", [32])
    moe = MOE_TENSORS.get(family)
    if moe is not None:  # the experts stacked (E slowest), the routers and gates F32
        block, extra = moe
        assert tensors[f"blk.{block}.ffn_gate_exps.weight"][:2] == ("BF16", [256, 256, 4])
        assert tensors[f"blk.{block}.ffn_down_exps.weight"][:2] == ("BF16", [256, 256, 4])
        assert tensors[f"blk.{block}.ffn_gate_inp.weight"][:2] == ("F32", [256, 4])
        for name, want in extra.items():
            assert tensors[f"blk.{block}.{name}"][:2] == want, name
    q4 = _gguf(src, tmp_path / "ours.q4_k_m.gguf", "q4_k_m")
    got = assert_same_as_llama_quantize(q4, ref, tmp_path, "q4_k_m")
    assert {got[t][0] for t in got} >= {"Q4_K", "Q6_K", "F32"}
    assert_generates(q4)


@pytest.mark.fast
@pytest.mark.parametrize("family, arch", [("olmo3", "olmo2"), ("qwen3_5", "qwen35")])
def test_mtp_tensors_are_refused_before_any_work(family, arch, tiny, tmp_path):
    """A checkpoint with MTP tensors (here `mtp.fc.weight`, as Qwen3.5 ships them) of an
    architecture whose nextn tensors the gguf package does not name is refused for GGUF with
    the way out, and nothing is written: a file without them would drop them silently.
    Qwen3.5: llama.cpp's converter writes its MTP layer as a nextn block (its gguf-py knows
    qwen35's nextn tensors), but the gguf package quantkit runs with (scripts/constraints.txt:
    gguf==0.19.0) has none for
    qwen35, so quantkit cannot name them (tests/test_gguf_mtp.py writes GLM-4.5's)."""
    from safetensors.torch import save_file

    from quantkit.errors import UnsupportedArchitecture

    src = shutil.copytree(tiny(family), tmp_path / family)
    save_file({"mtp.fc.weight": torch.zeros(256, 512, dtype=torch.bfloat16)},
              src / "mtp.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedArchitecture, match="MTP") as e:
        _gguf(src, tmp_path / "out.gguf", "bf16")
    assert "mtp.fc.weight" in e.value.message and "without its MTP tensors" in e.value.hint
    assert f"names no nextn (MTP) tensors for {arch}" in e.value.message
    assert not (tmp_path / "out.gguf").exists()


@pytest.mark.fast
@pytest.mark.parametrize("family, edit, match", [
    ("gemma4", dict(vocab_size_per_layer_input=262144), "per-layer vocabulary of 262144 rows"),
    ("gemma4", dict(use_double_wide_mlp=True), "double-wide MLPs"),
    ("llama4", dict(use_qk_norm=False), "use_qk_norm=False with 4 experts"),
    ("qwen3_next", dict(norm_topk_prob=False), "norm_topk_prob=false"),
    ("llama4", dict(attention_chunk_size=4096), "attention_chunk_size 4096"),
    ("nemotron_h", dict(layers_block_type=["linear_attention", "full_attention", "mlp"]),
     "dense MLP layers"),
    ("nemotron_h", dict(n_group=2, topk_group=1), "group-limited routing"),
    ("granitemoehybrid", dict(position_embedding_type="rope"), "RoPE in the attention layers"),
])
def test_variants_gguf_cannot_hold_are_refused(family, edit, match, tiny, tmp_path):
    """Configs whose GGUF llama.cpp would not load (Gemma 4 with a per-layer vocabulary unlike
    the token vocabulary: check_tensor_dims refuses per_layer_token_embd; Nemotron-H with a
    dense MLP layer beside MoE layers, which the converter's per-layer FFN lengths mark as a
    Mamba2 layer), whose layout quantkit does not write yet (Gemma 4's double-wide MLPs), or
    which llama.cpp would run as another function than transformers (Llama 4 with q/k norms
    off but not 128 experts, or with another attention chunk: its llama4 graph hard-codes
    both; Qwen3-Next without top-k renormalisation, which its qwen3next graph always applies;
    Nemotron-H's group-limited routing, untested there; Granite 4 hybrid with RoPE, which
    llama.cpp's granitehybrid leaves out whenever there are Mamba2 layers) are refused before
    any work, and nothing is written. The edit goes into config.json alone: nothing is
    loaded."""
    import json

    from quantkit.errors import UnsupportedArchitecture

    src = shutil.copytree(tiny(family), tmp_path / family)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(UnsupportedArchitecture, match=match) as e:
        _gguf(src, tmp_path / "out.gguf", "bf16")
    assert "convert_hf_to_gguf.py" in e.value.hint
    assert not (tmp_path / "out.gguf").exists()


@pytest.mark.fast
def test_minimax_m2_routes_by_sigmoid_whatever_the_config_says(tiny, tmp_path):
    """transformers' MiniMax-M2 router always scores with a sigmoid; the converter writes
    expert_gating_func only from a config's scoring_func (without one, llama.cpp's
    minimax-m2 graph aborts on gating NONE; "softmax" would route otherwise): quantkit's GGUF
    says sigmoid (ExpertGatingFuncType.SIGMOID, 2) for a config without it or with another."""
    import json

    from gguf import ExpertGatingFuncType

    for scoring in (None, "softmax"):
        src = shutil.copytree(tiny("minimax_m2"), tmp_path / f"m{scoring}")
        config = json.loads((src / "config.json").read_text())
        config.pop("scoring_func")
        if scoring:
            config["scoring_func"] = scoring
        (src / "config.json").write_text(json.dumps(config))
        kv, _ = gguf_contents(_gguf(src, tmp_path / f"m{scoring}.gguf", "bf16"))
        assert kv["minimax-m2.expert_gating_func"] == ExpertGatingFuncType.SIGMOID


@pytest.mark.engine
def test_gguf_gptq_rounds_tiled_value_heads_in_the_converters_order(tiny, tmp_path):
    """GPTQ onto the GGML grids (`--rounding gptq`) on Qwen3.5 with two value heads per key
    head: each Linear is rounded in the converter's row and column order, so every quantized
    tensor decodes near the converter's BF16 tensor of the same name (one left in the
    checkpoint's order is as far as an unrelated matrix: relative error ~1.4), and llama.cpp
    generates from the file. (That the Hessian's columns follow ssm_out's order is not
    separable here: a mismatched one would still round near the weights.)"""
    from gguf import GGMLQuantizationType

    from quantkit.ggml.codec import dequantize_tensor
    from quantkit.readers import read_gguf

    src = tiny("qwen3_5_tiled")
    ref = convert_with_llama_cpp(src, tmp_path / "ref.bf16.gguf", extra=("--no-mtp",))
    out = tmp_path / "gptq.gguf"
    quantize(QuantizeRequest(model=str(src), method="gguf", out=out, format="gguf",
                             scheme=QuantScheme(kind="kquant", gguf_type="q4_k_m"),
                             method_options={"gguf_type": "q4_k_m", "rounding": "gptq"},
                             calib="mixed", calib_samples=4, calib_seqlen=64, resume=False))
    (_, want), (_, got) = read_gguf(ref), read_gguf(out)
    errors = {}
    for name, t in got.items():
        if GGMLQuantizationType(t.qtype) not in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K):
            continue
        deq = dequantize_tensor(torch.from_numpy(np.asarray(t.data).copy()), int(t.qtype))
        w = torch.from_numpy(np.asarray(want[name].data).copy()).view(torch.bfloat16).float()
        w = w.reshape(deq.shape)
        errors[name] = float((deq - w).norm() / w.norm())
    assert {"blk.0.ssm_out.weight", "blk.0.attn_qkv.weight", "blk.0.attn_gate.weight"} <= set(errors)
    assert max(errors.values()) < 0.25, errors
    assert_generates(out)


def test_gguf_auto_refuses_tensors_the_converter_permutes(tiny, tmp_path):
    """--gguf-type auto measures each tensor in the model's order and is not built for the
    converter's value-head reorder: refused once the types are planned, before any data is
    read, and nothing is written."""
    from quantkit.errors import SchemeMismatch

    with pytest.raises(SchemeMismatch, match="converter permutes") as e:
        quantize(QuantizeRequest(model=str(tiny("qwen3_5_tiled")), method="gguf",
                                 out=tmp_path / "auto.gguf", format="gguf",
                                 scheme=QuantScheme(kind="kquant", gguf_type="auto"),
                                 method_options={"gguf_type": "auto", "target_bpw": 4.5},
                                 calib="mixed", calib_samples=2, calib_seqlen=32, resume=False))
    assert "blk.0." in e.value.message and "fixed --gguf-type" in e.value.hint
    assert not (tmp_path / "auto.gguf").exists()
