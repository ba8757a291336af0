"""gpt-oss through the one pipeline: OpenAI's MXFP4 checkpoint layout read and decoded by
quantkit, every method on its biased, interleaved, transposed fused experts, both layouts.

The tiny model is a real GptOssForCausalLM (2 layers, alternating sliding / full attention
with sinks, 4 experts of 128, top-2, biased router and experts) with random weights whose
experts lie on the MXFP4 grid; it is saved twice: by transformers (bf16, fused experts) and
in OpenAI's layout (experts as `*_blocks` / `*_scales`, quant_method mxfp4).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_model, write_gpt_oss_mxfp4

from quantkit.arch import spec_for_config
from quantkit.formats.common import load_tensors
from quantkit.pipeline.quantize import QuantizeRequest, quantize
from quantkit.pipeline.streaming import ShardReader
from quantkit.types import QuantScheme

EXPERTS = 4


@pytest.fixture(scope="module")
def gpt_oss_bf16(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss", hidden=128,
                           intermediate=128)


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(gpt_oss_bf16, tmp_path_factory) -> Path:
    return write_gpt_oss_mxfp4(gpt_oss_bf16, tmp_path_factory.mktemp("gpt_oss_mxfp4"))




def test_mxfp4_checkpoint_reads_as_its_bf16_decode(gpt_oss_bf16, gpt_oss_mxfp4):
    """quantkit's reader slices every per-expert Linear (weights and biases) out of the fused
    checkpoint tensors, MXFP4 blocks decoded on the way, to the very bits of the bf16 model
    transformers decodes from the same file (its own Mxfp4 dequantizer: an independent
    decode); the per-expert modules, run with GptOssExperts' own clamped SwiGLU, compute what
    the fused module computes."""
    import transformers

    from quantkit.pipeline.experts import linearize_experts

    config = json.loads((gpt_oss_mxfp4 / "config.json").read_text())
    spec = spec_for_config(config)
    assert spec.name == "gpt_oss" and spec.experts.count(config) == EXPERTS
    stored = set(load_tensors(gpt_oss_mxfp4))
    assert "model.layers.1.mlp.experts.gate_up_proj_blocks" in stored
    assert "model.layers.1.mlp.experts.gate_up_proj" not in stored

    # transformers decodes the MXFP4 experts to bf16 whatever dtype is asked for
    model = transformers.AutoModelForCausalLM.from_pretrained(gpt_oss_mxfp4).float()
    ids = torch.arange(1, 49)[None]  # longer than the sliding window (32)
    with torch.no_grad():
        fused_logits = model(ids).logits
    linearize_experts(model, spec)
    with torch.no_grad():
        linear_logits = model(ids).logits
    assert torch.allclose(linear_logits, fused_logits, atol=1e-4, rtol=0)

    # quantkit's whole-model load (--no-stream) of the MXFP4 checkpoint: one dtype throughout
    from quantkit.model_io import load_model

    assert {p.dtype for p in load_model(gpt_oss_mxfp4).parameters()} == {torch.float32}

    want = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.3.up_proj.bias" in want
    for source in (gpt_oss_mxfp4, gpt_oss_bf16):
        reader = ShardReader(source, spec.checkpoint_name, spec)
        got = reader.get_many(list(want))
        bad = [k for k in want if got[k].dtype != torch.bfloat16 or not torch.equal(got[k], want[k])]
        assert bad == [], (source.name, bad[:4])


@pytest.mark.fast
def test_awq_rows_fold_without_changing_the_model(gpt_oss_bf16):
    """Every AWQ group of the gpt-oss row, folded with random scales into every block (the
    norm's one scale for all experts' gate/up with the biased router compensated, q/k/v
    from the input norm; v -> o is skipped under grouped-query attention), leaves the model's logits as they were
    (before rounding). No up -> down group: down reads (clamp(up) + 1) * glu(gate), which a
    scale on up's rows would change (shown: that fold moves the block's output)."""
    import transformers

    from quantkit.methods.scaling import fold_scale, scale_plans
    from quantkit.pipeline.experts import linearize_experts
    from quantkit.types import BlockContext

    spec = spec_for_config(json.loads((gpt_oss_bf16 / "config.json").read_text()))
    model = transformers.AutoModelForCausalLM.from_pretrained(gpt_oss_bf16, dtype=torch.float32)
    linearize_experts(model, spec)
    ids = torch.arange(1, 49)[None]
    with torch.no_grad():
        before = model(ids).logits
    torch.manual_seed(0)
    for block in model.model.layers:
        linears = {n: m for n, m in block.named_modules() if isinstance(m, torch.nn.Linear)}
        ctx = BlockContext(index=0, block=block, linears=linears, stats={}, scheme=SCHEME,
                           inputs=[], rerun=list, arch=spec)
        plans = scale_plans(ctx)
        assert [p.group.prev for p in plans] == ["input_layernorm", "self_attn.v_proj",
                                                  "post_attention_layernorm"]
        assert list(plans[2].compensate) == ["mlp.router"] and len(plans[2].balance) == 2 * EXPERTS
        col = {n: torch.ones(m.in_features) for n, m in linears.items()}
        row = {n: torch.ones(m.out_features) for n, m in linears.items()}
        for plan in plans:
            if plan.mode == "skip":  # v -> o under grouped-query attention: AWQ skips it
                continue
            width = next(iter(plan.balance.values())).in_features
            fold_scale(plan, torch.exp(torch.randn(width) / 2), col, row, {})
    with torch.no_grad():
        after = model(ids).logits
    assert torch.allclose(after, before, rtol=1e-3, atol=1e-4)
    # what the missing group would do: up's rows / s, down's columns * s moves the output
    expert = model.model.layers[0].mlp.experts[0]
    x = torch.randn(16, expert.up_proj.in_features)
    with torch.no_grad():
        out = expert(x)
        s = torch.exp(torch.randn(expert.up_proj.out_features))
        expert.up_proj.weight.div_(s[:, None])
        expert.up_proj.bias.div_(s)
        expert.down_proj.weight.mul_(s)
        assert not torch.allclose(expert(x), out, rtol=1e-2, atol=1e-3)


SCHEME = QuantScheme(bits=4, group_size=64)
FP8 = QuantScheme(kind="fp8", bits=8, group_size=-1)


def _quantize(model: Path, out: Path, method: str, **kw) -> Path:
    options = {"awq": {"n_grid": 8, "clip_grid": 8}, "fp8": {"scheme": "dynamic"}}.get(method, {})
    req = QuantizeRequest(model=str(model), method=method, scheme=FP8 if method == "fp8" else SCHEME,
                          out=out, calib_samples=4 if method == "awq" else 2, calib_seqlen=64, resume=False,
                          method_options=options, **kw)
    quantize(req)
    return out


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq", "fp8"])
def test_gpt_oss_methods_mxfp4_streamed_equals_bf16_fused(gpt_oss_bf16, gpt_oss_mxfp4, tmp_path,
                                                          method):
    """The MXFP4 checkpoint streamed block by block (quantkit's decode) and the bf16 model
    loaded whole by transformers (fused experts sliced in memory) give the same bytes; experts
    are per-expert Linears under llm-compressor's names with their biases in bf16, the router
    stays bf16 and unquantized; quantkit's loader runs the artifact."""
    from quantkit.loader import load_artifact

    streamed = _quantize(gpt_oss_mxfp4, tmp_path / "streamed", method, stream=True)
    fused = _quantize(gpt_oss_bf16, tmp_path / "fused", method, stream=False)
    assert (streamed / "model.safetensors").read_bytes() == (fused / "model.safetensors").read_bytes()
    t = load_tensors(streamed)
    suffix = "weight" if method == "fp8" else "weight_packed"
    for e in range(EXPERTS):
        for w in ("gate_proj", "up_proj", "down_proj"):
            assert f"model.layers.1.mlp.experts.{e}.{w}.{suffix}" in t
            assert t[f"model.layers.1.mlp.experts.{e}.{w}.bias"].dtype == torch.bfloat16
    assert not any(k.endswith(("_blocks", "_scales", "experts.gate_up_proj")) for k in t)
    assert t["model.layers.0.mlp.router.weight"].dtype == torch.bfloat16
    assert t["model.layers.0.mlp.router.bias"].dtype == torch.bfloat16
    assert t["model.layers.0.self_attn.sinks"].dtype == torch.bfloat16
    qcfg = json.loads((streamed / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "compressed-tensors" and r"re:.*mlp\.router$" in qcfg["ignore"]
    stats = json.loads((streamed / "quantkit_stats.json").read_text())
    assert stats["experts"]["linears"] == 2 * EXPERTS * 3
    # vLLM 0.32 skips these per-expert names for gpt-oss: the artifact does not claim vLLM
    meta = json.loads((streamed / "quantkit.json").read_text())
    assert "vllm" not in meta["engines"] and "per-expert" in meta["engine_gaps"]["vllm"]
    if method == "awq":  # one scale for the norm's whole MoE group: the router compensated
        spec = spec_for_config(json.loads((gpt_oss_bf16 / "config.json").read_text()))
        groups = spec.awq_groups_for(EXPERTS)
        moe = [g for g in groups if g.prev == "post_attention_layernorm"]
        assert len(moe) == 1 and len(moe[0].balance) == 2 * EXPERTS
        assert moe[0].compensate == ("mlp.router",)
    loaded = load_artifact(streamed).model
    with torch.no_grad():
        assert torch.isfinite(loaded(torch.arange(1, 49)[None]).logits).all()


# ---------------------------------------------------------------- GGUF: llama.cpp's gpt-oss

@pytest.fixture(scope="module")
def gpt_oss_gguf_model(tmp_path_factory) -> Path:
    """K-quant widths (hidden 256, 4 experts of 256), bf16 as transformers saves it."""
    return make_tiny_model(tmp_path_factory.mktemp("gpt_oss_gguf"), "gpt_oss", hidden=256,
                           intermediate=256)


@pytest.fixture(scope="module")
def gpt_oss_reference_bf16(gpt_oss_gguf_model, tmp_path_factory) -> Path:
    from gguf_reference import convert_with_llama_cpp

    return convert_with_llama_cpp(gpt_oss_gguf_model,
                                  tmp_path_factory.mktemp("gpt_oss_ref") / "ref.bf16.gguf")


def _gguf(model: Path, out: Path, gguf_type: str, **kw) -> Path:
    quantize(QuantizeRequest(model=str(model), method="gguf", format="gguf",
                             method_options={"gguf_type": gguf_type},
                             scheme=QuantScheme(kind="kquant", gguf_type=gguf_type), out=out,
                             resume=False, **kw))
    return out


@pytest.mark.engine
def test_gpt_oss_bf16_gguf_equals_llama_cpp_converter_and_runs(gpt_oss_gguf_model,
                                                                gpt_oss_reference_bf16, tmp_path):
    """llama.cpp's gpt-oss: experts de-interleaved and stacked into ffn_{gate,up,down}_exps
    with their biases as F32 [n, E], the biased router as F32 ffn_gate_inp, sinks as
    attn_sinks, post_attention_norm, YaRN and sliding-window keys: tensor for tensor and key
    for key what convert_hf_to_gguf.py writes (but general.* provenance); llama.cpp then
    computes transformers' logits (the MXFP4 test below generates)."""
    from gguf_reference import assert_llama_cpp_logits_match, assert_same_gguf

    ours = _gguf(gpt_oss_gguf_model, tmp_path / "bf16.gguf", "bf16")
    kv, tensors = assert_same_gguf(ours, gpt_oss_reference_bf16)
    assert tensors["blk.1.ffn_gate_exps.weight"][:2] == ("BF16", [256, 256, 4])
    assert tensors["blk.1.ffn_gate_exps.bias"][:2] == ("F32", [256, 4])
    assert tensors["blk.1.ffn_gate_inp.bias"][:2] == ("F32", [4])
    assert tensors["blk.0.attn_sinks.weight"][:2] == ("F32", [4])
    assert (kv["gpt-oss.expert_count"], kv["gpt-oss.expert_used_count"],
            kv["gpt-oss.expert_feed_forward_length"], kv["gpt-oss.attention.sliding_window"]) == \
        (4, 2, 256, 32)
    assert kv["gpt-oss.rope.scaling.yarn_beta_fast"] == 32.0
    assert_llama_cpp_logits_match(ours, gpt_oss_gguf_model, "gpt-oss")


@pytest.mark.engine
def test_gpt_oss_mxfp4_checkpoint_bf16_gguf_keeps_its_mxfp4_experts_as_the_converter(
        gpt_oss_gguf_model, tmp_path):
    """From OpenAI's MXFP4 layout llama.cpp's converter writes the experts' stored blocks as
    ggml MXFP4 (nibbles re-laid, E8M0 byte first, gate/up rows de-interleaved) and the rest
    BF16; quantkit's BF16 GGUF of the same directory equals it tensor for tensor (types,
    shapes, bytes) and key for key but general.*, general.file_type MOSTLY_MXFP4_MOE in both;
    llama.cpp computes the logits transformers computes from that directory, and generates."""
    from gguf_reference import (
        assert_generates,
        assert_llama_cpp_logits_match,
        assert_same_gguf,
        convert_with_llama_cpp,
    )

    source = write_gpt_oss_mxfp4(gpt_oss_gguf_model, tmp_path / "mxfp4")
    ref = convert_with_llama_cpp(source, tmp_path / "ref.gguf")
    ours = _gguf(source, tmp_path / "bf16.gguf", "bf16")
    _, tensors = assert_same_gguf(ours, ref)
    assert tensors["blk.1.ffn_up_exps.weight"][:2] == ("MXFP4", [256, 256, 4])
    assert tensors["blk.1.ffn_down_exps.weight"][:2] == ("MXFP4", [256, 256, 4])
    assert tensors["blk.1.attn_q.weight"][0] == "BF16"
    from quantkit.readers import read_gguf

    assert read_gguf(ours)[0]["general.file_type"] == read_gguf(ref)[0]["general.file_type"] == 38
    assert_llama_cpp_logits_match(ours, source, "gpt-oss MXFP4")
    assert_generates(ours)


@pytest.mark.engine
def test_gpt_oss_q4_k_m_equals_llama_quantize(gpt_oss_gguf_model, gpt_oss_reference_bf16,
                                              tmp_path):
    """Q4_K_M of gpt-oss = llama_model_quantize of the converter's BF16 file, type and byte
    for byte (3-D experts included, biases and router F32). quantkit quantizes the MXFP4
    checkpoint of the same weights (its own decode, streamed): llama_model_quantize itself
    refuses the converter's MXFP4 file ("requantizing from type mxfp4 is disabled")."""
    from gguf_reference import gguf_contents

    from quantkit.engines.llamacpp import llama_quantize

    lq = tmp_path / "lq.gguf"
    llama_quantize(gpt_oss_reference_bf16, lq, "q4_k_m")
    source = write_gpt_oss_mxfp4(gpt_oss_gguf_model, tmp_path / "mxfp4")
    ours = _gguf(source, tmp_path / "q4_k_m.gguf", "q4_k_m")
    (_, got), (_, want) = gguf_contents(ours), gguf_contents(lq)
    assert {t: v[:2] for t, v in got.items()} == {t: v[:2] for t, v in want.items()}
    assert [t for t in want if got[t][2] != want[t][2]] == []
    assert (got["blk.0.ffn_down_exps.weight"][0], got["blk.0.ffn_gate_inp.weight"][0],
            got["blk.0.ffn_down_exps.bias"][0]) == ("Q4_K", "F32", "F32")


@pytest.mark.engine
def test_gpt_oss_w4a16_artifact_in_real_vllm(gpt_oss_mxfp4, tmp_path):
    """vLLM 0.32 picks its compressed-tensors WNA16 MoE method for gpt-oss's per-expert
    experts and refuses at engine start on every CPU: its CPU int4 MoE kernel
    (CPUExpertsInt4, fused_moe/experts/cpu_moe.py) takes SiLU only and gpt-oss's experts
    use "swigluoai" (models/gpt_oss.py), with or without AMX (seen on this AMX machine)."""
    from quantkit.engines.vllm import run_vllm
    from quantkit.errors import EngineError

    artifact = _quantize(gpt_oss_mxfp4, tmp_path / "rtn", "rtn")
    with pytest.raises(EngineError) as e:
        run_vllm(artifact, generate=[{"prompt": "The capital of France is", "max_tokens": 4}],
                 max_model_len=256)
    assert "No WNA16 MoE backend supports the deployment configuration." in str(e.value)
    assert "Using CompressedTensorsWNA16MoEMethod" in e.value.log
    # verify says so before starting vLLM (exit 3: the engine cannot run it here, the probe
    # asked CPUExpertsInt4 which activations it takes), coverage and fidelity still checked
    from quantkit.engines.capabilities import vllm_artifact_moe, vllm_cannot_run
    from quantkit.verify import EXIT_ENGINE_CANNOT_RUN, verify

    experts = vllm_artifact_moe(artifact)
    assert experts is not None and experts.activation == "swigluoai"
    result = verify(artifact, engine="vllm", base=gpt_oss_mxfp4)
    assert result.exit_code == EXIT_ENGINE_CANNOT_RUN, result.to_dict()
    assert result.engine_cannot_run == vllm_cannot_run("int4", experts=experts)
    assert "swigluoai" in result.engine_cannot_run or "AMX" in result.engine_cannot_run


def test_gpt_oss_gguf_refuses_layer_types_llama_cpp_would_not_run(gpt_oss_bf16, tmp_path):
    """llama.cpp's gpt-oss takes every 2nd layer as global, sliding first (the converter
    writes no pattern): other layer_types are refused before any work."""
    import shutil

    from quantkit.errors import UnsupportedArchitecture

    src = shutil.copytree(gpt_oss_bf16, tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    cfg["layer_types"] = ["full_attention", "sliding_attention"]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitecture, match="every 2nd layer global"):
        _gguf(src, tmp_path / "x.gguf", "bf16")
    assert not (tmp_path / "x.gguf").exists()
