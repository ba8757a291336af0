"""K-quant encoders, the per-tensor type mix and imatrix files, bit for bit against llama.cpp.

Reference = llama.cpp itself through llama-cpp-python: `ggml_quantize_chunk` from its
libggml-base for single tensors, `llama_model_quantize` (llama-quantize's engine) for whole
files. No mocks: every expected byte comes from the C code.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import dequantize as gguf_dequantize

from quantkit.errors import SchemeMismatch
from quantkit.formats.gguf import read_gguf
from quantkit.ggml.catalogue import PRESETS, use_more_bits
from quantkit.ggml.catalogue import REQUIRES_IMATRIX as REQUIRES_QW
from quantkit.ggml.codec import BACKENDS, dequantize_tensor, encode_rows, quantize_tensor, row_bytes
from quantkit.ggml.mix import plan_types
from quantkit.methods.imatrix import load_imatrix, save_imatrix
from quantkit.methods.kquants import GGUFQuantizer

llama_cpp = pytest.importorskip("llama_cpp")
from quantkit.engines.llamacpp import llama_quantize  # noqa: E402

TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q2_K, Q.Q3_K, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS,
         Q.IQ3_XXS, Q.IQ3_S, Q.IQ2_S, Q.IQ2_XS, Q.IQ2_XXS, Q.IQ1_S, Q.IQ1_M]


def _ggml():
    # the soname libllama links: one ggml instance, so its grid tables (ggml_quantize_init;
    # ~12 s for IQ1_S/IQ1_M on 2 cores) are built once for this and llama_model_quantize
    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so.0"))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    return lib


def ggml_quantize(w: np.ndarray, qtype: Q, qw: np.ndarray | None = None) -> np.ndarray:
    """llama.cpp's ggml_quantize_chunk on float32 rows (what llama-quantize calls per tensor)."""
    lib = _ggml()
    w = np.ascontiguousarray(w, dtype=np.float32)
    out = np.zeros((w.shape[0], row_bytes(qtype, w.shape[1])), dtype=np.uint8)
    qw = None if qw is None else np.ascontiguousarray(qw, dtype=np.float32)
    lib.ggml_quantize_init(int(qtype))
    lib.ggml_quantize_chunk(int(qtype), w.ctypes.data, out.ctypes.data, 0, w.shape[0], w.shape[1],
                            None if qw is None else qw.ctypes.data)
    return out


