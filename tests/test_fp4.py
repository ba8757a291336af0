"""NVFP4 (W4A16 / W4A4) and MXFP4 (issue 20): the E2M1 grid against compressed-tensors' own,
the nvfp4/mxfp4-pack-quantized artifacts against what llm-compressor 0.14 writes for the same
tiny model and calibration windows (run in its own venv, value for value), the loader's
dequantization and NVFP4 input rounding, `info`, `plan` and the CLI's refusals.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
from compressed_tensors.quantization import preset_name_to_scheme
from compressed_tensors.quantization.quant_args import FP4_E2M1_DATA
from tiny_models import tensor_headers

from quantkit.cli import main
from quantkit.e2m1 import (
    E2M1_VALUES,
    dequantize_fp4,
    e2m1_codes,
    e2m1_decode,
    quantize_mxfp4,
    quantize_nvfp4,
)
from quantkit.formats.common import load_tensors
from quantkit.formats.fp4 import pack_e2m1, read_fp4_pack_quantized, read_modelopt_nvfp4
from quantkit.info import artifact_info
from quantkit.loader import load_artifact
from quantkit.machine import cache_dir
from quantkit.methods.fp4 import fp4_scheme
from quantkit.pipeline.quantize import QuantizeRequest, quantize

LLMC_VENV = "llmcompressor-0.14.0.1"  # scripts/setup.sh builds it
# quantkit's scheme -> the compressed-tensors preset llm-compressor is run with
PRESETS = {"nvfp4-w4a16": "NVFP4A16", "nvfp4-w4a4": "NVFP4", "mxfp4": "MXFP4A16"}
CALIB = {"calib_samples": 8, "calib_seqlen": 64}


def _q(model, out, method: str, scheme: str = "w4a16"):
    opts = {"scheme": scheme} if method == "nvfp4" else {}
    return quantize(QuantizeRequest(model=str(model), method=method,
                                    scheme=fp4_scheme(method, scheme), out=Path(out),
                                    method_options=opts, **CALIB))


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], -1).reshape(packed.shape[0], -1)


# ------------------------------------------------------------------------- the grid ----

def test_e2m1_grid_and_packing_are_compressed_tensors_own():
    """Round half to even onto E2M1 with the sign kept on zeros (compressed-tensors'
    cast_to_fp4, eager), two codes per byte as its packer writes them, and the library's own
    compressors, handed quantkit's scales, writing quantkit's packed bytes."""
    torch.manual_seed(0)
    x = torch.randn(64, 128) * 3
    x[0, :10] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.1, 7.0, -0.0])
    ref = FP4_E2M1_DATA.cast_to_fp4.__wrapped__(x.clone())
    ours = e2m1_decode(e2m1_codes(x))
    assert torch.equal(ours, ref) and torch.equal(ours.signbit(), ref.signbit())
    assert ours[0, :9].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, 6.0]
    w = (torch.randn(48, 256) * 0.04).to(torch.bfloat16)
    w[3, :16] = 0  # an all-zero group: scale 0.125 (the library's epsilon), codes 0
    codes, scale, g = quantize_nvfp4(w)
    assert scale.dtype == torch.float8_e4m3fn and scale.shape == (48, 16)
    assert float(scale[3, 0]) == 0.125 and g.dtype == torch.float32
    nv = preset_name_to_scheme("NVFP4A16", ["Linear"])
    lib = NVFP4PackedCompressor.compress(
        {"weight": w, "weight_scale": scale.to(torch.bfloat16), "weight_global_scale": g}, nv)
    assert torch.equal(lib["weight_packed"], pack_e2m1(codes))
    back = NVFP4PackedCompressor.decompress(lib, nv)["weight"]  # bf16, rounded once from ours
    assert torch.equal(back, dequantize_fp4(codes, scale, g).to(back.dtype))
    codes, exp = quantize_mxfp4(w)
    assert exp.dtype == torch.uint8 and exp.shape == (48, 8)
    mx = preset_name_to_scheme("MXFP4A16", ["Linear"])
    step = torch.exp2(exp.float() - 127)
    lib = MXFP4PackedCompressor.compress({"weight": w, "weight_scale": step}, mx)
    assert torch.equal(lib["weight_packed"], pack_e2m1(codes)) and torch.equal(lib["weight_scale"], exp)
    # every value within half of its local E2M1 gap (0.5 below 2, 1 below 4, 2 below 6), but
    # where a group's max sits above 6 steps (the scale is a power of two) and clamps
    deq, wf = dequantize_fp4(codes, exp), w.float()
    steps = step.repeat_interleave(32, dim=1)
    u = wf.abs() / steps
    half_gap = torch.where(u <= 2, 0.25, torch.where(u <= 4, 0.5, 1.0))
    assert bool(((deq - wf).abs() / steps <= half_gap + (u - 6).clamp_min(0) + 1e-6).all())
    assert E2M1_VALUES.tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


# ------------------------------------------------ llm-compressor as the reference ----

def _llmc_python() -> Path:
    python = cache_dir() / "venvs" / LLMC_VENV / "bin" / "python"
    assert python.is_file(), f"llm-compressor venv missing at {python}: run scripts/setup.sh"
    return python


@pytest.fixture(scope="module")
def fp4_artifacts(tmp_path_factory):
    """The tiny Llama, quantkit's three artifacts and llm-compressor's for the same presets,
    all calibrated on the same 8 x 64 windows of `mixed`."""
    from tiny_models import make_tiny_model

    from quantkit.calibration import load_calibration
    from quantkit.model_io import load_tokenizer

    root = tmp_path_factory.mktemp("fp4")
    model = make_tiny_model(root / "llama", "llama")
    ids = load_calibration("mixed", load_tokenizer(model), n_samples=CALIB["calib_samples"],
                           seqlen=CALIB["calib_seqlen"], seed=0).input_ids
    torch.save(ids, root / "ids.pt")
    ref_root = root / "llmc"
    ref_root.mkdir()
    proc = subprocess.run([str(_llmc_python()), str(Path(__file__).with_name("llmc_reference.py")),
                           str(model), str(root / "ids.pt"), str(ref_root), *PRESETS.values()],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outcome = json.loads((ref_root / "outcome.json").read_text())
    assert outcome == dict.fromkeys(PRESETS.values(), "ok"), outcome
    for preset in PRESETS.values():  # so that quantkit's loader can read theirs as well
        shutil.copy2(model / "tokenizer.json", ref_root / preset / "tokenizer.json")
        shutil.copy2(model / "tokenizer_config.json", ref_root / preset / "tokenizer_config.json")
    ours = {}
    for name in PRESETS:
        method, _, scheme = name.partition("-")
        ours[name] = root / name
        _q(model, ours[name], method, scheme or "w4a16")
    return model, ours, {name: ref_root / p for name, p in PRESETS.items()}


def test_artifacts_equal_llm_compressor(fp4_artifacts, capsys):
    """Same tensor names, dtypes and shapes as llm-compressor 0.14.0.1; the same
    quantization_config but for what the compressed-tensors version writes (version 0.19 there,
    empty sparsity/transform configs); packed codes and scales identical (measured: every one,
    for all three presets), and where not, within one FP4 step (the share is printed)."""
    _, ours, refs = fp4_artifacts
    report = []
    for name in PRESETS:
        h_ours, h_ref = tensor_headers(ours[name]), tensor_headers(refs[name])
        assert h_ours == h_ref, name
        c_ours = json.loads((ours[name] / "config.json").read_text())["quantization_config"]
        c_ref = json.loads((refs[name] / "config.json").read_text())["quantization_config"]
        assert c_ref.pop("version") == "0.19.0" and c_ours.pop("version", None) is None
        for k in ("sparsity_config", "transform_config"):
            assert not c_ref.pop(k) and not c_ours.pop(k, None)
        assert c_ours == c_ref, name
        a, b = load_tensors(ours[name]), load_tensors(refs[name])
        differ = total = 0
        for k, t in b.items():
            if k.endswith(".weight_packed"):
                va = e2m1_decode(_nibbles(a[k])).view(-1)
                vb = e2m1_decode(_nibbles(t)).view(-1)
                pos = torch.bucketize(E2M1_VALUES, E2M1_VALUES)  # E2M1 index = grid position
                ia = pos[torch.bucketize(va.abs(), E2M1_VALUES)] * va.sign()
                ib = pos[torch.bucketize(vb.abs(), E2M1_VALUES)] * vb.sign()
                differ += int((va != vb).sum())
                total += va.numel()
                assert int((ia - ib).abs().max()) <= 1, k  # within one FP4 step
            elif k.endswith("input_global_scale"):  # observed on float32 (here) vs bf16 there
                assert abs(float(a[k]) / float(t) - 1) <= 2 ** -7, k
            elif k.endswith(("weight_scale", "weight_global_scale")):
                assert torch.equal(a[k].view(torch.uint8) if a[k].dtype != torch.float32 else a[k],
                                   t.view(torch.uint8) if t.dtype != torch.float32 else t), k
            else:
                assert torch.equal(a[k], t), k
        report.append(f"{PRESETS[name]} {differ}/{total} codes differ")
        assert differ / total < 0.001, (name, differ, total)
    with capsys.disabled():
        print("\nquantkit vs llm-compressor 0.14.0.1 (tiny Llama): " + "; ".join(report))


def test_loader_info_and_w4a4_inputs(fp4_artifacts):
    """The loader's weights are the library's own decompression of the stored tensors (for
    llm-compressor's artifact too); `info` counts 4.5 / 4.25 bits; a W4A4 artifact rounds each
    FP4 Linear's input through NVFP4 (every 16 inputs on one E4M3-scaled E2M1 grid)."""
    _, ours, refs = fp4_artifacts
    name = "model.layers.1.mlp.down_proj"  # [256, 512]
    for key, art in [*ours.items(), ("llmc-nvfp4", refs["nvfp4-w4a4"])]:
        raw = load_tensors(art)
        lm = load_artifact(art)
        w = lm.model.state_dict()[f"{name}.weight"].float()
        preset = PRESETS.get(key, "NVFP4")
        comp = MXFP4PackedCompressor if preset.startswith("MX") else NVFP4PackedCompressor
        sd = {k.rsplit(".", 1)[1]: t for k, t in raw.items() if k.startswith(name + ".")}
        lib = comp.decompress(sd, preset_name_to_scheme(preset, ["Linear"]))["weight"]
        assert torch.allclose(w, lib.float(), rtol=2 ** -8, atol=0), key  # bf16 library output
        hooks = sum(len(m._forward_pre_hooks) for m in lm.model.modules())
        assert hooks == (14 if preset == "NVFP4" else 0), key
    for key, bits in (("nvfp4-w4a16", 4.5), ("mxfp4", 4.25)):
        info = artifact_info(ours[key])
        assert info["nominal_bits_per_weight"] == bits
        assert abs(info["bits_per_weight_quantized"] - bits) < 0.01, info
    lm = load_artifact(ours["nvfp4-w4a4"])
    seen = {}
    q = lm.model.model.layers[0].self_attn.q_proj
    hooks = list(q._forward_pre_hooks.values())  # the loader's
    q.register_forward_pre_hook(lambda m, a: seen.setdefault("raw", a[0].clone()), prepend=True)
    with torch.no_grad():
        lm.model(torch.randint(0, 1000, (1, 12)))
        x = hooks[0](q, (seen["raw"],))[0].float()  # the emulated engine input
    g = float(load_tensors(ours["nvfp4-w4a4"])[
        "model.layers.0.self_attn.q_proj.input_global_scale"])
    groups = x.reshape(-1, 16)
    step = groups.abs().amax(-1, keepdim=True) / 6  # the E4M3 scale / g of each group
    onto = groups / step.clamp_min(1e-30)
    assert torch.allclose(onto, e2m1_decode(e2m1_codes(onto)), atol=1e-3)
    assert not torch.equal(x, seen["raw"].float()) and g > 0


def test_cli_refusals_and_plan(fp4_artifacts, tmp_path):
    model, ours, _ = fp4_artifacts
    run = CliRunner().invoke
    cases = [
        (["--method", "awq", "--scheme", "w4a8"], "--format compressed-tensors has no FP8 input"),
        (["--method", "awq", "--scheme", "w4a4", "--format", "modelopt"], "Unknown AWQ scheme"),
        (["--method", "nvfp4", "--calib-samples", "4"], "only with --scheme w4a4"),
        (["--method", "mxfp4", "--scheme", "w4a4"], "--method mxfp4 does not use it"),
        (["--method", "nvfp4", "--scheme", "w8a8"], "Unknown NVFP4 scheme 'w8a8'"),
        (["--method", "nvfp4", "--bits", "4"], "--bits is read by --method rtn"),
        (["--method", "mxfp4", "--calib-samples", "4"], "--calib-samples is read by"),
        (["--method", "nvfp4", "--smoothquant", "0.5"], "--smoothquant is read by --method int8"),
    ]
    for i, (args, msg) in enumerate(cases):
        res = run(main, ["quantize", str(model), *args, "-o", str(tmp_path / f"o{i}")])
        assert res.exit_code == 2 and msg in res.output, (args, res.output)
        assert not (tmp_path / f"o{i}").exists()
    for method, art in (("nvfp4", ours["nvfp4-w4a16"]), ("mxfp4", ours["mxfp4"])):
        res = run(main, ["plan", str(model), "--method", method, "--json"])
        assert res.exit_code == 0, res.output
        p = json.loads(res.output)
        assert p["method"] == method and p["calib_samples"] == 0
        assert p["scheme"].startswith(f"{method.upper()} W4A16")
        size = (art / "model.safetensors").stat().st_size
        assert abs(p["disk_bytes"] - size) < 0.02 * size, (p["disk_bytes"], size)
    meta = json.loads((ours["nvfp4-w4a4"] / "quantkit.json").read_text())
    assert "--method nvfp4 --format compressed-tensors --scheme w4a4" in meta["command"]
    assert meta["calibration"]["n_samples"] == CALIB["calib_samples"]
    assert h_dtype(ours["nvfp4-w4a4"], "model.layers.0.mlp.up_proj.weight_packed") == "U8"


def h_dtype(art: Path, key: str) -> str:
    return tensor_headers(art)[key][0]


@pytest.mark.fast
def test_unpack_reads_back_what_was_packed():
    codes = torch.randint(0, 16, (8, 32), dtype=torch.uint8)
    vals = unpack_fp4_from_uint8(pack_e2m1(codes), 8, 32, dtype=torch.float32)
    ours = e2m1_decode(codes)  # code 8 is -0.0 both ways
    assert torch.equal(vals, ours) and torch.equal(vals.signbit(), ours.signbit())


# ------------------------------------------------------- ModelOpt NVFP4 for TensorRT-LLM ----

# the nvidia-modelopt 0.47 configs run once (one subprocess) for the ModelOpt FP4 tests
MODELOPT_FP4_CFGS = ("NVFP4_DEFAULT_CFG", "W4A16_NVFP4_CFG", "W4A8_MXFP4_FP8_CFG", "MXFP4_DEFAULT_CFG",
                     "W4A8_AWQ_BETA_CFG")


@pytest.fixture(scope="module")
def modelopt_fp4_refs(fp4_artifacts, tmp_path_factory) -> Path:
    """nvidia-modelopt 0.47 quantizes and exports the tiny Llama on CPU from the same windows
    (test_fp8's reference runner, a subprocess), once per config of MODELOPT_FP4_CFGS (the
    W4A8_AWQ one is int4 AWQ with FP8 inputs; it is checked here beside the FP4 layouts)."""
    import sys

    model = fp4_artifacts[0]
    ref_root = tmp_path_factory.mktemp("modelopt-fp4")
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("test_fp8.py")),
                           "--modelopt-reference", str(model), str(model.parent / "ids.pt"),
                           str(ref_root), *MODELOPT_FP4_CFGS],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((ref_root / "outcome.json").read_text()) == dict.fromkeys(MODELOPT_FP4_CFGS, "ok")
    return ref_root


