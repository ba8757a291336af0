"""`quantkit plan` on the discovered 2026 block types (Gated DeltaNet, Mamba2, fused and
per-expert experts, MLA with an indexer, per-layer embeddings): its artifact size must match
what `quantize` then writes, so every quantized Linear and every dense tensor of the new blocks
is counted (a block type the planner did not understand is off by a whole share)."""

from __future__ import annotations

import math

import pytest
import transformers
from discovered_families import FAMILIES
from safetensors import safe_open

from quantkit.arch import spec_for_config
from quantkit.pipeline.plan import estimate
from quantkit.types import QuantScheme


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_plan_artifact_size_matches_the_gptq_artifact(family, discovered):
    src = discovered.model(family)
    config = transformers.AutoConfig.from_pretrained(src)
    plan = estimate(config, spec_for_config(config), method="gptq",
                    scheme=QuantScheme(bits=4, group_size=64), calib_samples=4, calib_seqlen=64,
                    calibrated=True)
    art = discovered.gptq(family)
    written = sum(f.stat().st_size for f in art.glob("*.safetensors"))
    stored = 0
    for f in src.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            for name in st.keys():
                shape = st.get_slice(name).get_shape()
                stored += math.prod(shape)
    # every parameter of the checkpoint counted once (blocks of every type, experts fused or
    # per expert), the tied head not twice; what the planner does not count are the few
    # buffers a checkpoint also stores (routers' score-correction biases, Gemma 4's layer
    # scalars: 2-8 values here), where a missed block type is a whole share of the model
    assert abs(plan.total_params - stored) <= 16, (family, plan.total_params, stored)
    assert plan.block_params > 0
    # int4 g64 tiny models: embeddings and norms are a large share; a block type the planner
    # missed moves the total far beyond this
    assert abs(plan.disk_bytes / written - 1) < 0.1, (family, plan.disk_bytes, written)
