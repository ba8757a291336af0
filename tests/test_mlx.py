"""--format mlx and MLX as an engine: mlx-lm (its own venv, scripts/setup_mlx.sh) loads what
quantkit writes, generates, and its mx.dequantize gives the weights quantkit computed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from quantkit.formats.mlx import pack_mlx, read_mlx, switch_name, unpack_mlx
from quantkit.pipeline.quantize import QuantizeRequest, quantize
from quantkit.types import QuantScheme

SCHEME = QuantScheme(bits=4, group_size=64)
PROMPT = "The capital of France is"


# ---- bytes: no engine ----------------------------------------------------------------------

@pytest.mark.fast
@pytest.mark.parametrize("bits", [2, 3, 4, 6, 8])
def test_pack_mlx_is_a_little_endian_bit_stream(bits):
    """Value k sits in bits [k*b, (k+1)*b) of the row's little-endian stream of uint32 words
    (what mx.quantize writes; test_mlx_dequantize_* checks it against MLX itself)."""
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (3, 64), generator=g)
    words = pack_mlx(codes, bits)
    assert words.dtype == torch.uint32 and words.shape == (3, 64 * bits // 32)
    assert torch.equal(unpack_mlx(words, bits), codes)
    stream = int.from_bytes(words[1].numpy().tobytes(), "little")
    assert [(stream >> (k * bits)) & ((1 << bits) - 1) for k in range(64)] == codes[1].tolist()


@pytest.mark.fast
def test_switch_names_follow_mlx_lm_sanitize():
    assert switch_name("model.layers.1.mlp.experts.3.gate_proj") == \
        ("model.layers.1.mlp.switch_mlp.gate_proj", 3)
    assert switch_name("model.layers.0.block_sparse_moe.experts.7.w2") == \
        ("model.layers.0.block_sparse_moe.switch_mlp.down_proj", 7)
    assert switch_name("model.layers.0.mlp.gate_proj") is None


@pytest.mark.fast
def test_mixed_bits_write_per_layer_overrides(tmp_path):
    """A Linear whose bits / group differ from the first one's is named in `quantization` by
    its module path, as mlx-lm's load reads it; the reader takes each layer's own values."""
    from quantkit.formats.mlx import MLXWriter
    from quantkit.methods.intquant import rtn_quantize_weight

    g = torch.Generator().manual_seed(0)
    w = {n: torch.randn(32, 128, generator=g) for n in ("a.q_proj", "a.o_proj")}
    schemes = {"a.q_proj": SCHEME, "a.o_proj": QuantScheme(bits=8, group_size=32)}
    results = {n: rtn_quantize_weight(n, w[n], schemes[n]) for n in w}
    MLXWriter().write(tmp_path, config={"model_type": "llama"}, dense={}, results=results,
                      ignore=[], dtype=torch.bfloat16)
    q = json.loads((tmp_path / "config.json").read_text())["quantization"]
    assert q == {"group_size": 64, "bits": 4, "a.o_proj": {"group_size": 32, "bits": 8}}
    dense = read_mlx(tmp_path, torch.float32)
    for n, r in results.items():  # within MLX's bf16 roundings of the exact levels
        err = (dense[f"{n}.weight"] - r.dequantize()).abs().max()
        assert err <= r.scale.max() * (1 << r.scheme.bits) * 2 ** -7, n


def _zero_points(path: Path) -> torch.Tensor:
    """z = -biases / scales of every stored Linear (quantkit writes biases = -scales * z)."""
    t = _source_weights(path)
    return torch.cat([(-t[k].float() / t[k.replace(".biases", ".scales")].float()).flatten()
                      for k in sorted(t) if k.endswith(".biases")])


@pytest.mark.fast
def test_mlx_format_defaults_to_the_asymmetric_grid(tiny_llama, tmp_path):
    """`--format mlx` without --sym / --asym quantizes on the asymmetric grid (the format's
    default, FormatRecord.symmetric) with fitted float zero points (FormatRecord.float_zero):
    the same bytes as --asym, zero points that differ between groups and are not integers,
    quantkit.json records asym and float_zero; --sym gives z = 8 in every group. Other
    formats keep the symmetric default: compressed-tensors without the flag is --sym's bytes."""
    from cli_runner import run_cli

    def run(name, *args):
        out = tmp_path / name
        proc = run_cli(["quantize", tiny_llama, "--method", "rtn", "--bits", "4",
                        "--group-size", "64", *args, "-o", out])
        assert proc.returncode == 0, proc.stderr[-3000:]
        return out

    def tensors(path):
        return {k: v.view(torch.uint8) if v.dtype != torch.uint32 else v
                for k, v in _source_weights(path).items()}

    mlx_default, mlx_asym, mlx_sym = (run(n, "--format", "mlx", *f) for n, f in
                                      (("mlx", ()), ("mlx-asym", ("--asym",)),
                                       ("mlx-sym", ("--sym",))))
    meta = json.loads((mlx_default / "quantkit.json").read_text())
    assert meta["scheme"]["symmetric"] is False and meta["scheme"]["float_zero"] is True
    a, b = tensors(mlx_default), tensors(mlx_asym)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    z = _zero_points(mlx_default)
    assert (z - z.round()).abs().median() > 0.1  # fitted, not rounded (bf16 is far finer)
    assert len(z.round().unique()) > 1  # zero points differ between groups
    assert torch.equal(_zero_points(mlx_sym), torch.full_like(z, 8.0))
    sym = json.loads((mlx_sym / "quantkit.json").read_text())["scheme"]
    assert sym["symmetric"] is True and "float_zero" not in sym  # stored only where set
    ct_default, ct_sym = run("ct", "--format", "compressed-tensors"), \
        run("ct-sym", "--format", "compressed-tensors", "--sym")
    assert json.loads((ct_default / "quantkit.json").read_text())["scheme"]["symmetric"] is True
    a, b = tensors(ct_default), tensors(ct_sym)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.fast