def test_modelopt_nvfp4_equals_nvidia_modelopt(fp4_artifacts, modelopt_fp4_refs, tmp_path, capsys):
    """nvidia-modelopt 0.47 quantizes (NVFP4_DEFAULT_CFG) and exports the same tiny Llama on
    CPU from the same windows; quantkit's `--format modelopt` NVFP4 has its hf_quant_config,
    config, tensor names, dtypes and shapes.
    Values: ModelOpt derives scales from amax / 2688 where compressed-tensors (whose codes
    quantkit keeps) multiplies by a bf16-rounded 2688 / amax, so a few codes and scales sit one
    step apart (share printed). `verify --engine trtllm` passes both; quantkit's loader reads
    ModelOpt's and its own back to the same weights as the compressed-tensors artifact."""
    from quantkit.engines.trtllm_rules import verify

    model, ours_ct, _ = fp4_artifacts
    ref_root = modelopt_fp4_refs
    ref = ref_root / "NVFP4_DEFAULT_CFG"
    ours = tmp_path / "ours"
    quantize(QuantizeRequest(model=str(model), method="nvfp4", scheme=fp4_scheme("nvfp4", "w4a4"),
                             out=ours, format="modelopt", method_options={"scheme": "w4a4"},
                             **CALIB))
    hq_ours = json.loads((ours / "hf_quant_config.json").read_text())
    hq_ref = json.loads((ref / "hf_quant_config.json").read_text())
    assert hq_ours["producer"]["name"] == "quantkit" and hq_ref["producer"]["name"] == "modelopt"
    assert hq_ours["quantization"] == hq_ref["quantization"]
    assert hq_ref["quantization"]["quant_algo"] == "NVFP4"
    c_ours = json.loads((ours / "config.json").read_text())["quantization_config"]
    c_ref = json.loads((ref / "config.json").read_text())["quantization_config"]
    c_ours.pop("producer"), c_ref.pop("producer")
    assert c_ours == c_ref
    assert tensor_headers(ours) == tensor_headers(ref)
    a, b = load_tensors(ours), load_tensors(ref)
    same_codes = same_scales = n_codes = n_scales = 0
    for k, t in b.items():
        if t.dtype == torch.uint8:  # packed E2M1 pairs: the same nibble order as ours
            va, vb = e2m1_decode(_nibbles(a[k])), e2m1_decode(_nibbles(t))
            same_codes += int((va == vb).sum())
            n_codes += va.numel()
            ia, ib = (torch.bucketize(v.abs(), E2M1_VALUES) * v.sign() for v in (va, vb))
            assert int((ia - ib).abs().max()) <= 1, k  # within one FP4 step
        elif t.dtype == torch.float8_e4m3fn:
            ua, ub = a[k].view(torch.uint8).int(), t.view(torch.uint8).int()
            same_scales += int((ua == ub).sum())
            n_scales += ua.numel()
            assert int((ua - ub).abs().max()) <= 1, k  # within one E4M3 step
        elif k.endswith(("weight_scale_2", "input_scale")):  # bf16 rounding on both sides
            assert abs(float(a[k]) / float(t) - 1) <= 2 ** -6, (k, float(a[k]), float(t))
        else:
            assert torch.equal(a[k], t), k
    with capsys.disabled():
        print(f"\nquantkit vs nvidia-modelopt 0.47 NVFP4 (tiny Llama): codes identical "
              f"{same_codes / n_codes:.4f}, E4M3 scales identical {same_scales / n_scales:.4f}")
    assert same_codes / n_codes > 0.95 and same_scales / n_scales > 0.9
    for art in (ours, ref):
        rep = verify(art, "trtllm")
        assert rep.conformant and rep.quant_algo == "NVFP4", rep.render()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(model / f, ref / f)
    w_ct = load_artifact(ours_ct["nvfp4-w4a4"]).model.state_dict()
    lm = load_artifact(ours)
    assert sum(len(m._forward_pre_hooks) for m in lm.model.modules()) == 14  # W4A4 inputs
    for name, w in lm.model.state_dict().items():
        assert torch.allclose(w, w_ct[name], rtol=1e-6, atol=0), name
    # a broken fused group: q's weight_scale_2 differs from k/v's, which TensorRT-LLM asserts
    bad = tmp_path / "bad"
    shutil.copytree(ours, bad)
    t = load_tensors(bad)
    t["model.layers.0.self_attn.q_proj.weight_scale_2"] *= 2
    from safetensors.torch import save_file
    save_file(t, str(bad / "model.safetensors"), metadata={"format": "pt"})
    rep = verify(bad, "trtllm")
    assert not rep.conformant and "weight_scale_2 differs over the shards" in rep.render()


