"""GGUF with multi-token-prediction (MTP) layers, as llama.cpp's converter writes them.

GLM-4.5 (`Glm4MoeForCausalLM`, llama.cpp's glm4moe): the tiny checkpoint of tests/test_mtp.py
(two trunk blocks, dense then MoE, and one MTP block `model.layers.2.*` with eh_proj / enorm /
hnorm / embed_tokens / shared_head, written into its shards as GLM's checkpoints store it),
with SmolLM2's tokenizer given the special tokens the converter's GLM vocabulary path reads by
their text ([gMASK], <|user|>, <|observation|>; <|endoftext|> SmolLM2 has): GLM's tokenizers
have them, and the converter fails without. quantkit's BF16 GGUF equals convert_hf_to_gguf.py's
file tensor for tensor and key for key (the MTP block as blk.2 with its nextn.* tensors,
block_count 3, glm4moe.nextn_predict_layers 1), its Q4_K_M equals llama_model_quantize of that
file (the nextn block's matrices quantized as llama-quantize does), and llama.cpp loads it and
generates.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from gguf_reference import (
    assert_generates,
    assert_same_as_llama_quantize,
    assert_same_gguf,
    convert_with_llama_cpp,
)
from test_mtp import _make
from tiny_models import smollm_dir

from quantkit.pipeline.quantize import QuantizeRequest, quantize
from quantkit.types import QuantScheme

pytest.importorskip("llama_cpp")

# GLM's special tokens in place of three of SmolLM2's (ids 3-5: <repo_name>, <reponame>,
# <file_sep>); the vocabulary keeps its size
GLM_SPECIALS = {3: "[gMASK]", 4: "<|user|>", 5: "<|observation|>"}


def with_glm_specials(d: Path) -> Path:
    """SmolLM2's tokenizer.json with GLM's special tokens (added tokens and vocabulary)."""
    tj = json.loads((d / "tokenizer.json").read_text())
    by_id = {i: t for t, i in tj["model"]["vocab"].items()}
    for i, text in GLM_SPECIALS.items():
        del tj["model"]["vocab"][by_id[i]]
        tj["model"]["vocab"][text] = i
        for added in tj["added_tokens"]:
            if added["id"] == i:
                added["content"] = text
    (d / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False))
    return d


@pytest.fixture(scope="module")
def glm(tmp_path_factory) -> tuple[Path, Path]:
    """(GLM-4.5 tiny with its MTP block, the same without the MTP tensors), GLM's tokens;
    q/k/v biases as GLM-4.5's checkpoints have them (attention_bias)."""
    src, plain = _make(tmp_path_factory.mktemp("gguf-mtp"), "glm4_moe", attention_bias=True)
    return with_glm_specials(src), with_glm_specials(plain)


def _gguf(src: Path, out: Path, gguf_type: str) -> Path:
    quantize(QuantizeRequest(model=str(src), method="gguf", out=out, format="gguf",
                             scheme=QuantScheme(kind="kquant", gguf_type=gguf_type),
                             method_options={"gguf_type": gguf_type}, resume=False))
    return out


@pytest.mark.engine
def test_glm4_moe_gguf_with_mtp_equals_converter_and_quantize(glm, tmp_path):
    """BF16 = convert_hf_to_gguf.py's file (the nextn block included), Q4_K_M =
    llama_model_quantize of it, byte for byte, and llama.cpp generates from quantkit's Q4_K_M."""
    src, _ = glm
    ref = convert_with_llama_cpp(src, tmp_path / "ref.bf16.gguf")
    kv, tensors = assert_same_gguf(_gguf(src, tmp_path / "ours.bf16.gguf", "bf16"), ref)
    assert kv["glm4moe.block_count"] == 3 and kv["glm4moe.nextn_predict_layers"] == 1
    assert kv["glm4moe.leading_dense_block_count"] == 1 and kv["glm4moe.rope.dimension_count"] == 32
    # the converter's GLM vocabulary: eot / eom from GLM's tokens; bos and unk stay as
    # tokenizer_config.json sets them (SpecialVocab sets a kind once)
    assert kv["tokenizer.ggml.eot_token_id"] == 4 and kv["tokenizer.ggml.eom_token_id"] == 5
    assert {"blk.2.nextn.eh_proj.weight", "blk.2.nextn.embed_tokens.weight",
            "blk.2.nextn.enorm.weight", "blk.2.nextn.hnorm.weight",
            "blk.2.nextn.shared_head_head.weight", "blk.2.nextn.shared_head_norm.weight",
            "blk.2.attn_q.weight", "blk.2.ffn_gate_exps.weight", "blk.2.exp_probs_b.bias",
            "blk.2.ffn_up_shexp.weight", "blk.2.attn_q.bias", "blk.0.attn_v.bias"} <= set(tensors)
    assert tensors["blk.2.ffn_down_exps.weight"][:2] == ("BF16", [256, 256, 4])
    q4 = _gguf(src, tmp_path / "ours.q4_k_m.gguf", "q4_k_m")
    got = assert_same_as_llama_quantize(q4, ref, tmp_path, "q4_k_m")
    assert got["blk.2.nextn.eh_proj.weight"][0] == "Q4_K"  # the nextn block is quantized too
    assert_generates(q4)