def test_api_symmetric_auto_takes_the_formats_grid(tiny_llama, tmp_path):
    """QuantizeRequest(symmetric_auto=True) resolves the grid through the format record, as
    the CLI does without --sym / --asym; without it the scheme is used as given. The same for
    GPTQ's act-order (act_order_auto, the CLI without --act-order / --no-act-order)."""
    from quantkit.pipeline.quantize import resolve_symmetric

    req = QuantizeRequest(model=str(tiny_llama), method="rtn", scheme=SCHEME, out=tmp_path,
                          format="mlx", symmetric_auto=True)
    assert resolve_symmetric(req).scheme.symmetric is False
    assert resolve_symmetric(req).symmetric_auto is False
    for fmt in ("compressed-tensors", "gptq", "awq"):
        other = QuantizeRequest(model=str(tiny_llama), method="rtn", scheme=SCHEME,
                                out=tmp_path, format=fmt, symmetric_auto=True)
        assert resolve_symmetric(other).scheme.symmetric is True, fmt
    given = QuantizeRequest(model=str(tiny_llama), method="rtn", scheme=SCHEME, out=tmp_path,
                            format="mlx")
    assert resolve_symmetric(given).scheme.symmetric is True
    assert resolve_symmetric(given).scheme.float_zero is False  # a symmetric grid keeps z
    # GPTQ without --act-order / --no-act-order (act_order_auto): on for mlx, off elsewhere;
    # the recorded command spells out --no-act-order either way it was chosen
    for fmt, act in (("mlx", True), ("compressed-tensors", False)):
        auto = QuantizeRequest(model=str(tiny_llama), method="gptq", scheme=SCHEME,
                               out=tmp_path, format=fmt, act_order_auto=True)
        assert resolve_symmetric(auto).scheme.act_order is act, fmt
    off = resolve_symmetric(QuantizeRequest(model=str(tiny_llama), method="gptq",
                                            scheme=SCHEME, out=tmp_path, format="mlx"))
    assert off.scheme.act_order is False and "--no-act-order" in off.cli_equivalent()
    # NVFP4 drops its tensor scale for mlx only (MLX's QuantizedLinear holds none); the
    # record leaves the field out where it keeps the default (other formats' bytes unchanged)
    from quantkit.methods.fp4 import fp4_scheme

    for fmt, kept in (("mlx", False), ("compressed-tensors", True), ("modelopt", True)):
        nv = resolve_symmetric(QuantizeRequest(model=str(tiny_llama), method="nvfp4",
                                               scheme=fp4_scheme("nvfp4"), out=tmp_path,
                                               format=fmt))
        assert nv.scheme.tensor_scale is kept, fmt
        assert ("tensor_scale" in nv.scheme.record()) is not kept, fmt