def _modelopt_config_pair(ours: Path, ref: Path) -> tuple[dict, dict]:
    """(hf_quant_config, inline quantization_config) of quantkit's artifact == ModelOpt's,
    producer aside."""
    hq_ours = json.loads((ours / "hf_quant_config.json").read_text())
    hq_ref = json.loads((ref / "hf_quant_config.json").read_text())
    assert hq_ours["quantization"] == hq_ref["quantization"]
    c_ours = json.loads((ours / "config.json").read_text())["quantization_config"]
    c_ref = json.loads((ref / "config.json").read_text())["quantization_config"]
    assert c_ours.pop("producer")["name"] == "quantkit" and c_ref.pop("producer")["name"] == "modelopt"
    assert c_ours == c_ref
    assert tensor_headers(ours) == tensor_headers(ref)
    return hq_ref["quantization"], c_ref


def _e2m1_positions(packed: torch.Tensor) -> torch.Tensor:
    """Signed grid position (-7 .. 7) of every packed E2M1 code; -0 and +0 are both 0."""
    v = e2m1_decode(_nibbles(packed))
    return torch.bucketize(v.abs(), E2M1_VALUES) * v.sign()


def test_modelopt_nvfp4a16_equals_nvidia_modelopt(fp4_artifacts, modelopt_fp4_refs, tmp_path,
                                                  capsys):
    """Weight-only NVFP4 for TensorRT-LLM (quant_algo W4A16_NVFP4): quantkit's `--method nvfp4
    --format modelopt` against ModelOpt's W4A16_NVFP4_CFG export: the same hf_quant_config,
    config (config_groups with weights only), tensor names, dtypes, shapes (no input_scale);
    codes and E4M3 scales one step apart at most (the amax / 2688 rounding as for NVFP4),
    identical shares printed. Both pass `verify --engine trtllm`; the loader reads quantkit's
    back to the compressed-tensors NVFP4A16 weights and leaves the inputs in bf16."""
    from quantkit.engines.trtllm_rules import verify

    model, ours_ct, _ = fp4_artifacts
    ref = modelopt_fp4_refs / "W4A16_NVFP4_CFG"
    ours = tmp_path / "ours"
    quantize(QuantizeRequest(model=str(model), method="nvfp4", scheme=fp4_scheme("nvfp4"),
                             out=ours, format="modelopt", method_options={"scheme": "w4a16"},
                             **CALIB))
    quant, inline = _modelopt_config_pair(ours, ref)
    assert quant["quant_algo"] == "W4A16_NVFP4" and quant["group_size"] == 16
    assert "input_activations" not in inline["config_groups"]["group_0"]
    a, b = load_tensors(ours), load_tensors(ref)
    assert not any(k.endswith("input_scale") for k in b)
    same = {"codes": 0, "scales": 0}
    total = {"codes": 0, "scales": 0}
    for k, t in b.items():
        if t.dtype == torch.uint8:
            pa, pb = _e2m1_positions(a[k]), _e2m1_positions(t)
            assert int((pa - pb).abs().max()) <= 1, k
            same["codes"] += int((pa == pb).sum())
            total["codes"] += pa.numel()
        elif t.dtype == torch.float8_e4m3fn:
            ua, ub = a[k].view(torch.uint8).int(), t.view(torch.uint8).int()
            assert int((ua - ub).abs().max()) <= 1, k
            same["scales"] += int((ua == ub).sum())
            total["scales"] += ua.numel()
        elif k.endswith("weight_scale_2"):
            assert abs(float(a[k]) / float(t) - 1) <= 2 ** -6, (k, float(a[k]), float(t))
        else:
            assert torch.equal(a[k], t), k
    share = {k: same[k] / total[k] for k in same}
    with capsys.disabled():
        print(f"\nquantkit vs nvidia-modelopt 0.47 W4A16_NVFP4 (tiny Llama): codes identical "
              f"{share['codes']:.4f}, E4M3 scales identical {share['scales']:.4f}")
    assert share["codes"] > 0.95 and share["scales"] > 0.9
    for art in (ours, ref):
        rep = verify(art, "trtllm")
        assert rep.conformant and rep.quant_algo == "W4A16_NVFP4", rep.render()
    lm = load_artifact(ours)
    assert sum(len(m._forward_pre_hooks) for m in lm.model.modules()) == 0  # bf16 inputs
    w_ct = read_fp4_pack_quantized(ours_ct["nvfp4-w4a16"])
    for name, w in read_modelopt_nvfp4(ours).items():
        assert torch.allclose(w, w_ct[name], rtol=1e-6, atol=0), name


