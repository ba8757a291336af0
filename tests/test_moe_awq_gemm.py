"""AutoAWQ GEMM (--format awq) on mixture-of-experts models: the hand decode against
compressed-tensors, both input layouts, modules_to_not_convert entries, and vLLM's reading of
them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from moe_models import (
    AWQ_FASTER,
    _quantize,
)
from tiny_models import make_tiny_model

from quantkit.arch import spec_for_config
from quantkit.formats.common import load_tensors
from quantkit.pipeline.quantize import linear_shapes
from quantkit.types import QuantScheme

ASYM = QuantScheme(bits=4, group_size=64, symmetric=False)


@pytest.fixture(scope="module")
def awq_gemm_moe(tmp_path_factory) -> Path:
    """A small Qwen3-MoE whose block 0 is dense (mlp_only_layers): hidden 128, 4 heads of 32, a
    dense MLP of 256 in block 0, 4 experts of 128 in block 1. Block 0's `mlp.gate_proj` is what
    a short `mlp.gate` entry in AutoAWQ's substring-matched modules_to_not_convert would also
    skip. Hidden 128, not 64: vLLM takes AutoAWQMoEMethod only where hidden % 128 == 0
    (check_moe_marlin_supports_config), else MoeWNA16, which needs a CUDA GPU."""
    return make_tiny_model(tmp_path_factory.mktemp("qwen3moe_dense0"), "qwen3_moe", hidden=128,
                           intermediate=256, moe={"num_experts": 4, "moe_intermediate_size": 128,
                                                  "mlp_only_layers": [0]})


@pytest.fixture(scope="module")
def awq_gemm_pair(awq_gemm_moe, tmp_path_factory) -> dict[str, Path]:
    """One RTN scheme (asymmetric: real zero points) written as AutoAWQ GEMM and as
    compressed-tensors (RTN reads no calibration: both runs quantize the same weights)."""
    root = tmp_path_factory.mktemp("awq_gemm_pair")
    return {fmt: _quantize(awq_gemm_moe, root / fmt, "rtn", scheme=ASYM, format=fmt)
            for fmt in ("awq", "compressed-tensors")}


def _autoawq_decode(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [N, K], zeros [N, G], scales [N, G]) of one AutoAWQ GEMM Linear, unpacked by hand
    (not quantkit's unpack_awq): nibble i of int32 word c holds output column 8c +
    (0, 2, 4, 6, 1, 3, 5, 7)[i], so vLLM's reverse order (0, 4, 1, 5, 2, 6, 3, 7) over the
    nibbles gives the columns in order; qweight rows are input columns, qzeros rows groups."""
    def unpack(words: torch.Tensor) -> torch.Tensor:
        w = words.to(torch.int64) & 0xFFFFFFFF
        nibbles = (w[..., None] >> (4 * torch.arange(8))) & 0xF
        return nibbles[..., [0, 4, 1, 5, 2, 6, 3, 7]].reshape(w.shape[0], -1)

    return unpack(qweight).T, unpack(qzeros).T, scales.T