def _hard_weights(n: int, k: int, seed: int) -> torch.Tensor:
    """bf16-representable rows with the cases that break naive ports: zero and constant
    blocks, one-sided blocks, outliers, heavy tails, tiny values."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    w[1] = torch.distributions.StudentT(2.0).sample((k,)) * 0.01
    w[2, : k // 2] = 0
    w[3] = 0.25
    w[4] = torch.rand(k, generator=g) * 0.1
    w[5] = -torch.rand(k, generator=g) * 0.1 - 0.05
    w[6, 7] = 2.0
    w[7] *= 1e-5
    w[8, ::5] = 0
    return w.to(torch.bfloat16).float()


@pytest.mark.fast
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_encoder_bytes_equal_ggml(qtype, backend):
    """Both encoders (compiled CPU loops; torch, which is also the GPU path) = llama.cpp.
    IQ2_XXS / IQ2_XS / IQ1_S exist only with an imatrix (ggml asserts one): refused without."""
    w = _hard_weights(48, 768, seed=int(qtype))
    imatrices = [None, torch.rand(768) ** 4 + 1e-3,
                 torch.where(torch.rand(768) < 0.3, torch.zeros(768), torch.rand(768) * 50)]
    for qw in imatrices:
        if qw is None and qtype in REQUIRES_QW:
            with pytest.raises(ValueError, match=f"{qtype.name} needs an importance matrix"):
                encode_rows(w, qtype, backend=backend)
            continue
        ours = encode_rows(w, qtype, qw, backend=backend).numpy()
        ref = ggml_quantize(w.numpy(), qtype, None if qw is None else qw.numpy())
        bad = np.nonzero((ours != ref).any(1))[0]
        assert bad.size == 0, f"{qtype.name} imatrix={qw is not None}: rows {bad[:8]} differ"
        _, sq_err = encode_rows(w, qtype, qw, backend=backend, errors=True)  # no second decode
        decoded = gguf_dequantize(ref, qtype).astype(np.float64)
        np.testing.assert_allclose(sq_err.numpy(), ((decoded - w.double().numpy()) ** 2).sum(1),
                                   rtol=1e-6, atol=1e-30)
    # our torch decoder = gguf's reference dequantizer, value for value
    assert np.array_equal(dequantize_tensor(torch.from_numpy(ours), qtype).numpy(),
                          gguf_dequantize(ours, qtype))
    qw = torch.ones(768) if qtype in REQUIRES_QW else None  # a flat imatrix: plain weighting
    plain = torch.from_numpy(encode_rows(w, qtype, qw, backend=backend).numpy()[9:])  # the ordinary gaussian rows
    rel = float((dequantize_tensor(plain, qtype) - w[9:]).norm() / w[9:].norm())
    assert rel < {Q.Q8_0: 0.01, Q.Q6_K: 0.03, Q.Q5_K: 0.05, Q.Q5_0: 0.06, Q.Q5_1: 0.06, Q.Q3_K: 0.2,
                  Q.Q2_K: 0.35, Q.IQ3_S: 0.2, Q.IQ3_XXS: 0.25, Q.IQ2_S: 0.3,  # measured 0.167 0.213 0.264
                  Q.IQ2_XS: 0.33, Q.IQ2_XXS: 0.38,  # flat imatrix: measured 0.298 0.345
                  Q.IQ1_S: 0.52, Q.IQ1_M: 0.62}.get(qtype, 0.12)  # measured 0.482, no imatrix 0.578


@pytest.mark.fast
def test_encoder_rejects_bad_width_and_backend():
    with pytest.raises(ValueError, match="multiple of 256"):
        encode_rows(torch.zeros(2, 320), Q.Q4_K)
    with pytest.raises(ValueError, match="backend 'numpy'"):
        encode_rows(torch.zeros(2, 256), Q.Q4_K, backend="numpy")


# ---------------------------------------------------------------- the per-tensor type mix

def _write_plain_gguf(path: Path, arch: str, n_layer: int, hidden: int, ffn: int, vocab: int,
                      tied: bool, n_head: int = 4, n_kv: int = 2, seed: int | None = None) -> dict[str, tuple[int, ...]]:
    """A weightless (all-zero F16) dense model: enough for llama-quantize's type choice; with
    a seed, gaussian F16 weights (heavy-tailed rows included) for comparing bytes."""
    rng = None if seed is None else np.random.default_rng(seed)
    w = GGUFWriter(str(path), arch)
    hd = hidden // n_head
    w.add_block_count(n_layer)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(hd)
    w.add_vocab_size(vocab)
    w.add_file_type(1)
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    if not tied:
        shapes["output.weight"] = (vocab, hidden)
    for i in range(n_layer):
        shapes.update({f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
                       f"blk.{i}.attn_q.weight": (hidden, hidden), f"blk.{i}.attn_k.weight": (n_kv * hd, hidden),
                       f"blk.{i}.attn_v.weight": (n_kv * hd, hidden), f"blk.{i}.attn_output.weight": (hidden, hidden),
                       f"blk.{i}.ffn_gate.weight": (ffn, hidden), f"blk.{i}.ffn_up.weight": (ffn, hidden),
                       f"blk.{i}.ffn_down.weight": (hidden, ffn)})
    for name, shape in shapes.items():
        if len(shape) == 1:
            w.add_tensor(name, np.ones(shape, dtype=np.float32))
        elif rng is None:
            w.add_tensor(name, np.zeros(shape, dtype=np.float16))
        else:
            w.add_tensor(name, (rng.standard_t(3, shape) * 0.02).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return shapes


def _types(path: Path) -> dict[str, Q]:
    return {n: t.qtype for n, t in read_gguf(path)[1].items()}


@pytest.mark.fast
@pytest.mark.parametrize("n_layer,hidden,ffn,tied", [
    (8, 256, 256, True), (28, 256, 512, False), (32, 256, 256, False), (32, 320, 256, True),
    (80, 256, 256, False)])  # 80 layers with GQA: llama.cpp's "70B" attn_v bump
def test_q4_k_m_type_mix_equals_llama_cpp(tmp_path, n_layer, hidden, ffn, tied):
    src = tmp_path / "f16.gguf"
    shapes = _write_plain_gguf(src, "llama", n_layer, hidden, ffn, vocab=512, tied=tied)
    llama_quantize(src, tmp_path / "q.gguf", "q4_k_m")
    theirs = _types(tmp_path / "q.gguf")
    plans = plan_types("q4_k_m", shapes, n_layer, is_70b=n_layer == 80)
    ours = {n: (plans[n].qtype if n in plans else Q.F32) for n in shapes}
    assert ours == theirs


_MIXES = ["q4_k_s", "q5_k_m", "q5_k_s", "q6_k", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "q3_k_l", "q3_k_m",
          "q3_k_s", "q2_k", "iq4_nl", "iq4_xs", "iq3_s"]


@pytest.mark.fast
@pytest.mark.parametrize("preset,ffn,imat", [(p, 288, False) for p in _MIXES]
                         + [(p, 272, False) for p in _MIXES if p != "iq4_nl"]  # iq4_xs: -> IQ4_NL -> F16
                         + [(p, 288, True) for p in ("q4_0", "q5_0", "q3_k_m", "q2_k", "iq4_nl", "iq4_xs", "iq3_s")])
def test_other_presets_type_mix_equals_llama_cpp(tmp_path, preset, ffn, imat):
    """Same types as llama-quantize, fallbacks included (ffn 272: not a multiple of 32); with
    an imatrix Q4_0/Q5_0 give the first eighth of ffn_down Q4_1/Q5_1 (llama.cpp's guard,
    seen from 8 layers on); IQ4_NL/IQ4_XS give it Q5_K only without one."""
    src = tmp_path / "f16.gguf"
    shapes = _write_plain_gguf(src, "qwen2", 16, 256, ffn, vocab=256, tied=False)
    imatrix = {n: np.ones(s[-1], np.float32) for n, s in shapes.items()
               if n.startswith("blk.") and len(s) == 2} if imat else None
    llama_quantize(src, tmp_path / "q.gguf", preset, imatrix=imatrix)
    plans = plan_types(preset, shapes, 16, has_imatrix=imat)
    assert {n: (plans[n].qtype if n in plans else Q.F32) for n in shapes} == _types(tmp_path / "q.gguf")
    guard = {"q4_0": Q.Q4_1, "q5_0": Q.Q5_1}.get(preset) if imat else None
    if guard:
        assert [plans[f"blk.{i}.ffn_down.weight"].qtype for i in range(3)] == [guard, guard, PRESETS[preset].base]
    if preset in ("iq4_nl", "iq4_xs") and ffn == 288:  # 288 % 256 != 0: IQ4_XS falls back to IQ4_NL
        early = Q.Q5_1 if not imat else Q.IQ4_NL  # Q5_K -> Q5_1 on 288 columns
        assert [plans[f"blk.{i}.ffn_down.weight"].qtype for i in range(3)] == [early, early, Q.IQ4_NL]


@pytest.mark.fast
@pytest.mark.parametrize("preset", ["q3_k_m", "q2_k", "iq4_xs", "iq3_s"])
def test_low_bit_mixes_with_gqa_4_equal_llama_cpp(tmp_path, preset):
    """32 layers, 4 query heads per KV head: Q2_K's and IQ3_S's attn_v go Q4_K, Q3_K_M's first
    two attn_v and first 32/16 ffn_down Q5_K, IQ4_XS's attn_v Q5_K; untied output Q6_K."""
    src = tmp_path / "f16.gguf"
    shapes = _write_plain_gguf(src, "llama", 32, 256, 512, vocab=256, tied=False, n_kv=1)
    llama_quantize(src, tmp_path / "q.gguf", preset)
    plans = plan_types(preset, shapes, 32, n_gqa=4)
    ours = {n: (plans[n].qtype if n in plans else Q.F32) for n in shapes}
    assert ours == _types(tmp_path / "q.gguf")
    assert ours["blk.5.attn_v.weight"] == (Q.Q5_K if preset == "iq4_xs" else Q.Q4_K)
    assert ours["blk.1.ffn_down.weight"] == {"q2_k": Q.Q3_K, "iq3_s": Q.IQ3_S}.get(preset, Q.Q5_K)


