"""The one block-by-block calibration loop every method goes through.

For each decoder block: gather the statistics the quantizer asked for (per sequential group of
Linears when the quantizer wants true-sequential order), let it quantize, write the
dequantized weights back into the block, and hand the block's outputs to the next block.
The loop never names a method: methods declare what they need as attributes.
"""

from __future__ import annotations

import torch

from quantkit.arch import ArchSpec
from quantkit.model_io import check_finite
from quantkit.pipeline.capture import BlockInputs, capture_block_inputs, run_block
from quantkit.pipeline.stats import StatCollector
from quantkit.types import BlockContext, ProgressFn, Quantizer, QuantResult, QuantScheme

__all__ = ["get_blocks", "quantize_blocks"]


def get_blocks(model, spec: ArchSpec) -> torch.nn.ModuleList:
    obj = model
    for part in spec.block_path.split("."):
        obj = getattr(obj, part)
    return obj


def _linears(block: torch.nn.Module, names: tuple[str, ...]) -> dict[str, torch.nn.Linear]:
    mods = dict(block.named_modules())
    return {n: mods[n] for n in names if n in mods}


def _set_weight(linear: torch.nn.Linear, result: QuantResult) -> None:
    if result.scheme.kind == "int":
        w = result.dequantize(linear.weight.dtype)
    else:
        w = result.extra["dequantized"].to(linear.weight.dtype)
    linear.weight.data.copy_(w.to(linear.weight.device))


def quantize_blocks(
    model,
    spec: ArchSpec,
    quantizer: Quantizer,
    scheme: QuantScheme,
    batches: list[torch.Tensor] | None,
    *,
    device: torch.device | str = "cpu",
    compute_dtype: torch.dtype = torch.float32,
    options: dict | None = None,
    on_progress: ProgressFn | None = None,
) -> dict[str, QuantResult]:
    """Quantize every block Linear of `model` in place; return results keyed by full name."""
    blocks = get_blocks(model, spec)
    results: dict[str, QuantResult] = {}
    inputs: BlockInputs | None = None
    if quantizer.needs_calibration:
        if not batches:
            raise ValueError("this method needs calibration batches")
        inputs = capture_block_inputs(model, blocks, batches, compute_dtype).to(device)
    groups = spec.sequential if getattr(quantizer, "true_sequential", False) else (spec.block_linears,)
    total = len(blocks)
    for i, block in enumerate(blocks):
        prefix = f"{spec.block_path}.{i}."
        check_finite((prefix + n, p) for n, p in block.named_parameters())
        orig_dtype = next(block.parameters()).dtype
        block.to(device=device, dtype=compute_dtype)
        outputs_fp = None
        if inputs is not None and not quantizer.propagate_quantized:
            outputs_fp = run_block(block, inputs)
        for group in groups:
            linears = _linears(block, group)
            stats = {}
            if quantizer.stats and inputs is not None:
                with StatCollector(linears, quantizer.stats) as collector:
                    collector.run(block, inputs)
                stats = collector.results

            def rerun(block=block, inputs=inputs):
                return run_block(block, inputs) if inputs is not None else []

            ctx = BlockContext(
                index=i, block=block, linears=linears, stats=stats, scheme=scheme,
                inputs=inputs.hidden if inputs is not None else [], rerun=rerun, arch=spec,
                options=dict(options or {}),
                collect=lambda names, st, block=block, inputs=inputs: _collect(block, names, st, inputs),
            )
            for name, res in quantizer.quantize_block(ctx).items():
                _set_weight(linears[name], res)
                results[prefix + name] = _to_cpu(res, prefix + name)
        if inputs is not None:
            outs = outputs_fp if outputs_fp is not None else run_block(block, inputs)
            inputs = BlockInputs(outs, inputs.kwargs)
        block.to(device="cpu", dtype=orig_dtype)
        if on_progress:
            on_progress(f"quantizing blocks ({quantizer.name})", i + 1, total)
    return results


def _collect(block, names, stats, inputs) -> dict:
    if inputs is None:
        return {}
    with StatCollector(_linears(block, tuple(names)), tuple(stats)) as collector:
        collector.run(block, inputs)
    return collector.results


def _to_cpu(res: QuantResult, full_name: str) -> QuantResult:
    res.name = full_name
    for attr in ("codes", "scale", "zero", "g_idx", "bias"):
        t = getattr(res, attr)
        if t is not None:
            setattr(res, attr, t.detach().cpu())
    res.extra = {k: v.detach().cpu() for k, v in res.extra.items()}
    return res
