"""GGUF of mixture-of-experts models: llama.cpp's 3-D expert tensors for Qwen3-MoE and
Mixtral (arch llama) against llama.cpp's converter and llama-quantize, the per-expert imatrix,
the writer's memory, and what the GGUF path refuses."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from gguf_reference import (
    assert_generates,
    assert_llama_cpp_logits_match,
    assert_same_gguf,
    convert_with_llama_cpp,
    gguf_body,
    gguf_contents,
)
from moe_models import (
    _quantize,
)
from tiny_models import make_tiny_model

from quantkit.cli import main
from quantkit.pipeline.quantize import QuantizeRequest, quantize
from quantkit.types import QuantScheme


def _gguf(model: Path, out: Path, gguf_type: str, **kw) -> Path:
    return _quantize(model, out, "gguf", format="gguf", method_options={"gguf_type": gguf_type},
                     scheme=QuantScheme(kind="kquant", gguf_type=gguf_type), **kw)


@pytest.mark.fast
def test_moe_refuses_what_is_not_built_yet(moe_model, tmp_path):
    from quantkit.errors import UnsupportedArchitecture

    # the CLI lets --moe-calibrate-all-experts reach the FP8 / int8 / FP4 statistics it now
    # feeds, and refuses it where nothing reads it (dynamic FP8 / int8 rounded to nearest)
    for method in ("int8", "fp8"):
        res = CliRunner().invoke(main, ["quantize", str(moe_model), "--method", method,
                                        "--moe-calibrate-all-experts", "-o", str(tmp_path / "cli")])
        assert res.exit_code == 2 and f"read by --method {method} only with --scheme static" \
            in res.output, res.output
    # llama.cpp's qwen3moe makes every block MoE and always renormalises the top-k weights
    for change, why in (({"mlp_only_layers": [0]}, "has no llama.cpp layout"),
                        ({"norm_topk_prob": False}, "always renormalises")):
        src = tmp_path / f"cfg{len(why)}"
        src.mkdir()
        for f in moe_model.iterdir():
            (src / f.name).symlink_to(f)
        (src / "config.json").unlink()
        config = json.loads((moe_model / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(UnsupportedArchitecture, match=why) as e:
            _gguf(src, tmp_path / "x.gguf", "q4_k_m")
        assert "--format compressed-tensors" in e.value.hint
    assert not (tmp_path / "x.gguf").exists()


@pytest.fixture(scope="module")
def moe_reference_bf16(moe_model, tmp_path_factory) -> Path:
    """llama.cpp's own convert_hf_to_gguf.py --outtype bf16 of the tiny model."""
    return convert_with_llama_cpp(moe_model, tmp_path_factory.mktemp("ref") / "ref.bf16.gguf")


@pytest.mark.engine
def test_moe_bf16_gguf_equals_llama_cpp_converter_and_runs(moe_model, moe_reference_bf16, tmp_path):
    """Experts stacked into blk.N.ffn_{gate,up,down}_exps (E on the slowest axis), the router
    as F32 ffn_gate_inp, the expert KV keys: tensor for tensor and key for key what
    convert_hf_to_gguf.py writes; llama.cpp then computes transformers' logits."""

    ours = _gguf(moe_model, tmp_path / "bf16.gguf", "bf16")
    kv, tensors = assert_same_gguf(ours, moe_reference_bf16)
    assert tensors["blk.1.ffn_gate_exps.weight"][:2] == ("BF16", [256, 256, 8])
    assert tensors["blk.1.ffn_down_exps.weight"][:2] == ("BF16", [256, 256, 8])
    assert tensors["blk.1.ffn_gate_inp.weight"][:2] == ("F32", [256, 8])
    assert (kv["qwen3moe.expert_count"], kv["qwen3moe.expert_used_count"],
            kv["qwen3moe.expert_feed_forward_length"]) == (8, 2, 256)

    assert_llama_cpp_logits_match(ours, moe_model, "Qwen3-MoE")


# llama-quant.cpp with exactly 8 experts: attn_v and attn_k Q8_0; attn_output Q5_K for Q4_K_M
# but the base type for Q3_K_L (whose dense rule is Q5_K); ffn_down_exps by use_more_bits(layer)
# (Q4_K_M) or always Q5_K (Q3_K_L); gate/up experts the base type; the router never quantized
EXPECTED_TYPES = {
    "q4_k_m": {"attn_v": "Q8_0", "attn_k": "Q8_0", "attn_output": "Q5_K", "attn_q": "Q4_K",
               "ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q4_K", "ffn_down_exps": ("Q4_K", "Q6_K"),
               "ffn_gate_inp": "F32"},
    "q3_k_l": {"attn_v": "Q8_0", "attn_k": "Q8_0", "attn_output": "Q3_K", "attn_q": "Q3_K",
               "ffn_gate_exps": "Q3_K", "ffn_up_exps": "Q3_K", "ffn_down_exps": "Q5_K",
               "ffn_gate_inp": "F32"},
}


