"""Dense families beyond Llama: Gemma 3 (gemma3_text) and Phi-3, on tiny random models built
with their real transformers config classes (widths multiples of 256 for the K-quants).

Per family: every method quantizes through the one pipeline and loads back close to the
model; AWQ's scale folds keep the block's function (Gemma's (1 + w) norms, Phi-3's fused
gate_up_proj); the BF16 GGUF equals llama.cpp's own convert_hf_to_gguf.py output for the
same directory; the Q4_K_M GGUF equals llama.cpp's quantizer on that BF16 file, loads and
generates in real llama.cpp, and the int4 artifact generates in real vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf_reference import (
    assert_generates,
    assert_llama_cpp_logits_match,
    assert_same_gguf,
    convert_with_llama_cpp,
    gguf_contents,
)
from tiny_models import make_tiny_model

from quantkit.arch import spec_for_config
from quantkit.formats.gguf import read_gguf
from quantkit.loader import load_artifact
from quantkit.methods.fp8 import fp8_scheme
from quantkit.pipeline.quantize import QuantizeRequest, quantize
from quantkit.types import QuantScheme

FAMILIES = ["gemma3_text", "phi3"]
I4 = QuantScheme(bits=4, group_size=64)


def _make(out: Path, family: str) -> Path:
    # tied embeddings: the 49152-row vocabulary is most of the model, one copy keeps it fast
    d = make_tiny_model(out, family, layers=6 if family == "gemma3_text" else 2, seed=5, tie=True)
    if family == "phi3":  # llama.cpp's Phi-3 converter reads a BPE vocabulary only for this class
        p = d / "tokenizer_config.json"
        p.write_text(json.dumps({**json.loads(p.read_text()), "tokenizer_class": "GPT2Tokenizer"}))
    # non-trivial norms, so a wrong (1 + w) or a missed norm shows
    from safetensors.torch import load_file, save_file
    sd = load_file(d / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    for k, v in sd.items():
        if v.ndim == 1:
            sd[k] = (v.float() + 0.2 * torch.randn(v.shape, generator=g)).to(v.dtype)
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    return d


class Family:
    """A family's tiny model and the artifacts made from it (each made once per module)."""

    def __init__(self, name: str, root: Path):
        self.name, self.root = name, root
        # no family name in the path: llama.cpp sets Phi-3 token attributes when general.name
        # contains "phi3" and then needs </s>, <unk> and <s> in the vocabulary (llama-vocab.cpp)
        self.src = _make(root / "model", name)
        self._made: dict[str, Path] = {}

    def artifact(self, method: str) -> Path:
        if method not in self._made:
            out = self.root / (f"{method}.gguf" if method in ("q4_k_m", "bf16") else method)
            self._made[method] = _quantize(self.src, out, method)
        return self._made[method]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory) -> Family:
    return Family(request.param, tmp_path_factory.mktemp("family"))


def _quantize(src: Path, out: Path, method: str) -> Path:
    scheme, fmt, opts = {
        "rtn": (I4, "compressed-tensors", {}), "gptq": (I4, "compressed-tensors", {}),
        "awq": (I4, "compressed-tensors", {}),
        "fp8": (fp8_scheme("dynamic"), "compressed-tensors", {"scheme": "dynamic"}),
        "q4_k_m": (QuantScheme(kind="kquant", gguf_type="q4_k_m"), "gguf", {"gguf_type": "q4_k_m"}),
        "bf16": (QuantScheme(kind="kquant", gguf_type="bf16"), "gguf", {"gguf_type": "bf16"}),
    }[method]
    quantize(QuantizeRequest(model=str(src), method="gguf" if fmt == "gguf" else method,
                             scheme=scheme, out=out, format=fmt, method_options=opts,
                             calib="mixed", calib_samples=4, calib_seqlen=64))
    return out


# ---------------------------------------------------------------- methods, through the pipeline

