"""AWQ on families no table names: the pipeline folds the groups discovery found from the
model's dataflow (quantkit.arch.dataflow), records them in quantkit.json, and the artifact is
closer to the source model than RTN's.

Models: tests/discovered_families.py's tiny random Qwen3.5 (three Gated DeltaNet blocks, one of
gated full attention) and GLM-4.5 (one dense block, one MoE block with a shared expert), built
once per session.
"""

from __future__ import annotations

import json

import pytest
import torch
from discovered_families import I4, quantize_to

from quantkit.arch import spec_for_config
from quantkit.calibration import load_calibration
from quantkit.formats.common import read_config
from quantkit.loader import load_artifact
from quantkit.pipeline.quantize import QuantizeRequest, quantize


def _logit_error(path, src, held) -> float:
    with torch.no_grad():
        ref = load_artifact(src).model(held).logits
        return float((load_artifact(path).model(held).logits - ref).pow(2).mean())


# (calibration samples, length, AWQ options): Qwen3.5's recurrent forward in torch is slow, so
# its search grid is coarse; GLM-4.5's routed experts need more tokens (measured on these
# models: AWQ / RTN logit MSE 1.13 from 4 x 64 tokens, 0.89 from 8 x 128; Qwen3.5 0.85 from 4 x 64)
CALIBRATION = {"qwen3_5": (4, 64, {"n_grid": 4}), "glm4_moe": (8, 128, {})}


@pytest.mark.parametrize("family", sorted(CALIBRATION))
def test_awq_on_a_discovered_family_folds_the_discovered_groups(family, discovered, tmp_path):
    """The artifact's quantkit.json lists the discovered groups, the blocks each folded, and
    the Linear sets without a group with why; the AWQ artifact's logits are closer to the
    source's than RTN's."""
    samples, seqlen, options = CALIBRATION[family]
    src = discovered.model(family)
    spec = spec_for_config(read_config(src))
    assert spec.awq_source == "discovered" and spec.awq_groups
    out = tmp_path / "awq"
    quantize(QuantizeRequest(model=str(src), method="awq", scheme=I4, out=out,
                             format="compressed-tensors", method_options=options,
                             calib="mixed", calib_samples=samples, calib_seqlen=seqlen))
    record = json.loads((out / "quantkit.json").read_text())["awq_groups"]
    assert record["source"] == "discovered"
    assert [(g["prev"], tuple(g["balance"])) for g in record["groups"]] == \
        [(g.prev, g.balance) for g in spec.awq_groups]
    blocks = read_config(src)["num_hidden_layers"]
    folded = {g["prev"]: g["blocks"] for g in record["groups"]}
    assert folded["input_layernorm"] == list(range(blocks))  # every block scales its inputs
    if family == "qwen3_5":
        # the Gated DeltaNet out_proj reads a gated norm: no group, and the artifact says so
        why = {tuple(u["linears"]): u["why"] for u in record["unscaled"]}
        assert "gated norm" in why[("linear_attn.out_proj",)]
        assert folded["self_attn.v_proj"] == []  # grouped-query attention: skipped (widths)
        assert next(g for g in record["groups"]
                    if g["prev"] == "input_layernorm")["norm_offset"] == 1.0
    else:  # the MoE block: every expert's up -> down, the shared expert's, on block 1
        assert folded["mlp.experts.{e}.up_proj"] == [1]
        assert folded["mlp.shared_experts.up_proj"] == [1]
    rtn = quantize_to(src, tmp_path / "rtn", "rtn")
    tok = load_artifact(src).tokenizer
    held = load_calibration("mixed", tok, n_samples=4, seqlen=128, seed=1).input_ids
    err_awq, err_rtn = _logit_error(out, src, held), _logit_error(rtn, src, held)
    assert err_awq < err_rtn, (err_awq, err_rtn)
