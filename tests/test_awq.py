"""AWQ: the method (beats RTN, folds scales, refuses what it cannot do), its three exports
(AutoAWQ GEMM, compressed-tensors asym, ModelOpt W4A16_AWQ) bit for bit, SmolLM2 end to end,
real vLLM, and ModelOpt's own exporter as the reference of the TensorRT-LLM layout."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from vllm_checks import agreement, agreement_floor, heldout_ids, vllm_runs

from quantkit.arch import spec_for_config
from quantkit.errors import CalibrationError, EngineError, SchemeMismatch, UnsupportedArchitecture
from quantkit.formats.awq_gemm import (
    AWQ_ORDER,
    AWQGemmWriter,
    pack_awq,
    pack_awq_gemm,
    read_awq_gemm,
    unpack_awq,
)
from quantkit.formats.common import load_tensors, read_config
from quantkit.formats.modelopt import (
    ModelOptAWQWriter,
    pack_int4_rows,
    read_modelopt_awq,
    unpack_int4_rows,
)
from quantkit.methods.awq import AWQQuantizer, candidate_scales, fake_quantize, search_clip
from quantkit.methods.intquant import rtn_quantize_weight
from quantkit.types import QuantScheme

SCHEME = QuantScheme(bits=4, group_size=64, symmetric=True)
PROMPT = "The capital of France is"
SMOL_CALIB = dict(calib_samples=16, calib_seqlen=256)  # 4096 tokens, the same for AWQ and RTN


# ------------------------------------------------------------------ bit layouts

@pytest.mark.fast
def test_awq_nibble_order_golden_word():
    """Columns 0..7 holding 0..7 pack to nibbles [0,2,4,6,1,3,5,7] from the LSB: 0x75316420."""
    word = pack_awq(torch.arange(8)[None, :])
    assert int(word[0, 0]) & 0xFFFFFFFF == 0x75316420
    # and the largest nibble lands in the sign bit without overflow: column 7 -> nibble 7
    top = torch.zeros(1, 8, dtype=torch.int64)
    top[0, 7] = 15
    assert int(pack_awq(top)[0, 0]) & 0xFFFFFFFF == 0xF0000000


@pytest.mark.fast
def test_awq_pack_unpack_bit_for_bit():
    torch.manual_seed(0)
    q = torch.randint(0, 16, (48, 64))
    words = pack_awq(q)
    assert words.dtype == torch.int32 and words.shape == (48, 8)
    # every bit where the layout says it is: nibble i of word c <- column c*8 + ORDER[i]
    w = words.to(torch.int64) & 0xFFFFFFFF
    for c in range(8):
        for i in range(8):
            assert torch.equal((w[:, c] >> (4 * i)) & 0xF, q[:, c * 8 + AWQ_ORDER[i]])
    assert torch.equal(unpack_awq(words), q)
    # vLLM's loader undoes the order with [0,4,1,5,2,6,3,7] (auto_awq.py): same columns back
    nib = (w[..., None] >> (torch.arange(8) * 4)) & 0xF
    assert torch.equal(nib[..., [0, 4, 1, 5, 2, 6, 3, 7]].reshape(48, 64), q)


@pytest.mark.fast
def test_modelopt_int4_rows_bit_for_bit():
    """uint8 [N/2, K]: row 2i in the low nibble, 2i+1 in the high one, two's complement."""
    q = torch.tensor([[-8, 0, 7], [7, -1, -8]], dtype=torch.int8)
    packed = pack_int4_rows(q)
    assert packed.dtype == torch.uint8 and packed.shape == (1, 3)
    assert packed.tolist() == [[0x78, 0xF0, 0x87]]
    torch.manual_seed(1)
    q = torch.randint(-8, 8, (64, 96), dtype=torch.int8)
    packed = pack_int4_rows(q)
    lo = packed.to(torch.int16) & 0xF
    hi = packed.to(torch.int16) >> 4
    assert torch.equal(torch.where(lo >= 8, lo - 16, lo), q[0::2].to(torch.int16))
    assert torch.equal(torch.where(hi >= 8, hi - 16, hi), q[1::2].to(torch.int16))
    assert torch.equal(unpack_int4_rows(packed), q)


