"""Families no line of quantkit's tables names, quantized through discovery
(quantkit.arch.discover): OLMo 3, Qwen3.5, Qwen3.5-MoE, GLM-4.5.

Tiny random models from transformers' own config and model classes (tests/discovered_families.py
builds them once per session). Per family: the methods run through the one pipeline, every
tensor of the source checkpoint is in the artifact (quantized, or dense under its own name), and
the artifact loads back and predicts what the model predicts. vLLM runs them in
test_discovered_families_vllm.py.
"""

from __future__ import annotations

import pytest
from discovered_families import FAMILIES, check_family_keeps_every_tensor

from quantkit.arch import ARCHS

NAMES = ("olmo3", "qwen3_5", "glm4_moe", "qwen3_5_moe")


def test_no_table_row_names_these_families():
    """The point of the file: discovery, not a row, carries them."""
    known = {c for spec in ARCHS for c in spec.hf_classes}
    assert not known & {FAMILIES[f].model_cls for f in NAMES}


@pytest.mark.parametrize("family", sorted(NAMES))
def test_discovered_family_quantizes_keeping_every_tensor(family, discovered, tmp_path):
    """GPTQ (every family), RTN and FP8 (the hybrid and the MoE ones): each artifact holds every
    source tensor (quantized Linears as their packed tensors, everything else, such as
    Gated DeltaNet's conv1d / A_log / dt_bias, routers and norms, dense under its own name),
    and predicts what the model predicts."""
    check_family_keeps_every_tensor(family, discovered, tmp_path)