def test_family_quantizes_with_every_method(family):
    """rtn, gptq, awq, fp8 (compressed-tensors) and Q4_K_M (GGUF) run on CPU; each directory
    artifact loads back and predicts what the model predicts."""
    name, src = family.name, family.src
    base = load_artifact(src)
    ids = torch.randint(10, 40000, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = base.model(ids).logits.float()
    for method in ("rtn", "gptq", "awq", "fp8"):
        out = family.artifact(method)
        meta = json.loads((out / "quantkit.json").read_text())
        assert meta["source_model"]["architecture"] == name
        with torch.no_grad():
            got = load_artifact(out).model(ids).logits.float()
        cos = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0).item()
        top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        print(f"{name} {method}: logits cosine {cos:.4f}, top-1 agreement {top1:.2f}")
        # int4 g64 on a random tiny model: cosine ~0.93-0.95 (int8 RTN: 0.9998); a wrong layout
        # or a lost norm offset is far below
        assert cos > (0.99 if method == "fp8" else 0.85), (method, cos)
    kv, tensors = read_gguf(family.artifact("q4_k_m"))
    assert kv["general.architecture"] == spec_for_config(base.model.config).gguf_arch
    assert {"Q4_K", "Q6_K"} <= {t.qtype.name for t in tensors.values()}


@pytest.mark.fast
@pytest.mark.parametrize("name", FAMILIES)
def test_awq_folds_keep_the_block_function(tmp_path, name):
    """Every scaling group's fold, with random scales, leaves the float block's output as it
    was: Gemma's norms fold into (1 + w), Phi-3's gate_up_proj -> down_proj into the up rows."""
    from transformers import AutoModelForCausalLM

    from quantkit.methods.scaling import fold_scale, scale_plans
    from quantkit.pipeline.blocks import get_blocks
    from quantkit.pipeline.capture import capture_block_inputs, run_block
    from quantkit.types import BlockContext

    src = _make(tmp_path / "m", name)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    spec = spec_for_config(model.config)
    blocks = get_blocks(model, spec)
    inputs = capture_block_inputs(model, blocks, [torch.randint(10, 40000, (1, 40))], torch.float32)
    block = blocks[0]
    before = run_block(block, inputs)[0]
    linears = {n: m for n, m in block.named_modules() if n in spec.block_linears}
    ctx = BlockContext(index=0, block=block, linears=linears, stats={}, scheme=I4, inputs=[],
                       rerun=lambda: [], arch=spec, options={}, collect=lambda *_: {})
    plans = scale_plans(ctx)
    assert {p.mode for p in plans} - {"skip"} and all(p.mode != "skip" or p.reason for p in plans)
    g = torch.Generator().manual_seed(2)
    for plan in plans:
        if plan.mode in ("norm", "linear"):
            k = next(iter(plan.balance.values())).in_features
            ones = {b: torch.ones(k) for b in plan.balance}
            fold_scale(plan, 0.5 + torch.rand(k, generator=g), ones, {}, {})
    after = run_block(block, inputs)[0]
    err = ((after - before).norm() / before.norm()).item()
    assert err < 1e-4, err
    folded = [p.group.prev for p in plans if p.mode in ("norm", "linear")]
    assert folded == {"gemma3_text": ["input_layernorm", "pre_feedforward_layernorm", "mlp.up_proj"],
                      "phi3": ["input_layernorm", "post_attention_layernorm", "mlp.gate_up_proj"]}[name]


@pytest.mark.fast
def test_every_block_gets_its_own_kwargs(tmp_path):
    """Gemma 3's global layer (block 5) runs with its own mask and rotary table: blocks fed the
    captured inputs one after the other reproduce the model's hidden states exactly."""
    from transformers import AutoModelForCausalLM

    from quantkit.pipeline.blocks import get_blocks
    from quantkit.pipeline.capture import capture_block_inputs, run_block

    model = AutoModelForCausalLM.from_pretrained(_make(tmp_path / "g", "gemma3_text"),
                                                 dtype=torch.float32).eval()
    assert model.config.layer_types[5] == "full_attention" and model.config.sliding_window < 80
    blocks = get_blocks(model, spec_for_config(model.config))
    ids = torch.randint(10, 40000, (1, 80))
    inputs = capture_block_inputs(model, blocks, [ids], torch.float32)
    cos0, cos5 = (inputs.block_kwargs[i][0]["position_embeddings"][0] for i in (0, 5))
    assert not torch.equal(cos0, cos5)  # local (10k) and global (1M) rotary bases
    for i, block in enumerate(blocks):
        inputs = inputs.with_hidden(run_block(block, inputs), i + 1)
    with torch.no_grad():
        want = model.model(ids).last_hidden_state
    assert torch.equal(model.model.norm(inputs.hidden[0]), want)


