"""The one block-by-block calibration loop every method goes through.

For each decoder block: gather the statistics the quantizer asked for (per sequential group of
Linears when the quantizer wants true-sequential order), let it quantize, write the
dequantized weights back into the block, and hand the block's outputs to the next block.
The loop never names a method: methods declare what they need as attributes.
Where block weights come from (already in memory, or read from the shards one block at a time)
is a `BlockSource`; an optional checkpoint saves every finished block so a run can resume.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from quantkit.arch import ArchSpec
from quantkit.model_io import check_finite
from quantkit.pipeline.attention_v import attention_v_hessian, attention_v_name, check_attention_v
from quantkit.pipeline.capture import BlockInputs, capture_block_inputs, run_block
from quantkit.pipeline.experts import num_experts
from quantkit.pipeline.heap import reuse_freed_memory
from quantkit.pipeline.kvcache import kv_absmax as observe_kv
from quantkit.pipeline.offload import fast_pinned_memory
from quantkit.pipeline.replay import BlockReplay
from quantkit.pipeline.staged import StagedForward
from quantkit.pipeline.stats import StatCollector
from quantkit.pipeline.transfer import any_finite_problem, fetch_to_cpu
from quantkit.types import (
    EXPERT_MIN_TOKENS,
    BlockContext,
    ProgressFn,
    Quantizer,
    QuantResult,
    QuantScheme,
)

__all__ = ["get_blocks", "quantize_blocks", "BlockSource", "dense_tensor", "block_dense"]


class BlockSource:
    """Block weights already in the model (the in-memory path): nothing to load or free.

    A streaming source reads block i in `load` and drops it in `release`; `embedding()` is the
    context in which the modules before block 0 hold real weights (for input capture).
    """

    def load(self, index: int, block: torch.nn.Module) -> None:
        pass

    def release(self, index: int, block: torch.nn.Module) -> None:
        pass

    def embedding(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


def dense_tensor(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """How every unquantized tensor is stored: on CPU, floats in the checkpoint's dtype."""
    return t.detach().to("cpu", dtype if t.is_floating_point() else t.dtype).contiguous()


