"""Vision-language checkpoints (Qwen3-VL, Mistral 3, Gemma 4, Llama 4) through `quantkit quantize`.

Tiny random models from transformers' own config and model classes (the settings of
/work/shared/docs/families-2026.md), saved as a user's checkpoint would be, with SmolLM2's
tokenizer and a processor's files beside them. The language model is quantized (discovered
through model.get_decoder()); the vision tower and projector stay dense, byte for byte, under
the checkpoint's own names (Mistral 3 stores `language_model.model.*`, transformers 5's module
tree says `model.language_model.*`), and the ignore list names each of their Linears exactly
(vLLM maps exact names to its modules, not regexes). --quantize-vision quantizes the vision
encoder blocks' Linears, round-to-nearest for a calibrated method (the text calibration never
reaches the vision tower).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from compressed_tensors.compressors import FloatQuantizationCompressor, PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationScheme
from discovered_families import stored_fused
from tiny_models import smollm_dir
from vllm_checks import engine_check, vllm_imports_torchvision, vllm_runs

from quantkit.arch import spec_for_config
from quantkit.errors import SchemeMismatch
from quantkit.formats.common import load_tensors
from quantkit.loader import load_artifact
from quantkit.methods.fp8 import fp8_scheme
from quantkit.model_io import load_config
from quantkit.pipeline.quantize import QuantizeRequest, quantize
from quantkit.types import QuantScheme

I4 = QuantScheme(bits=4, group_size=64)
_TEXT = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=49152, tie_word_embeddings=False, intermediate_size=512, head_dim=64)
# family -> (config, model class, config kwargs, checkpoint prefix of the language model,
# the towers' checkpoint prefixes, vision encoder blocks' prefix)
FAMILIES = {
    "qwen3_vl": (
        "Qwen3VLConfig", "Qwen3VLForConditionalGeneration",
        dict(text_config=dict(**_TEXT, rope_scaling={"rope_type": "default",
                                                     "mrope_section": [8, 12, 12]}),
             vision_config=dict(depth=2, hidden_size=128, intermediate_size=256, num_heads=2,
                                out_hidden_size=256, deepstack_visual_indexes=[0])),
        "model.language_model.", ("model.visual.",), "model.visual.blocks."),
    "mistral3": (
        "Mistral3Config", "Mistral3ForConditionalGeneration",
        dict(text_config=dict(**_TEXT, model_type="ministral3"), tie_word_embeddings=False,
             vision_config=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                num_attention_heads=2, head_dim=64)),
        "language_model.model.", ("vision_tower.", "multi_modal_projector."),
        "vision_tower.transformer.layers."),
    # per-layer input embeddings run before block 0 (outside the blocks); no audio tower
    "gemma4": (
        "Gemma4Config", "Gemma4ForConditionalGeneration",
        dict(text_config=dict(**_TEXT, vocab_size_per_layer_input=49152,
                              hidden_size_per_layer_input=64, global_head_dim=64),
             vision_config=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                num_attention_heads=2, num_key_value_heads=2, head_dim=64),
             audio_config=None),
        "model.language_model.", ("model.vision_tower.", "model.embed_vision."),
        "model.vision_tower.encoder.layers."),
    # MoE text model (fused experts, written per expert); checkpoints say language_model.model.*
    "llama4": (
        "Llama4Config", "Llama4ForConditionalGeneration",
        dict(text_config=dict(**{**_TEXT, "intermediate_size": 256}, intermediate_size_mlp=512,
                              num_local_experts=4, interleave_moe_layer_step=2,
                              num_experts_per_tok=1),
             vision_config=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                num_attention_heads=2, vision_output_dim=256,
                                projector_input_dim=256, projector_output_dim=256)),
        "language_model.", ("vision_model.", "multi_modal_projector."),
        "vision_model.model.layers."),
}
# the random tiny Gemma 4 is far more sensitive to int4 than the others (its text-only floors
# in discovered_families.py: RTN 0.6, GPTQ 0.5); a dropped tensor or a wrong per-layer input
# is near 0
_FLOOR = {"gemma4": {"fp8": 0.92, "int4": 0.5}}
# a processor's files as a checkpoint ships them (content is the checkpoint's business: the
# artifact must carry them unchanged)
PROCESSOR_FILES = {
    "preprocessor_config.json": {"image_processor_type": "TinyImageProcessor", "patch_size": 16},
    "processor_config.json": {"processor_class": "TinyProcessor"},
    "video_preprocessor_config.json": {"video_processor_type": "TinyVideoProcessor"},
    "chat_template.json": {"chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"},
}
_QUANT_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_shape", ".weight_zero_point")


def _make(out: Path, family: str) -> Path:
    config_cls, model_cls, kwargs, *_ = FAMILIES[family]
    config = getattr(transformers, config_cls)(**kwargs)
    config.architectures = [model_cls]
    torch.manual_seed(5)
    model = getattr(transformers, model_cls)(config).to(torch.bfloat16)
    with torch.no_grad():  # realistic scale (the default init is tiny)
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.04)
    model.save_pretrained(out)
    for f in smollm_dir().iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    for name, content in PROCESSOR_FILES.items():
        (out / name).write_text(json.dumps(content, indent=2))
    return out


def _run(src: Path, out: Path, method: str, **extra) -> Path:
    scheme, opts = {"rtn": (I4, {}), "gptq": (I4, {}),
                    "fp8": (fp8_scheme("dynamic"), {"scheme": "dynamic"})}[method]
    quantize(QuantizeRequest(model=str(src), method=method, scheme=scheme, out=out,
                             format="compressed-tensors", method_options=opts, calib="mixed",
                             calib_samples=4, calib_seqlen=64, **extra))
    return out




def _tower_linears(src: Path) -> set[str]:
    """Checkpoint names of every nn.Linear of the towers (from the model on the meta device)."""
    from quantkit.model_io import meta_model

    config = load_config(src)
    spec = spec_for_config(config)
    return {spec.checkpoint_name(n + ".")[:-1] for n, m in meta_model(config).named_modules()
            if isinstance(m, torch.nn.Linear) and n.startswith(tuple(t + "." for t in spec.towers))}


def _decompressed(art: Path, raw: dict[str, torch.Tensor], linear: str) -> torch.Tensor:
    """One quantized Linear's weight, decompressed by the compressed-tensors library."""
    cfg = json.loads((art / "config.json").read_text())["quantization_config"]
    scheme = QuantizationScheme.model_validate(cfg["config_groups"]["group_0"])
    local = {k[len(linear) + 1:]: v for k, v in raw.items() if k.startswith(linear + ".")}
    compressor = PackedQuantizationCompressor if cfg["format"] == "pack-quantized" \
        else FloatQuantizationCompressor
    return compressor.decompress(local, scheme)["weight"].float()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vlm")
    return {f: _make(root / f, f) for f in FAMILIES}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_vlm_quantizes_the_language_model_and_keeps_the_vision_tower(family, models, tmp_path):
    """rtn, gptq and fp8: every source tensor is in the artifact; the quantized Linears are the
    language model's, each decompressed by the compressed-tensors library near its source;
    every vision / projector tensor is byte-identical under its own name, and every tower
    Linear is in the ignore list by its exact name; config (model_type, architectures,
    vision_config) and processor files as the source has them; quantkit's loader builds the
    multimodal model from the artifact and predicts near the source model."""
    src = models[family]
    _, _, _, text_prefix, towers, _ = FAMILIES[family]
    source = load_tensors(src)
    # Llama 4 stores its routed experts fused (3-D), written per expert (as vLLM reads them)
    fused = stored_fused(spec_for_config(load_config(src)), src)
    tower_linears = _tower_linears(src)
    assert tower_linears  # the tiny model has a vision tower with Linears
    ids = torch.randint(10, 40000, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = load_artifact(src).model(input_ids=ids).logits.float()
    src_config = json.loads((src / "config.json").read_text())
    for method in ("rtn", "gptq", "fp8"):
        art = _run(src, tmp_path / method, method)
        raw = load_tensors(art)
        quantized = {n[: -len(".weight_scale")] for n in raw if n.endswith(".weight_scale")}
        missing = [n for n in source if n not in raw and n.rsplit(".", 1)[0] not in quantized
                   and not (n in fused and set(fused[n]) <= quantized)]
        assert not missing, (method, missing[:5])
        assert quantized and all(n.startswith(text_prefix) for n in quantized), method
        for name, t in source.items():
            if name.startswith(towers):
                assert raw[name].dtype == t.dtype and torch.equal(raw[name], t), (method, name)
        # (experts split from a fused source tensor are checked through the logits below)
        for linear in (q for q in quantized if f"{q}.weight" in source):
            w = source[f"{linear}.weight"].float()
            err = float((_decompressed(art, raw, linear) - w).norm() / w.norm())
            assert err < (0.05 if method == "fp8" else 0.2), (method, linear, err)
        config = json.loads((art / "config.json").read_text())
        ignore = config.pop("quantization_config")["ignore"]
        assert tower_linears <= set(ignore), (method, sorted(tower_linears - set(ignore))[:3])
        assert config == src_config
        for name in PROCESSOR_FILES:
            assert (art / name).read_bytes() == (src / name).read_bytes(), name
        meta = json.loads((art / "quantkit.json").read_text())
        assert meta["towers"]["vision_quantized"] == 0
        with torch.no_grad():
            got = load_artifact(art).model(input_ids=ids).logits.float()
        cos = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0).item()
        # int4 g64 on a random tiny model: 0.8-0.95; a wrong tensor name or layout is far below
        floor = {"fp8": 0.97, "int4": 0.75, **_FLOOR.get(family, {})}
        assert cos > floor["fp8" if method == "fp8" else "int4"], (method, cos)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_quantize_vision_quantizes_the_vision_encoder_blocks(family, models, tmp_path):
    """--quantize-vision with GPTQ: the vision encoder blocks' Linears are quantized too (RTN:
    the calibration text never reaches them; quantkit.json says so), near their source; the
    projector / mergers stay dense, byte-identical and in the ignore list."""
    src = models[family]
    _, _, _, text_prefix, towers, vision_blocks = FAMILIES[family]
    source = load_tensors(src)
    art = _run(src, tmp_path / "gptq", "gptq", quantize_vision=True)
    raw = load_tensors(art)
    quantized = {n[: -len(".weight_scale")] for n in raw if n.endswith(".weight_scale")}
    vision = {n for n in quantized if n.startswith(vision_blocks)}
    linears = _tower_linears(src)
    expected = {n for n in linears if n.startswith(vision_blocks)}
    assert vision == expected and vision
    assert quantized - vision and all(n.startswith(text_prefix) for n in quantized - vision)
    for linear in vision:
        w = source[f"{linear}.weight"].float()
        assert float((_decompressed(art, raw, linear) - w).norm() / w.norm()) < 0.2, linear
    ignore = json.loads((art / "config.json").read_text())["quantization_config"]["ignore"]
    kept = linears - vision
    assert kept and kept <= set(ignore) and not vision & set(ignore)
    for name, t in source.items():
        if name.startswith(towers) and name.rsplit(".", 1)[0] not in vision:
            assert torch.equal(raw[name], t), name
    meta = json.loads((art / "quantkit.json").read_text())
    assert meta["towers"] == {**meta["towers"], "vision_quantized": len(vision),
                              "vision_method": "rtn"}
    assert "--quantize-vision" in meta["command"]


