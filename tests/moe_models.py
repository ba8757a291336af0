"""The tiny mixture-of-experts models and helpers that tests/test_moe_*.py share.

Registered as a plugin in tests/conftest.py, so each model fixture is built once per session
and shared by every MoE test file (a fixture imported into two test modules would be built
twice). The session's fixtures name their temporary dirs "session-*" (tests/conftest.py keeps
those until the run ends).

The tiny model is a real Qwen3MoeForCausalLM (hidden 256, 2 layers, 8 experts, top-2,
moe_intermediate 256) with random weights, saved by transformers 5 (per-expert tensors on
disk, fused 3-D experts in memory).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_model

from quantkit.arch import spec_for_config
from quantkit.pipeline.quantize import QuantizeRequest, quantize
from quantkit.types import QuantScheme

SCHEME = QuantScheme(bits=4, group_size=64)
STARVED = (6, 7)  # experts the starved model's router never picks


def _quantize(model: Path, out: Path, method: str, **kw) -> Path:
    req = QuantizeRequest(model=str(model), method=method, scheme=kw.pop("scheme", SCHEME),
                          out=out, calib_samples=kw.pop("calib_samples", 8), calib_seqlen=64,
                          resume=False, **kw)
    quantize(req)
    return out


@pytest.fixture(scope="session")
def moe_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("session-qwen3moe"), "qwen3_moe")


@pytest.fixture(scope="session")
def starved_model(tmp_path_factory) -> Path:
    """Routers that never pick experts 6 and 7: hidden dimension 0 carries a constant +0.5 from
    the embeddings (no o_proj / expert down_proj writes to it), so after the norm it is large
    and positive for every token, and those two experts' router rows read it with weight -4."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path_factory.mktemp("session-qwen3moe_starved"), "qwen3_moe",
                           seed=1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 0.5
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0
            layer.mlp.experts.down_proj[:, 0] = 0
            layer.mlp.gate.weight[:, 0] = 0
            layer.mlp.gate.weight[list(STARVED), 0] = -4.0
    model.save_pretrained(path)
    return path


FP8 = QuantScheme(kind="fp8", bits=8, group_size=-1)


# AWQ in the tests: a coarser grid than the default 20 x 20 (the MoE block's loss runs every
# expert per candidate; the tiny model's choice is the same kind, at a third of the time)
AWQ_FAST = {"n_grid": 8, "clip_grid": 8}


def _first_block_linearized(model_dir: Path):
    """The float32 model with per-expert Linears, its arch row, block 0 and that block's
    context (what the fold tests act on)."""
    from transformers import AutoModelForCausalLM

    from quantkit.pipeline.experts import linearize_experts

    spec = spec_for_config(json.loads((model_dir / "config.json").read_text()))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    linearize_experts(model, spec)
    block = model.model.layers[0]
    return spec, model, block, _block_context(block, spec)