@pytest.mark.engine
def test_glm4_moe_gguf_without_mtp_tensors_equals_converter(glm, tmp_path):
    """A GLM-4.5 checkpoint whose config counts an MTP block its shards lack (transformers'
    save_pretrained drops it): the converter still counts it (block_count 3, nextn 1) and
    writes the trunk; llama.cpp's glm4moe loader then loads the trunk alone. quantkit's file
    is the same, and llama.cpp generates from it."""
    _, plain = glm
    ref = convert_with_llama_cpp(plain, tmp_path / "ref.bf16.gguf")
    ours = _gguf(plain, tmp_path / "ours.bf16.gguf", "bf16")
    kv, tensors = assert_same_gguf(ours, ref)
    assert kv["glm4moe.block_count"] == 3 and not any(t.startswith("blk.2.") for t in tensors)
    assert_generates(ours)


def test_glm4_moe_gguf_refusals(glm, tmp_path):
    """Refused before any work, nothing written: a tokenizer without GLM's special tokens
    (the converter's GLM vocabulary path fails on it), MTP tensors with a config that counts
    no nextn block, --quantize-mtp (GGUF always quantizes the nextn block as the trunk), and a
    calibrated run (transformers gives the MTP block no forward to calibrate it with)."""
    from quantkit.errors import SchemeMismatch, UnsupportedArchitecture

    src, _ = glm
    smol = shutil.copytree(src, tmp_path / "smol")
    shutil.copy(smollm_dir() / "tokenizer.json", smol / "tokenizer.json")
    with pytest.raises(UnsupportedArchitecture, match=r"no \[gMASK\], <\|user\|>, <\|observation\|>"):
        _gguf(smol, tmp_path / "a.gguf", "bf16")
    zero = shutil.copytree(src, tmp_path / "zero")
    config = json.loads((zero / "config.json").read_text())
    (zero / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(UnsupportedArchitecture, match="num_nextn_predict_layers says 0 nextn blocks"):
        _gguf(zero, tmp_path / "b.gguf", "bf16")
    with pytest.raises(SchemeMismatch, match="always quantizes the MTP layers"):
        quantize(QuantizeRequest(model=str(src), method="gguf", out=tmp_path / "c.gguf",
                                 format="gguf", scheme=QuantScheme(kind="kquant", gguf_type="q8_0"),
                                 method_options={"gguf_type": "q8_0"}, quantize_mtp=True))
    with pytest.raises(SchemeMismatch, match="nothing to calibrate them with"):
        quantize(QuantizeRequest(model=str(src), method="gguf", out=tmp_path / "d.gguf",
                                 format="gguf", scheme=QuantScheme(kind="kquant", gguf_type="q4_k_m"),
                                 method_options={"gguf_type": "q4_k_m", "rounding": "gptq"},
                                 calib="mixed", calib_samples=2, calib_seqlen=32))
    assert not list(tmp_path.glob("*.gguf"))


def test_deepseek_v3_mtp_is_refused_as_the_converter_drops_it(tmp_path):
    """DeepSeek-V3 with its MTP block (`model.layers.{N}.*`): llama.cpp's converter leaves it
    out (DeepseekV2Model's skip_mtp) and llama.cpp's deepseek2 reads none, so quantkit refuses
    GGUF and says why, instead of dropping it silently; nothing is written."""
    import transformers
    from safetensors.torch import save_file
    from tiny_models import MOE_DEFAULTS

    from quantkit.errors import UnsupportedArchitecture

    # config.json and the MTP shard: the refusal comes before any trunk weight is read
    src = tmp_path / "dsv3"
    config = transformers.DeepseekV3Config(hidden_size=256, intermediate_size=512,
                                           num_hidden_layers=2, num_attention_heads=4,
                                           vocab_size=49152, **MOE_DEFAULTS["deepseek_v3"])
    config.architectures = ["DeepseekV3ForCausalLM"]
    config.save_pretrained(src)
    save_file({"model.layers.2.eh_proj.weight": torch.zeros(256, 512, dtype=torch.bfloat16)},
              src / "mtp.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedArchitecture, match="converter drops DeepSeek-V3's MTP") as e:
        _gguf(src, tmp_path / "out.gguf", "bf16")
    assert "model.layers.2.eh_proj.weight" in e.value.message
    assert "compressed-tensors" in e.value.hint and not (tmp_path / "out.gguf").exists()


def test_deepseek_v32_gguf_is_refused_and_why(discovered, tmp_path):
    """DeepSeek-V3.2 (`DeepseekV32ForCausalLM`): llama.cpp's converter has it (DeepseekV32Model,
    architecture deepseek32: MLA, the DSA indexer, the MTP block as nextn), its gguf-py has the
    architecture, and on this tiny checkpoint it stops in its vocabulary step (it asserts a
    tokenizer that adds BOS, as DeepSeek's do; SmolLM2's does not). The gguf package quantkit
    runs with has no deepseek32, so no tensor name can come from its TensorNameMap: quantkit
    refuses GGUF before any work, naming the architecture and why, and writes nothing."""
    from gguf import MODEL_ARCH_NAMES
    from gguf_reference import reference_converter, run_converter

    from quantkit.errors import UnsupportedArchitecture

    src = discovered.model("deepseek_v32")
    assert "deepseek32" not in MODEL_ARCH_NAMES.values()
    assert '"deepseek32"' in (reference_converter() / "gguf-py" / "gguf" / "constants.py").read_text()
    proc = run_converter(src, tmp_path / "ref.gguf")
    assert proc.returncode != 0 and "Change value of add_bos_token to true" in proc.stderr
    with pytest.raises(UnsupportedArchitecture, match="writes it as its deepseek32 architecture, "
                       "which the gguf package quantkit runs with does not have"):
        _gguf(src, tmp_path / "out.gguf", "bf16")
    assert not (tmp_path / "out.gguf").exists()