def test_awq_gemm_moe_decodes_to_the_compressed_tensors_weights(awq_gemm_pair):
    """Every Linear of the AutoAWQ GEMM artifact (dense block, attention, each expert's
    gate/up/down under vLLM's FusedMoE names) decodes by hand to the compressed-tensors
    artifact's codes and zero points of the same RTN run, its scales being the same float32
    values in fp16 instead of bf16; quantkit's reader gives exactly the hand-decoded weights;
    everything else (router, norms, embeddings) is the same bytes. modules_to_not_convert
    names the router of the MoE block alone (vLLM matches entries as substrings: `mlp.gate`
    would also skip block 0's gate_proj). quantkit's loader runs it (what `quantkit eval`
    reads) close to the compressed-tensors artifact, and `quantkit verify` says why
    TensorRT-LLM cannot read it."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    from quantkit.engines.trtllm_rules import verify
    from quantkit.formats.awq_gemm import read_awq_gemm
    from quantkit.loader import load_artifact

    awq, ct = (load_tensors(awq_gemm_pair[f]) for f in ("awq", "compressed-tensors"))
    bases = sorted(k.removesuffix(".qweight") for k in awq if k.endswith(".qweight"))
    assert bases == sorted(k.removesuffix(".weight_packed") for k in ct if k.endswith(".weight_packed"))
    assert len([b for b in bases if ".mlp.experts." in b]) == 4 * 3
    assert {"model.layers.0.mlp.gate_proj", "model.layers.1.mlp.experts.3.down_proj"} <= set(bases)
    decoded = read_awq_gemm(awq_gemm_pair["awq"])
    for base in bases:
        codes, zeros, scales = _autoawq_decode(awq[f"{base}.qweight"], awq[f"{base}.qzeros"],
                                               awq[f"{base}.scales"])
        n, k = ct[f"{base}.weight_shape"].tolist()
        assert codes.shape == (n, k) and scales.dtype == torch.float16
        ct_codes = unpack_from_int32(ct[f"{base}.weight_packed"], 4, torch.Size([n, k])) + 8
        ct_zeros = unpack_from_int32(ct[f"{base}.weight_zero_point"], 4,
                                     torch.Size([n, k // 64]), packed_dim=0) + 8
        assert torch.equal(codes, ct_codes.long()) and torch.equal(zeros, ct_zeros.long()), base
        assert not torch.all(zeros == 8)  # asymmetric: real zero points
        assert torch.allclose(scales.float(), ct[f"{base}.weight_scale"].float(), rtol=2**-8,
                              atol=0), base
        g = torch.arange(k) // 64
        want = (codes - zeros[:, g]).float() * scales.float()[:, g]
        assert torch.equal(decoded[f"{base}.weight"], want), base
    awq_rest = {k: v for k, v in awq.items() if not k.endswith((".qweight", ".qzeros", ".scales"))}
    ct_rest = {k: v for k, v in ct.items() if not k.rsplit(".", 1)[-1].startswith("weight_")}
    assert awq_rest.keys() == ct_rest.keys() and "model.layers.1.mlp.gate.weight" in awq_rest
    assert all(torch.equal(v, ct_rest[k]) and v.dtype == ct_rest[k].dtype for k, v in awq_rest.items())
    qcfg = json.loads((awq_gemm_pair["awq"] / "config.json").read_text())["quantization_config"]
    assert qcfg["modules_to_not_convert"] == ["lm_head", "model.layers.1.mlp.gate"]

    ids = torch.arange(1, 65)[None]
    with torch.no_grad():
        ours, ref = (load_artifact(awq_gemm_pair[f]).model.float()(ids).logits
                     for f in ("awq", "compressed-tensors"))
    err = float((ours - ref).norm() / ref.norm())
    print(f"loader logits, AutoAWQ GEMM vs compressed-tensors: relative difference {err:.2e}")
    assert err < 1e-2
    report = verify(awq_gemm_pair["awq"])
    assert not report.conformant and "load_hf_quant_config has no branch for awq" in \
        report.problems[0].why


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_awq_gemm_moe_layouts_give_identical_artifacts(arch, awq_gemm_moe, mixtral_model, tmp_path):
    """--format awq from streamed per-expert shards and from transformers 5's fused 3-D experts
    (--no-stream): the same bytes; every expert's qweight [K, N/8] / qzeros / scales under the
    checkpoint names vLLM's FusedMoE loader maps (Mixtral: block_sparse_moe.experts.{e}.w1/w3/
    w2), the router bf16 and named in modules_to_not_convert block by block. Qwen3-MoE by AWQ
    (norm scales folded, routers compensated), Mixtral by GPTQ (per-expert Hessians)."""
    from quantkit.loader import load_artifact

    if arch == "qwen3_moe":
        model, method, options, moe, blocks = awq_gemm_moe, "awq", AWQ_FASTER, "mlp", (1,)
        projs, experts, widths = ("gate_proj", "up_proj", "down_proj"), 4, (128, 128)
    else:
        model, method, options, moe, blocks = mixtral_model, "gptq", {}, "block_sparse_moe", (0, 1)
        projs, experts, widths = ("w1", "w3", "w2"), 4, (128, 128)
    kw = {"format": "awq", "method_options": options, "calib_samples": 4}  # 256 tokens
    streamed = _quantize(model, tmp_path / "streamed", method, **kw)
    fused = _quantize(model, tmp_path / "fused", method, stream=False, **kw)
    assert (streamed / "model.safetensors").read_bytes() == (fused / "model.safetensors").read_bytes()
    t = load_tensors(streamed)
    hidden, inter = widths
    for i in blocks:
        for e in range(experts):
            for p in projs:
                k, n = (inter, hidden) if p in ("down_proj", "w2") else (hidden, inter)
                base = f"model.layers.{i}.{moe}.experts.{e}.{p}"
                assert t[f"{base}.qweight"].shape == (k, n // 8)
                assert t[f"{base}.qzeros"].shape == (k // 64, n // 8)
                assert t[f"{base}.scales"].shape == (k // 64, n)
                assert f"{base}.weight" not in t
        assert t[f"model.layers.{i}.{moe}.gate.weight"].dtype == torch.bfloat16
    if arch == "mixtral":
        assert not any(".mlp." in k for k in t)
    qcfg = json.loads((streamed / "config.json").read_text())["quantization_config"]
    assert qcfg["modules_to_not_convert"] == ["lm_head"] + [f"model.layers.{i}.{moe}.gate"
                                                           for i in blocks]
    with torch.no_grad():
        assert torch.isfinite(load_artifact(streamed).model(torch.arange(1, 33)[None]).logits).all()


@pytest.mark.fast
def test_awq_gemm_refuses_entries_that_name_quantized_linears(awq_gemm_moe):
    """vLLM leaves a module unquantized when any modules_to_not_convert entry is a SUBSTRING of
    its name. On the names of the small Qwen3-MoE (dense block 0, MoE block 1), from its config
    alone: the router pattern becomes the one MoE block's router, which occurs in no quantized
    name; a short `mlp.gate` (what one entry for every router would be) also occurs in block
    0's gate_proj and is refused, naming it; vLLM's fused names count too (`self_attn.qkv`
    occurs only in the fused qkv_proj)."""
    from quantkit.formats.awq_gemm import not_convert_entries
    from quantkit.model_io import load_config, meta_model
    from quantkit.pipeline.experts import linearize_experts

    config = load_config(awq_gemm_moe)
    spec = spec_for_config(config)
    quantized = set(linear_shapes(config, spec))
    kept = {n.rpartition(".")[0] for n in linearize_experts(meta_model(config), spec).state_dict()
            } - quantized
    assert "model.layers.1.mlp.gate" in kept and "model.layers.0.mlp.gate_proj" in quantized
    assert not_convert_entries(["lm_head", r"re:.*mlp\.gate$"], kept, quantized) == (
        ["lm_head", "model.layers.1.mlp.gate"], [])
    entries, problems = not_convert_entries(["lm_head", "mlp.gate", "self_attn.qkv"], kept, quantized)
    assert entries == ["lm_head", "mlp.gate", "self_attn.qkv"]
    assert problems == [
        "modules_to_not_convert entry 'mlp.gate' is a substring of the quantized "
        "'model.layers.0.mlp.gate_proj', which vLLM would then load unquantized",
        "modules_to_not_convert entry 'self_attn.qkv' is a substring of the quantized "
        "'model.layers.0.self_attn.qkv_proj', which vLLM would then load unquantized"]


# vLLM's own substring match (quant_utils.is_layer_skipped, as AutoAWQConfig.get_quant_method
# calls it: the model's packed_modules_mapping for Linears, none for the experts module) on the
# module prefixes vLLM builds for an artifact; argv: request JSON {artifact: [prefix, ...]}, out
_VLLM_SKIP_SCRIPT = """\
import json, sys
from vllm.model_executor.layers.quantization.auto_awq import AutoAWQConfig
from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
from vllm.model_executor.models.mixtral import MixtralForCausalLM
from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM
out = {}
for path, prefixes in json.load(open(sys.argv[1])).items():
    config = json.load(open(path + "/config.json"))
    cls = {"Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
           "MixtralForCausalLM": MixtralForCausalLM}[config["architectures"][0]]
    quant = AutoAWQConfig.from_config(config["quantization_config"])
    quant.apply_vllm_mapper(cls.hf_to_vllm_mapper.get_rename_mapper())
    mapping = dict(cls.packed_modules_mapping)
    if config.get("mlp_only_layers"):  # what Qwen3MoeForCausalLM.__init__ adds
        mapping["gate_up_proj"] = ["gate_proj", "up_proj"]
    out[path] = {p: is_layer_skipped(p, quant.modules_to_not_convert,
                                     {} if p.endswith(".experts") else mapping,
                                     match_mode="substring") for p in prefixes}