def test_modelopt_mxfp4_layout_and_modelopt_scale_rule(fp4_artifacts, modelopt_fp4_refs, tmp_path,
                                                       capsys):
    """MXFP4 for TensorRT-LLM. ModelOpt 0.47 writes MXFP4_DEFAULT_CFG as quant_algo "mxfp4",
    which TensorRT-LLM's QuantAlgo rejects (verify says so), and TensorRT-LLM has no dense
    weight-only MXFP4 Linear; its dense MXFP4 Linear is W4A8_MXFP4_FP8 (FP8 per-tensor inputs
    at run time), the config ModelOpt writes for W4A8_MXFP4_FP8_CFG with the very same tensors.
    quantkit's `--method mxfp4 --format modelopt` equals that export in hf_quant_config,
    config, tensor names, dtypes and shapes. Values: ModelOpt picks the E8M0 scale
    2^ceil(log2(amax / 6)) (never clips) where quantkit keeps compressed-tensors' / OCP's
    2^(floor(log2 amax) - 2) (mantissa >= 1.75 rounds up): ModelOpt's exponent is the same or
    one higher (share printed), and where the exponents agree the codes are within one E2M1
    step (ModelOpt rounds ties down, not to even)."""
    from quantkit.engines.trtllm_rules import verify
    from quantkit.model_io import load_model

    model, ours_ct, _ = fp4_artifacts
    ref = modelopt_fp4_refs / "W4A8_MXFP4_FP8_CFG"
    ours = tmp_path / "ours"
    quantize(QuantizeRequest(
        model=str(model), method="mxfp4", scheme=fp4_scheme("mxfp4"), out=ours, format="modelopt",
        **CALIB))
    quant, inline = _modelopt_config_pair(ours, ref)
    assert quant["quant_algo"] == "W4A8_MXFP4_FP8" and quant["group_size"] == 32
    assert "config_groups" not in inline
    own = modelopt_fp4_refs / "MXFP4_DEFAULT_CFG"  # ModelOpt's MXFP4: the same tensors, bytes
    mx_tensors, w4a8_tensors = load_tensors(own), load_tensors(ref)
    assert all(torch.equal(t, w4a8_tensors[k]) for k, t in mx_tensors.items())
    assert json.loads((own / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "mxfp4"
    rep = verify(own, "trtllm")
    assert not rep.conformant and "quant_algo 'mxfp4' is not a QuantAlgo" in rep.render()
    for art in (ours, ref):
        rep = verify(art, "trtllm")
        assert rep.conformant and rep.quant_algo == "W4A8_MXFP4_FP8", rep.render()
    base = load_model(model, dtype=torch.bfloat16).state_dict()
    a = load_tensors(ours)
    higher = n_scales = code_diff = n_codes = 0
    for k, t in w4a8_tensors.items():
        if not k.endswith(".weight_scale"):
            continue
        w = base[k.replace(".weight_scale", ".weight")].float()
        amax = w.reshape(w.shape[0], -1, 32).abs().amax(-1)
        rule = torch.ceil(torch.log2(amax / 6).clamp_min(-127)) + 127  # ModelOpt's MXFP4QTensor
        assert torch.equal(t.float(), rule), k
        d = t.int() - a[k].int()
        assert set(d.unique().tolist()) <= {0, 1}, k
        higher += int(d.sum())
        n_scales += d.numel()
        packed = k.replace(".weight_scale", ".weight")
        pa, pb = _e2m1_positions(a[packed]), _e2m1_positions(w4a8_tensors[packed])
        agree = (d == 0).repeat_interleave(32, dim=1)
        assert int(((pa - pb).abs() * agree).max()) <= 1, packed
        code_diff += int(((pa != pb) & agree).sum())
        n_codes += int(agree.sum())
    with capsys.disabled():
        print(f"\nquantkit vs nvidia-modelopt 0.47 MXFP4 (tiny Llama): E8M0 exponent one higher "
              f"in ModelOpt's {higher / n_scales:.4f} of blocks; where equal, codes differ in "
              f"{code_diff / n_codes:.4f}")
    assert code_diff / n_codes < 0.02 and 0 < higher / n_scales < 0.5
    lm = load_artifact(ours)  # FP8 per-tensor inputs, as W4A8MXFP4FP8LinearMethod runs them
    assert sum(len(m._forward_pre_hooks) for m in lm.model.modules()) == 14
    w_ct = read_fp4_pack_quantized(ours_ct["mxfp4"])
    for name, w in read_modelopt_nvfp4(ours).items():
        assert torch.equal(w, w_ct[name]), name


def _w4a8_relations(art: Path) -> dict[str, float]:
    """What TensorRT-LLM's W4A8_AWQ_LinearMethod needs of a checkpoint, asserted: weight_scale_2
    = max |q * weight_scale| / 448 of its fused group, one input_scale and one weight_scale_2
    per fused group, pre_quant_scale (bf16) on o_proj / down_proj only; returns input_scales."""
    from quantkit.formats.modelopt import unpack_int4_rows

    t = load_tensors(art)
    fused = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}
    inputs = {}
    for layer in range(2):
        groups = [(f"{m}.{x}",) for m, x in (("self_attn", "o_proj"), ("mlp", "down_proj"))]
        groups += [tuple(f"{m}.{x}" for x in xs) for m, xs in fused.items()]
        for group in groups:
            names = [f"model.layers.{layer}.{x}" for x in group]
            amax = 0.0
            for n in names:
                q = unpack_int4_rows(t[n + ".weight"]).float()
                s = t[n + ".weight_scale"]
                amax = max(amax, float((q * s.repeat_interleave(q.shape[1] // s.shape[1], 1)).abs().max()))
                assert (n + ".pre_quant_scale" in t) == (len(group) == 1), n
                if len(group) == 1:
                    assert t[n + ".pre_quant_scale"].dtype == torch.bfloat16, n
                inputs[n] = float(t[n + ".input_scale"])
            for key in ("weight_scale_2", "input_scale"):
                assert len({float(t[f"{n}.{key}"]) for n in names}) == 1, (names, key)
            assert abs(float(t[names[0] + ".weight_scale_2"]) * 448 / amax - 1) < 1e-6, names
    return inputs


def test_modelopt_w4a8_awq_equals_nvidia_modelopt(fp4_artifacts, modelopt_fp4_refs, tmp_path,
                                                  capsys):
    """int4 AWQ weights with FP8 static inputs for TensorRT-LLM (quant_algo W4A8_AWQ):
    `--method awq --scheme w4a8 --format modelopt` against ModelOpt's W4A8_AWQ_BETA_CFG export
    (awq_lite) on the same tiny Llama and windows: the same hf_quant_config, config, tensor
    names, dtypes and shapes; both hold the scale relations the engine's loader assumes. The
    AWQ searches differ (quantkit's grid + clipping, ModelOpt's awq_lite), so values are
    compared as quantities: FP8 input scales within 25 % of ModelOpt's (ratio range printed),
    each Linear's effective weight error no worse than 1.5x ModelOpt's + 0.02. `verify --engine
    trtllm` passes both and catches a missing o_proj pre_quant_scale; the loader emulates the
    FP8 inputs on every Linear."""
    from quantkit.engines.trtllm_rules import verify
    from quantkit.formats.modelopt import read_modelopt_awq
    from quantkit.model_io import load_model

    model = fp4_artifacts[0]
    ref = modelopt_fp4_refs / "W4A8_AWQ_BETA_CFG"
    ours = tmp_path / "ours"
    res = CliRunner().invoke(main, ["quantize", str(model), "--method", "awq", "--scheme", "w4a8",
                                    "--format", "modelopt", "--group-size", "128",
                                    "--calib-samples", str(CALIB["calib_samples"]),
                                    "--calib-seqlen", str(CALIB["calib_seqlen"]), "-o", str(ours)])
    assert res.exit_code == 0, res.output
    hq = json.loads((ref / "hf_quant_config.json").read_text())
    assert json.loads((ours / "hf_quant_config.json").read_text()) == hq
    assert hq["quantization"]["quant_algo"] == "W4A8_AWQ" and hq["quantization"]["group_size"] == 128
    assert (json.loads((ours / "config.json").read_text())["quantization_config"]
            == json.loads((ref / "config.json").read_text())["quantization_config"])
    assert tensor_headers(ours) == tensor_headers(ref)
    in_ours, in_ref = _w4a8_relations(ours), _w4a8_relations(ref)
    ratios = [in_ours[n] / in_ref[n] for n in in_ref]
    assert 0.8 < min(ratios) and max(ratios) < 1.25, ratios
    base = load_model(model, dtype=torch.float32).state_dict()
    w_ours, w_ref = read_modelopt_awq(ours), read_modelopt_awq(ref)
    errs = []
    for layer in range(2):
        for lin, norm in (("self_attn.q_proj", "input_layernorm"), ("self_attn.o_proj", None),
                          ("mlp.up_proj", "post_attention_layernorm"), ("mlp.down_proj", None)):
            key = f"model.layers.{layer}.{lin}.weight"

            def eff(state, key=key, norm=norm, layer=layer):
                return state[key] * (state[f"model.layers.{layer}.{norm}.weight"][None, :]
                                     if norm else 1)
            w0 = eff(base)
            e_ours = float((eff(w_ours) - w0).norm() / w0.norm())
            e_ref = float((eff(w_ref) - w0).norm() / w0.norm())
            assert e_ours < 1.5 * e_ref + 0.02, (key, e_ours, e_ref)
            errs.append(e_ours / e_ref)
    with capsys.disabled():
        print(f"\nquantkit vs nvidia-modelopt 0.47 W4A8_AWQ (tiny Llama): input_scale ratio "
              f"{min(ratios):.3f} .. {max(ratios):.3f}; effective-weight error ratio "
              f"{min(errs):.3f} .. {max(errs):.3f}")
    for art in (ours, ref):
        rep = verify(art, "trtllm")
        assert rep.conformant and rep.quant_algo == "W4A8_AWQ", rep.render()
    bad = tmp_path / "bad"
    shutil.copytree(ours, bad)
    t = load_tensors(bad)
    del t["model.layers.0.self_attn.o_proj.pre_quant_scale"]
    from safetensors.torch import save_file
    save_file(t, str(bad / "model.safetensors"), metadata={"format": "pt"})
    rep = verify(bad, "trtllm")
    assert not rep.conformant and "pre_quant_scale None" in rep.render()
    lm = load_artifact(ours)
    assert sum(len(m._forward_pre_hooks) for m in lm.model.modules()) == 14
    meta = json.loads((ours / "quantkit.json").read_text())
    assert meta["scheme"]["activations"] == "fp8" and meta["method_options"]["pre_quant_scale"]
    res = CliRunner().invoke(main, ["plan", str(model), "--method", "awq", "--scheme", "w4a8",
                                    "--format", "modelopt", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["scheme"].startswith("W4A8 int4 g128 sym, FP8"), res.output


# ------------------------------------------------- --rounding gptq onto the FP4 grid ----

GPTQ_CALIB = {"calib_samples": 16, "calib_seqlen": 128}  # 2048 tokens: > down_proj's 512 inputs


def _rtn_and_gptq_block(method: str, hessian) -> tuple[dict, dict]:
    """One llama-shaped block's Linears (q/k/v fused, bf16) through FP4Quantizer with
    rounding rtn and gptq, every Hessian given by `hessian(k)`."""
    from quantkit.arch import spec_for_config
    from quantkit.methods.fp4 import FP4Quantizer
    from quantkit.types import BlockContext

    torch.manual_seed(1)
    spec = spec_for_config({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    shapes = {"self_attn.q_proj": (128, 128), "self_attn.k_proj": (64, 128),
              "self_attn.v_proj": (64, 128), "mlp.down_proj": (128, 256)}
    linears = {}
    for n, (rows, cols) in shapes.items():
        lin = torch.nn.Linear(cols, rows, bias=False)
        lin.weight.data = (torch.randn(rows, cols) * 0.05 * (1 + 4 * (n == "self_attn.k_proj"))
                           ).to(torch.bfloat16).float()
        linears[n] = lin
    out = {}
    for rounding in ("rtn", "gptq"):
        q = FP4Quantizer(method, rounding=rounding)
        q.prepare(config=None, spec=spec, shapes=shapes)
        stats = {n: {"hessian": hessian(lin.in_features), "tokens": 64}
                 for n, lin in linears.items()}
        ctx = BlockContext(index=0, block=torch.nn.Module(), linears=linears, stats=stats,
                           scheme=q.scheme, inputs=[], rerun=list, arch=spec)
        out[rounding] = q.quantize_block(ctx)
    return out["rtn"], out["gptq"]


@pytest.mark.fast
@pytest.mark.parametrize("method", ["nvfp4", "mxfp4"])
def test_gptq_with_identity_hessian_is_rtn_exactly(method):
    """H = I (and any diagonal H) has an inverse factor with nothing above its diagonal, so
    GPTQ feeds no error forward: every code, scale and global scale is RTN's, bit for bit,
    including the global scale q/k/v share. A full H moves codes but not the scales."""
    rtn, gptq = _rtn_and_gptq_block(method, lambda k: torch.eye(k))
    _, gptq_diag = _rtn_and_gptq_block(method, lambda k: torch.diag(torch.rand(k) + 0.1))
    for n, r in rtn.items():
        for other in (gptq[n], gptq_diag[n]):
            assert torch.equal(r.codes, other.codes), n
            assert torch.equal(r.scale.view(torch.uint8), other.scale.view(torch.uint8)), n
            assert r.extra.keys() == other.extra.keys()
            for k, t in r.extra.items():
                assert torch.equal(t, other.extra[k]), (n, k)
    if method == "nvfp4":  # the fused group's shared global scale (k_proj is 5x larger)
        gs = {n: float(r.extra["global_scale"]) for n, r in rtn.items() if "self_attn" in n}
        assert len(set(gs.values())) == 1, gs

    def full(k):
        x = torch.randn(4 * k, k)
        return x.T @ x

    _, gptq_full = _rtn_and_gptq_block(method, full)
    moved = sum(int((rtn[n].codes != gptq_full[n].codes).sum()) for n in rtn)
    assert moved > 0
    for n, r in rtn.items():
        assert torch.equal(r.scale.view(torch.uint8), gptq_full[n].scale.view(torch.uint8)), n


@pytest.fixture(scope="module")
def gptq_artifacts(fp4_artifacts, tmp_path_factory):
    """NVFP4 W4A16 and MXFP4 with --rounding gptq on the tiny Llama (16 x 128 windows)."""
    model, ours, _ = fp4_artifacts
    root = tmp_path_factory.mktemp("fp4-gptq")
    arts = {}
    rtn_of = {"nvfp4": "nvfp4-w4a16", "mxfp4": "mxfp4"}
    for method in rtn_of:
        arts[method] = root / method
        opts = {"rounding": "gptq", **({"scheme": "w4a16"} if method == "nvfp4" else {})}
        quantize(QuantizeRequest(model=str(model), method=method, scheme=fp4_scheme(method),
                                 out=arts[method], method_options=opts, **GPTQ_CALIB))
    return model, {m: ours[r] for m, r in rtn_of.items()}, arts


def test_gptq_lowers_every_layer_output_error(gptq_artifacts, capsys):
    """On the calibration windows, as each Linear sees them in the GPTQ-quantized model (the
    inputs its Hessian summed: true-sequential, quantized outputs propagated), the output
    error ||X W^T - X Q^T|| of GPTQ-FP4 is below RTN-FP4's for every Linear of the tiny model."""
    from quantkit.calibration import load_calibration
    from quantkit.model_io import load_model, load_tokenizer

    model, rtn_arts, gptq_arts = gptq_artifacts
    ids = load_calibration("mixed", load_tokenizer(model), n_samples=GPTQ_CALIB["calib_samples"],
                           seqlen=GPTQ_CALIB["calib_seqlen"], seed=0).input_ids
    base = load_model(model, dtype=torch.float32).state_dict()
    lines = []
    for method in ("nvfp4", "mxfp4"):
        w_gptq = read_fp4_pack_quantized(gptq_arts[method])
        w_rtn = read_fp4_pack_quantized(rtn_arts[method])
        lm = load_model(model, dtype=torch.float32)
        lm.load_state_dict({k: w_gptq.get(k, v) for k, v in base.items()})
        inputs: dict[str, list[torch.Tensor]] = {}
        for name, mod in lm.named_modules():
            if isinstance(mod, torch.nn.Linear) and ".layers." in name:
                mod.register_forward_pre_hook(
                    lambda m, a, name=name, seen=inputs: seen.setdefault(name, []).append(a[0]))
        with torch.no_grad():
            lm(ids)
        ratios = {}
        for name, xs in inputs.items():
            x = torch.cat(xs).reshape(-1, xs[0].shape[-1])
            w = base[name + ".weight"]
            err = {k: float((x @ (w - q[name + ".weight"]).T).norm())
                   for k, q in (("rtn", w_rtn), ("gptq", w_gptq))}
            ratios[name] = err["gptq"] / err["rtn"]
        assert len(ratios) == 14
        assert all(r < 1 for r in ratios.values()), ratios
        lines.append(f"{method}: GPTQ/RTN layer output error {min(ratios.values()):.2f} .. "
                     f"{max(ratios.values()):.2f} over 14 Linears")
    with capsys.disabled():
        print("\n" + "; ".join(lines))


def test_gptq_artifact_decodes_with_compressed_tensors(gptq_artifacts):
    """The GPTQ artifact is an ordinary pack-quantized file: the same tensor names, dtypes,
    shapes and quantization_config as the RTN one, the same scales (GPTQ moves codes only),
    and compressed-tensors' own decompressor gives exactly quantkit's weights (in its bf16);
    the loader reads it unchanged."""

    _, rtn_arts, gptq_arts = gptq_artifacts
    for method, preset, comp in (("nvfp4", "NVFP4A16", NVFP4PackedCompressor),
                                 ("mxfp4", "MXFP4A16", MXFP4PackedCompressor)):
        art, rtn = gptq_arts[method], rtn_arts[method]
        assert tensor_headers(art) == tensor_headers(rtn)
        cfg = json.loads((art / "config.json").read_text())["quantization_config"]
        assert cfg == json.loads((rtn / "config.json").read_text())["quantization_config"]
        raw, raw_rtn = load_tensors(art), load_tensors(rtn)
        ours = read_fp4_pack_quantized(art)
        lm = load_artifact(art).model.state_dict()
        moved = 0
        for key in raw:
            if not key.endswith(".weight_packed"):
                if key.endswith(("weight_scale", "weight_global_scale")):
                    assert torch.equal(raw[key].view(torch.uint8), raw_rtn[key].view(torch.uint8)), key
                continue
            base = key[: -len(".weight_packed")]
            sd = {k.rsplit(".", 1)[1]: t for k, t in raw.items() if k.startswith(base + ".")}
            lib = comp.decompress(sd, preset_name_to_scheme(preset, ["Linear"]))["weight"]
            mine = ours[base + ".weight"]
            assert torch.equal(lib, mine.to(lib.dtype)), key
            assert torch.equal(lm[base + ".weight"].float(), mine.to(lm[base + ".weight"].dtype).float()), key
            moved += int((raw[key] != raw_rtn[key]).sum())
        assert moved > 0, method  # GPTQ did change codes
        meta = json.loads((art / "quantkit.json").read_text())
        assert f"--method {method}" in meta["command"] and "--rounding gptq" in meta["command"]
        assert meta["calibration"]["n_samples"] == GPTQ_CALIB["calib_samples"]


def test_gptq_rounding_cli_and_plan(gptq_artifacts, tmp_path):
    model, _, _ = gptq_artifacts
    run = CliRunner().invoke
    cases = [
        (["--method", "mxfp4", "--damp", "0.1"], "--damp is read by --method mxfp4 only with --rounding gptq"),
        (["--method", "nvfp4", "--rounding", "nearest"], "'nearest' is not one of"),
        (["--method", "fp8", "--rounding", "gptq"], "--rounding is read by --method int8 / nvfp4"),
    ]
    for i, (args, msg) in enumerate(cases):
        res = run(main, ["quantize", str(model), *args, "-o", str(tmp_path / f"o{i}")])
        assert res.exit_code == 2 and msg in res.output, (args, res.output)
        assert not (tmp_path / f"o{i}").exists()
    plans = {}
    for rounding in ("rtn", "gptq"):
        res = run(main, ["plan", str(model), "--method", "mxfp4", "--rounding", rounding, "--json"])
        assert res.exit_code == 0, res.output
        plans[rounding] = json.loads(res.output)
    assert plans["gptq"]["rounding"] == "gptq" and plans["gptq"]["calib_samples"] == 128
    assert plans["rtn"]["rounding"] == "rtn" and plans["rtn"]["calib_samples"] == 0
    assert plans["gptq"]["seconds"] > plans["rtn"]["seconds"]
    assert plans["gptq"]["disk_bytes"] == plans["rtn"]["disk_bytes"]
    out = tmp_path / "cli"
    res = run(main, ["quantize", str(model), "--method", "nvfp4", "--rounding", "gptq",
                     "--damp", "0.05", "--calib-samples", "4", "--calib-seqlen", "64",
                     "-o", str(out)])
    assert res.exit_code == 0, res.output
    meta = json.loads((out / "quantkit.json").read_text())
    assert meta["method_options"] == {"rounding": "gptq", "damp": 0.05}
    assert meta["calibration"]["n_samples"] == 4