@pytest.mark.fast
@pytest.mark.parametrize("sym", [True, False])
def test_awq_gemm_writer_reader_round_trip(tmp_path, sym):
    torch.manual_seed(2)
    scheme = QuantScheme(bits=4, group_size=64, symmetric=sym)
    r = rtn_quantize_weight("model.layers.0.mlp.down_proj", torch.randn(64, 192) * 0.03, scheme)
    r.bias = torch.randn(64) * 0.01
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    AWQGemmWriter().write(tmp_path, config=cfg, dense={"model.norm.weight": torch.ones(8)},
                          results={r.name: r}, ignore=["lm_head"], dtype=torch.bfloat16)
    qcfg = read_config(tmp_path)["quantization_config"]
    assert qcfg == {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 64,
                    "zero_point": True, "modules_to_not_convert": ["lm_head"]}
    raw = load_tensors(tmp_path)
    base = r.name
    assert raw[f"{base}.qweight"].shape == (192, 8) and raw[f"{base}.qweight"].dtype == torch.int32
    assert raw[f"{base}.qzeros"].shape == (3, 8) and raw[f"{base}.scales"].shape == (3, 64)
    assert raw[f"{base}.scales"].dtype == torch.float16
    # codes and TRUE zeros come back exactly
    assert torch.equal(unpack_awq(raw[f"{base}.qweight"]).T, r.codes.long())
    assert torch.equal(unpack_awq(raw[f"{base}.qzeros"]).T, r.zero.long())
    dense = read_awq_gemm(tmp_path)
    want = (r.codes.float() - r.zero.float().repeat_interleave(64, 1)) * \
        r.scale.half().float().repeat_interleave(64, 1)
    assert torch.equal(dense[f"{base}.weight"], want)
    assert torch.allclose(dense[f"{base}.weight"], r.dequantize(), atol=float(r.scale.max()) * 16 * 2**-11)  # fp16 scales


@pytest.mark.fast
def test_awq_gemm_writer_refuses_what_it_cannot_hold():
    problems = AWQGemmWriter().check(QuantScheme(bits=8, group_size=64), {"x": (60, 64)})
    assert any("4-bit" in p for p in problems) and any("multiple of 8" in p for p in problems)
    r = rtn_quantize_weight("x", torch.randn(8, 64), SCHEME)
    r.extra["pre_quant_scale"] = torch.ones(64)
    with pytest.raises(ValueError, match="pre_quant_scale"):
        pack_awq_gemm(r)


@pytest.mark.fast
def test_modelopt_writer_reader_round_trip(tmp_path):
    torch.manual_seed(3)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    results = {}
    for name, shape in (("model.layers.0.self_attn.q_proj", (64, 128)),
                        ("model.layers.0.self_attn.o_proj", (128, 64))):
        results[name] = rtn_quantize_weight(name, torch.randn(*shape) * 0.03, SCHEME)
    pqs = torch.rand(64) + 0.5
    results["model.layers.0.self_attn.o_proj"].extra["pre_quant_scale"] = pqs
    ModelOptAWQWriter().write(tmp_path, config=cfg,
                              dense={"model.embed_tokens.weight": torch.zeros(4, 128)},
                              results=results, ignore=["lm_head"], dtype=torch.float32)
    hf = json.loads((tmp_path / "hf_quant_config.json").read_text())
    assert hf["quantization"] == {"quant_algo": "W4A16_AWQ", "kv_cache_quant_algo": None,
                                  "group_size": 64, "has_zero_point": False, "pre_quant_scale": True,
                                  "exclude_modules": ["lm_head", "model.embed_tokens"]}
    raw = load_tensors(tmp_path)
    assert raw["model.layers.0.self_attn.q_proj.weight"].shape == (32, 128)
    assert raw["model.layers.0.self_attn.q_proj.weight"].dtype == torch.uint8
    assert raw["model.layers.0.self_attn.q_proj.weight_scale"].shape == (64, 2)
    assert "model.layers.0.self_attn.q_proj.pre_quant_scale" not in raw  # folded into the norm
    assert torch.equal(raw["model.layers.0.self_attn.o_proj.pre_quant_scale"], pqs)
    dense = read_modelopt_awq(tmp_path)
    q = results["model.layers.0.self_attn.q_proj"]
    assert torch.allclose(dense["model.layers.0.self_attn.q_proj.weight"], q.dequantize(), atol=1e-7)
    o = results["model.layers.0.self_attn.o_proj"]
    assert torch.allclose(dense["model.layers.0.self_attn.o_proj.weight"],
                          o.dequantize() * pqs[None, :], atol=1e-7)
    problems = ModelOptAWQWriter().check(QuantScheme(bits=4, group_size=64, symmetric=False), {})
    assert any("--sym" in p for p in problems)


