"""HF -> GGUF conversion checked by real llama.cpp: it loads our files, computes the same logits as
transformers, tokenizes like the HF tokenizer, and answers like the model should."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from quantkit.builtin_models import builtin_gguf_path
from quantkit.errors import QuantkitError
from quantkit.formats.gguf import read_gguf
from quantkit.pipeline.quantize import QuantizeRequest, quantize
from quantkit.types import QuantScheme

pytest.importorskip("llama_cpp")
from quantkit.engines.llamacpp import LlamaCppModel, llama_quantize  # noqa: E402

TEXT = ("The quick brown fox jumps over the lazy dog. In 2024, 3.14159 people wrote:\n"
        "    def f(x):  return x**2  # squares!\n"
        "Ünïcödé, 日本語, emojis 🦙🚀 and  double  spaces; e-mail: a.b@c.org ... ?!")


def _gguf(model: str | Path, out: Path, gguf_type: str, **options) -> dict:
    return quantize(QuantizeRequest(model=str(model), method="gguf", format="gguf", out=out,
                                    scheme=QuantScheme(kind="kquant", gguf_type=gguf_type),
                                    method_options={"gguf_type": gguf_type, **options}))


# ---------------------------------------------------------------- the real model, end to end

@pytest.fixture(scope="module")
def smollm_q4km(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("smol") / "smollm2-135m.q4_k_m.gguf"
    _gguf("smollm2-135m", out, "q4_k_m")
    return out


@pytest.fixture(scope="module")
def smollm_llama(smollm_q4km):
    m = LlamaCppModel(smollm_q4km, n_ctx=256)
    yield m
    m.close()


def test_smollm2_q4_k_m_generates_in_llama_cpp(smollm_llama):
    assert "Paris" in smollm_llama.greedy("The capital of France is", max_tokens=8)


def test_smollm2_tokenization_equals_hf(smollm_llama, smollm_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm_path)
    for text in (TEXT, " leading space", "trailing\n\n", "<|im_start|>user\nhi<|im_end|>"):
        assert smollm_llama.tokenize(text, special=True) == tok.encode(text, add_special_tokens=False), text


@pytest.mark.engine
def test_smollm2_q4_k_m_verifies_in_llama_cpp(smollm_q4km):
    """`quantkit verify --engine llamacpp` on the real model's Q4_K_M (Q5_0 / Q8_0 fallbacks for
    its 576-wide rows): coverage, fidelity per GGML type and parity in llama.cpp pass under
    the bounds measured on it (benchmarks/verify_tolerances.py "smollm2 gguf q4_k_m")."""
    from quantkit.verify import EXIT_VERIFIED, verify

    result = verify(smollm_q4km, engine="llamacpp")
    assert result.exit_code == EXIT_VERIFIED, result.to_dict()
    worst = result.checks["fidelity"].measured["worst_rel_rmse"]
    assert {"q4_k", "q6_k", "q5_0"} <= set(worst), worst
    assert result.checks["parity"].measured["positions"] > 100


def test_smollm2_metadata_matches_original_gguf(smollm_q4km):
    ours, tensors = read_gguf(smollm_q4km)
    orig, _ = read_gguf(builtin_gguf_path("smollm2-135m"))
    same = [k for k in orig if k.startswith(("tokenizer.", "llama."))]
    assert len(same) > 20
    for key in same:
        a, b = ours[key], orig[key]
        assert a == b or (isinstance(b, float) and abs(a - b) <= 1e-6 * abs(b)), key
    assert ours["general.file_type"] == 15 and ours["general.quantization_version"] == 2
    assert "output.weight" not in tensors  # tied embeddings
    kinds = {t.qtype.name for t in tensors.values()}
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0", "F32"} == kinds  # width 576: llama.cpp's fallbacks
    assert any("Q4_K -> Q5_0" in note for note in ours["quantkit.fallbacks"])
    meta = json.loads(ours["quantkit.metadata"])
    assert meta["method"] == "gguf" and meta["scheme"]["gguf_type"] == "q4_k_m"


def test_eval_scores_gguf_in_llama_cpp_like_hf(tmp_path):
    """`quantkit eval x.gguf`: llama.cpp's logits, the harness's convention; the same weights
    (a bf16 GGUF export) give the same perplexity as quantkit's torch loader, within 1 %."""
    import jsonschema

    from quantkit.eval.harness import evaluate
    from quantkit.eval.logits import PPLConvention

    bf16 = tmp_path / "smollm2.bf16.gguf"
    _gguf("smollm2-135m", bf16, "bf16")
    rec, = evaluate([str(bf16)], "smollm2-135m", conv=PPLConvention(ctx=256, max_windows=4))
    jsonschema.validate(rec, json.loads((Path(__file__).parents[1] / "quantkit" / "eval" /
                                         "schema.json").read_text()))
    assert rec["engine"]["name"] == "llama.cpp" and rec["metrics"]["base_engine"] == "quantkit-torch"
    ppl_cpp, ppl_hf = rec["metrics"]["ppl"]["value"], rec["metrics"]["base_ppl"]["value"]
    assert abs(ppl_cpp / ppl_hf - 1) < 0.01, (ppl_cpp, ppl_hf)
    assert rec["metrics"]["top1_agreement"]["value"] > 0.97
    assert rec["artifact"]["format"] == "gguf" and rec["artifact"]["method"] == "gguf"


