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
from quantkit.formats.fp4 import pack_e2m1
from quantkit.info import artifact_info
from quantkit.loader import load_artifact
from quantkit.methods.fp4 import fp4_scheme
from quantkit.model_io import cache_dir
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
        (["--method", "nvfp4", "--calib-samples", "4"], "only with --scheme w4a4"),
        (["--method", "mxfp4", "--scheme", "w4a4"], "--method mxfp4 does not use it"),
        (["--method", "nvfp4", "--scheme", "w8a8"], "Unknown NVFP4 scheme 'w8a8'"),
        (["--method", "nvfp4", "--bits", "4"], "--bits is read by --method rtn"),
        (["--method", "mxfp4", "--calib-samples", "4"], "--calib-samples is read by"),
        (["--method", "nvfp4", "--smoothquant", "0.5"], "--smoothquant is read by --method int8"),
        (["--method", "mxfp4", "--format", "modelopt"], "ModelOpt FP4 is written here as NVFP4 W4A4"),
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


def test_unpack_reads_back_what_was_packed():
    codes = torch.randint(0, 16, (8, 32), dtype=torch.uint8)
    vals = unpack_fp4_from_uint8(pack_e2m1(codes), 8, 32, dtype=torch.float32)
    ours = e2m1_decode(codes)  # code 8 is -0.0 both ways
    assert torch.equal(vals, ours) and torch.equal(vals.signbit(), ours.signbit())


# ------------------------------------------------------- ModelOpt NVFP4 for TensorRT-LLM ----

def test_modelopt_nvfp4_equals_nvidia_modelopt(fp4_artifacts, tmp_path, capsys):
    """nvidia-modelopt 0.47 quantizes (NVFP4_DEFAULT_CFG) and exports the same tiny Llama on
    CPU from the same windows (test_fp8's reference runner, a subprocess); quantkit's
    `--format modelopt` NVFP4 has its hf_quant_config, config, tensor names, dtypes and shapes.
    Values: ModelOpt derives scales from amax / 2688 where compressed-tensors (whose codes
    quantkit keeps) multiplies by a bf16-rounded 2688 / amax, so a few codes and scales sit one
    step apart (share printed). `verify --engine trtllm` passes both; quantkit's loader reads
    ModelOpt's and its own back to the same weights as the compressed-tensors artifact."""
    import sys

    from quantkit.verify import verify

    model, ours_ct, _ = fp4_artifacts
    ref_root = tmp_path / "ref"
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("test_fp8.py")),
                           "--modelopt-reference", str(model), str(model.parent / "ids.pt"),
                           str(ref_root), "NVFP4_DEFAULT_CFG"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((ref_root / "outcome.json").read_text()) == {"NVFP4_DEFAULT_CFG": "ok"}
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