def block_dense(block: torch.nn.Module, prefix: str, results: dict[str, QuantResult],
                dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The block's tensors that are not quantized Linear weights (norms, possibly AWQ-scaled)."""
    skip = {f"{n}.weight" for n in results} | {f"{n}.bias" for n in results}
    return {prefix + n: dense_tensor(t, dtype) for n, t in block.state_dict().items()
            if prefix + n not in skip}


def get_blocks(model, spec: ArchSpec) -> torch.nn.ModuleList:
    obj = model
    for part in spec.block_path.split("."):
        obj = getattr(obj, part)
    return obj


def _linears(block: torch.nn.Module, names: tuple[str, ...]) -> dict[str, torch.nn.Linear]:
    mods = dict(block.named_modules())
    return {n: mods[n] for n in names if n in mods}


def _set_weight(linear: torch.nn.Linear, result: QuantResult, propagate: bool) -> None:
    """Write the quantized weight back into the block (what later groups and blocks see).

    A method that calibrates on the float model (propagate False) may leave out the
    dequantized weight (GGUF does: decoding every tensor again cost a third of its run).
    """
    if result.scheme.kind == "int":
        w = result.dequantize(linear.weight.dtype)
    elif "dequantized" in result.extra or propagate:
        w = result.extra["dequantized"].to(linear.weight.dtype)
    else:
        return
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
    source: BlockSource | None = None,
    checkpoint=None,
    dense: dict[str, torch.Tensor] | None = None,
    dense_dtype: torch.dtype = torch.bfloat16,
    dp=None,
    staged: bool | None = None,
    offload_activations: bool = False,
    expert_min_tokens: int = EXPERT_MIN_TOKENS,
    kv_absmax: dict[str, tuple[float, float]] | None = None,
) -> dict[str, QuantResult]:
    """Quantize every block Linear of `model` in place; return results keyed by full name.

    `dense` (when given) receives each block's unquantized tensors in `dense_dtype`: a
    streaming source frees the block, so they must be kept here. `checkpoint`
    (quantkit.pipeline.checkpoint.BlockCheckpoint) saves each finished block and, when it
    holds earlier blocks of the same request, the loop starts after them; the results then
    come back as a mapping that reads them from the checkpoint on access.
    `dp` (quantkit.pipeline.distributed.DataParallel) makes this one rank of a data-parallel
    run: `batches` are this rank's share, statistics are summed on every rank; each rank
    solves its share of a group's Linears when the method names independent solves
    (Quantizer.solve_units), else rank 0 alone runs the method and broadcasts its weights;
    only rank 0 returns results.
    `staged` runs a true-sequential method's groups in ONE block forward
    (quantkit.pipeline.staged) instead of replaying the block for each group; the results are
    the same, bit for bit. Default: on the CPU only, where the forwards dominate (SmolLM2
    GPTQ 284 s -> 201 s); on an H100 it measured slower (2.07 vs 1.45 s per 8B block) and
    held every batch's activations (24 vs 8.8 GiB peak), so GPUs replay.
    `offload_activations` keeps the calibration hidden states in pinned host memory between
    block forwards (quantkit.pipeline.offload; GPU only, same results): GPU memory then holds
    the block, its statistics and two batches instead of every batch's inputs and outputs.
    quantize() turns it on when the plan's peak does not fit the free GPU memory.
    Mixture-of-experts
    blocks always replay: their expert groups do not share one input (each expert reads its
    own routed tokens). Each result records the calibration tokens its Linear saw;
    experts below `expert_min_tokens` are named in a warning.
    `kv_absmax` (when given) receives, per attention module, the max |key| and |value| its
    KV cache would hold, observed on the quantized block (quantkit.pipeline.kvcache); the
    calibration inputs are then captured even for a method that needs none.
    """
    if dp is not None:
        dp.check_method(quantizer)
        if checkpoint is not None:
            raise ValueError("per-block checkpoints are not supported in data-parallel runs")
    check_attention_v(spec, quantizer)
    source = source or BlockSource()
    blocks = get_blocks(model, spec)
    results: dict[str, QuantResult] = {}
    inputs: BlockInputs | None = None
    quantizer.warm_up(scheme, torch.device(device))  # e.g. compile a GPU kernel meanwhile
    if quantizer.needs_calibration or kv_absmax is not None:
        if not batches:
            raise ValueError("this method needs calibration batches")
        offload = offload_activations and torch.device(device).type == "cuda"
        if offload:
            fast_pinned_memory()  # before the first pinned allocation
        with source.embedding():
            inputs = capture_block_inputs(model, blocks, batches, compute_dtype).to(
                device, offload=offload)
            if dp is None:  # while the embedding table is real
                quantizer.observe_embedding(model.get_submodule(spec.embed), batches)
    total = len(blocks)
    start = 0
    resumed = checkpoint.resume(total, needs_hidden=inputs is not None) \
        if checkpoint is not None else None
    if resumed is not None:
        start = resumed.start
        if dense is not None:
            dense.update(resumed.dense)
        if inputs is not None and resumed.hidden is not None:
            inputs = inputs.with_hidden(resumed.hidden, start).to(device, inputs.device is not None)
        if on_progress:
            on_progress(f"resuming at block {start + 1}/{total}" if start < total else
                        f"resuming: all {total} blocks were finished, writing the artifact",
                        start, total)
    # the loop replaces the hidden states block after block: handed over, not kept here, so
    # the first block's inputs are freed once block 0 is done (kept, they held 2 GiB of GPU or
    # pinned host memory for the whole run on 8B shapes, and the offloaded block 1 had to pin
    # 2 GiB more, which cost time: benchmarks/results/gpu_where_time_goes_h200_handoff.json)
    handoff, resumed = [inputs], None
    del inputs
    try:
        _run_blocks(blocks, start, total, spec, quantizer, scheme, handoff, device=device,
                    compute_dtype=compute_dtype, options=options, on_progress=on_progress,
                    source=source, checkpoint=checkpoint, dense=dense, dense_dtype=dense_dtype,
                    dp=dp, staged=staged, expert_min_tokens=expert_min_tokens,
                    kv_absmax=kv_absmax, results=results)
    except BaseException:
        if checkpoint is not None:  # what is on disk when the error's message is written
            with contextlib.suppress(Exception):
                checkpoint.close()
        raise
    if checkpoint is not None:
        checkpoint.close()  # every block on disk before the writer reads them back
        return checkpoint.results(total)
    return results