# ---- real mlx-lm ---------------------------------------------------------------------------

@pytest.fixture(scope="session")
def mlx_artifacts(tmp_path_factory) -> dict[str, Path]:
    """SmolLM2 4-bit g64 as MLX checkpoints, by method, on the format's default grid
    (asymmetric: symmetric_auto, as the CLI without --sym / --asym); GPTQ with static-group
    act-order (groups stay k // 64, which MLX stores)."""
    root = tmp_path_factory.mktemp("session-smollm2-mlx")
    out = {}
    for method in ("rtn", "gptq", "awq"):
        out[method] = root / method
        scheme = QuantScheme(bits=4, group_size=64, act_order=method == "gptq")
        meta = quantize(QuantizeRequest(model="smollm2-135m", method=method, scheme=scheme,
                                        out=out[method], format="mlx", calib_samples=8,
                                        calib_seqlen=256, symmetric_auto=True))
        assert meta["scheme"]["symmetric"] is False
    return out


def _source_weights(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_smollm2_mlx_loads_in_mlx_lm_and_answers_paris(mlx_artifacts, method):
    """mlx_lm.load builds every Linear as a QuantizedLinear from the stored codes and
    mlx_lm.generate (greedy, MLX's quantized matmul: slow on the CPU, so 3 tokens) continues
    the prompt with Paris."""
    from quantkit.engines.mlx import run_mlx

    path = mlx_artifacts[method]
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 64, "bits": 4}
    assert (path / "tokenizer.json").is_file()
    res = run_mlx(path, generate=[{"prompt": PROMPT, "max_tokens": 3}])
    assert res["quantized_layers"] == 30 * 7  # SmolLM2: 30 blocks x 7 Linears, all packed
    assert "Paris" in res["generate"][0], res["generate"]


@pytest.mark.engine
@pytest.mark.slow
def test_verify_passes_smollm2_gptq_mlx(mlx_artifacts):
    """A good SmolLM2 MLX artifact verifies in mlx-lm under the bound measured on SmolLM2
    (benchmarks/verify_tolerances.py "smollm2 rtn int4 g64 mlx": MLX's bf16 forward against
    quantkit's float32 decode; the tiny models' bound alone was 40x too tight for it)."""
    from quantkit.verify import EXIT_VERIFIED, verify

    result = verify(mlx_artifacts["gptq"], engine="mlx")
    assert result.exit_code == EXIT_VERIFIED, result.to_dict()
    parity = result.checks["parity"].measured
    assert parity["tolerance_key"] == "int4:bfloat16" and parity["positions"] > 100, parity


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_mlx_dequantize_equals_quantkits_reading(mlx_artifacts, method):
    """mx.dequantize of every stored Linear equals, bit for bit in bf16, quantkit's reader of
    the artifact (read_mlx: scales * q rounded to bf16, then + biases rounded again, the
    arithmetic MLX's CPU kernel does)."""
    from quantkit.engines.mlx import mlx_dequantize

    path = mlx_artifacts[method]
    mlx_w = mlx_dequantize(path)
    ours = read_mlx(path, torch.bfloat16)
    assert len(mlx_w) == 30 * 7
    for name, w in mlx_w.items():
        assert torch.equal(w, ours[name].float()), name