# ------------------------------------------------------------------ the method's pieces

@pytest.mark.fast
def test_candidate_scales_and_fake_quantize():
    torch.manual_seed(4)
    x_mean = torch.rand(128) + 0.01
    s = candidate_scales(x_mean, torch.rand(128) + 0.1, 20)
    assert s.shape == (21, 128) and torch.all(s[0] == 1)
    for row in s[1:]:  # normalised: sqrt(max * min) = 1
        assert float((row.max() * row.min()).sqrt()) == pytest.approx(1.0, rel=1e-5)
    w = torch.randn(32, 128)
    assert torch.allclose(fake_quantize(w, SCHEME),
                          rtn_quantize_weight("w", w, SCHEME).dequantize(), atol=1e-6)


@pytest.mark.fast
def test_clip_search_lowers_output_error():
    torch.manual_seed(5)
    w = torch.randn(64, 128)
    w[:, 3] *= 8  # outliers make plain RTN's grid coarse
    x = torch.randn(512, 128)
    max_val = search_clip(w, x, SCHEME)
    assert max_val.shape == (64, 2)
    clipped = torch.clamp(w.reshape(64, 2, 64), -max_val[..., None], max_val[..., None]).reshape(64, 128)

    def err(wq):
        return float((x @ (wq - w).T).pow(2).mean())
    assert err(fake_quantize(clipped, SCHEME)) < err(fake_quantize(w, SCHEME))


# ------------------------------------------------------------------ the method on a tiny model

@pytest.fixture(scope="module")
def tiny_gqa(tmp_path_factory) -> Path:
    from tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("awq") / "llama", "llama", hidden=256,
                           intermediate=512, layers=2, heads=4, kv_heads=2)


def _tiny_run(path: Path, method: str, scheme: QuantScheme, n_samples=8, seqlen=128, **opts):
    from quantkit.calibration import load_calibration
    from quantkit.methods import get_quantizer
    from quantkit.model_io import load_model, load_tokenizer
    from quantkit.pipeline.blocks import quantize_blocks

    tok = load_tokenizer(path)
    model = load_model(path, dtype=torch.float32)
    spec = spec_for_config(model.config)
    q = get_quantizer(method, **opts)
    cal = load_calibration("mixed", tok, n_samples=n_samples, seqlen=seqlen, seed=0)
    results = quantize_blocks(model, spec, q, scheme, list(cal.batches(1)))
    return model, results, q


def test_awq_beats_rtn_on_a_tiny_model(tiny_gqa, caplog):
    from quantkit.calibration import load_calibration
    from quantkit.model_io import load_model, load_tokenizer

    held = load_calibration("mixed", load_tokenizer(tiny_gqa), n_samples=4, seqlen=128, seed=1).input_ids
    base = load_model(tiny_gqa, dtype=torch.float32)
    with torch.no_grad():
        ref = base(held).logits
    with caplog.at_level(logging.WARNING, logger="quantkit.awq"):
        awq, results, quantizer = _tiny_run(tiny_gqa, "awq", SCHEME)
    rtn, _, _ = _tiny_run(tiny_gqa, "rtn", SCHEME)
    with torch.no_grad():
        err_awq = float((awq(held).logits - ref).pow(2).mean())
        err_rtn = float((rtn(held).logits - ref).pow(2).mean())
    assert err_awq < 0.95 * err_rtn, (err_awq, err_rtn)
    # GQA: v_proj (128 outputs) cannot take o_proj's (256 inputs) scale -> skipped, said once
    assert sum("skipping scaling pair self_attn.v_proj -> self_attn.o_proj" in r.message
               for r in caplog.records) == 1
    assert {h["prev"] for h in quantizer.history} == {"input_layernorm", "post_attention_layernorm",
                                                      "mlp.up_proj"}
    assert all(h["loss"] <= h["rtn_loss"] for h in quantizer.history)  # never worse than s = 1
    # QuantResult invariant: codes in range, dequantize() is what sits in the model
    for name, r in results.items():
        assert r.codes.dtype == torch.uint8 and int(r.codes.max()) <= 15
        assert torch.equal(awq.get_submodule(name).weight.data, r.dequantize())