# ---------------------------------------------------------------- GGUF: llama.cpp's converter

@pytest.mark.engine
def test_bf16_gguf_equals_llama_cpp_converter_and_runs(family, tmp_path):
    """Same tensor names, shapes, types and bytes and the same KV (but general.* provenance)
    as convert_hf_to_gguf.py --outtype bf16; llama.cpp then computes transformers' logits."""
    name, src = family.name, family.src
    ours = family.artifact("bf16")
    assert_same_gguf(ours, convert_with_llama_cpp(src, tmp_path / "ref.bf16.gguf"))

    assert_llama_cpp_logits_match(ours, src, name)


@pytest.mark.engine
def test_q4_k_m_equals_llama_quantize_and_generates(family, tmp_path):
    """quantkit's Q4_K_M = llama_model_quantize(Q4_K_M) of the BF16 export, type and byte for
    byte (Phi-3's fused attn_qkv follows attn_v's rule: llama.cpp's category_is_attn_v branch
    comes before its ATTENTION_QKV one); it generates in llama.cpp; the int4 artifact in vLLM."""
    from vllm_checks import vllm_runs

    from quantkit.engines.llamacpp import llama_quantize
    from quantkit.engines.vllm import run_vllm
    from quantkit.errors import EngineError
    from quantkit.info import artifact_info
    from quantkit.report.rows import scheme_text

    name = family.name
    ours = family.artifact("q4_k_m")
    llama_quantize(family.artifact("bf16"), tmp_path / "lq.gguf", "q4_k_m")
    (_, t_a), (_, t_b) = gguf_contents(ours), gguf_contents(tmp_path / "lq.gguf")
    assert {t: v[:2] for t, v in t_a.items()} == {t: v[:2] for t, v in t_b.items()}
    assert [t for t in t_b if t_a[t][2] != t_b[t][2]] == []
    if name == "phi3":  # use_more_bits(i, 2): layer 1 only
        assert [t_a[f"blk.{i}.attn_qkv.weight"][0] for i in (0, 1)] == ["Q4_K", "Q6_K"]
    # a file quantkit did not write is labelled by its own general.file_type in reports
    theirs = artifact_info(tmp_path / "lq.gguf")
    assert (theirs["method"], theirs["gguf_file_type"]) == ("unknown", "q4_k_m")
    assert scheme_text(theirs.get("scheme"), theirs) == "q4_k_m (file type)"
    assert scheme_text(artifact_info(ours)["scheme"], artifact_info(ours)) == "q4_k_m"
    assert_generates(ours)

    rtn = family.artifact("rtn")
    prompt = [{"prompt": "The capital of France is", "max_tokens": 4}]
    if vllm_runs("int4"):
        assert len(run_vllm(rtn, generate=prompt, max_model_len=128)["generate"][0]) > 0
    else:  # vLLM's int4 CPU kernel is missing on AVX2-only CPUs
        with pytest.raises(EngineError) as e:
            run_vllm(rtn, generate=prompt, max_model_len=128)
        assert "object has no attribute 'cpu_gemm_wna16'" in str(e.value) + e.value.log


def test_gemma3_gguf_refuses_layer_types_llama_cpp_would_not_run(tmp_path):
    """llama.cpp's gemma3 takes every 6th layer as global (the converter writes no pattern):
    other layer_types are refused before any work, not written into a GGUF that runs wrong."""
    from quantkit.errors import UnsupportedArchitecture

    src = make_tiny_model(tmp_path / "g", "gemma3_text", layers=2)
    cfg = json.loads((src / "config.json").read_text())
    cfg["layer_types"] = ["sliding_attention", "full_attention"]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitecture, match="every 6th layer global"):
        _quantize(src, tmp_path / "x.gguf", "bf16")
    assert not (tmp_path / "x.gguf").exists()