def _run_blocks(blocks, start: int, total: int, spec: ArchSpec, quantizer: Quantizer,
                scheme: QuantScheme, handoff: list[BlockInputs | None], *, device, compute_dtype,
                options, on_progress, source: BlockSource, checkpoint, dense, dense_dtype, dp,
                staged, expert_min_tokens: int, kv_absmax, results: dict) -> None:
    """The loop of quantize_blocks from block `start` on; fills `results` (the blocks a
    checkpoint does not hold) and `dense`. `handoff` holds the first block's inputs: taken
    out, so that no caller keeps them alive."""
    inputs = handoff.pop()
    true_sequential = quantizer.true_sequential
    for i, block in enumerate(blocks):
        if i < start:
            continue
        prefix = f"{spec.block_path}.{i}."
        source.load(i, block)
        orig_dtype = next(block.parameters()).dtype
        _check_block_finite(block, prefix, device)
        block.to(device=device, dtype=compute_dtype)
        block_inputs = inputs
        with contextlib.ExitStack() as scope:
            experts = num_experts(block, spec)
            groups = spec.groups_for(experts) if true_sequential else (spec.linears_for(experts),)
            present = dict(block.named_modules())
            block_groups = [g for g in (tuple(n for n in group if n in present) for group in groups) if g]
            one_pass = (torch.device(device).type == "cpu" if staged is None else staged) \
                and inputs is not None and inputs.device is None \
                and bool(quantizer.stats) and quantizer.propagate_quantized and len(block_groups) > 1 \
                and not experts
            # batch after batch, the forwards reuse freed activation memory (trimmed after); not
            # while every batch is paused mid-block at once: the freed tensors then sit between
            # live ones and the heap keeps them (SmolLM2 GPTQ, 64 x 512 tokens: a much higher
            # peak RSS with reuse, about the same time; benchmarks/README.md, Memory 2026-11-26)
            if inputs is not None and not one_pass:
                scope.enter_context(reuse_freed_memory())
            outputs_fp, first_stats = None, None
            attn_v = [attention_v_name(quantizer, spec, g) for g in block_groups]
            if inputs is not None and not quantizer.propagate_quantized:
                with _step(dp, f"running {prefix.rstrip('.')}"):
                    if len(block_groups) == 1 and quantizer.stats and not attn_v[0]:  # one forward for both
                        outputs_fp, first_stats = _outputs_and_stats(
                            block, _linears(block, block_groups[0]), quantizer.stats, inputs)
                    else:
                        outputs_fp = run_block(block, inputs)
            run = scope.enter_context(StagedForward(block, block_groups, inputs)) if one_pass else None
            for gi, group in enumerate(block_groups):
                linears = _linears(block, group)
                if gi == 0 and first_stats is not None:
                    stats = first_stats
                else:
                    with _step(dp, f"gathering the statistics of {prefix}{'/'.join(group)}"):
                        stats = _group_stats(block, linears, quantizer.stats, inputs,
                                             run.advance(gi) if one_pass else None,
                                             attn_v[gi], spec.attention)
                if dp is not None and stats:
                    dp.reduce_stats(stats, linears, quantizer.stats, device)
                if experts and stats and (dp is None or dp.is_main):
                    _warn_few_tokens(prefix, spec, stats, expert_min_tokens)

                def rerun(max_batches=None, hidden=None, block=block, inputs=inputs):
                    if inputs is None:
                        return []
                    chosen = inputs if max_batches is None else inputs.head(max_batches)
                    if hidden is not None:  # other hidden states, same kwargs and placement
                        chosen = BlockInputs(list(hidden), chosen.kwargs[:len(hidden)], chosen.device,
                                             chosen.block_kwargs, chosen.block)
                    return run_block(block, chosen)

                ctx = BlockContext(
                    index=i, block=block, linears=linears, stats=stats, scheme=scheme,
                    inputs=inputs.hidden if inputs is not None else [], rerun=rerun, arch=spec,
                    options=dict(options or {}),
                    collect=lambda names, st, block=block, inputs=inputs: _collect(block, names, st, inputs),
                    replay=BlockReplay(block, rerun, spec,
                                       inputs.hidden if inputs is not None else []),
                )
                # data-parallel: the solves spread over the ranks where the method names
                # independent ones (every rank then holds every result), else on rank 0
                units = quantizer.solve_units(ctx) \
                    if dp is not None and quantizer.data_parallel is True else None
                if units is not None:
                    solved = dp.solve_spread(quantizer.quantize_block, ctx, units, prefix)
                elif dp is None:
                    solved = quantizer.quantize_block(ctx)
                else:
                    dp.rank0_groups += 1
                    with dp.step(f"solving {prefix}{'/'.join(group)} on rank 0"):
                        solved = quantizer.quantize_block(ctx) if dp.is_main else {}
                for name, res in solved.items():
                    _set_weight(linears[name], res, quantizer.propagate_quantized)
                    if dp is not None and not dp.is_main:
                        continue
                    res.name = prefix + name
                    if name in stats:
                        res.calib_tokens = int(stats[name]["tokens"])
                    results[prefix + name] = res  # still on the device: fetched once per block
                solved = None
                if units is None and dp is not None and quantizer.data_parallel == "block":
                    dp.broadcast_module(block)  # the method also changed other tensors (AWQ norms)
                elif units is None and dp is not None:
                    dp.broadcast_linears(linears)
            if inputs is not None:
                with _step(dp, f"running {prefix.rstrip('.')} on its quantized weights"):
                    if one_pass:
                        outs = run.finish()
                    else:
                        outs = outputs_fp if outputs_fp is not None else run_block(block, inputs)
                inputs = inputs.with_hidden(outs, i + 1)
        if kv_absmax is not None and block_inputs is not None:
            kv_absmax[prefix + spec.attention] = observe_kv(block, spec.attention, block_inputs)
        mine = {k: r for k, r in results.items() if k.startswith(prefix)}
        _block_and_results_to_cpu(block, orig_dtype, list(mine.values()))
        kept = block_dense(block, prefix, mine, dense_dtype) if dp is None or dp.is_main else {}
        if dense is not None:
            dense.update(kept)
        if checkpoint is not None:  # from here on the results live in the checkpoint only
            checkpoint.save(i, total, mine, kept, inputs.hidden if inputs is not None else None)
            for k in mine:
                del results[k]
        source.release(i, block)
        # the last group's context and rerun closure point at this block's inputs: dropped
        # here, so they are freed before the next block makes its outputs (see handoff)
        ctx = rerun = block_inputs = None
        if on_progress:
            on_progress(f"quantizing blocks ({quantizer.name})", i + 1, total)