def _dry_run_types(src: Path, preset: str) -> dict[str, Q]:
    """llama-quantize --dry-run without an imatrix: the type it would give every tensor, read
    from its log ("... type = f16, size = ... (iq3_s)"), where a real run refuses."""
    import contextlib
    import io
    import re

    from llama_cpp import _logger

    from quantkit.ggml.catalogue import LLAMA_FTYPES as FTYPES

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread, params.dry_run = FTYPES[preset], 1, True
    level, buf = _logger.logger.level, io.StringIO()
    _logger.logger.setLevel("DEBUG")
    try:
        with contextlib.redirect_stderr(buf):
            assert llama_cpp.llama_model_quantize(str(src).encode(), str(src.with_suffix(".dry")).encode(),
                                                  ctypes.byref(params)) == 0
    finally:
        _logger.logger.setLevel(level)
    found = re.findall(r"\] (\S+)\s+- \[[^\]]*\], type =\s+(\w+), size = [^\n]*?(?:\((\w+)\))?\n", buf.getvalue())
    return {n: Q[(new or old).upper()] for n, old, new in found}


@pytest.mark.fast
@pytest.mark.parametrize("n_layer,ffn,tied,n_kv,imat", [
    (16, 512, False, 2, True), (16, 288, True, 2, True), (8, 512, False, 1, True), (80, 256, False, 1, True),
    (16, 512, False, 2, False), (16, 288, True, 1, False)])