def test_awq_scales_fold_without_changing_the_function(tiny_gqa):
    """With 8-bit weights the folded, quantized model stays within int8 noise of the base."""
    from quantkit.calibration import load_calibration
    from quantkit.model_io import load_model, load_tokenizer

    held = load_calibration("mixed", load_tokenizer(tiny_gqa), n_samples=2, seqlen=64, seed=2).input_ids
    base = load_model(tiny_gqa, dtype=torch.float32)
    model, _, q = _tiny_run(tiny_gqa, "awq", QuantScheme(bits=8, group_size=64), n_samples=4,
                            seqlen=64, n_grid=4, clip=False)
    scaled = [h for h in q.history if h["alpha"] is not None and h["prev"].endswith("layernorm")]
    assert scaled  # some norm really took a scale (which one depends on the random weights)
    h = scaled[0]
    norm = model.model.layers[h["block"]].get_submodule(h["prev"]).weight
    assert not torch.equal(norm, base.model.layers[h["block"]].get_submodule(h["prev"]).weight)
    with torch.no_grad():
        a, b = model(held).logits, base(held).logits
    assert float((a - b).abs().max()) < 0.05 * float(b.abs().max())


@pytest.mark.fast
def test_awq_refuses_architecture_without_table_and_short_calibration(tiny_gqa):
    spec = spec_for_config(read_config(tiny_gqa))
    with pytest.raises(UnsupportedArchitecture, match="no scaling table"):
        AWQQuantizer().prepare(spec=dataclasses.replace(spec, awq_groups=()), shapes={})
    with pytest.raises(CalibrationError, match="calibration tokens"):
        _tiny_run(tiny_gqa, "awq", SCHEME, n_samples=2, seqlen=32)  # 64 tokens < 256
    with pytest.raises(SchemeMismatch):
        AWQQuantizer(n_grid=0)


@pytest.mark.fast
def test_modelopt_asym_refused_before_calibration(tiny_gqa, tmp_path, monkeypatch):
    from quantkit.pipeline import quantize as qmod

    def no_calibration(*a, **k):
        raise AssertionError("calibration must not load before the format check")
    monkeypatch.setattr("quantkit.calibration.load_calibration", no_calibration)
    req = qmod.QuantizeRequest(model=str(tiny_gqa), method="awq", format="modelopt",
                               scheme=QuantScheme(bits=4, group_size=64, symmetric=False),
                               out=tmp_path / "out")
    with pytest.raises(SchemeMismatch, match="--sym"):
        qmod.quantize(req)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ ModelOpt's exporter as reference

MODELOPT_SCRIPT = r'''
import copy, json, sys
import torch
import modelopt.torch.quantization as mtq
from modelopt.torch.export import export_hf_checkpoint
from transformers import AutoModelForCausalLM
src, ids_file, out, group = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
from safetensors.torch import load_file
ids = load_file(ids_file)["input_ids"]
cfg = copy.deepcopy(mtq.INT4_AWQ_CFG)
for entry in cfg["quant_cfg"]:
    if entry.get("quantizer_name") == "*weight_quantizer":
        entry["cfg"]["block_sizes"][-1] = group
def loop(m):
    with torch.no_grad():
        for row in ids:
            m(row[None])
model = mtq.quantize(model, cfg, loop)
export_hf_checkpoint(model, export_dir=out)
'''


def _modelopt_python() -> Path | None:
    import importlib.util

    if importlib.util.find_spec("modelopt") is not None:  # scripts/setup.sh installs it in .venv
        return Path(sys.executable)
    for cand in (os.environ.get("QUANTKIT_MODELOPT_PYTHON"),
                 str(Path.home() / ".cache/quantkit/venvs/modelopt-0.47.0/bin/python"),
                 "/tmp/venv-modelopt/bin/python"):
        if cand and Path(cand).is_file():
            return Path(cand)
    return None