@pytest.mark.engine
@pytest.mark.slow
def test_mlx_dequantize_vs_quantkits_own_dequantized_weights(mlx_artifacts, smollm_path):
    """Against what quantkit itself computes for RTN (QuantResult.dequantize in bf16): the
    stored codes are quantkit's codes exactly, and mx.dequantize's weights differ only where
    MLX rounds: the scale to bf16 (MLX keeps no float32 scale), and scale * q to bf16 before
    the bias is added. The artifact is on the format's default grid (asymmetric, z a float
    fitted per group, written as biases = -s * z rounded once), so per weight, with L =
    max(|z|, |15 - z|) * s >= 7.5s the group's largest level and bf16's rounding at most 2^-8
    relative: the scale's rounding times q (<= 15 * 2^-8 s), the bias's (2^-8 |s z| <= 2^-8 L),
    that of s_bf16 * q (< 16 * 2^-8 s), of the sum and of quantkit's own result (2^-8 L each):
    (31 / 7.5 + 3) * 2^-8 L = 0.028 L at most, asserted below 2^-5 (measured 0.023 on SmolLM2
    RTN g64, 75 % of the weights one bf16 step or more apart; with integer z, biases =
    -s_bf16 * z: 0.0128 and 61 %; printed)."""
    from quantkit.engines.mlx import mlx_dequantize
    from quantkit.methods.intquant import rtn_quantize_weight

    path = mlx_artifacts["rtn"]
    mlx_w = mlx_dequantize(path)
    stored = _source_weights(path)
    source = _source_weights(smollm_path)
    asym = QuantScheme(bits=4, group_size=64, symmetric=False, float_zero=True)
    worst, differing, total = 0.0, 0, 0
    for name, w in mlx_w.items():
        r = rtn_quantize_weight(name[: -len(".weight")], source[name], asym)
        assert torch.equal(unpack_mlx(stored[name], 4), r.codes.long()), name
        ref = r.dequantize(torch.bfloat16).float()
        largest = torch.maximum(r.zero, 15 - r.zero).float() * r.scale  # the largest |level|
        level = largest.repeat_interleave(64, dim=1)
        rel = ((w - ref).abs() / level).max().item()
        worst = max(worst, rel)
        differing += int((w != ref).sum())
        total += w.numel()
    print(f"max |mx.dequantize - QuantResult.dequantize| / group max level = {worst:.3g}; "
          f"{differing / total:.2%} of weights differ")
    assert 0 < worst <= 2 ** -5


@pytest.mark.engine
@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_tiny_asym_mlx_dequantize_equals_quantkits_reading(tiny_llama, tmp_path, method):
    """The asymmetric grid (the format's default) on a tiny Llama, RTN and GPTQ with
    static-group act-order: mx.dequantize of every stored Linear equals quantkit's reader bit
    for bit, and the stored zero points differ between groups."""
    from quantkit.engines.mlx import mlx_dequantize

    out = tmp_path / method
    meta = quantize(QuantizeRequest(model=str(tiny_llama), method=method, out=out,
                                    scheme=QuantScheme(bits=4, group_size=64,
                                                       act_order=method == "gptq"),
                                    format="mlx", symmetric_auto=True, calib_samples=4,
                                    calib_seqlen=128))
    assert meta["scheme"]["symmetric"] is False and meta["scheme"]["act_order"] == (method == "gptq")
    assert len(_zero_points(out).round().unique()) > 1
    ours = read_mlx(out, torch.bfloat16)
    mlx_w = mlx_dequantize(out)
    assert mlx_w
    for name, w in mlx_w.items():
        assert torch.equal(w, ours[name].float()), name
    # bf16 scales and bf16 biases per group of 64: 4 + 32 / 64 bits per weight, as stored
    from quantkit.info import artifact_info

    info = artifact_info(out)
    assert info["bits_per_weight_quantized"] == info["nominal_bits_per_weight"] == 4.5


