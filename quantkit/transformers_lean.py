"""transformers imported without the extras no LLM path uses (scikit-learn, scipy.optimize).

Why a module of its own: every quantkit module that imports from transformers calls it first
(model_io, builtin_models, loader, eval), so it sits below all of them.
"""

from __future__ import annotations

import sys

__all__ = ["trim_transformers_extras", "causal_lm_class", "model_class"]


def trim_transformers_extras() -> None:
    """Tell transformers that scikit-learn and scipy are absent, before it first loads.

    Where they are installed (lm-eval brings them), transformers' auto classes import
    scikit-learn (with pandas and scipy behind it) for assisted generation's `roc_curve`, and
    scipy.optimize for object-detection losses: +123 MiB resident and ~1 s in every process
    that reads a config (measured: 524 -> 401 MiB after the imports of a GPTQ run, CPU torch).
    No LLM path calls either; quantkit imports scipy.linalg's BLAS itself (the Hessians) and
    lm-eval its own metrics. Once transformers' generation code has loaded this changes nothing;
    every quantkit function that imports from transformers calls it first."""
    if "transformers.generation.candidate_generator" in sys.modules:
        return
    import transformers.utils as hf_utils

    for flag in ("is_sklearn_available", "is_scipy_available"):
        if hasattr(hf_utils, flag):
            setattr(hf_utils, flag, _absent)


def _absent() -> bool:
    return False


def causal_lm_class():
    """transformers' AutoModelForCausalLM, after trim_transformers_extras()."""
    trim_transformers_extras()
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM


def model_class(config=None):
    """The auto class that builds `config`'s whole checkpoint: AutoModelForImageTextToText
    for a vision-language checkpoint (its config.architectures names an image-text-to-text
    class: Qwen3-VL, Mistral 3, Gemma 4, Llama 4 ForConditionalGeneration), whose vision
    tower AutoModelForCausalLM would refuse or leave out; AutoModelForCausalLM otherwise."""
    auto = causal_lm_class()
    if config is None:
        return auto
    from transformers import AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    if set(get("architectures") or ()) & set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.values()):
        return AutoModelForImageTextToText
    return auto
