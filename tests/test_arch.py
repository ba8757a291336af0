"""Every supported architecture resolves, quantizes through the pipeline and loads back."""

from __future__ import annotations

import pytest
import torch

from quantkit.arch import spec_for_config, supported_architectures
from quantkit.errors import UnsupportedArchitecture
from quantkit.loader import load_artifact
from quantkit.pipeline.quantize import QuantizeRequest, quantize
from quantkit.types import QuantScheme


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_arch_quantizes_and_loads(tiny_model_factory, tmp_path, arch):
    src = tiny_model_factory(arch)
    out = tmp_path / f"{arch}-rtn"
    meta = quantize(QuantizeRequest(model=str(src), method="rtn",
                                    scheme=QuantScheme(bits=8, group_size=64), out=out))
    assert meta["source_model"]["architecture"] == arch
    q = load_artifact(out)
    base = load_artifact(src)
    ids = torch.randint(10, 40000, (1, 32))
    with torch.no_grad():
        lq, lb = q.model(ids).logits, base.model(ids).logits
    # int8 g64 is close to the original; a wrong layout would be far off
    assert torch.nn.functional.cosine_similarity(lq.flatten(), lb.flatten(), dim=0) > 0.99
    assert (lq.argmax(-1) == lb.argmax(-1)).float().mean() > 0.8
    spec = spec_for_config(q.model.config)
    assert len(meta) and spec.name == arch


@pytest.mark.fast
def test_unknown_architecture_lists_supported():
    with pytest.raises(UnsupportedArchitecture) as e:
        spec_for_config({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    assert "GPT2LMHeadModel" in str(e.value)
    for name in supported_architectures():
        assert name in str(e.value)