@pytest.mark.engine
@pytest.mark.parametrize("gguf_type", list(EXPECTED_TYPES))
def test_moe_k_quants_equal_llama_quantize_in_both_layouts(moe_model, moe_reference_bf16, tmp_path,
                                                           gguf_type):
    """quantkit's K-quant GGUF = llama_model_quantize of the converter's BF16 file, type and
    byte for byte, 3-D expert tensors included; the per-expert layout (streamed from the
    shards) and transformers 5's fused 3-D experts (--no-stream) give the same file; the
    Q4_K_M file generates in real llama.cpp."""
    from quantkit.engines.llamacpp import llama_quantize

    fused = _gguf(moe_model, tmp_path / "fused.gguf", gguf_type, stream=False)
    lq = tmp_path / "lq.gguf"
    llama_quantize(moe_reference_bf16, lq, gguf_type)
    (_, ours), (_, ref) = gguf_contents(fused), gguf_contents(lq)
    assert {t: v[:2] for t, v in ours.items()} == {t: v[:2] for t, v in ref.items()}
    assert [t for t in ref if ours[t][2] != ref[t][2]] == []
    for short, want in EXPECTED_TYPES[gguf_type].items():
        got = tuple(ours[f"blk.{i}.{short}.weight"][0] for i in (0, 1))
        assert got == (want if isinstance(want, tuple) else (want, want)), (short, got)
    if gguf_type != "q4_k_m":
        return
    streamed = _gguf(moe_model, tmp_path / "streamed.gguf", gguf_type)
    assert gguf_body(streamed) == gguf_body(fused)
    assert_generates(streamed)


@pytest.mark.fast
def test_moe_gguf_writer_stacks_one_expert_tensor_at_a_time(moe_model, tmp_path):
    """The 3-D expert tensors are built from the per-expert pieces as each is written: the
    writer's numpy allocations (what tracemalloc sees; the stacks are numpy arrays) peak near
    one stacked tensor (1 MiB here), not the six of the model (6 MiB) that stacking them all
    up front, as GGUFWriter.add_tensor would keep them, would hold."""
    import tracemalloc

    from safetensors.torch import load_file

    from quantkit.formats.gguf import GGUFFileWriter

    config = json.loads((moe_model / "config.json").read_text())
    dense = load_file(moe_model / "model.safetensors")
    one = 8 * 256 * 256 * 2  # one block's ffn_gate_exps in BF16
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        GGUFFileWriter().write(tmp_path / "w.gguf", config=config, dense=dense, results={},
                               scheme=QuantScheme(kind="kquant", gguf_type="bf16"))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"writer peak (tracemalloc): {peak / 2**20:.2f} MiB; one expert tensor {one / 2**20:.2f} MiB")
    assert one <= peak < 2.5 * one
    _, tensors = gguf_contents(tmp_path / "w.gguf")
    assert len([t for t in tensors if "_exps" in t]) == 6


@pytest.mark.engine
def test_moe_imatrix_per_expert_equals_llama_quantize(moe_model, moe_reference_bf16, tmp_path):
    """--imatrix from calibration on a MoE model: one importance vector per expert of each
    3-D tensor (in_sum2 [E, K], counts [E, 1], the tokens routed to each expert); an expert
    that got no token is saved with count 0, which llama-quantize reads as importance 1, and
    quantkit quantizes it so. llama_model_quantize given that file's values writes the same
    bytes; reading the file back (--imatrix FILE) gives the same GGUF data again."""
    from quantkit.engines.llamacpp import llama_quantize
    from quantkit.methods.imatrix import load_imatrix
    from quantkit.readers import read_gguf

    imatrix = tmp_path / "moe.imatrix.gguf"

    def run(out: Path, source: str) -> Path:
        opts = {"gguf_type": "q4_k_m", "imatrix": source, "imatrix_out": str(imatrix)}
        if source != "calib":
            del opts["imatrix_out"]
        quantize(QuantizeRequest(model=str(moe_model), method="gguf", format="gguf", out=out,
                                 scheme=QuantScheme(kind="kquant", gguf_type="q4_k_m"),
                                 method_options=opts, calib="mixed", calib_samples=1,
                                 calib_seqlen=16, resume=False))
        return out

    with pytest.warns(RuntimeWarning, match="routed tokens"):  # 16 tokens, top-2 of 8 experts
        collected = run(tmp_path / "calib.gguf", "calib")
    _, entries = read_gguf(imatrix)
    counts = {n[:-len(".counts")]: np.asarray(t.data).view(np.float32).reshape(-1)
              for n, t in entries.items() if n.endswith("_exps.weight.counts")}
    assert len(counts) == 6 and all(c.shape == (8,) and c.sum() == 2 * 16 for c in counts.values())
    assert entries["blk.1.ffn_down_exps.weight.in_sum2"].shape == (8, 256)
    assert any((c == 0).any() for c in counts.values())  # an expert the router never fed
    values = load_imatrix(imatrix).values
    llama_quantize(moe_reference_bf16, tmp_path / "lq.gguf", "q4_k_m",
                   imatrix={k: v.numpy() for k, v in values.items()})
    (_, ours), (_, ref) = gguf_contents(collected), gguf_contents(tmp_path / "lq.gguf")
    assert [t for t in ref if ours[t][:2] != ref[t][:2] or ours[t][2] != ref[t][2]] == []
    plain = gguf_contents(_gguf(moe_model, tmp_path / "plain.gguf", "q4_k_m"))[1]
    assert ours["blk.1.ffn_up_exps.weight"][2] != plain["blk.1.ffn_up_exps.weight"][2]
    assert gguf_body(run(tmp_path / "file.gguf", str(imatrix)))[1] == gguf_body(collected)[1]