@pytest.mark.engine
@pytest.mark.slow
def test_eval_backend_mlx_scores_in_mlx(mlx_artifacts, tmp_path):
    """`quantkit eval --backend mlx`: artifact and base both run in mlx-lm's decoder; the
    record names MLX and its KLD is close to the torch loader's (MLX computes in bf16, the
    torch loader in float32: not equal)."""
    from cli_runner import run_cli

    res = {}
    for backend in ("mlx", None):
        out = tmp_path / f"{backend}.json"
        args = ["eval", str(mlx_artifacts["gptq"]), "--base", "smollm2-135m", "--ctx", "128",
                "--max-windows", "2", "--batch-size", "2", "--json", str(out)]
        proc = run_cli(args + (["--backend", backend] if backend else []))
        assert proc.returncode == 0, proc.stderr[-3000:]
        res[backend] = json.loads(out.read_text())
    assert res["mlx"]["engine"]["name"] == "mlx"
    assert res["mlx"]["engine"]["dtype"] == "bfloat16"
    k_mlx, k_torch = (res[b]["metrics"]["kld"]["mean"] for b in ("mlx", None))
    assert math.isfinite(k_mlx) and k_mlx > 0
    assert 0.5 < k_mlx / k_torch < 2.0, (k_mlx, k_torch)