json.dump(out, open(sys.argv[2], "w"))
"""


def _vllm_prefixes(artifact: Path) -> dict[str, bool]:
    """The module prefixes vLLM's Qwen3-MoE / Mixtral build for an AutoAWQ artifact, each with
    whether it must stay unquantized (the routers): q/k/v fused into qkv_proj, a dense
    gate/up into gate_up_proj, each block's experts one `experts` module."""
    out = {}
    for key in load_tensors(artifact):
        if key.endswith(".gate.weight"):
            out[key.removesuffix(".weight")] = True
        if not key.endswith(".qweight"):
            continue
        head, _, last = key.removesuffix(".qweight").rpartition(".")
        if ".experts." in key:
            out[key.split(".experts.")[0] + ".experts"] = False
        elif last in ("q_proj", "k_proj", "v_proj"):
            out[f"{head}.qkv_proj"] = False
        elif last in ("gate_proj", "up_proj"):
            out[f"{head}.gate_up_proj"] = False
        else:
            out[f"{head}.{last}"] = False
    return out


@pytest.mark.engine
def test_awq_gemm_moe_in_real_vllm(awq_gemm_pair, mixtral_model, tmp_path):
    """The AutoAWQ GEMM MoE artifacts in vLLM 0.32. vLLM's own is_layer_skipped, fed their
    modules_to_not_convert as vLLM reads it, skips exactly the routers among the modules vLLM
    builds (the dense block's gate_up_proj, qkv_proj, o_proj, down_proj and every experts
    module stay quantized). Where the probe finds vLLM's CPU MoE int4 kernel (AMX), both load
    and generate and vLLM's top-1 predictions agree with quantkit's loader; without it vLLM
    refuses at engine start, in AutoAWQMoEMethod (the experts were not skipped), after its
    Linears took the CPU WNA16 kernel."""
    from vllm_checks import agreement, agreement_floor, heldout_ids, vllm_runs

    from quantkit.engines.vllm import run_vllm, run_vllm_worker
    from quantkit.errors import EngineError
    from quantkit.loader import load_artifact

    qwen = awq_gemm_pair["awq"]
    mixtral = _quantize(mixtral_model, tmp_path / "mixtral", "rtn", scheme=ASYM, format="awq")
    want = {str(p.resolve()): _vllm_prefixes(p) for p in (qwen, mixtral)}
    assert want[str(qwen.resolve())]["model.layers.0.mlp.gate_up_proj"] is False
    (tmp_path / "skip.py").write_text(_VLLM_SKIP_SCRIPT)
    (tmp_path / "req.json").write_text(json.dumps({p: sorted(v) for p, v in want.items()}))
    proc = run_vllm_worker(tmp_path / "skip.py", [str(tmp_path / "req.json"),
                                                  str(tmp_path / "resp.json")],
                           cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.log[-3000:]
    assert json.loads((tmp_path / "resp.json").read_text()) == want

    prompt = [{"prompt": "The capital of France is", "max_tokens": 4}]
    if vllm_runs("int4", moe=True):
        for path in (qwen, mixtral):
            ids = heldout_ids(load_artifact(path).tokenizer, 256)
            res = run_vllm(path, generate=prompt, score=[ids], max_model_len=512)
            assert len(res["generate"][0]) > 0
            share = agreement(path, res["score"][0]["top1"], ids)
            print(f"{path.name} AutoAWQ GEMM in vLLM vs quantkit loader top-1 agreement: {share:.3f}")
            assert share >= agreement_floor(path, ids)
        return
    with pytest.raises(EngineError) as e:
        run_vllm(qwen, generate=prompt, max_model_len=256)
    print(f"vLLM refused: {e.value}")
    assert "No WNA16 MoE backend supports the deployment configuration." in str(e.value)
    assert "Using CPUWNA16LinearKernel for AutoAWQMarlinLinearMethod" in e.value.log
    assert "return AutoAWQMoEMethod(self, layer.moe_config)" in e.value.log
