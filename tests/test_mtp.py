"""Multi-token-prediction (MTP) layers survive quantization (quantkit.pipeline.mtp).

transformers drops MTP tensors when it loads a model, and does not save them, so the tiny
checkpoints get them written into their shards here, shaped and named as the real ones:
GLM-4.5 (`Glm4MoeForCausalLM`, num_nextn_predict_layers=1): one extra MoE decoder block
`model.layers.{num_hidden_layers}.*` with eh_proj / enorm / hnorm / shared_head / embed_tokens
(the names vLLM 0.32's glm4_moe_mtp.py reads); Qwen3.5 (`Qwen3_5ForCausalLM`,
mtp_num_hidden_layers=1): `mtp.fc`, `mtp.layers.0.*` (a gated full-attention block), `mtp.norm`,
`mtp.pre_fc_norm_*` (qwen3_5_mtp.py). Then: every MTP tensor is in the rtn / gptq / fp8
compressed-tensors artifacts byte for byte and its Linears in the ignore list; with
--quantize-mtp the MTP Linears are packed and decompress near their source; vLLM's own MTP
model class loads them.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from discovered_families import quantize_to, tensor_names
from safetensors import safe_open
from safetensors.torch import save_file
from tiny_models import MOE_DEFAULTS, smollm_dir

from quantkit.errors import SchemeMismatch
from quantkit.pipeline.quantize import QuantizeRequest, quantize
from quantkit.types import QuantScheme

_COMMON = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=49152, tie_word_embeddings=False)
# (config class, model class, settings, the trunk block the MTP block copies the shapes of)
FAMILIES = {
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(intermediate_size=512, n_routed_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=256, first_k_dense_replace=1, num_hidden_layers=2,
                      num_nextn_predict_layers=1, n_group=1, topk_group=1, head_dim=64), 1),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
                dict(intermediate_size=512, head_dim=64, num_hidden_layers=4,
                     mtp_num_hidden_layers=1), 3),
    # DeepSeek-V3's MTP block is stored as GLM's (model.layers.{N}.eh_proj / enorm / hnorm /
    # shared_head / embed_tokens beside a MoE block's tensors)
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(intermediate_size=512, num_hidden_layers=2, num_nextn_predict_layers=1,
                         num_key_value_heads=4,  # MLA: as many KV heads as query heads
                         **MOE_DEFAULTS["deepseek_v3"]), 1),
}
# what the real checkpoints' config.json carry beyond transformers' config class (DeepSeek-V3:
# vLLM routes by scoring_func / topk_method, which DeepseekV3Config does not keep)
_CHECKPOINT_KEYS = {"deepseek_v3": {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}}
# families whose MTP block is one more `model.layers.{N}` (not a separate `mtp.*` tree)
_LAYER_STYLE = ("glm4_moe", "deepseek_v3")
I4 = QuantScheme(bits=4, group_size=64)


def _mtp_tensors(family: str, trunk: dict[str, torch.Tensor], n_layer: int, like: int,
                 hidden: int, vocab: int) -> dict[str, torch.Tensor]:
    """MTP tensors as the real checkpoints store them (random values, bf16)."""
    g = torch.Generator().manual_seed(7)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    def norm():
        return (1 + torch.randn(hidden, generator=g) * 0.05).to(torch.bfloat16)

    src = f"model.layers.{like}."
    if family in _LAYER_STYLE:
        dst = f"model.layers.{n_layer}."
        extra = {"eh_proj.weight": rand(hidden, 2 * hidden), "enorm.weight": norm(),
                 "hnorm.weight": norm(), "shared_head.norm.weight": norm(),
                 "shared_head.head.weight": rand(vocab, hidden),
                 "embed_tokens.weight": rand(vocab, hidden)}
        out = {dst + k: v for k, v in extra.items()}
    else:
        dst = "mtp.layers.0."
        out = {"mtp.fc.weight": rand(hidden, 2 * hidden), "mtp.norm.weight": norm(),
               "mtp.pre_fc_norm_embedding.weight": norm(), "mtp.pre_fc_norm_hidden.weight": norm()}
    for name, t in trunk.items():
        if name.startswith(src):
            out[dst + name[len(src):]] = (norm() if t.dim() == 1 and t.numel() == hidden
                                          and "norm" in name else
                                          (torch.randn(t.shape, generator=g) * 0.05).to(t.dtype))
    return out


def _make(root: Path, family: str, **settings) -> tuple[Path, Path]:
    """(the checkpoint with MTP tensors, the same checkpoint without them); `settings` change
    the family's config."""
    config_cls, model_cls, kwargs, like = FAMILIES[family]
    kwargs = {**kwargs, **settings}
    config = getattr(transformers, config_cls)(**{**_COMMON, **kwargs})
    torch.manual_seed(3)
    model = getattr(transformers, model_cls)(config).to(torch.bfloat16)
    plain = root / f"{family}_plain"
    model.save_pretrained(plain)
    for f in smollm_dir().iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, plain / f.name)
    src = root / family
    shutil.copytree(plain, src)
    cfg = json.loads((src / "config.json").read_text())
    for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers"):
        if key in kwargs:
            cfg[key] = kwargs[key]
    cfg.update(_CHECKPOINT_KEYS.get(family, {}))
    (src / "config.json").write_text(json.dumps(cfg, indent=2))
    with safe_open(src / "model.safetensors", "pt") as f:
        trunk = {k: f.get_tensor(k) for k in f.keys()}
    mtp = _mtp_tensors(family, trunk, kwargs["num_hidden_layers"], like, 256, 49152)
    save_file(mtp, src / "model-mtp.safetensors", metadata={"format": "pt"})
    weight_map = {**{k: "model.safetensors" for k in trunk},
                  **{k: "model-mtp.safetensors" for k in mtp}}
    (src / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weight_map}, indent=1))
    return src, plain