def test_quantize_vision_refusals(models, tmp_path):
    """Before any work: a calibrated non-integer scheme has no RTN form for the vision Linears;
    a checkpoint without a vision tower has nothing to quantize there."""
    from tiny_models import make_tiny_model

    with pytest.raises(SchemeMismatch, match="vision Linears get no calibration"):
        quantize(QuantizeRequest(model=str(models["qwen3_vl"]), method="fp8",
                                 scheme=fp8_scheme("static"), method_options={"scheme": "static"},
                                 out=tmp_path / "a", calib_samples=2, calib_seqlen=32,
                                 quantize_vision=True))
    llama = make_tiny_model(tmp_path / "llama", "llama")
    with pytest.raises(SchemeMismatch, match="has no vision encoder blocks"):
        quantize(QuantizeRequest(model=str(llama), method="rtn", scheme=I4, out=tmp_path / "b",
                                 quantize_vision=True))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.engine
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_vlm_artifact_in_vllm(family, models, tmp_path):
    """The RTN artifact in real vLLM as the multimodal model: it generates where vLLM's model
    file imports here; without torchvision in vLLM's environment, vLLM refuses the
    architecture when it inspects it, and the test asserts that refusal."""
    from quantkit.engines.vllm import run_vllm
    from quantkit.errors import EngineError

    art = _run(models[family], tmp_path / "rtn", "rtn")
    prompt = [{"prompt": "The capital of France is", "max_tokens": 4}]
    if vllm_imports_torchvision() and vllm_runs("int4"):
        assert len(run_vllm(art, generate=prompt, max_model_len=128)["generate"][0]) > 0
        return
    engine_check(f"vllm {family}", real=False, reason="No module named 'torchvision'")
    with pytest.raises(EngineError) as e:
        run_vllm(art, generate=prompt, max_model_len=128)
    text = str(e.value) + e.value.log
    arch = FAMILIES[family][1]
    assert f"Model architectures ['{arch}'] failed to be inspected" in text
    assert "No module named 'torchvision'" in text