def _step(dp, what: str) -> contextlib.AbstractContextManager:
    """A data-parallel step all ranks agree finished (DataParallel.step); one process: nothing."""
    return dp.step(what) if dp is not None else contextlib.nullcontext()


def _outputs_and_stats(block, linears, stats: tuple[str, ...], inputs) -> tuple[list, dict]:
    """The block's outputs and its Linears' statistics from ONE forward per batch.

    Why: a method calibrated on the float block (AWQ, GGUF imatrix) needs both, and they
    were two forwards; the hooks see the very inputs the separate pass saw, in the same
    order, so the sums are the same bit for bit (SmolLM2 AWQ, 2 threads: the separate statistics pass took 62 s, now 0; benchmarks/awq_cpu_phases.py).
    """
    with StatCollector(linears, stats) as collector:
        outs = run_block(block, inputs)
    return outs, collector.results


def _group_stats(block, linears, stats: tuple[str, ...], inputs, staged_inputs,
                 attention_v: str | None = None, attention: str = "") -> dict:
    """The statistics of one sequential group: from the inputs a StagedForward paused at
    (`staged_inputs`, one per batch, shared by every member), or by replaying the block.
    `attention_v` names the group's v_proj whose Hessian becomes the attention-weighted one
    (quantkit.pipeline.attention_v), computed from the same inputs before any is quantized."""
    if not stats or inputs is None:
        return {}
    if staged_inputs is None:
        seen: list[torch.Tensor] = []
        handle = None
        if attention_v is not None:  # v_proj's input per batch (on the host when offloaded)
            host = inputs.device is not None
            handle = linears[attention_v].register_forward_pre_hook(
                lambda _m, args: seen.append(args[0].detach().to("cpu") if host else args[0].detach()))
        try:
            with StatCollector(linears, stats) as collector:
                collector.run(block, inputs)
        finally:
            if handle is not None:
                handle.remove()
        results = collector.results
    else:
        seen = staged_inputs
        collector = StatCollector(linears, stats, hook=False)
        for x in staged_inputs:  # batch by batch, member by member: the replay path's order
            for name in linears:
                collector.observe(name, x)
        results = collector.close()
    if attention_v is not None and "hessian" in stats and attention_v in results:
        results[attention_v]["hessian"] = attention_v_hessian(block, attention, seen, inputs.kwargs)
    return results


