"""The rest of the 2026 text families through discovery (quantkit.arch.discover): Qwen3-Next,
DeepSeek-V3.2, Gemma 4, Llama 4, Nemotron-H, Granite 4 hybrid, MiniMax-M2, Ministral 3.

Same pattern as test_discovered_families.py (tests/discovered_families.py builds the models once
per session). Per family: GPTQ (calibrated through the model's real forward: Gated DeltaNet and
Mamba2 recurrences, routed experts) and, where cheap, RTN and FP8; every source tensor is in the
artifact (quantized, or dense under its own name), every dense Linear is in the ignore list, the
Linears vLLM 0.32 builds without a quantization method stay dense, and the artifact loads back
with quantkit's loader and predicts near the source. vLLM runs them in
test_discovered_families_vllm.py.
"""

from __future__ import annotations

import pytest
from discovered_families import FAMILIES, check_family_keeps_every_tensor

from quantkit.arch import ARCHS

NAMES = ("qwen3_next", "deepseek_v32", "gemma4", "llama4", "nemotron_h", "granitemoehybrid",
         "minimax_m2", "ministral3")


def test_no_table_row_names_these_families():
    known = {c for spec in ARCHS for c in spec.hf_classes}
    assert not known & {FAMILIES[f].model_cls for f in NAMES}


@pytest.mark.parametrize("family", sorted(NAMES))
def test_2026_family_quantizes_keeping_every_tensor(family, discovered, tmp_path):
    """Every source tensor survives each method (Mamba2's conv1d / A_log / D / dt_bias and
    gated norm, Gated DeltaNet's, Gemma 4's per-layer embeddings, routers: dense under their
    own names), every dense Linear is in the ignore list, and the artifact predicts what the
    model predicts."""
    check_family_keeps_every_tensor(family, discovered, tmp_path)
