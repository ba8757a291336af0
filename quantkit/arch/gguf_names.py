"""HF -> GGUF tensor names from the gguf package: llama.cpp's own TensorNameMap, per architecture.

llama.cpp's converter names every tensor through gguf-py's TensorNameMap (the HF spellings
each MODEL_TENSOR has, limited to the tensors an architecture holds); quantkit asks the same
table, so a name is never written by hand where the package knows the architecture. Only the
converter's own renames before that lookup are family facts (ArchSpec.gguf_renames).
"""

from __future__ import annotations

import functools

__all__ = ["gguf_has_nextn", "gguf_lookup", "gguf_model_arch", "refuse_gguf"]

_SUFFIXES = (".weight", ".bias")


def gguf_model_arch(gguf_arch: str):
    """gguf.MODEL_ARCH of llama.cpp's architecture name ("qwen3moe" -> MODEL_ARCH.QWEN3MOE)."""
    from gguf import MODEL_ARCH_NAMES  # gguf (and numpy) load only once a GGUF name is asked

    found = next((arch for arch, name in MODEL_ARCH_NAMES.items() if name == gguf_arch), None)
    if found is None:
        raise KeyError(f"the gguf package knows no architecture {gguf_arch!r}")
    return found


@functools.cache
def _name_map(gguf_arch: str):
    """The architecture's TensorNameMap for one block (block 0: callers put the index back)."""
    from gguf import get_tensor_name_map

    return get_tensor_name_map(gguf_model_arch(gguf_arch), 1)


def gguf_lookup(gguf_arch: str, hf_name: str) -> str | None:
    """A checkpoint tensor name (block index 0) -> its GGUF tensor name, or None.

    A bare parameter (gpt-oss's self_attn.sinks) comes out as `.weight`, as the converter
    writes it: every GGUF tensor llama.cpp reads ends in .weight or .bias.
    """
    found = _name_map(gguf_arch).get_name(hf_name, try_suffixes=_SUFFIXES)
    if found is None:
        return None
    return found if found.endswith(_SUFFIXES) else f"{found}.weight"


def gguf_has_nextn(gguf_arch: str) -> bool:
    """Whether the gguf package's tensor table of the architecture holds the nextn (MTP)
    block tensors (its MODEL_TENSORS): without them no MTP tensor has a GGUF name."""
    from gguf import MODEL_TENSOR, MODEL_TENSORS

    return MODEL_TENSOR.NEXTN_EH_PROJ in MODEL_TENSORS.get(gguf_model_arch(gguf_arch), ())


def refuse_gguf(family: str, found: list[str], *, yet: bool = False) -> None:
    """A family's GGUF refusal (its gguf_check) when `found` names anything: what llama.cpp
    would load or compute otherwise, or what quantkit does not write (`yet`)."""
    if found:
        from quantkit.errors import UnsupportedArchitecture

        raise UnsupportedArchitecture(
            f"quantkit's GGUF writer does not write {family} with {', '.join(found)}"
            f"{' yet' if yet else ''}.",
            "Use llama.cpp's convert_hf_to_gguf.py for this checkpoint, or a safetensors "
            "format (compressed-tensors) with quantkit.")