def _warn_few_tokens(prefix: str, spec, stats: dict, min_tokens: int) -> None:
    """Name the experts whose statistics rest on fewer than `min_tokens` routed tokens."""
    few = {n: int(s["tokens"]) for n, s in stats.items()
           if spec.is_expert_linear(n) and int(s["tokens"]) < min_tokens}
    if not few:
        return
    shown = ", ".join(f"{n} ({t})" for n, t in list(few.items())[:6])
    warnings.warn(
        f"{len(few)} expert Linear(s) of {prefix.rstrip('.')} calibrated on fewer than "
        f"{min_tokens} routed tokens: {shown}{' ...' if len(few) > 6 else ''}. "
        "Use more calibration samples or --moe-calibrate-all-experts.",
        RuntimeWarning, stacklevel=3)


def _collect(block, names, stats, inputs) -> dict:
    if inputs is None:
        return {}
    with StatCollector(_linears(block, tuple(names)), tuple(stats)) as collector:
        collector.run(block, inputs)
    return collector.results


def _check_block_finite(block: torch.nn.Module, prefix: str, device) -> None:
    """check_finite of the block's parameters, on the compute device when that is a GPU.

    On a GPU the block is moved there first (dtype unchanged, so the check sees the very
    values the CPU check would) and all tensors are checked with one read-back; the CPU
    path is check_finite itself. Raises check_finite's error for the first bad tensor.
    """
    if torch.device(device).type == "cpu":
        check_finite((prefix + n, p) for n, p in block.named_parameters())
        return
    block.to(device=device)
    named = list(block.named_parameters())
    for (n, p), bad in zip(named, any_finite_problem([p for _, p in named]), strict=True):
        if bad:
            check_finite([(prefix + n, p)])


def _block_and_results_to_cpu(block: torch.nn.Module, dtype: torch.dtype,
                              results: list[QuantResult]) -> None:
    """block.to("cpu", dtype) and every result tensor to the CPU, as ONE batched transfer.

    Why: per-tensor `.cpu()` / `Module.to("cpu")` are synchronous pageable copies (~0.5 s of a
    ~2.1 s GPTQ block on the H100 machine). fetch_to_cpu moves them through reused pinned
    buffers with overlapped draining. Floating parameters/buffers are cast to `dtype` on the
    device first (the same IEEE rounding Module.to does), so the CPU tensors are identical to
    the old path's. A block already on the CPU takes Module.to exactly as before.
    """
    slots = []  # (owner, kind, name, tensor) for every parameter/buffer on a GPU
    for mod in block.modules():
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(mod, kind).items():
                if t is not None and t.is_cuda:
                    slots.append((mod, kind, name, t))
    res_slots = []  # (result, attr or extra key, tensor)
    for res in results:
        for attr in ("codes", "scale", "zero", "g_idx", "bias"):
            t = getattr(res, attr)
            if t is not None:
                res_slots.append((res, attr, t))
        for key, t in res.extra.items():
            res_slots.append((res, "extra:" + key, t))
    seen: dict[int, int] = {}  # parameters shared inside the block are copied once
    tensors = []
    for _, _, _, t in slots:
        if id(t) not in seen:
            seen[id(t)] = len(tensors)
            tensors.append(t.detach().to(dtype) if t.is_floating_point() else t.detach())
    first_res = len(tensors)
    tensors += [t for _, _, t in res_slots]
    cpu = fetch_to_cpu(tensors)
    for mod, kind, name, t in slots:
        new = cpu[seen[id(t)]]
        if kind == "_parameters":
            t.data = new  # what Module.to does: the Parameter object stays, its data moves
        else:
            mod._buffers[name] = new
    for (res, attr, _), t in zip(res_slots, cpu[first_res:], strict=True):
        if attr.startswith("extra:"):
            res.extra[attr[6:]] = t
        else:
            setattr(res, attr, t)
    block.to(device="cpu", dtype=dtype)  # the CPU path; a no-op once everything moved above