def test_q4_k_m_imatrix_from_calibration_lowers_kld(tmp_path, smollm_q4km):
    """An imatrix collected through the shared pipeline (--calib) beats none, in llama.cpp."""
    from quantkit.eval.harness import evaluate
    from quantkit.eval.logits import PPLConvention

    with_im = tmp_path / "smollm2.q4_k_m.imatrix.gguf"
    quantize(QuantizeRequest(model="smollm2-135m", method="gguf", format="gguf", out=with_im,
                             scheme=QuantScheme(kind="kquant", gguf_type="q4_k_m"),
                             calib="mixed", calib_samples=16, calib_seqlen=256,
                             method_options={"gguf_type": "q4_k_m", "imatrix": "calib"}))
    plain, imat = evaluate([str(smollm_q4km), str(with_im)], "smollm2-135m",
                           conv=PPLConvention(ctx=256, max_windows=8))
    k_plain, k_im = plain["metrics"]["kld"]["mean"], imat["metrics"]["kld"]["mean"]
    print(f"Q4_K_M KLD without imatrix {k_plain:.4f}, with {k_im:.4f}; PPL "
          f"{plain['metrics']['ppl']['value']:.3f} vs {imat['metrics']['ppl']['value']:.3f}")
    assert k_im <= k_plain
    assert imat["metrics"]["ppl"]["value"] <= plain["metrics"]["ppl"]["value"] * 1.005
    assert imat["artifact"]["calibration"] == "mixed"


# ---------------------------------------------------------------- converter: same logits as HF

def _perturb(model_dir: Path, seed: int = 0) -> None:
    """Non-trivial norms and biases, so a wrong mapping of either shows in the logits."""
    from safetensors.torch import load_file, save_file

    f = model_dir / "model.safetensors"
    sd = load_file(f)
    g = torch.Generator().manual_seed(seed)
    for k, v in sd.items():
        if v.ndim == 1:
            sd[k] = (v.float() + 0.2 * torch.randn(v.shape, generator=g)).to(v.dtype)
    save_file(sd, f, metadata={"format": "pt"})


