"""AWQ on mixture-of-experts blocks: the MoE scale groups and their folds, the block error
against RTN, expert chunking under a memory budget, starved experts; the W4A16 MoE artifacts in
real vLLM."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from moe_models import (
    AWQ_FAST,
    AWQ_FASTER,
    STARVED,
    _first_block_linearized,
    _mixtral,
    _moe_and_router_logits,
    _quantize,
)

from quantkit.formats.common import load_tensors
from quantkit.formats.compressed_tensors import read_compressed_tensors


@pytest.fixture(scope="module")
def awq_artifact(moe_model, tmp_path_factory) -> Path:
    return _quantize(moe_model, tmp_path_factory.mktemp("awq") / "awq", "awq",
                     method_options=AWQ_FAST)


@pytest.fixture(scope="module")
def rtn_artifact(moe_model, tmp_path_factory) -> Path:
    return _quantize(moe_model, tmp_path_factory.mktemp("rtn") / "rtn", "rtn")


@pytest.mark.fast
def test_awq_moe_groups_fold_without_changing_block_or_routing(moe_model):
    """The MoE rows of the AWQ table: ONE scale for the post-attention norm shared by every
    expert's gate/up, the router compensated (it reads the scaled input too), and each
    expert's up -> down on its own. Folding any scale leaves the MoE block's output and the
    router logits as they were (before rounding); without the router's compensation the
    logits move (what the compensation is for)."""
    from quantkit.methods.scaling import fold_scale, scale_plans

    spec, model, block, ctx = _first_block_linearized(moe_model)
    plans = scale_plans(ctx)
    shared = [p for p in plans if p.group.prev == "post_attention_layernorm"]
    assert len(shared) == 1 and len(shared[0].balance) == 16 and shared[0].mode == "norm"
    assert list(shared[0].compensate) == ["mlp.gate"] and shared[0].group.inspect == "mlp"
    per_expert = [p for p in plans if p.group.prev.startswith("mlp.experts.")]
    assert [p.group.prev for p in per_expert] == [f"mlp.experts.{e}.up_proj" for e in range(8)]
    assert all(list(p.balance) == [p.group.inspect] and p.mode == "linear" for p in per_expert)

    torch.manual_seed(0)
    h = torch.randn(1, 64, 256)

    def moe_and_logits():
        return _moe_and_router_logits(block, h)

    out0, logits0 = moe_and_logits()
    ones = lambda lin: torch.ones(lin, dtype=torch.float32)  # noqa: E731
    col = {n: ones(m.in_features) for n, m in ctx.linears.items()}
    row = {n: ones(m.out_features) for n, m in ctx.linears.items()}
    for plan in plans:
        if plan in shared or plan in per_expert:
            fold_scale(plan, torch.exp(torch.randn(plan.balance[next(iter(plan.balance))].in_features)),
                       col, row, {})
    out1, logits1 = moe_and_logits()
    assert torch.allclose(logits1, logits0, rtol=1e-4, atol=1e-5)
    assert torch.equal(logits1.topk(2).indices, logits0.topk(2).indices)
    assert torch.allclose(out1, out0, rtol=1e-4, atol=1e-5)
    # what the compensation is for: the router reading x / s with its old weight routes
    # differently
    s = torch.exp(torch.randn(256))
    shared[0].compensate = {}
    fold_scale(shared[0], s, col, row, {})
    out2, logits2 = moe_and_logits()
    assert not torch.allclose(logits2, logits0, rtol=1e-2, atol=1e-3)


def _moe_block_error(model_dir: Path, artifact: Path) -> float:
    """||MoE(x) - MoE_q(x)|| / ||MoE(x)|| for block 0's post-attention norm + router + experts
    (the artifact's own folded norm and router), x = the base model's residual stream on
    held-out text: the error of the MoE block alone, with each model's real routing."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantkit.calibration import load_heldout_text
    from quantkit.loader import load_artifact

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(load_heldout_text("mixed")[0], return_tensors="pt")["input_ids"][:, :512]
    seen = []
    layer = base.model.layers[0]
    hook = layer.post_attention_layernorm.register_forward_pre_hook(lambda _m, a: seen.append(a[0]))
    with torch.no_grad():
        base(ids)
    hook.remove()
    quant = load_artifact(artifact).model.model.layers[0]

    def moe(block):
        with torch.no_grad():
            out = block.mlp(block.post_attention_layernorm(seen[0]))
        return out[0] if isinstance(out, tuple) else out

    want = moe(layer)
    return float((moe(quant) - want).norm() / want.norm())


def test_awq_moe_block_error_below_rtn(moe_model, awq_artifact, rtn_artifact):
    awq = _moe_block_error(moe_model, awq_artifact)
    rtn = _moe_block_error(moe_model, rtn_artifact)
    print(f"MoE block 0 output relative error on held-out text: AWQ {awq:.4f}, RTN {rtn:.4f}")
    assert awq < rtn
    t = load_tensors(awq_artifact)
    assert t["model.layers.0.mlp.experts.3.down_proj.weight_packed"].dtype == torch.int32
    assert t["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16  # router: unquantized
    base = load_tensors(moe_model)  # the fold moved the norm and (compensating) the router
    assert not torch.equal(t["model.layers.0.post_attention_layernorm.weight"],
                           base["model.layers.0.post_attention_layernorm.weight"])
    assert not torch.equal(t["model.layers.0.mlp.gate.weight"], base["model.layers.0.mlp.gate.weight"])
    stats = json.loads((awq_artifact / "quantkit_stats.json").read_text())
    assert stats["experts"]["linears"] == 48 and stats["experts"]["fallback_rtn"] == []
    assert all(0 < v["rel_error"] < 1 for v in stats["layers"].values())


@pytest.fixture(scope="module")
def starved_awq_all_experts(starved_model, tmp_path_factory) -> Path:
    """AWQ with --moe-calibrate-all-experts (a coarse grid), the default expert_input_bytes
    (1 GiB: every input in the one-pass capture); no RTN fallback or few-token warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        return _quantize(starved_model, tmp_path_factory.mktemp("awq_all") / "all", "awq",
                         method_options=AWQ_FASTER, moe_calibrate_all_experts=True)


@pytest.mark.parametrize("experts", ["routed", "all"])
def test_awq_expert_chunks_give_the_same_artifact_with_bounded_inputs(
        moe_model, awq_artifact, starved_model, starved_awq_all_experts, tmp_path, caplog, experts):
    """AWQ's up -> down searches and clips over chunks of experts (the down_proj inputs
    replayed, searched and freed chunk by chunk; routed, the gate/up inputs too, replayed for
    their clips after the fold) write the same bytes as the one-pass capture
    (the fixtures, default expert_input_bytes), while the expert inputs held at once stay
    within `expert_input_bytes`. Tiny model, 512 calibration tokens, in the CPU's compute
    dtype (4 B float32, 2 B bf16 where torch has native bf16 GEMMs): each expert's down_proj
    input is 512 x 256 x 4 B = 512 KiB in float32 with all experts calibrated (4 MiB for 8),
    ~128 KiB routed; half that in bf16."""
    import logging

    from quantkit.pipeline.quantize import compute_dtype_for

    elem = torch.finfo(compute_dtype_for("cpu", torch.bfloat16, True)).bits // 8
    caplog.set_level(logging.DEBUG, logger="quantkit.awq")
    if experts == "all":
        budget, reference = 3 * 512 * 256 * elem, starved_awq_all_experts  # 3 experts a chunk
        chunked = _quantize(starved_model, tmp_path / "chunked", "awq", moe_calibrate_all_experts=True,
                            method_options={**AWQ_FASTER, "expert_input_bytes": budget})
    else:
        budget, reference = 64 * 1024 * elem, awq_artifact
        chunked = _quantize(moe_model, tmp_path / "chunked", "awq",
                            method_options={**AWQ_FAST, "expert_input_bytes": budget})
    assert (chunked / "model.safetensors").read_bytes() == (reference / "model.safetensors").read_bytes()
    held = [r.awq_capture for r in caplog.records if hasattr(r, "awq_capture")]
    assert len(held) == 2 and all(h["expert_chunks"] >= 3 for h in held), held
    assert all(0 < h["largest_chunk_bytes"] <= budget for h in held), held
    # what stays in the one-pass capture: q/k/v's input, o_proj's and, with all experts, the
    # experts' one shared gate/up input; no down_proj's. Routed, each expert's own gate/up
    # rows (2 x 512 gathered rows in all) are replayed chunk by chunk for their clip instead
    rows = 3 * 512 if experts == "all" else 2 * 512
    assert all(h["one_pass_bytes"] == rows * 256 * elem for h in held), held
    assert all((h["gate_up_chunks"] >= 3) == (experts == "routed") for h in held), held


def test_awq_starved_experts_scale_one_and_all_experts_calibration(starved_model, starved_awq_all_experts,
                                                                    tmp_path):
    """Experts the router never picks: their own up -> down group keeps s = 1 and nothing is
    clipped, so their down_proj is exactly RTN's; their gate/up carry the block's shared scale
    (the norm's fold divides their input too). Finite everywhere, reported as RTN fallbacks.
    With all-experts calibration every expert gets AWQ statistics of every token."""
    with pytest.warns(RuntimeWarning, match="AWQ: .* received no calibration tokens and fall back to RTN"):
        routed = _quantize(starved_model, tmp_path / "routed", "awq", method_options=AWQ_FASTER)
    rtn = load_tensors(_quantize(starved_model, tmp_path / "rtn", "rtn"))
    stats = json.loads((routed / "quantkit_stats.json").read_text())
    experts = {k: v for k, v in stats["layers"].items() if ".mlp.experts." in k}
    empty = sorted(k for k, v in experts.items() if v["tokens"] == 0)
    starved = {f"model.layers.{i}.mlp.experts.{e}.{p}" for i in (0, 1) for e in STARVED
               for p in ("gate_proj", "up_proj", "down_proj")}
    assert starved <= set(empty) and sorted(stats["experts"]["fallback_rtn"]) == empty
    t = load_tensors(routed)
    assert all(torch.isfinite(v).all() for v in t.values() if v.is_floating_point())
    for i in (0, 1):
        for e in STARVED:
            base = f"model.layers.{i}.mlp.experts.{e}"
            assert torch.equal(t[f"{base}.down_proj.weight_packed"], rtn[f"{base}.down_proj.weight_packed"])
            assert torch.equal(t[f"{base}.down_proj.weight_scale"], rtn[f"{base}.down_proj.weight_scale"])

    everyone = starved_awq_all_experts  # no fallback, no few-token warning
    stats_all = json.loads((everyone / "quantkit_stats.json").read_text())
    assert stats_all["experts"]["fallback_rtn"] == [] == stats_all["experts"]["below_min_tokens"]
    assert all(v["tokens"] == 8 * 64 for k, v in stats_all["layers"].items() if ".mlp.experts." in k)
    t_all = load_tensors(everyone)
    base = f"model.layers.0.mlp.experts.{STARVED[0]}.down_proj"
    assert not torch.equal(t_all[f"{base}.weight_packed"], rtn[f"{base}.weight_packed"])
    assert "--moe-calibrate-all-experts" in json.loads((everyone / "quantkit.json").read_text())["command"]

    # the CLI takes the flag for AWQ (here it stops at AWQ's too-short calibration, after it)
    from click.testing import CliRunner

    from quantkit.cli import main

    res = CliRunner().invoke(main, ["quantize", str(starved_model), "--method", "awq",
                                    "--moe-calibrate-all-experts", "--calib-samples", "2",
                                    "--calib-seqlen", "64", "-o", str(tmp_path / "cli")])
    assert res.exit_code != 0 and "saw 128 calibration tokens" in res.output


@pytest.mark.engine
def test_moe_artifact_in_real_vllm(moe_model, awq_artifact, mixtral_model, tmp_path):
    """The packed W4A16 MoE artifacts in vLLM (AWQ's: the same pack-quantized tensors RTN and
    GPTQ write, plus the folded norms and the compensated routers). vLLM picks its
    compressed-tensors WNA16 MoE method for the experts (the router stays unquantized); its
    CPU MoE int4 kernel needs AMX. With AMX, Qwen3-MoE's and Mixtral's artifacts load and
    generate as they are, and vLLM predicts what quantkit's loader predicts. Without, vLLM
    refuses at engine start; Qwen3-MoE's artifact decoded back to bf16 under the same
    per-expert names then runs in vLLM's FusedMoE loader (routers and norms included)."""
    import shutil

    from safetensors.torch import save_file
    from vllm_checks import agreement, heldout_ids, vllm_runs

    from quantkit.engines.vllm import run_vllm
    from quantkit.errors import EngineError
    from quantkit.loader import load_artifact

    artifact = awq_artifact
    prompt = [{"prompt": "The capital of France is", "max_tokens": 4}]
    ids = heldout_ids(load_artifact(artifact).tokenizer, 256)
    if vllm_runs("int4", moe=True):  # vLLM's CPU MoE kernels need AMX (the probe asks vLLM)
        for name, path in (("qwen3_moe", artifact),
                           ("mixtral", _mixtral(mixtral_model, tmp_path / "mixtral", "awq"))):
            res = run_vllm(path, generate=prompt, score=[ids], max_model_len=512)
            assert len(res["generate"][0]) > 0
            share = agreement(path, res["score"][0]["top1"], ids)
            print(f"{name} AWQ W4A16 in vLLM vs quantkit loader top-1 agreement: {share:.3f}")
            assert share >= 0.9
    else:
        with pytest.raises(EngineError) as e:
            run_vllm(artifact, generate=prompt, max_model_len=256)
        assert "No WNA16 MoE backend supports the deployment configuration." in str(e.value)
        assert "Using CompressedTensorsWNA16MoEMethod" in e.value.log
        decoded = tmp_path / "decoded"
        decoded.mkdir()
        state = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
                 for k, v in read_compressed_tensors(artifact).items()}
        assert "model.layers.0.mlp.experts.5.down_proj.weight" in state
        save_file(state, str(decoded / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((artifact / "config.json").read_text())
        del config["quantization_config"]
        (decoded / "config.json").write_text(json.dumps(config))
        for f in artifact.glob("tokenizer*"):
            shutil.copy2(f, decoded / f.name)
        res = run_vllm(decoded, generate=prompt, score=[ids], max_model_len=512)
        assert len(res["generate"][0]) > 0
        share = agreement(artifact, res["score"][0]["top1"], ids)
        print(f"vLLM (decoded bf16) vs quantkit loader top-1 agreement: {share:.3f}")
        assert share >= 0.9

    # Mixtral's FP8 artifact (block_sparse_moe.experts.{e}.w1/w3/w2, router
    # block_sparse_moe.gate): vLLM's CPU FP8 MoE kernels take 128x128-block experts only (and
    # AMX), so channel-wise FP8 experts are refused on every CPU, after every weight was read
    # under its name (the same writer names Qwen3-MoE's experts)
    fp8 = _mixtral(mixtral_model, tmp_path / "fp8", "fp8")
    if not vllm_runs("fp8-dynamic", moe=True):
        with pytest.raises(EngineError) as e:
            run_vllm(fp8, generate=prompt, max_model_len=256)
        assert "Unsupported FP8 MoE backend: NONE" in str(e.value)
        assert "process_weights_after_loading" in e.value.log
    else:
        assert len(run_vllm(fp8, generate=prompt, max_model_len=256)["generate"]) == 1
