"""Per-architecture facts as data: which blocks, which Linears, how they group, how GGUF
names them.

The spec types and the common decoder block are quantkit.arch.spec; each family module
(llama.py, qwen3_moe.py, ...) states where its family differs, and this registry lists them.
Code outside this package asks the spec, never a family name.
"""

from __future__ import annotations

import dataclasses

from quantkit.arch import (
    deepseek_v3,
    deepseek_v32,
    gemma3,
    gemma4,
    glm4_moe,
    gpt_oss,
    granitemoehybrid,
    llama,
    llama4,
    minimax_m2,
    ministral3,
    mixtral,
    nemotron_h,
    olmo3,
    phi3,
    qwen3_5,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
)
from quantkit.arch.discover import discovered_spec
from quantkit.arch.gguf_names import gguf_model_arch
from quantkit.arch.spec import EXPERT, ArchSpec, AwqGroup, ExpertsSpec, gguf_linear_name, gguf_name
from quantkit.errors import UnsupportedArchitecture

__all__ = ["ArchSpec", "AwqGroup", "ExpertsSpec", "ARCHS", "EXPERT", "spec_for_config",
           "supported_architectures", "gguf_architectures", "gguf_name", "gguf_linear_name"]

# the families, in the order specs are matched and listed
FAMILIES = (llama, qwen3_moe, mixtral, gpt_oss, deepseek_v3, gemma3, phi3)

ARCHS: tuple[ArchSpec, ...] = tuple(spec for family in FAMILIES for spec in family.SPECS)

# families carried by discovery that need a fact no model can tell (what the engine keeps
# dense): model_type -> block-relative Linears
DISCOVERED_FAMILIES = (deepseek_v32,)
ENGINE_DENSE: dict[str, tuple[str, ...]] = {
    t: names for family in DISCOVERED_FAMILIES for t, names in family.DISCOVERED_DENSE.items()}

# discovered families llama.cpp has an architecture for: model_type -> the ArchSpec's gguf_*
# fields (the architecture name, its optional keys, the converter's tensor transforms), the
# facts discovery cannot read off the model; tensor names still come from the gguf package
GGUF_FAMILIES = (olmo3, ministral3, gemma4, qwen3_5, qwen3_5_moe, minimax_m2, llama4,
                 qwen3_next, nemotron_h, granitemoehybrid, glm4_moe, deepseek_v32)
DISCOVERED_GGUF: dict[str, dict] = {
    t: fields for family in GGUF_FAMILIES for t, fields in family.GGUF.items()}


def supported_architectures() -> list[str]:
    return [c for a in ARCHS for c in a.hf_classes]


def gguf_architectures() -> list[str]:
    """llama.cpp architectures quantkit writes GGUF for."""
    return list(dict.fromkeys([a.gguf_arch for a in ARCHS if a.gguf_arch]
                              + [f["gguf_arch"] for f in DISCOVERED_GGUF.values()
                                 if "gguf_arch" in f]))


def with_gguf(spec: ArchSpec) -> ArchSpec:
    """A discovered spec with its family's GGUF layout (DISCOVERED_GGUF), when llama.cpp has one;
    the architecture must be one the gguf package knows (its MODEL_ARCH_NAMES)."""
    fields = next((DISCOVERED_GGUF[t] for t in spec.model_types if t in DISCOVERED_GGUF), None)
    if fields is None or spec.gguf_arch is not None:
        return spec
    if "gguf_arch" in fields:  # else only why not (gguf_unwritten)
        gguf_model_arch(fields["gguf_arch"])  # KeyError: a name the gguf package lacks
    return dataclasses.replace(spec, **fields)


def spec_for_config(config) -> ArchSpec:
    """The row for a transformers config (or a config.json dict); for a family no row names,
    the layout discovered from the model itself (quantkit.arch.discover); a clear error when
    neither is possible."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    classes = tuple(get("architectures") or ())
    model_type = get("model_type")
    for spec in ARCHS:
        if any(c in spec.hf_classes for c in classes) or (not classes and model_type in spec.model_types):
            return spec
    name = ", ".join(classes) or f"model_type={model_type!r}"
    try:
        return with_gguf(discovered_spec(config, ENGINE_DENSE))
    except UnsupportedArchitecture as exc:
        raise UnsupportedArchitecture(
            f"Architecture {name} is not supported by quantkit: {exc.message}",
            f"Supported by a family module: {', '.join(supported_architectures())}; other "
            "transformers decoders are supported where their layout can be discovered. "
            "Adding one is a family module in quantkit/arch/ (llama.py is the shortest), "
            "listed in FAMILIES in quantkit/arch/__init__.py.",
        ) from exc