@pytest.mark.engine
@pytest.mark.slow
def test_tiny_qwen3_moe_mlx_stacks_experts_and_generates(moe_model, tmp_path):
    """A tiny Qwen3-MoE: experts stacked as SwitchGLU (switch_mlp.{gate,up,down}_proj
    [E, out, packed in]), routers dense; mlx-lm builds them as QuantizedSwitchLinear, generates,
    and mx.dequantize of the stacked experts equals quantkit's per-expert reading."""
    from quantkit.engines.mlx import mlx_dequantize, run_mlx

    out = tmp_path / "moe-mlx"
    quantize(QuantizeRequest(model=str(moe_model), method="rtn", scheme=SCHEME, out=out,
                             format="mlx"))
    cfg = json.loads((moe_model / "config.json").read_text())
    stored = _source_weights(out)
    e, inter, hidden = cfg["num_local_experts"], cfg["moe_intermediate_size"], cfg["hidden_size"]
    w = stored["model.layers.0.mlp.switch_mlp.gate_proj.weight"]
    assert w.dtype == torch.uint32 and tuple(w.shape) == (e, inter, hidden * 4 // 32)
    assert tuple(stored["model.layers.0.mlp.switch_mlp.down_proj.scales"].shape) == \
        (e, hidden, inter // 64)
    assert stored["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16  # router dense
    assert not any(".experts." in k for k in stored)
    res = run_mlx(out, generate=[{"prompt": PROMPT, "max_tokens": 4}])
    # per block: q, k, v, o + the three stacked projections
    assert res["quantized_layers"] == cfg["num_hidden_layers"] * 7
    assert isinstance(res["generate"][0], str) and res["generate"][0]
    ours = read_mlx(out, torch.bfloat16)
    for name, t in mlx_dequantize(out).items():
        if ".switch_mlp." in name:
            block, _, proj = name.partition(".switch_mlp.")
            for i in range(e):
                assert torch.equal(t[i], ours[f"{block}.experts.{i}.{proj}"].float()), name
        else:
            assert torch.equal(t, ours[name].float()), name


@pytest.mark.engine
def test_tiny_qwen3_5_hybrid_mlx_loads_strict_and_generates(discovered, tmp_path):
    """A hybrid family: the tiny Qwen3.5 of tests/discovered_families.py (three Gated DeltaNet
    blocks, then gated full attention) as RTN 4-bit g64 MLX. mlx-lm 0.32's qwen3_5.py loads it
    strictly (every stored tensor a parameter, every parameter stored): conv1d, A_log, dt_bias
    and the norms stay dense in the checkpoint's own layout, which its sanitize() converts
    (conv1d [C, 1, K] moved to [C, K, 1], the (1 + w) RMSNorm weights shifted); every Linear
    of both kinds of block packed; it generates; mx.dequantize equals quantkit's reading."""
    from quantkit.engines.mlx import mlx_dequantize, run_mlx

    src = discovered.model("qwen3_5")
    out = tmp_path / "qwen3_5-mlx"
    quantize(QuantizeRequest(model=str(src), method="rtn", scheme=SCHEME, out=out,
                             format="mlx", symmetric_auto=True))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5"  # mlx-lm's module; the text config's own is qwen3_5_text
    stored = _source_weights(out)
    dense = [k for k in stored if "conv1d" in k or k.endswith(("A_log", "dt_bias"))]
    assert dense and all(stored[k].dtype != torch.uint32 for k in dense)
    assert stored["model.layers.0.linear_attn.conv1d.weight"].dim() == 3
    packed = {k[: -len(".scales")] for k in stored if k.endswith(".scales")}
    assert "model.layers.0.linear_attn.in_proj_qkv" in packed
    assert "model.layers.3.self_attn.q_proj" in packed
    res = run_mlx(out, generate=[{"prompt": PROMPT, "max_tokens": 4}])
    assert res["quantized_layers"] == len(packed)
    assert isinstance(res["generate"][0], str) and res["generate"][0]
    ours = read_mlx(out, torch.bfloat16)
    mlx_w = mlx_dequantize(out)
    assert set(mlx_w) == {f"{p}.weight" for p in packed}
    for name, w in mlx_w.items():
        assert torch.equal(w, ours[name].float()), name


@pytest.mark.engine
@pytest.mark.parametrize("mode", ["mxfp4", "nvfp4"])
def test_tiny_fp4_mlx_modes_load_and_dequantize_exactly(tiny_llama, tmp_path, mode):
    """`--method mxfp4|nvfp4 --format mlx`: MLX 0.32's "mxfp4" / "nvfp4" modes (E2M1 codes
    packed as 4-bit values, uint8 scales: E8M0 exponents per 32 / E4M3 bytes per 16, no
    biases; config `quantization` names the mode). NVFP4 goes without its tensor scale, which
    MLX's QuantizedLinear does not hold: its E4M3 scales are the groups' own steps. mlx-lm
    loads it strictly and generates; mx.dequantize(mode=...) equals quantkit's reading bit for
    bit, and that equals the method's own weights (e2m1.quantize_mxfp4 / quantize_nvfp4 with
    the tensor scale 1 on the source weights, exact in bf16); verify --engine mlx passes."""
    from quantkit.e2m1 import dequantize_fp4, quantize_mxfp4, quantize_nvfp4
    from quantkit.engines.mlx import mlx_dequantize, run_mlx
    from quantkit.methods.fp4 import fp4_scheme
    from quantkit.verify import EXIT_VERIFIED, verify

    out = tmp_path / f"{mode}-mlx"
    meta = quantize(QuantizeRequest(model=str(tiny_llama), method=mode, scheme=fp4_scheme(mode),
                                    out=out, format="mlx"))
    group = {"mxfp4": 32, "nvfp4": 16}[mode]
    assert (meta["scheme"].get("tensor_scale", True) is False) == (mode == "nvfp4")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": group, "bits": 4, "mode": mode}
    stored = _source_weights(out)
    assert not any(k.endswith((".biases", "global_scale")) for k in stored)
    assert all(stored[k].dtype == torch.uint8 for k in stored if k.endswith(".scales"))
    res = run_mlx(out, generate=[{"prompt": PROMPT, "max_tokens": 3}])
    packed = [k for k in stored if k.endswith(".scales")]
    assert res["quantized_layers"] == len(packed) > 0
    assert isinstance(res["generate"][0], str) and res["generate"][0]
    ours = read_mlx(out, torch.bfloat16)
    source = _source_weights(Path(tiny_llama))
    mlx_w = mlx_dequantize(out)
    assert len(mlx_w) == len(packed)
    for name, w in mlx_w.items():
        assert torch.equal(w, ours[name].float()), name
        if mode == "mxfp4":
            want = dequantize_fp4(*quantize_mxfp4(source[name]))
        else:
            codes, scale, one = quantize_nvfp4(source[name], torch.ones(1), source[name].dtype)
            want = dequantize_fp4(codes, scale, one)
        assert torch.equal(w, want.to(torch.bfloat16).float()), name
    result = verify(out, engine="mlx", base=str(tiny_llama))
    assert result.exit_code == EXIT_VERIFIED, result.to_dict()
    # `quantkit info` counts the packed codes as the weights they stand for
    from quantkit.info import artifact_info

    info = artifact_info(out)
    assert info["bits_per_weight_quantized"] == info["nominal_bits_per_weight"] == 4 + 8 / group
    assert info["parameters"] == sum(t.numel() for t in source.values())
