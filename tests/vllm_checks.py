"""Helpers shared by the tests that run real engines: whether vLLM has a kernel here (asked of
vLLM through quantkit's probe, never guessed from CPU flags), the record of which engine checks
ran for real and which asserted a refusal (printed by conftest at the end), and the comparisons
of vLLM's predictions with quantkit's loader."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from quantkit.engines.capabilities import VllmExperts, vllm_cannot_run


@dataclass(frozen=True)
class EngineCheck:
    test: str
    kind: str
    real: bool
    reason: str | None


ENGINE_CHECKS: list[EngineCheck] = []


def engine_check(kind: str, real: bool, reason: str | None = None) -> None:
    """Record that the running test checked `kind` in a real engine (`real`) or asserted the
    engine's refusal (`reason`); conftest's terminal summary counts them."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
    ENGINE_CHECKS.append(EngineCheck(test, kind, real, reason))


def vllm_runs(scheme: str, *, moe: bool = False, experts: VllmExperts | None = None) -> bool:
    """Whether vLLM here has the kernel for `scheme` (int4, fp8-dynamic, fp8-static, ...; `moe`:
    as quantized experts, `experts` their routing and activation, capabilities.vllm_moe_experts): the
    test then runs the real check, else asserts vLLM's refusal. Recorded for the summary."""
    reason = vllm_cannot_run(scheme, moe=moe, experts=experts)
    engine_check(f"vllm {scheme}{' moe' if moe or experts else ''}", real=reason is None, reason=reason)
    return reason is None


def vllm_imports_torchvision() -> bool:
    """Whether vLLM's environment has torchvision (its Qwen3-VL, Qwen3.5 and Pixtral model
    files import transformers' image processors, which import it); scripts/setup.sh removes it
    beside the CPU torch, where it does not import."""
    import subprocess

    from quantkit.engines.vllm_venv import vllm_env, vllm_python

    return subprocess.run([str(vllm_python()), "-c", "import torchvision"], env=vllm_env(),
                          capture_output=True).returncode == 0


def heldout_ids(tokenizer, n_tokens: int = 512) -> list[int]:
    from quantkit.calibration import load_heldout_text

    text, _ = load_heldout_text("mixed")
    return tokenizer(text, add_special_tokens=False)["input_ids"][:n_tokens]


def agreement(artifact_path, vllm_top1, ids) -> float:
    """Share of positions where vLLM's top-1 next token equals quantkit's loader's."""
    from quantkit.loader import load_artifact

    lm = load_artifact(artifact_path)
    with torch.no_grad():
        ours = lm.model(torch.tensor([ids])).logits[0].argmax(-1)
    # vLLM position i holds argmax p(. | ids[:i]); ours position i-1 predicts the same token
    pairs = [(v, int(ours[i - 1])) for i, v in enumerate(vllm_top1) if i > 0 and v is not None]
    return sum(a == b for a, b in pairs) / len(pairs)


def agreement_floor(artifact_path, ids, floor: float = 0.95, margin: float = 0.05) -> float:
    """The top-1 agreement a correct engine must reach: `floor`, lowered to `margin` under how
    well quantkit's loader agrees with itself in float32 vs bf16 on the same ids. A 4-bit 135M
    model has many near-ties: a SmolLM2 GPTQ artifact calibrated in float32 (an AVX512 Xeon
    without BF16) agreed 0.945 with itself across the two precisions and 0.933 with vLLM, where
    the AMX Xeon's bf16-calibrated one passed 0.95. A packing or layout bug scores far lower."""
    from quantkit.loader import load_artifact

    lm = load_artifact(artifact_path)
    x = torch.tensor([ids])
    with torch.no_grad():
        f32 = lm.model.float()(x).logits[0].argmax(-1)
        bf16 = lm.model.bfloat16()(x).logits[0].argmax(-1)
    return min(floor, float((f32 == bf16).float().mean()) - margin)


def loader_greedy(artifact_path, prompt: str, max_tokens: int) -> str:
    """quantkit's loader's greedy continuation of `prompt` (what vLLM should also write)."""
    from quantkit.loader import load_artifact

    lm = load_artifact(artifact_path)
    ids = lm.tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = lm.model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
    # vLLM's detokenizer skips special tokens (its default): an end-of-turn token is not text
    return lm.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def vllm_mean_nll(scored: dict) -> float:
    """Mean negative log-likelihood of the scored tokens from vLLM's prompt log-probs."""
    lps = [lp for lp in scored["logprobs"] if lp is not None]
    return -sum(lps) / len(lps)


def loader_mean_nll(artifact_path, ids) -> float:
    """The same mean NLL from quantkit's loader (position i-1 predicts token i)."""
    from quantkit.loader import load_artifact

    lm = load_artifact(artifact_path)
    with torch.no_grad():
        logp = torch.log_softmax(lm.model(torch.tensor([ids])).logits[0].float(), -1)
    return float(-logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].mean())
