"""The families no table row of quantkit names (quantkit.arch.discover carries them): their tiny
random models, built once per session, and the checks the discovered-family test files share.

Registered as a plugin in tests/conftest.py, so test_discovered_families.py,
test_discovered_families_2026.py and test_discovered_families_vllm.py share one build of each
model and one GPTQ artifact of each (a fixture imported into two modules is built twice).
Models come from transformers' own config and model classes, saved as a user's checkpoint would
be (save_pretrained writes the per-expert names the Hub uses), with SmolLM2's tokenizer.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from tiny_models import smollm_dir

from quantkit.arch import spec_for_config
from quantkit.loader import load_artifact
from quantkit.methods.fp8 import fp8_scheme
from quantkit.pipeline.quantize import QuantizeRequest, quantize
from quantkit.types import QuantScheme

I4 = QuantScheme(bits=4, group_size=64)
QUANT_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")
_COMMON = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=49152)
_MOE = dict(num_experts_per_tok=2)
# GLM-4.5's head_dim: its checkpoints' config.json carries it and vLLM's glm4_moe.py reads it
# ("'Glm4MoeConfig' object has no attribute 'head_dim'" without), transformers' class keeps it


@dataclass(frozen=True)
class Family:
    config_cls: str
    model_cls: str
    settings: dict
    methods: tuple[str, ...]  # GPTQ everywhere; RTN and FP8 where the family brings a layout
    tied: bool = False


# the Qwen3.5 models get 4 blocks: three Gated DeltaNet (linear attention) blocks, then one of
# gated full attention, as their default layer pattern repeats. The Mamba2 mixers (Nemotron-H,
# Granite 4 hybrid) have 32 heads of 16: in_proj's width 2 * 512 + 2 * groups * state + heads
# is then a multiple of 32, which vLLM's CPU int4 kernel (CPUWNA16) needs; 8 heads of 64 gave
# 1096 and vLLM's "Failed to find a kernel that can implement the WNA16 linear layer."
FAMILIES: dict[str, Family] = {
    "olmo3": Family("Olmo3Config", "Olmo3ForCausalLM", dict(intermediate_size=512), ("gptq",),
                    tied=True),
    "qwen3_5": Family("Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
                      dict(intermediate_size=512, head_dim=64, num_hidden_layers=4),
                      ("gptq", "rtn", "fp8"), tied=True),
    "glm4_moe": Family("Glm4MoeConfig", "Glm4MoeForCausalLM",
                       dict(intermediate_size=512, n_routed_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=256, first_k_dense_replace=1, head_dim=64),
                       ("gptq",), tied=True),
    "qwen3_5_moe": Family("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                          dict(moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2,
                               head_dim=64, num_hidden_layers=4), ("gptq", "rtn", "fp8"),
                          tied=True),
    "qwen3_next": Family("Qwen3NextConfig", "Qwen3NextForCausalLM",
                         dict(intermediate_size=512, moe_intermediate_size=256, num_experts=4,
                              head_dim=64, num_hidden_layers=4, **_MOE), ("gptq", "rtn", "fp8")),
    "deepseek_v32": Family("DeepseekV32Config", "DeepseekV32ForCausalLM",
                           dict(num_key_value_heads=4, n_routed_experts=4,
                                moe_intermediate_size=256, intermediate_size=512,
                                first_k_dense_replace=1, n_group=2, topk_group=1, **_MOE),
                           ("gptq", "rtn")),
    "gemma4": Family("Gemma4TextConfig", "Gemma4ForCausalLM",
                     dict(intermediate_size=512, head_dim=64), ("gptq", "rtn", "fp8")),
    "llama4": Family("Llama4TextConfig", "Llama4ForCausalLM",
                     dict(intermediate_size=256, intermediate_size_mlp=512, num_local_experts=4,
                          interleave_moe_layer_step=2, **_MOE), ("gptq",)),
    "nemotron_h": Family("NemotronHConfig", "NemotronHForCausalLM",
                         dict(num_hidden_layers=4, hybrid_override_pattern="ME*-",
                              mamba_num_heads=32, mamba_head_dim=16, ssm_state_size=16,
                              n_groups=2, n_routed_experts=4, moe_intermediate_size=256,
                              moe_shared_expert_intermediate_size=256, intermediate_size=512,
                              head_dim=64, **_MOE), ("gptq", "rtn", "fp8")),
    "granitemoehybrid": Family("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
                               dict(intermediate_size=256, shared_intermediate_size=512,
                                    num_local_experts=4, mamba_n_heads=32, mamba_d_head=16,
                                    mamba_d_state=16, mamba_n_groups=2, num_hidden_layers=2,
                                    layer_types=["mamba", "attention"], **_MOE),
                               ("gptq", "rtn")),
    # scoring_func: MiniMax's own checkpoints carry it in config.json (vLLM's minimax_m2.py
    # reads it); transformers' MiniMaxM2Config has no such field and keeps it as given
    "minimax_m2": Family("MiniMaxM2Config", "MiniMaxM2ForCausalLM",
                         dict(intermediate_size=256, rotary_dim=32, num_local_experts=4,
                              head_dim=64, scoring_func="sigmoid", **_MOE), ("gptq",)),
    "ministral3": Family("Ministral3Config", "Ministral3ForCausalLM",
                         dict(intermediate_size=512, head_dim=64), ("fp8", "rtn", "gptq")),
}

# the random tiny Gemma 4 is far more sensitive than the others: FP8 (no calibration at all)
# reaches only 0.945, RTN int4 0.77, GPTQ from 4 samples 0.62-0.68 (0.75 from 32); a dropped
# tensor or a wrong per-layer input is near 0
_FLOOR = {"gemma4": {"fp8": 0.92, "rtn": 0.6, "gptq": 0.5}}


def make_model(out: Path, config_cls: str, model_cls: str, settings: dict,
               tied: bool = False, *, seed: int = 3,
               prepare: Callable[[torch.nn.Module], None] | None = None) -> Path:
    """A tiny random checkpoint of a transformers class, SmolLM2's tokenizer beside it
    (`prepare` edits the random model before it is saved)."""
    config = getattr(transformers, config_cls)(**{**_COMMON, "tie_word_embeddings": tied,
                                                  **settings})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(torch.bfloat16)
    if prepare is not None:
        prepare(model)
    model.save_pretrained(out)
    for f in smollm_dir().iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


def quantize_to(src: Path, out: Path, method: str) -> Path:
    """rtn / gptq (int4 group 64) or fp8 (dynamic) into compressed-tensors."""
    scheme, opts = {"rtn": (I4, {}), "gptq": (I4, {}),
                    "fp8": (fp8_scheme("dynamic"), {"scheme": "dynamic"})}[method]
    quantize(QuantizeRequest(model=str(src), method=method, scheme=scheme, out=out,
                             format="compressed-tensors", method_options=opts,
                             calib="mixed", calib_samples=4, calib_seqlen=64))
    return out


class DiscoveredFamilies:
    """Each family's model and GPTQ artifact, built on first use, kept for the session."""

    def __init__(self, root: Path):
        self.root = root
        self._models: dict[str, Path] = {}
        self._gptq: dict[str, Path] = {}

    def model(self, family: str) -> Path:
        if family not in self._models:
            f = FAMILIES[family]
            self._models[family] = make_model(self.root / family, f.config_cls, f.model_cls,
                                              f.settings, f.tied)
        return self._models[family]

    def gptq(self, family: str) -> Path:
        if family not in self._gptq:
            self._gptq[family] = quantize_to(self.model(family), self.root / f"{family}-gptq",
                                             "gptq")
        return self._gptq[family]