@pytest.fixture(scope="module")
def mtp_models(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("mtp")
    return {f: _make(root, f) for f in FAMILIES}


def _mtp_names(src: Path) -> dict[str, torch.Tensor]:
    with safe_open(src / "model-mtp.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _artifact_tensors(out: Path, names) -> dict[str, torch.Tensor]:
    got = {}
    for f in out.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            for k in st.keys():
                if k in names:
                    got[k] = st.get_tensor(k)
    return got


def _ignored(name: str, ignore: list[str]) -> bool:
    return any(name == i or (i.startswith("re:") and re.match(i[3:], name)) for i in ignore)


def _linear_modules(mtp: dict[str, torch.Tensor]) -> list[str]:
    """The MTP Linears vLLM builds (2-D weights but the embedding)."""
    return [n[: -len(".weight")] for n, t in mtp.items()
            if n.endswith(".weight") and t.dim() == 2 and "embed_tokens" not in n]


@pytest.mark.parametrize("method", ["rtn", "gptq", "fp8"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_mtp_tensors_kept_dense_and_ignored(family, method, mtp_models, tmp_path):
    """Every MTP tensor is in the artifact byte for byte (same dtype, same values), every MTP
    Linear is named in the ignore list (so vLLM builds it unquantized), quantkit.json records
    them, and the trunk is quantized as without MTP tensors."""
    src, _ = mtp_models[family]
    mtp = _mtp_names(src)
    out = quantize_to(src, tmp_path / method, method)
    got = _artifact_tensors(out, mtp)
    assert sorted(got) == sorted(mtp)
    for name, t in mtp.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    for module in _linear_modules(mtp):
        assert _ignored(module, ignore), (module, ignore[-5:])
    meta = json.loads((out / "quantkit.json").read_text())
    assert meta["mtp"]["tensors"] == len(mtp) and meta["mtp"]["quantized"] == []
    assert any(n.endswith(".weight_packed") or n.endswith(".weight_scale")
               for n in tensor_names(out))


@pytest.mark.parametrize("method,fmt", [("rtn", "gptq"), ("fp8", "fp8"), ("fp8", "modelopt")])
def test_mtp_tensors_kept_in_other_formats(method, fmt, mtp_models, tmp_path):
    """GPTQ v1, vLLM-native FP8 and ModelOpt artifacts keep every MTP tensor byte for byte
    too (Qwen3.5: dense trunk, which every one of these formats stores); FP8 and ModelOpt name
    the MTP Linears among their unquantized modules."""
    from quantkit.methods.fp8 import fp8_scheme

    src, _ = mtp_models["qwen3_5"]
    mtp = _mtp_names(src)
    preset = "block" if fmt == "fp8" else "dynamic"  # vLLM's native fp8 has no channel scales
    scheme, opts = (I4, {}) if method == "rtn" else (fp8_scheme(preset), {"scheme": preset})
    out = tmp_path / fmt
    quantize(QuantizeRequest(model=str(src), method=method, scheme=scheme, out=out, format=fmt,
                             method_options=opts))
    got = _artifact_tensors(out, mtp)
    assert sorted(got) == sorted(mtp)
    for name, t in mtp.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    if fmt != "gptq":
        text = json.dumps(json.loads((out / "config.json").read_text()).get("quantization_config")
                          or json.loads((out / "hf_quant_config.json").read_text()))
        assert '"mtp.fc"' in text and '"mtp.layers.0.self_attn.q_proj"' in text


@pytest.mark.parametrize("method", ["rtn", "gptq"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_quantize_mtp_packs_the_mtp_linears(family, method, mtp_models, tmp_path):
    """--quantize-mtp: the MTP block's attention, MLP and expert Linears carry weight_packed /
    weight_scale (the trunk's layout: per-expert Linears) and the compressed-tensors library's
    unpacking gives their source weights back within int4 rounding; eh_proj / fc /
    shared_head stay dense and ignored; GPTQ's MTP Linears are RTN, as quantkit.json says."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    src, _ = mtp_models[family]
    mtp = _mtp_names(src)
    out = tmp_path / method
    quantize(QuantizeRequest(model=str(src), method=method, scheme=I4, out=out,
                             format="compressed-tensors", calib_samples=4, calib_seqlen=64,
                             quantize_mtp=True))
    meta = json.loads((out / "quantkit.json").read_text())
    assert meta["mtp"]["method"] == "rtn"
    quantized = set(meta["mtp"]["quantized"])
    expected = {m for m in _linear_modules(mtp)
                if not re.search(r"(eh_proj|\.fc|shared_head\.head|mlp\.gate)$", m)}
    assert quantized == expected, sorted(quantized ^ expected)[:5]
    if family in _LAYER_STYLE:
        assert "model.layers.2.mlp.experts.3.down_proj" in quantized
    keys = [m + s for m in quantized for s in (".weight_packed", ".weight_scale", ".weight_shape")]
    got = _artifact_tensors(out, set(keys) | set(mtp))
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    for m in quantized:
        assert m + ".weight" not in got and not _ignored(m, ignore), m
        shape = torch.Size(got[m + ".weight_shape"].tolist())
        q = unpack_from_int32(got[m + ".weight_packed"], 4, shape).float()
        scale = got[m + ".weight_scale"].float()
        w = q * scale.repeat_interleave(64, dim=1)
        ref = mtp[m + ".weight"].float()
        rel = ((w - ref).norm() / ref.norm()).item()
        assert rel < 0.15, (m, rel)
    for m in set(_linear_modules(mtp)) - quantized:
        assert torch.equal(got[m + ".weight"], mtp[m + ".weight"]) and _ignored(m, ignore), m


def test_quantize_mtp_refusals(mtp_models, tmp_path):
    """--quantize-mtp is refused before any work where there are no MTP tensors, into GGUF
    (which quantizes MTP layers as nextn blocks always),
    and for a calibrated scheme without a round-to-nearest form."""
    from quantkit.methods.fp8 import fp8_scheme

    src, plain = mtp_models["qwen3_5"]
    with pytest.raises(SchemeMismatch, match="no multi-token-prediction"):
        quantize(QuantizeRequest(model=str(plain), method="rtn", scheme=I4, out=tmp_path / "a",
                                 quantize_mtp=True))
    with pytest.raises(SchemeMismatch, match="format gguf always quantizes the MTP"):
        quantize(QuantizeRequest(model=str(src), method="gguf",
                                 scheme=QuantScheme(kind="kquant", gguf_type="q8_0"),
                                 method_options={"gguf_type": "q8_0"}, format="gguf", out=tmp_path / "b.gguf", quantize_mtp=True))
    with pytest.raises(SchemeMismatch, match="no forward for the MTP layers"):
        quantize(QuantizeRequest(model=str(src), method="fp8", scheme=fp8_scheme("static"),
                                 method_options={"scheme": "static"}, out=tmp_path / "c",
                                 quantize_mtp=True))
    assert not any(tmp_path.iterdir())


def _vllm_mtp(artifact: Path, tmp_path: Path) -> tuple[dict, str]:
    """vLLM's MTP drafter of `artifact`, built and loaded by vLLM's own loader
    (tests/vllm_mtp_worker.py, in vLLM's virtualenv): its answer and its log."""
    from quantkit.engines.vllm import run_vllm_worker

    resp = tmp_path / "mtp.json"
    proc = run_vllm_worker(Path(__file__).with_name("vllm_mtp_worker.py"),
                           [str(artifact.resolve()), str(resp)], cwd=tmp_path, timeout=900)
    assert resp.is_file(), proc.log[-3000:]
    return json.loads(resp.read_text()), proc.log


@pytest.mark.engine
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_vllm_mtp_loader_reads_them(family, mtp_models, tmp_path):
    """vLLM 0.32's MTP model (Glm4MoeMTP / DeepSeekMTP / Qwen3_5MTP, chosen by its speculative config
    "mtp") loads the int4 artifact's MTP layers: its loader is given every MTP tensor, its
    load_weights fills every parameter of the drafter with the stored values, and the dense
    MTP Linears (ignore list) are built without a quantization method. vLLM's qwen3_5.py
    imports torchvision (through its Qwen3-VL parts), which vLLM's environment here lacks
    (scripts/setup.sh removes it): there the test asserts vLLM's refusal."""
    from vllm_checks import engine_check, vllm_imports_torchvision

    src, _ = mtp_models[family]
    mtp = _mtp_names(src)
    out = quantize_to(src, tmp_path / "rtn", "rtn")
    got, log = _vllm_mtp(out, tmp_path)
    if family == "qwen3_5" and not vllm_imports_torchvision():
        engine_check(f"vllm mtp {family}", real=False, reason="No module named 'torchvision'")
        assert "Model architectures ['Qwen3_5ForCausalLM'] failed to be inspected" in got["error"]
        assert "No module named 'torchvision'" in log
        return
    engine_check(f"vllm mtp {family}", real=True)
    assert "error" not in got, got.get("trace", "")[-3000:]
    assert got["architecture"] == {"glm4_moe": "Glm4MoeMTPModel", "deepseek_v3": "DeepSeekMTPModel",
                                   "qwen3_5": "Qwen3_5MTP"}[family]
    assert set(mtp) <= set(got["given"])
    assert got["loaded"] is not None and set(got["params"]) <= set(got["loaded"]), \
        sorted(set(got["params"]) - set(got["loaded"]))[:5]
    # no packed parameter anywhere in the drafter: every Linear is the dense one stored
    assert not [p for p in got["params"] if p.endswith(("weight_packed", "weight_scale"))]
    # and the values are the stored ones (the MTP input projection and its norms)
    fc, norm = (("model.layers.2.eh_proj.weight", "model.layers.2.enorm.weight")
                if family in _LAYER_STYLE else ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight"))
    for name in (fc, norm):
        param = name.replace("mtp.", "model.", 1)
        assert got["sums"][param] == pytest.approx(mtp[name].float().sum().item(), rel=1e-3,
                                                   abs=1e-2), name