def _moe_and_router_logits(block, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block `block`'s MoE output and router logits for hidden states `h` (through its
    post-attention norm): what a scale fold must leave unchanged."""
    with torch.no_grad():
        x = block.post_attention_layernorm(h)
        return block.mlp(x), torch.nn.functional.linear(x, block.mlp.gate.weight)


def _block_context(block, spec):
    from quantkit.types import BlockContext

    linears = {n: m for n, m in block.named_modules() if isinstance(m, torch.nn.Linear)}
    return BlockContext(index=0, block=block, linears=linears, stats={}, scheme=SCHEME,
                        inputs=[], rerun=list, arch=spec)


AWQ_FASTER = {"n_grid": 4, "clip_grid": 4}


@pytest.fixture(scope="session")
def mixtral_model(tmp_path_factory) -> Path:
    """A real MixtralForCausalLM (hidden 128, 2 layers, 4 experts of 128, top-2), saved by
    transformers 5: legacy names block_sparse_moe.experts.{e}.w1/w3/w2 on disk."""
    return make_tiny_model(tmp_path_factory.mktemp("session-mixtral"), "mixtral", hidden=128,
                           intermediate=128)


def _mixtral(model: Path, out: Path, method: str, **kw) -> Path:
    options = {"awq": AWQ_FAST, "fp8": {"scheme": "dynamic"}}.get(method, {})
    scheme = FP8 if method == "fp8" else SCHEME
    req = QuantizeRequest(model=str(model), method=method, scheme=scheme, out=out, calib_samples=4,
                          calib_seqlen=64, resume=False, method_options=options, **kw)
    quantize(req)
    return out


# quantkit's MoE schemes -> llm-compressor's preset of the same scheme
MOE_PRESETS = {"nvfp4": "NVFP4A16", "mxfp4": "MXFP4A16", "int8": "W8A8", "w4a4": "NVFP4",
               "fp8": "FP8"}


MOE_CALIB = {"calib_samples": 1, "calib_seqlen": 16}  # the reference's window (llmc_moe)


@pytest.fixture(scope="session")
def small_moe(tmp_path_factory) -> Path:
    """A smaller Qwen3-MoE (hidden 64, 2 layers, 2 heads, 4 experts of 64, top-2): FP4 groups of
    16 / 32 tile it, and each quantization takes a fraction of the hidden-256 model's time."""
    return make_tiny_model(tmp_path_factory.mktemp("session-qwen3moe_small"), "qwen3_moe",
                           hidden=64, intermediate=64, heads=2,
                           kv_heads=1,  # head_dim 32: vLLM CPU's least
                           moe={"num_experts": 4, "moe_intermediate_size": 64})


@pytest.fixture(scope="session")
def llmc_moe(small_moe, tmp_path_factory) -> dict[str, Path]:
    """llm-compressor 0.14.0.1's artifacts of the small Qwen3-MoE (its own venv; it linearizes
    transformers 5's fused experts into per-expert Linears itself, and by default sends every
    token through every expert for statistics). Only NVFP4 (W4A4) and FP8 (static) read
    activations: their input scales come from one 16-token window, which quantkit calibrates
    on as well."""
    from llmc_reference import run_reference

    from quantkit.calibration import load_calibration
    from quantkit.model_io import load_tokenizer

    ids = load_calibration("mixed", load_tokenizer(small_moe), n_samples=MOE_CALIB["calib_samples"],
                           seqlen=MOE_CALIB["calib_seqlen"], seed=0).input_ids
    refs = run_reference(small_moe, ids, tmp_path_factory.mktemp("session-llmc_moe"),
                         list(MOE_PRESETS.values()))
    assert all(isinstance(p, Path) for p in refs.values()), refs
    return {k: refs[p] for k, p in MOE_PRESETS.items()}


def _same_config_as_llmc(ours: Path, ref: Path) -> None:
    """quantization_config equal but for the compressed-tensors version's fields and how the
    routers are ignored: llm-compressor lists each router, quantkit one regex matching them."""
    import re

    c_ours = json.loads((ours / "config.json").read_text())["quantization_config"]
    c_ref = json.loads((ref / "config.json").read_text())["quantization_config"]
    assert c_ref.pop("version") == "0.19.0" and c_ours.pop("version", None) is None
    for k in ("sparsity_config", "transform_config"):
        assert not c_ref.pop(k) and not c_ours.pop(k, None)
    assert c_ours.pop("ignore") == ["lm_head", r"re:.*mlp\.gate$"]
    assert sorted(c_ref.pop("ignore")) == ["lm_head", "model.layers.0.mlp.gate",
                                           "model.layers.1.mlp.gate"]
    assert all(re.match(r".*mlp\.gate$", f"model.layers.{i}.mlp.gate") for i in (0, 1))
    assert c_ours == c_ref


def _headers_match_reference(ours: Path, ref: Path, scale_suffix: str) -> dict:
    """Our tensor names, dtypes and shapes are the reference writer's, except scales (names
    ending in `scale_suffix`), which quantkit keeps in F32; returns our headers."""
    from tiny_models import tensor_headers

    h_ours, h_ref = tensor_headers(ours), tensor_headers(ref)
    assert h_ours.keys() == h_ref.keys()
    for name, (dtype, shape) in h_ref.items():
        want = ("F32", shape) if name.endswith(scale_suffix) else (dtype, shape)
        assert h_ours[name] == want, name
    return h_ours