@pytest.mark.slow
def test_modelopt_export_matches_nvidia_modelopt(tiny_gqa, tmp_path):
    """Same tiny model, same calibration tokens: ModelOpt 0.47's INT4 AWQ export on CPU vs
    quantkit's, key for key (names, dtypes, shapes), values within int4 tolerance."""
    python = _modelopt_python()
    if python is None:
        pytest.skip("nvidia-modelopt 0.47 venv not found (QUANTKIT_MODELOPT_PYTHON)")
    from quantkit.calibration import load_calibration
    from quantkit.model_io import load_model, load_tokenizer
    from quantkit.pipeline.quantize import QuantizeRequest, quantize

    calib = dict(calib_samples=8, calib_seqlen=128)
    cal = load_calibration("mixed", load_tokenizer(tiny_gqa), n_samples=8, seqlen=128, seed=0)
    save_file({"input_ids": cal.input_ids.contiguous()}, str(tmp_path / "ids.safetensors"))
    (tmp_path / "ref.py").write_text(MODELOPT_SCRIPT)
    ref_dir = tmp_path / "modelopt"
    proc = subprocess.run([str(python), str(tmp_path / "ref.py"), str(tiny_gqa),
                           str(tmp_path / "ids.safetensors"), str(ref_dir), "64"],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours_dir = tmp_path / "quantkit"
    quantize(QuantizeRequest(model=str(tiny_gqa), method="awq", format="modelopt", scheme=SCHEME,
                             out=ours_dir, method_options={"pre_quant_scale": True}, **calib))
    ref_hf = json.loads((ref_dir / "hf_quant_config.json").read_text())
    ours_hf = json.loads((ours_dir / "hf_quant_config.json").read_text())
    assert ours_hf == ref_hf
    ref_q = read_config(ref_dir)["quantization_config"]
    assert read_config(ours_dir)["quantization_config"] == ref_q
    ref_t, ours_t = load_tensors(ref_dir), load_tensors(ours_dir)
    assert sorted(ours_t) == sorted(ref_t)
    for k in ref_t:
        assert (ours_t[k].dtype, ours_t[k].shape) == (ref_t[k].dtype, ref_t[k].shape), k
    # values: both effective Linears (norm folded back in) approximate the original weights
    base = load_model(tiny_gqa, dtype=torch.float32).state_dict()
    ref_w, ours_w = read_modelopt_awq(ref_dir), read_modelopt_awq(ours_dir)
    spec = spec_for_config(read_config(tiny_gqa))
    for i in range(2):
        p = f"model.layers.{i}."
        for grp in spec.awq_groups:
            for b in grp.balance:
                key = p + b + ".weight"
                norm = (p + grp.prev + ".weight") if grp.prev not in spec.block_linears else None

                def eff(state, key=key, norm=norm):
                    return state[key] * (state[norm][None, :] if norm else 1)
                w0 = eff(base)
                e_ref = float((eff(ref_w) - w0).norm() / w0.norm())
                e_ours = float((eff(ours_w) - w0).norm() / w0.norm())
                assert e_ref < 0.2 and e_ours < 0.2, (key, e_ref, e_ours)
                assert e_ours < 1.5 * e_ref + 0.02, (key, e_ref, e_ours)


# ------------------------------------------------------------------ SmolLM2 end to end

@pytest.fixture(scope="module")
def smol_awq(tmp_path_factory) -> dict:
    """AWQ with zero points (AutoAWQ's default, zero_point=True) -> AutoAWQ GEMM, and RTN at the
    same scheme -> compressed-tensors asym: the accuracy baseline and vLLM's other int4 path.
    One AWQ run of SmolLM2 (the symmetric case is checked on the tiny model and bit for bit):
    the suite's CI budget."""
    import time

    from quantkit.pipeline.quantize import QuantizeRequest, quantize

    root = tmp_path_factory.mktemp("smol_awq")
    out = {}
    for key, method, fmt in (("awq_asym", "awq", "awq"), ("rtn_asym", "rtn", "compressed-tensors")):
        t0 = time.perf_counter()
        meta = quantize(QuantizeRequest(
            model="smollm2-135m", method=method, format=fmt, out=root / key,
            scheme=QuantScheme(bits=4, group_size=64, symmetric=False),
            # 512 search tokens: KLD 0.2416 vs 0.2356 with 1024 (RTN 0.3988), 20 s less per run
            method_options={"search_tokens": 512} if method == "awq" else {}, **SMOL_CALIB))
        out[key] = {"path": root / key, "meta": meta, "seconds": time.perf_counter() - t0}
    return out


@pytest.fixture(scope="module")
def smol_eval(smol_awq) -> dict:
    from quantkit.eval.harness import evaluate
    from quantkit.eval.logits import PPLConvention

    keys = list(smol_awq)
    recs = evaluate([str(smol_awq[k]["path"]) for k in keys], "smollm2-135m",
                    conv=PPLConvention(max_windows=4))
    table = {k: r["metrics"] for k, r in zip(keys, recs, strict=True)}
    print("\nAWQ vs RTN on smollm2-135m, int4 g64, calibration mixed 16 x 256, held-out mixed "
          "4 x 512 tokens:")
    for k, m in table.items():
        print(f"  {k:9s} ppl {m['ppl']['value']:.3f} (base {m['base_ppl']['value']:.3f})  "
              f"kld {_kld(m):.5f}  top1 {m['top1_agreement']['value']:.4f}  "
              f"quantize {smol_awq[k]['meta']['seconds']['quantize']} s")
    return table


def _kld(m) -> float:
    v = m["kld"]
    return float(v["mean"] if isinstance(v, dict) else v)


@pytest.mark.slow
def test_awq_kld_at_most_0_9_of_rtn_on_smollm2(smol_eval):
    awq, rtn = smol_eval["awq_asym"], smol_eval["rtn_asym"]
    assert _kld(awq) <= 0.9 * _kld(rtn), (awq, rtn)
    assert awq["ppl"]["value"] < rtn["ppl"]["value"]


@pytest.mark.slow
def test_awq_artifacts_metadata(smol_awq):
    awq_cfg = read_config(smol_awq["awq_asym"]["path"])["quantization_config"]
    assert awq_cfg["quant_method"] == "awq" and awq_cfg["group_size"] == 64
    assert awq_cfg["zero_point"] is True
    ct = read_config(smol_awq["rtn_asym"]["path"])["quantization_config"]
    assert ct["config_groups"]["group_0"]["weights"]["symmetric"] is False
    meta = json.loads((smol_awq["awq_asym"]["path"] / "quantkit.json").read_text())
    assert meta["method"] == "awq" and meta["calibration"]["n_samples"] == 16
    # the folded norms were written (they differ from the base model's)
    from quantkit.model_io import resolve_model

    base = load_tensors(resolve_model("smollm2-135m").path, {"model.layers.0.input_layernorm.weight"})
    ours = load_tensors(smol_awq["awq_asym"]["path"], {"model.layers.0.input_layernorm.weight"})
    assert not torch.equal(base["model.layers.0.input_layernorm.weight"],
                           ours["model.layers.0.input_layernorm.weight"])


# ------------------------------------------------------------------ real vLLM

@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize("key,kernel_line", [
    ("awq_asym", "for AutoAWQMarlinLinearMethod"),
    ("rtn_asym", "for CompressedTensorsWNA16"),
])
def test_awq_artifacts_in_vllm(smol_awq, key, kernel_line):
    from quantkit.engines.vllm import run_vllm
    from quantkit.loader import load_artifact

    path = smol_awq[key]["path"]
    if not vllm_runs("int4"):
        with pytest.raises(EngineError) as e:
            run_vllm(path, generate=[{"prompt": PROMPT, "max_tokens": 8}])
        log = e.value.log
        assert "object has no attribute 'cpu_gemm_wna16'" in str(e.value)
        # vLLM accepted the config and every tensor; only the CPU int4 kernel is missing
        assert f"Using CPUWNA16LinearKernel {kernel_line}" in log
        assert "Loading safetensors checkpoint shards: 100% Completed" in log
        assert "Unable to find matching target" not in log
        return
    ids = heldout_ids(load_artifact(path).tokenizer)
    res = run_vllm(path, generate=[{"prompt": PROMPT, "max_tokens": 8}], score=[ids])
    assert "Paris" in res["generate"][0]
    assert agreement(path, res["score"][0]["top1"], ids) >= agreement_floor(path, ids)


def test_loader_reads_awq_artifact_like_pipeline(tmp_path, tiny_gqa):
    """quantkit's loader on an AWQ GEMM artifact gives the weights the pipeline computed."""
    from quantkit.loader import load_artifact
    from quantkit.pipeline.quantize import QuantizeRequest, quantize

    out = tmp_path / "awq"
    quantize(QuantizeRequest(model=str(tiny_gqa), method="awq", format="awq", scheme=SCHEME, out=out,
                             calib_samples=4, calib_seqlen=128,
                             method_options={"n_grid": 4, "clip_grid": 4}))
    lm = load_artifact(out)
    assert lm.format == "awq"
    raw = load_tensors(out)
    w = lm.model.model.layers[1].mlp.down_proj.weight
    q = unpack_awq(raw["model.layers.1.mlp.down_proj.qweight"]).float()
    z = unpack_awq(raw["model.layers.1.mlp.down_proj.qzeros"]).float().repeat_interleave(64, 0)
    s = raw["model.layers.1.mlp.down_proj.scales"].float().repeat_interleave(64, 0)
    assert torch.equal(w, ((q - z) * s).T)
    shutil.rmtree(out)
