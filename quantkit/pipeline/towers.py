"""A vision-language checkpoint's parts beside the language model (ArchSpec.towers): kept
dense and named in the ignore list by default, or, with --quantize-vision, the Linears of
the vision encoder's blocks quantized.

Why a module of its own: the block loop calibrates the language model only (calibration is
text, and text never reaches the vision tower), so a vision Linear gets no statistics; a
calibrated method's vision Linears are rounded to nearest (RTN) in the same scheme instead,
and quantkit.json says so. An uncalibrated method (RTN, FP8 dynamic) runs as it is.
"""

from __future__ import annotations

import torch

from quantkit.arch import ArchSpec
from quantkit.errors import SchemeMismatch
from quantkit.types import BlockContext, Quantizer, QuantResult, QuantScheme

__all__ = ["tower_linears", "vision_linears", "vision_quantizer", "quantize_vision",
           "VISION_HINT"]

VISION_HINT = "Drop --quantize-vision (the vision tower then stays dense)."


def tower_linears(model: torch.nn.Module, spec: ArchSpec) -> list[str]:
    """Module names of every nn.Linear in the towers (vision, audio, projectors)."""
    return [f"{tower}.{n}" for tower in spec.towers
            for n, m in model.get_submodule(tower).named_modules() if isinstance(m, torch.nn.Linear)]


def vision_linears(model: torch.nn.Module, spec: ArchSpec) -> dict[int, tuple[str, list[str]]]:
    """Per vision encoder block (numbered across the encoders): (its module path, its Linears
    relative to it)."""
    out = {}
    for blocks_path in spec.vision_blocks:
        for i, block in enumerate(model.get_submodule(blocks_path)):
            names = [n for n, m in block.named_modules() if isinstance(m, torch.nn.Linear)]
            if names:
                out[len(out)] = (f"{blocks_path}.{i}", names)
    return out


def vision_quantizer(quantizer: Quantizer, scheme: QuantScheme, spec: ArchSpec) -> Quantizer:
    """The method the vision Linears get: the run's own when it reads no calibration, else RTN
    in the same integer scheme (text calibration never reaches the vision tower). Refusals
    before any work."""
    if not spec.vision_blocks:
        raise SchemeMismatch(f"--quantize-vision: {spec.name} has no vision encoder blocks.",
                             VISION_HINT)
    return stand_in_quantizer(quantizer, scheme, "--quantize-vision",
                              "the vision Linears get no calibration (it is text)", VISION_HINT)


def stand_in_quantizer(quantizer: Quantizer, scheme: QuantScheme, flag: str, why: str,
                       hint: str) -> Quantizer:
    """The method for Linears that calibration never reaches (vision towers, MTP layers): the
    run's own when it reads no calibration, else RTN in the same integer scheme."""
    if not quantizer.needs_calibration:
        return quantizer
    if scheme.kind != "int":
        raise SchemeMismatch(
            f"{flag} with the calibrated method {quantizer.name} ({scheme.describe()}): "
            f"{why}, and only integer schemes have a round-to-nearest form for them.",
            "Use an uncalibrated scheme (e.g. --method fp8 --scheme dynamic), an integer "
            "method (rtn, gptq, awq), or " + hint[0].lower() + hint[1:])
    from quantkit.methods import get_quantizer

    rtn = get_quantizer("rtn")
    rtn.check(scheme)
    return rtn


def quantize_vision(model: torch.nn.Module, spec: ArchSpec, quantizer: Quantizer,
                    scheme: QuantScheme, load=None, release=None) -> dict[str, QuantResult]:
    """Quantize the vision encoder blocks' Linears, block by block; results keyed by full
    module name. `load(prefix, block)` / `release(block)` give a streamed block its weights
    and take them back (None: the weights are in memory)."""
    results: dict[str, QuantResult] = {}
    for index, (path, names) in vision_linears(model, spec).items():
        block = model.get_submodule(path)
        if load is not None:
            load(path + ".", block)
        mods = dict(block.named_modules())
        ctx = BlockContext(index=index, block=block, linears={n: mods[n] for n in names},
                           stats={}, scheme=scheme, inputs=[], rerun=_no_rerun)
        with torch.no_grad():
            for name, res in quantizer.quantize_block(ctx).items():
                results[f"{path}.{name}"] = res
        if release is not None:
            release(block)
    return results


def _no_rerun(*_args, **_kwargs):
    raise RuntimeError("vision blocks are quantized without calibration inputs")