@pytest.fixture(scope="session")
def discovered(tmp_path_factory) -> DiscoveredFamilies:
    return DiscoveredFamilies(tmp_path_factory.mktemp("session-discovered"))


def base_linears(src: Path):
    """(checkpoint name, module) of every nn.Linear of the model but the head."""
    model = load_artifact(src).model
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n != "lm_head"]


def tensor_names(d: Path) -> set[str]:
    names: set[str] = set()
    for f in d.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            names |= set(st.keys())
    return names


def stored_fused(spec, src: Path) -> dict[str, list[str]]:
    """Fused 3-D expert tensors of the source -> the per-expert Linears they become."""
    es = spec.experts
    if es is None or not es.stored_fused:
        return {}
    out = {}
    for f in src.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            for name in st.keys():
                module = spec.module_name(name)
                for which, param in (("up", es.fused_gate_up), ("down", es.fused_down)):
                    tail = f".{es.module}.{param}"
                    if module.endswith(tail):
                        block = module[: -len(tail)] + "."
                        out[name] = [block + spec.checkpoint_name(es.linear(w, e)) for e in
                                     range(st.get_slice(name).get_shape()[0])
                                     for w in (es.inputs if which == "up" else ("down",))]
    return out


def check_family_keeps_every_tensor(family: str, discovered: DiscoveredFamilies,
                                    tmp_path: Path) -> None:
    """Each of the family's methods: every source tensor is in the artifact (quantized Linears
    as their packed tensors; everything else, such as Gated DeltaNet's and Mamba2's conv1d /
    A_log / D / dt_bias and gated norms, routers and norms, dense under its own name), every
    dense Linear is in the ignore list the engine reads, the Linears vLLM 0.32 builds without a
    quantization method stay dense, and the artifact predicts what the model predicts."""
    src = discovered.model(family)
    source = tensor_names(src)
    spec = spec_for_config(transformers.AutoConfig.from_pretrained(src))
    # the Linears under the checkpoint's names (Nemotron-H's backbone.*, as the artifact and
    # vLLM spell them), and the per-expert ones the checkpoint stores (transformers fuses those
    # into 3-D parameters when it loads the model)
    linears = {spec.checkpoint_name(n) for n, _ in base_linears(src)} | {
        n.rsplit(".", 1)[0] for n in source if ".experts." in n and n.endswith(".weight")}
    # Llama 4 and Granite 4 checkpoints store the routed experts fused (3-D); the artifact
    # writes them per expert, the names vLLM's llama4.py / granitemoehybrid.py expert mappings
    # read for quantized checkpoints (experts.{e}.gate_proj, ...): those source tensors are
    # replaced by their experts' Linears
    fused = stored_fused(spec, src)
    linears |= {x for per_expert in fused.values() for x in per_expert}
    base = load_artifact(src)
    ids = torch.randint(10, 40000, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = base.model(ids).logits.float()
    for method in FAMILIES[family].methods:
        out = (discovered.gptq(family) if method == "gptq"
               else quantize_to(src, tmp_path / method, method))
        written = tensor_names(out)
        quantized = {n.rsplit(".", 1)[0] for n in written if n.endswith(QUANT_SUFFIXES)}
        missing = {n for n in source if n not in written and n.rsplit(".", 1)[0] not in quantized
                   and not (n in fused and set(fused[n]) <= quantized)}
        assert not missing, (method, sorted(missing)[:5])
        assert quantized and quantized <= linears, sorted(quantized - linears)[:5]
        ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
        dense = {n.rsplit(".", 1)[0] for n in written if n.endswith(".weight")
                 and n.rsplit(".", 1)[0] in linears} - quantized
        for name in dense:
            assert any(name == i or (i.startswith("re:") and re.match(i[3:], name))
                       for i in ignore), (name, ignore)
        # what vLLM 0.32 builds without a quantization method stays dense, in every block
        for rel in spec.dense_linears:
            assert not any(q.endswith("." + rel) for q in quantized), rel
        meta = json.loads((out / "quantkit.json").read_text())
        assert meta["source_model"]["architecture"] == transformers.AutoConfig.from_pretrained(
            src).model_type
        with torch.no_grad():
            got = load_artifact(out).model(ids).logits.float()
        cos = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0).item()
        print(f"{family} {method}: logits cosine {cos:.4f}, {len(quantized)} Linears quantized")
        # int4 g64 on a random tiny model from 4 x 64 calibration tokens: 0.82-0.95 (GPTQ from
        # so few tokens is no better than RTN here, on llama as well); a dropped tensor or a
        # wrong layout is far below (FP8 0.98-0.99: a routed MoE flips a few top-k choices)
        assert cos > _FLOOR.get(family, {}).get(method, 0.97 if method == "fp8" else 0.75), \
            (method, cos)