@pytest.mark.parametrize("arch,dtype,gguf_type,rope", [
    ("llama", torch.bfloat16, "bf16", "llama3"),
    ("mistral", torch.bfloat16, "bf16", None),
    ("qwen2", torch.float16, "f16", None),
    ("qwen3", torch.bfloat16, "bf16", None),
])
def test_float_export_logits_equal_hf(tmp_path, arch, dtype, gguf_type, rope):
    from tiny_models import make_tiny_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"qwen2": {"tie": False}}.get(arch, {"tie": True})
    d = make_tiny_model(tmp_path / arch, arch, dtype=dtype, seed=3, **kw)
    cfg = json.loads((d / "config.json").read_text())
    if arch == "qwen2":
        cfg["attention_bias"] = True  # Qwen2 always has q/k/v biases; make them random
    if rope == "llama3":
        cfg["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 64}
    (d / "config.json").write_text(json.dumps(cfg))
    _perturb(d)
    out = tmp_path / f"{arch}.{gguf_type}.gguf"
    _gguf(d, out, gguf_type)
    kv, tensors = read_gguf(out)
    assert ("output.weight" in tensors) == (arch == "qwen2")
    assert ("rope_freqs.weight" in tensors) == (rope == "llama3")
    tok = AutoTokenizer.from_pretrained(d)
    ids = tok.encode(TEXT, add_special_tokens=False)[:40]
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    llm = LlamaCppModel(out, n_ctx=64, logits_all=True)
    try:
        got = llm.logits(ids)
        assert llm.tokenize(TEXT)[:40] == ids
    finally:
        llm.close()
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < 0.03, f"{arch}: max logit error {err:.4f} of the logit range"
    assert (got.argmax(1) == ref.argmax(1)).mean() > 0.9
    # llama.cpp's own quantizer accepts our 16-bit export as its input
    llama_quantize(out, tmp_path / "q8.gguf", "q8_0")
    assert read_gguf(tmp_path / "q8.gguf")[1]["blk.0.attn_q.weight"].qtype.name == "Q8_0"
    # it copies our quantkit.metadata too; that is the BF16 input's provenance, not its own
    from quantkit.info import artifact_info

    assert artifact_info(out)["scheme"]["gguf_type"] == gguf_type
    info = artifact_info(tmp_path / "q8.gguf")
    assert info["scheme"] is None and info["nominal_bits_per_weight"] is None


# ---------------------------------------------------------------- refusals, before any work

def _copy_tiny(tiny_llama: Path, dst: Path) -> Path:
    shutil.copytree(tiny_llama, dst)
    return dst


@pytest.mark.fast
def test_unknown_pretokenizer_is_refused(tmp_path, tiny_llama):
    d = _copy_tiny(tiny_llama, tmp_path / "m")
    tj = json.loads((d / "tokenizer.json").read_text())
    # digits in pairs, letters runs: a split llama.cpp has no regex for (same vocabulary)
    tj["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": " ?\\p{L}+|\\p{N}{1,2}|\\s+|[^\\s\\p{L}\\p{N}]+"},
         "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    (d / "tokenizer.json").write_text(json.dumps(tj))
    out = tmp_path / "x.gguf"
    with pytest.raises(QuantkitError, match="pre-tokenizer"):
        _gguf(d, out, "q8_0")
    assert not out.exists() and not list(tmp_path.glob(".x.gguf.tmp-*"))


@pytest.mark.fast
def test_non_bpe_tokenizer_and_sliding_window_are_refused(tmp_path, tiny_llama):
    d = _copy_tiny(tiny_llama, tmp_path / "wp")
    tj = json.loads((d / "tokenizer.json").read_text())
    tj["pre_tokenizer"] = {"type": "Whitespace"}
    (d / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(QuantkitError, match="llama.cpp would tokenize it differently"):
        _gguf(d, tmp_path / "wp.gguf", "f16")
    d2 = _copy_tiny(tiny_llama, tmp_path / "sw")
    cfg = json.loads((d2 / "config.json").read_text())
    cfg["use_sliding_window"] = True
    (d2 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantkitError, match="Sliding-window"):
        _gguf(d2, tmp_path / "sw.gguf", "f16")


@pytest.mark.fast
def test_scheme_must_match_format(tmp_path, tiny_llama):
    with pytest.raises(QuantkitError, match="kquant"):
        quantize(QuantizeRequest(model=str(tiny_llama), method="gguf", format="gguf",
                                 out=tmp_path / "x.gguf", scheme=QuantScheme(kind="int"),
                                 method_options={"gguf_type": "q4_k_m"}))


def test_bpe_merges_equal_gguf_special_vocab(tmp_path, smollm_path):
    """Our one-pass merges = gguf's SpecialVocab(load_merges=True), in both tokenizer.json
    formats ("a b" strings; [a, b] pairs whose parts may hold spaces)."""
    import gguf

    from quantkit.formats.gguf_tokenizer import bpe_merges

    def same(path: Path) -> list[str]:
        ours = bpe_merges(json.loads((path / "tokenizer.json").read_text()))
        assert ours == gguf.SpecialVocab(path, load_merges=True).merges
        return ours

    assert len(same(Path(smollm_path))) > 40000  # the real vocabulary: pair format
    for merges in ([["a b", "c"], ["\u0120x", "y "], ["d", "e"]], ["a b", "c d"]):
        (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "merges": merges}}))
        assert len(same(tmp_path)) == len(merges)