def test_iq3_xxs_type_mix_equals_llama_cpp(tmp_path, n_layer, ffn, tied, n_kv, imat):
    """IQ3_XXS: output Q5_K, untied token_embd IQ3_S, attn_q/attn_k IQ2_S, attn_output IQ3_S,
    attn_v Q4_K with >= 4 query heads per KV head (Q5_K on an 80-layer "70B"), else IQ3_S
    without an imatrix; without one ffn_down Q4_K / Q3_K; 288 columns fall back to IQ4_NL.
    Without an imatrix llama.cpp refuses the file (compared with its --dry-run), so do we."""
    from quantkit.arch import ARCHS
    from quantkit.errors import EngineError

    src = tmp_path / "f16.gguf"
    shapes = _write_plain_gguf(src, "llama", n_layer, 256, ffn, vocab=256, tied=tied, n_kv=n_kv)
    plans = plan_types("iq3_xxs", shapes, n_layer, has_imatrix=imat, n_gqa=4 // n_kv, is_70b=n_layer == 80)
    ours = {n: (plans[n].qtype if n in plans else Q.F32) for n in shapes}
    if imat:
        llama_quantize(src, tmp_path / "q.gguf", "iq3_xxs",
                       imatrix={n: np.ones(s[-1], np.float32) for n, s in shapes.items()
                                if n.startswith("blk.") and len(s) == 2})
        assert ours == _types(tmp_path / "q.gguf")
    else:
        assert ours == _dry_run_types(src, "iq3_xxs")
        with pytest.raises(EngineError):
            llama_quantize(src, tmp_path / "q.gguf", "iq3_xxs")
        cfg = {"vocab_size": 256, "hidden_size": 256, "num_hidden_layers": 1, "tie_word_embeddings": tied}
        linears = {"model.layers.0.mlp.up_proj": (ffn, 256), "model.layers.0.self_attn.q_proj": (256, 256)}
        with pytest.raises(SchemeMismatch, match="needs an importance matrix"):
            GGUFQuantizer("iq3_xxs").prepare(cfg, ARCHS[0], linears)
        # an imatrix without the IQ2_S attn_q: llama-quantize's "Missing importance matrix"
        save_imatrix(tmp_path / "part.gguf", {"blk.0.ffn_up.weight": (torch.ones(256), 1)},
                     datasets=["x"], chunk_count=1, chunk_size=1)
        with pytest.raises(SchemeMismatch, match="no entry for blk.0.attn_q.weight"):
            GGUFQuantizer("iq3_xxs", imatrix=tmp_path / "part.gguf").prepare(cfg, ARCHS[0], linears)
    v = ours["blk.3.attn_v.weight"]
    assert v == (Q.Q5_K if n_layer == 80 else Q.Q4_K if n_kv == 1 else Q.IQ3_XXS if imat else Q.IQ3_S)
    assert ours["blk.0.attn_q.weight"] == Q.IQ2_S and ours["blk.0.attn_output.weight"] == Q.IQ3_S
    assert ours["token_embd.weight"] == (Q.Q5_K if tied else Q.IQ3_S)
    down = [ours[f"blk.{i}.ffn_down.weight"] for i in range(n_layer)]
    if ffn % 256 == 0:
        assert down == ([Q.IQ3_XXS] * n_layer if imat else [Q.Q4_K] * (n_layer // 8) + [Q.Q3_K] * (n_layer - n_layer // 8))
    else:
        assert set(down) == ({Q.IQ4_NL} if imat else {Q.Q5_0, Q.Q4_0})


_IQ_MIXES = ["iq2_xxs", "iq2_xs", "iq2_s", "iq2_m", "iq3_xs", "iq3_m", "iq1_s", "iq1_m", "q2_k_s"]


@pytest.mark.fast
@pytest.mark.parametrize("preset,n_layer,ffn,tied,n_kv", [(p, 16, 288, True, 1) for p in _IQ_MIXES]
                         + [(p, 8, 512, False, 2) for p in _IQ_MIXES]
                         + [(p, 80, 256, False, 1) for p in ("iq2_xxs", "iq3_m", "q2_k_s")])
def test_iq_mixes_equal_llama_cpp(tmp_path, preset, n_layer, ffn, tied, n_kv):
    """IQ2_XXS / IQ2_XS / IQ2_S / IQ2_M / IQ1_S / IQ1_M (llama.cpp's own IQ2 branch: output
    Q5_K, attn_v Q4_K with >= 4 query heads per KV head, else Q2_K / IQ3_S, no "70B" bump;
    IQ1_*: attn_output IQ2_XXS), IQ3_XS / IQ3_M and Q2_K_S (attn_v Q4_K with >= 4 query heads
    per KV head, early ffn_down Q4_K; its Q2_K tensors need an imatrix): llama-quantize's
    types, fallbacks included (288 columns), with an imatrix where llama.cpp requires one.
    Without it: its --dry-run types, and both it and quantkit refuse."""
    from quantkit.arch import ARCHS
    from quantkit.errors import EngineError

    src = tmp_path / "f16.gguf"
    shapes = _write_plain_gguf(src, "llama", n_layer, 256, ffn, vocab=256, tied=tied, n_kv=n_kv)
    imat = PRESETS[preset].imatrix_required
    plans = plan_types(preset, shapes, n_layer, has_imatrix=imat, n_gqa=4 // n_kv, is_70b=n_layer == 80)
    ours = {n: (plans[n].qtype if n in plans else Q.F32) for n in shapes}
    imatrix = {n: np.ones(s[-1], np.float32) for n, s in shapes.items() if n.startswith("blk.") and len(s) == 2}
    llama_quantize(src, tmp_path / "q.gguf", preset, imatrix=imatrix if imat else None)
    assert ours == _types(tmp_path / "q.gguf")
    assert imat == (preset != "iq3_m")
    if imat and n_layer == 8:
        assert plan_types(preset, shapes, n_layer, n_gqa=2) == plans
        assert ours == _dry_run_types(src, preset)
        with pytest.raises(EngineError):
            llama_quantize(src, tmp_path / "q.gguf", preset)
        cfg = {"vocab_size": 256, "hidden_size": 256, "num_hidden_layers": 1, "tie_word_embeddings": tied}
        with pytest.raises(SchemeMismatch, match=f"--gguf-type {preset} needs an importance matrix"):
            GGUFQuantizer(preset).prepare(cfg, ARCHS[0], {"model.layers.0.self_attn.q_proj": (256, 256),
                                                          "model.layers.0.mlp.up_proj": (512, 256)})
    v = ours["blk.3.attn_v.weight"]
    if n_layer == 80:  # the IQ2 branch has no 70B bump
        assert v == (Q.Q4_K if preset == "iq2_xxs" else Q.Q5_K)
    elif preset.startswith(("iq2", "iq1")):
        assert v == (Q.Q4_K if n_kv == 1 else Q.IQ3_S if preset in ("iq2_s", "iq2_m") else Q.Q2_K)
    if preset.startswith("iq1"):
        assert ours["blk.0.attn_output.weight"] == Q.IQ2_XXS and ours["blk.0.ffn_down.weight"] == \
            (Q.Q2_K if ffn % 256 == 0 else Q.Q4_0)
    if preset == "q2_k_s":
        assert ours["blk.0.ffn_down.weight"] == (Q.Q4_K if ffn % 256 == 0 else Q.Q5_0)
    assert PRESETS[preset].base in set(ours.values())


def _write_moe_gguf(path: Path, n_layer: int, n_expert: int, hidden: int = 256,
                    ffn_exp: int = 256, vocab: int = 256) -> dict[str, tuple[int, ...]]:
    """A weightless (all-zero F16) qwen3moe model: 3-D experts and an F32 router per block."""
    w = GGUFWriter(str(path), "qwen3moe")
    n_head, n_kv, hd = 4, 2, hidden // 4
    for add, value in ((w.add_block_count, n_layer), (w.add_context_length, 256),
                       (w.add_embedding_length, hidden), (w.add_feed_forward_length, 512),
                       (w.add_head_count, n_head), (w.add_head_count_kv, n_kv),
                       (w.add_key_length, hd), (w.add_value_length, hd),
                       (w.add_expert_count, n_expert), (w.add_expert_used_count, 2),
                       (w.add_expert_feed_forward_length, ffn_exp), (w.add_file_type, 1)):
        add(value)
    w.add_layer_norm_rms_eps(1e-6)
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,),
              "output.weight": (vocab, hidden)}
    for i in range(n_layer):
        shapes.update({f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
                       f"blk.{i}.attn_q_norm.weight": (hd,), f"blk.{i}.attn_k_norm.weight": (hd,),
                       f"blk.{i}.attn_q.weight": (hidden, hidden), f"blk.{i}.attn_k.weight": (n_kv * hd, hidden),
                       f"blk.{i}.attn_v.weight": (n_kv * hd, hidden), f"blk.{i}.attn_output.weight": (hidden, hidden),
                       f"blk.{i}.ffn_gate_inp.weight": (n_expert, hidden),
                       f"blk.{i}.ffn_gate_exps.weight": (n_expert, ffn_exp, hidden),
                       f"blk.{i}.ffn_up_exps.weight": (n_expert, ffn_exp, hidden),
                       f"blk.{i}.ffn_down_exps.weight": (n_expert, hidden, ffn_exp)})
    for name, shape in shapes.items():
        f32 = len(shape) == 1 or "ffn_gate_inp" in name
        w.add_tensor(name, np.zeros(shape, dtype=np.float32 if f32 else np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return shapes


@pytest.mark.fast
@pytest.mark.parametrize("preset,n_expert", [(p, 8) for p in ["q4_k_m", *_MIXES, "iq3_xxs", "iq2_xxs", "iq2_s",
                                                                "iq3_xs", "iq3_m"]]
                         + [("q4_k_m", 4), ("q2_k", 4), ("iq3_xxs", 4), ("iq2_xxs", 4), ("iq1_s", 4),
                            ("iq1_m", 8), ("q2_k_s", 8), ("q2_k_s", 4)])
def test_moe_type_mix_equals_llama_cpp(tmp_path, preset, n_expert):
    """qwen3moe, 8 layers: the 3-D expert tensors and the rest get llama-quantize's types
    (ffn_down_exps by its layer; with exactly 8 experts attn_v/attn_k Q8_0 and attn_output
    Q5_K only for the low-bit K presets); the router stays F32. IQ3_XXS, IQ3_XS, IQ2_*: with
    an imatrix (one vector per expert), which llama.cpp requires. The IQ2 branch: attn_v Q4_K
    from 4 experts on, with 8 attn_k Q4_K (not Q8_0) and attn_output Q5_K."""
    src = tmp_path / "f16.gguf"
    shapes = _write_moe_gguf(src, 8, n_expert)
    imat = PRESETS[preset].imatrix_required
    imatrix = {n: np.ones(s[-1] * (s[0] if len(s) == 3 else 1), np.float32) for n, s in shapes.items()
               if n.startswith("blk.") and len(s) >= 2} if imat else None
    llama_quantize(src, tmp_path / "q.gguf", preset, imatrix=imatrix)
    plans = plan_types(preset, {n: s for n, s in shapes.items() if "ffn_gate_inp" not in n}, 8,
                       n_expert=n_expert, has_imatrix=imat)
    ours = {n: (plans[n].qtype if n in plans else Q.F32) for n in shapes}
    assert ours == _types(tmp_path / "q.gguf")
    if n_expert == 8 and preset == "q4_k_m":
        assert {ours[f"blk.3.{t}.weight"] for t in ("attn_v", "attn_k")} == {Q.Q8_0}
        assert [ours[f"blk.{i}.ffn_down_exps.weight"] for i in range(8)] == \
            [Q.Q6_K if use_more_bits(i, 8) else Q.Q4_K for i in range(8)]
    if preset in ("iq2_xxs", "iq1_s", "iq1_m"):
        assert ours["blk.3.attn_v.weight"] == Q.Q4_K
        assert ours["blk.3.attn_k.weight"] == (Q.Q4_K if n_expert == 8 else PRESETS[preset].base)
    if preset.startswith("iq1"):
        assert ours["blk.3.attn_output.weight"] == (Q.Q5_K if n_expert == 8 else Q.IQ2_XXS)


@pytest.mark.fast
def test_use_more_bits_worked_example():
    picked = [i for i in range(32) if use_more_bits(i, 32)]
    assert picked == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]


# ---------------------------------------------------------------- whole models, bit for bit

def _gguf_tensors(path: Path) -> dict[str, tuple[Q, np.ndarray]]:
    return {n: (t.qtype, t.data) for n, t in read_gguf(path)[1].items()}


def _float_rows(qtype: Q, data: np.ndarray) -> torch.Tensor:
    """Raw F32/F16/BF16 row bytes -> float32 rows (what llama-quantize converts them to)."""
    raw = torch.from_numpy(np.array(data, dtype=np.uint8))
    dt = {Q.BF16: torch.bfloat16, Q.F16: torch.float16, Q.F32: torch.float32}[qtype]
    return raw.view(dt).float()


def _base_gguf(root: Path, arch: str, dtype: torch.dtype, tie: bool) -> dict:
    """A tiny random model exported by quantkit as a 16-bit GGUF, plus a synthetic imatrix."""
    from tiny_models import make_tiny_model

    from quantkit.pipeline.quantize import QuantizeRequest, quantize
    from quantkit.types import QuantScheme

    model = make_tiny_model(root / arch, arch, tie=tie, dtype=dtype)
    float_type = "bf16" if dtype == torch.bfloat16 else "f16"
    base = root / f"base.{float_type}.gguf"
    quantize(QuantizeRequest(model=str(model), method="gguf", format="gguf", out=base,
                             scheme=QuantScheme(kind="kquant", gguf_type=float_type),
                             method_options={"gguf_type": float_type}))
    rng = np.random.default_rng(0)
    imatrix = {}
    for name, t in read_gguf(base)[1].items():
        if name.startswith("blk.") and len(t.shape) == 2:
            imatrix[name] = (torch.from_numpy(rng.random(t.shape[1], dtype=np.float32) ** 3 * 40),
                             int(rng.integers(100, 5000)))
    save_imatrix(root / "imatrix.gguf", imatrix, datasets=["synthetic"], chunk_count=3, chunk_size=64)
    return {"root": root, "model": model, "base": base, "imatrix": root / "imatrix.gguf", "cache": {}}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """llama, bf16 checkpoint, tied embeddings (token_embd takes the output's Q6_K/Q8_0)."""
    return _base_gguf(tmp_path_factory.mktemp("kq_llama"), "llama", torch.bfloat16, tie=True)


@pytest.fixture(scope="module")
def tiny_qwen2_gguf(tmp_path_factory):
    """qwen2, f16 checkpoint, untied: token_embd keeps the base type, output.weight exists."""
    return _base_gguf(tmp_path_factory.mktemp("kq_qwen2"), "qwen2", torch.float16, tie=False)


def _compare_file(tiny, preset: str, with_imatrix: bool) -> set[Q]:
    """llama.cpp quantizes the base GGUF; quantkit must produce the same bytes for every tensor."""
    root, cache = tiny["root"], tiny["cache"]
    values = load_imatrix(tiny["imatrix"]).values if with_imatrix else None
    ref = root / f"ref.{preset}.{int(with_imatrix)}.gguf"
    llama_quantize(tiny["base"], ref, preset, imatrix={k: v.numpy() for k, v in values.items()}
                   if values else None)
    base = _gguf_tensors(tiny["base"])
    seen = set()
    for name, (qtype, data) in _gguf_tensors(ref).items():
        btype, bdata = base[name]
        if qtype in (Q.F32, Q.F16, Q.BF16):
            assert qtype == btype and np.array_equal(data, bdata), name
            continue
        qw = values.get(name) if values else None
        key = (name, qtype, qw is not None)
        if key not in cache:
            cache[key] = quantize_tensor(_float_rows(btype, bdata), qtype, qw).numpy()
        ours = cache[key]
        bad = np.nonzero((ours != data.reshape(ours.shape)).any(1))[0]
        assert bad.size == 0, f"{preset} {name} {qtype.name}: {bad.size} rows differ, first {bad[:5]}"
        seen.add(qtype)
    return seen


@pytest.mark.parametrize("model,preset,imat,expect", [
    ("tiny_gguf", "q4_k_m", False, {Q.Q4_K, Q.Q6_K}), ("tiny_gguf", "q5_k_m", False, {Q.Q5_K, Q.Q6_K}),
    ("tiny_gguf", "q6_k", False, {Q.Q6_K}), ("tiny_gguf", "q8_0", False, {Q.Q8_0}),
    ("tiny_gguf", "q4_k_m", True, {Q.Q4_K, Q.Q6_K}), ("tiny_gguf", "q6_k", True, {Q.Q6_K}),
    ("tiny_qwen2_gguf", "q4_k_m", False, {Q.Q4_K, Q.Q6_K}),
    ("tiny_qwen2_gguf", "q4_k_m", True, {Q.Q4_K, Q.Q6_K}),
    ("tiny_qwen2_gguf", "q6_k", True, {Q.Q6_K}),
    ("tiny_gguf", "q4_0", False, {Q.Q4_0, Q.Q6_K}), ("tiny_gguf", "q4_0", True, {Q.Q4_0, Q.Q6_K}),
    ("tiny_gguf", "q4_1", False, {Q.Q4_1, Q.Q6_K}), ("tiny_gguf", "q4_1", True, {Q.Q4_1, Q.Q6_K}),
    ("tiny_gguf", "q5_k_s", False, {Q.Q5_K, Q.Q6_K}),
    ("tiny_qwen2_gguf", "q5_0", False, {Q.Q5_0, Q.Q6_K}), ("tiny_qwen2_gguf", "q5_0", True, {Q.Q5_0, Q.Q6_K}),
    ("tiny_qwen2_gguf", "q5_1", False, {Q.Q5_1, Q.Q6_K}), ("tiny_qwen2_gguf", "q5_1", True, {Q.Q5_1, Q.Q6_K}),
    ("tiny_gguf", "q3_k_m", False, {Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}),
    ("tiny_gguf", "q3_k_m", True, {Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}),
    ("tiny_gguf", "q2_k", False, {Q.Q2_K, Q.Q3_K, Q.Q6_K}), ("tiny_gguf", "q2_k", True, {Q.Q2_K, Q.Q3_K, Q.Q6_K}),
    ("tiny_gguf", "iq4_xs", False, {Q.IQ4_XS, Q.Q6_K}), ("tiny_gguf", "iq4_xs", True, {Q.IQ4_XS, Q.Q6_K}),
    ("tiny_qwen2_gguf", "iq4_nl", False, {Q.IQ4_NL, Q.Q6_K}),
    ("tiny_gguf", "iq4_nl", True, {Q.IQ4_NL, Q.Q6_K}),
    ("tiny_gguf", "iq3_s", False, {Q.IQ3_S, Q.Q6_K}), ("tiny_gguf", "iq3_s", True, {Q.IQ3_S, Q.Q6_K})])  # qwen2's untied 49152-row token_embd: 6 s
def test_every_tensor_bit_exact_vs_llama_quantize(request, model, preset, imat, expect):
    assert _compare_file(request.getfixturevalue(model), preset, imat) == expect


@pytest.mark.parametrize("preset,expect", [("iq3_xxs", {Q.IQ3_XXS, Q.IQ3_S, Q.IQ2_S, Q.Q5_K}),
                                           ("iq2_xxs", {Q.IQ2_XXS, Q.Q2_K, Q.Q5_K}),
                                           ("iq2_xs", {Q.IQ2_XS, Q.Q2_K, Q.Q5_K}),
                                           ("iq1_s", {Q.IQ1_S, Q.IQ2_XXS, Q.Q2_K, Q.Q5_K}),
                                           ("iq1_m", {Q.IQ1_M, Q.IQ2_XXS, Q.Q2_K, Q.Q5_K})])
def test_iq_every_tensor_bit_exact_vs_llama_quantize(tmp_path, preset, expect):
    """Every tensor of llama-quantize's iq3_xxs / iq2_xxs / iq2_xs / iq1_s / iq1_m file (4 layers, untied
    256-row vocab, random weights and imatrix; token_embd without one) = quantkit's bytes.
    The tiny HF model's whole file is compared in the pipeline test below."""
    src = tmp_path / "f16.gguf"
    shapes = _write_plain_gguf(src, "llama", 4, 256, 512, vocab=256, tied=False, seed=0)
    rng = np.random.default_rng(1)
    imatrix = {n: (rng.random(s[-1]) ** 3 * 40).astype(np.float32) for n, s in shapes.items()
               if n.startswith("blk.") and len(s) == 2}
    llama_quantize(src, tmp_path / "q.gguf", preset, imatrix=imatrix)
    base = _gguf_tensors(src)
    seen = set()
    for name, (qtype, data) in _gguf_tensors(tmp_path / "q.gguf").items():
        if qtype == Q.F32:
            continue
        rows = _float_rows(*base[name])
        qw = imatrix.get(name)
        ours = quantize_tensor(rows, qtype, None if qw is None else torch.from_numpy(qw)).numpy()
        assert np.array_equal(ours, np.asarray(data).reshape(ours.shape)), f"{name} {qtype.name}"
        seen.add(qtype)
    assert seen == expect


# the IQ mixes whose file adds a new encoder or rule set here; iq2_s / iq2_m / iq3_xs files hold
# only types and rules checked above (encoder bytes, test_iq_mixes_equal_llama_cpp): 6-9 s each
@pytest.mark.parametrize("preset", ["q4_k_m", "q4_0", "q3_k_m", "q2_k", "iq4_xs", "iq3_xxs",
                                    "iq2_xxs", "iq2_xs", "iq3_m"])
def test_pipeline_with_imatrix_file_equals_llama_quantize(tiny_gguf, preset):
    """The whole path: HF model -> quantize(method=gguf, imatrix=FILE) -> one GGUF file, equal
    to llama-quantize's, which llama.cpp then runs: its logits follow the 16-bit file's."""
    from quantkit.engines.llamacpp import LlamaCppModel
    from quantkit.pipeline.quantize import QuantizeRequest, quantize
    from quantkit.types import QuantScheme

    out = tiny_gguf["root"] / f"ours.{preset}.imat.gguf"
    quantize(QuantizeRequest(model=str(tiny_gguf["model"]), method="gguf", format="gguf", out=out,
                             scheme=QuantScheme(kind="kquant", gguf_type=preset),
                             method_options={"gguf_type": preset, "imatrix": str(tiny_gguf["imatrix"])}))
    ref = tiny_gguf["root"] / f"ref.pipeline.{preset}.gguf"
    values = load_imatrix(tiny_gguf["imatrix"]).values
    llama_quantize(tiny_gguf["base"], ref, preset, imatrix={k: v.numpy() for k, v in values.items()})
    ours, theirs = _gguf_tensors(out), _gguf_tensors(ref)
    assert set(ours) == set(theirs)
    for name, (qtype, data) in theirs.items():
        assert ours[name][0] == qtype, name
        assert np.array_equal(ours[name][1], data), name
    kv = read_gguf(out)[0]
    assert {"quantkit.version", "quantkit.metadata", "quantkit.stats"} <= set(kv)
    assert kv["general.file_type"] == PRESETS[preset].ftype
    assert not list(out.parent.glob(f".{out.name}.tmp-*"))
    base_llm, q_llm = (LlamaCppModel(p, n_ctx=64, logits_all=True) for p in (tiny_gguf["base"], out))
    try:
        ids = base_llm.tokenize("The quick brown fox jumps over the lazy dog.", add_bos=True)
        a, b = base_llm.logits(ids).astype(np.float64), q_llm.logits(ids).astype(np.float64)
        cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
        print(f"{preset}: logits cosine vs the 16-bit file, min {cos.min():.3f} mean {cos.mean():.3f}")
        # measured: q2_k 0.83, q3_k_m 0.96, iq3_xxs 0.757, iq3_m 0.926, iq3_xs 0.870, iq2_m 0.825,
        # iq2_s 0.727, iq2_xs 0.564, iq2_xxs 0.357 (llama.cpp's own bytes, asserted above; the
        # grid types follow the synthetic imatrix, not real activations, on random weights)
        assert cos.min() > {"q2_k": 0.8, "iq3_xxs": 0.7, "iq3_m": 0.88, "iq3_xs": 0.8, "iq2_m": 0.75,
                            "iq2_s": 0.65, "iq2_xs": 0.5, "iq2_xxs": 0.3}.get(preset, 0.95), cos
        assert len(q_llm.tokenize(q_llm.greedy("The quick brown", max_tokens=4))) > 0
    finally:
        base_llm.close()
        q_llm.close()


# ---------------------------------------------------------------- imatrix files and collection

@pytest.mark.fast
def test_imatrix_gguf_and_legacy_roundtrip(tmp_path):
    sums = {"blk.0.attn_q.weight": (torch.rand(256) * 10, 300), "blk.0.ffn_down.weight": (torch.rand(512), 7)}
    save_imatrix(tmp_path / "m.gguf", sums, datasets=["calib"], chunk_count=2, chunk_size=150)
    data = load_imatrix(tmp_path / "m.gguf")
    assert data.datasets == ["calib"] and data.chunk_count == 2 and not data.legacy
    for name, (s, c) in sums.items():
        assert torch.equal(data.values[name], s / float(c))
    # legacy .dat as llama-imatrix wrote it: values stored as mean * ncall
    import struct

    buf = struct.pack("<i", 1)
    name, ncall, vals = b"blk.3.attn_v.weight", 5, np.arange(1, 257, dtype=np.float32)
    buf += struct.pack("<i", len(name)) + name + struct.pack("<ii", ncall, vals.size) + vals.tobytes()
    buf += struct.pack("<i", 12) + struct.pack("<i", 4) + b"wiki"
    (tmp_path / "old.dat").write_bytes(buf)
    old = load_imatrix(tmp_path / "old.dat")
    assert old.legacy and old.datasets == ["wiki"] and old.chunk_count == 12
    assert torch.equal(old.values["blk.3.attn_v.weight"], torch.from_numpy(vals / np.float32(5)))


def _ctx(index: int, linears: dict, stats: dict):
    from quantkit.arch import ARCHS
    from quantkit.types import BlockContext, QuantScheme

    return BlockContext(index=index, block=torch.nn.Module(), linears=linears, stats=stats,
                        scheme=QuantScheme(kind="kquant", gguf_type="q4_k_m"), inputs=[torch.zeros(1)] * 4,
                        rerun=lambda: [], arch=ARCHS[0])


@pytest.mark.fast
def test_imatrix_from_pipeline_stats_equals_file_path(tmp_path):
    """sq_mean statistics (what the shared calibration loop gathers) -> the same bytes as the
    imatrix file they are saved to, and a file llama.cpp's loader format accepts."""
    from quantkit.arch import ARCHS

    spec = ARCHS[0]
    torch.manual_seed(0)
    lin = {"self_attn.q_proj": torch.nn.Linear(256, 256, bias=False),
           "mlp.down_proj": torch.nn.Linear(512, 256, bias=False)}
    shapes = {f"model.layers.0.{n}": tuple(m.weight.shape) for n, m in lin.items()}
    cfg = {"vocab_size": 512, "hidden_size": 256, "num_hidden_layers": 1, "tie_word_embeddings": True}
    stats = {n: {"sq_mean": torch.rand(m.in_features) * 100, "tokens": 1000} for n, m in lin.items()}
    collect = GGUFQuantizer("q4_k_m", imatrix="calib", imatrix_out=tmp_path / "im.gguf")
    assert collect.stats == ("sq_mean",) and collect.needs_calibration
    collect.prepare(cfg, spec, shapes)
    a = collect.quantize_block(_ctx(0, lin, stats))
    for n, r in a.items():  # the encoder's own error = the error of the decoded bytes
        w = lin[n].weight.data.double()
        deq = dequantize_tensor(r.extra["gguf_bytes"], int(r.extra["gguf_type"])).double()
        assert "dequantized" not in r.extra
        assert r.loss == pytest.approx(float((deq - w).norm() / w.norm()), rel=1e-6)
    collect.quantize_rest(torch.nn.Module(), spec)
    from_file = GGUFQuantizer("q4_k_m", imatrix=tmp_path / "im.gguf")
    assert not from_file.needs_calibration and from_file.stats == ()
    from_file.prepare(cfg, spec, shapes)
    b = from_file.quantize_block(_ctx(0, lin, {}))
    plain = GGUFQuantizer("q4_k_m")
    plain.prepare(cfg, spec, shapes)
    c = plain.quantize_block(_ctx(0, lin, {}))
    for n in lin:
        assert torch.equal(a[n].extra["gguf_bytes"], b[n].extra["gguf_bytes"])
        assert not torch.equal(a[n].extra["gguf_bytes"], c[n].extra["gguf_bytes"])
        w = lin[n].weight.data
        qw = stats[n]["sq_mean"] / 1000.0
        ref = ggml_quantize(w.numpy(), Q(int(a[n].extra["gguf_type"])), qw.numpy())
        assert np.array_equal(a[n].extra["gguf_bytes"].numpy(), ref)


@pytest.mark.fast
def test_imatrix_for_another_model_is_refused(tmp_path):
    from quantkit.arch import ARCHS

    save_imatrix(tmp_path / "other.gguf", {"blk.0.attn_q.weight": (torch.ones(128), 1)},
                 datasets=["x"], chunk_count=1, chunk_size=1)
    shapes = {"model.layers.0.self_attn.q_proj": (256, 256)}
    cfg = {"vocab_size": 512, "hidden_size": 256, "num_hidden_layers": 1, "tie_word_embeddings": True}
    q = GGUFQuantizer("q4_k_m", imatrix=tmp_path / "other.gguf")
    with pytest.raises(SchemeMismatch, match="128 values but the tensor has 256"):
        q.prepare(cfg, ARCHS[0], shapes)
    save_imatrix(tmp_path / "none.gguf", {"blk.0.unrelated.weight": (torch.ones(256), 1)},
                 datasets=["x"], chunk_count=1, chunk_size=1)
    with pytest.raises(SchemeMismatch, match="no entry for any tensor"):
        GGUFQuantizer("q4_k_m", imatrix=tmp_path / "none.gguf").prepare(cfg, ARCHS[0], shapes)
    with pytest.raises(SchemeMismatch, match="Unknown GGUF type"):
        GGUFQuantizer("q3_k_xl")