@pytest.fixture(scope="module")
def mixtral_gguf_model(tmp_path_factory) -> Path:
    """A real MixtralForCausalLM with K-quant widths (hidden 256, 4 experts of 256, top-2).

    Its tokenizer is SmolLM2's with `byte_fallback` off. llama.cpp's converter writes Mixtral
    through LlamaModel.set_vocab, which takes any BPE tokenizer.json with byte_fallback on and a
    Sequence decoder (SmolLM2's) as a SentencePiece-style `llama` vocabulary with scores
    (gguf-py's LlamaHfVocab), while quantkit writes SmolLM2's byte-level BPE as `gpt2`, which
    is how llama.cpp tokenizes it right. Off, the converter also writes `gpt2`, so the whole
    header compares; the tokenization is unchanged (the byte-level alphabet covers every byte,
    so no byte fallback ever happens)."""
    src = make_tiny_model(tmp_path_factory.mktemp("mixtral_gguf"), "mixtral", hidden=256,
                          intermediate=256)
    tj = json.loads((src / "tokenizer.json").read_text())
    tj["model"]["byte_fallback"] = False
    (src / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False))
    return src


@pytest.fixture(scope="module")
def mixtral_reference_bf16(mixtral_gguf_model, tmp_path_factory) -> Path:
    """llama.cpp's own convert_hf_to_gguf.py --outtype bf16 of the tiny Mixtral."""
    return convert_with_llama_cpp(mixtral_gguf_model,
                                  tmp_path_factory.mktemp("mixtral_ref") / "ref.bf16.gguf")


@pytest.mark.engine
def test_mixtral_bf16_gguf_equals_llama_cpp_converter_and_runs(mixtral_gguf_model,
                                                                mixtral_reference_bf16, tmp_path):
    """Mixtral as llama.cpp's arch llama: q/k rows permuted, block_sparse_moe's router as F32
    ffn_gate_inp and w1/w3/w2 stacked into ffn_{gate,up,down}_exps, the expert keys: tensor for
    tensor and key for key what convert_hf_to_gguf.py writes; llama.cpp then computes
    transformers' logits."""

    ours = _gguf(mixtral_gguf_model, tmp_path / "bf16.gguf", "bf16")
    kv, tensors = assert_same_gguf(ours, mixtral_reference_bf16)
    assert tensors["blk.1.ffn_gate_exps.weight"][:2] == ("BF16", [256, 256, 4])
    assert tensors["blk.1.ffn_down_exps.weight"][:2] == ("BF16", [256, 256, 4])
    assert tensors["blk.1.ffn_gate_inp.weight"][:2] == ("F32", [256, 4])
    assert (kv["llama.expert_count"], kv["llama.expert_used_count"]) == (4, 2)
    assert kv["tokenizer.ggml.model"] == "gpt2"

    assert_llama_cpp_logits_match(ours, mixtral_gguf_model, "Mixtral")


@pytest.mark.engine
def test_mixtral_q4_k_m_equals_llama_quantize_in_both_layouts(mixtral_gguf_model,
                                                              mixtral_reference_bf16, tmp_path):
    """Q4_K_M of Mixtral = llama_model_quantize of the converter's BF16 file, type and byte for
    byte (3-D experts included); the shards streamed under block_sparse_moe names and
    transformers 5's fused in-memory experts give the same file; it generates in llama.cpp."""
    from quantkit.engines.llamacpp import llama_quantize

    lq = tmp_path / "lq.gguf"
    llama_quantize(mixtral_reference_bf16, lq, "q4_k_m")
    fused = _gguf(mixtral_gguf_model, tmp_path / "fused.gguf", "q4_k_m", stream=False)
    (_, ours), (_, want) = gguf_contents(fused), gguf_contents(lq)
    assert {t: v[:2] for t, v in ours.items()} == {t: v[:2] for t, v in want.items()}
    assert [t for t in want if ours[t][2] != want[t][2]] == []
    assert (ours["blk.0.ffn_gate_exps.weight"][0], ours["blk.0.ffn_gate_inp.weight"][0]) == \
        ("Q4_K", "F32")
    streamed = _gguf(mixtral_gguf_model, tmp_path / "streamed.gguf", "q4_k_m")
    assert gguf_body(streamed) == gguf_body(fused)
    assert_generates(streamed)
