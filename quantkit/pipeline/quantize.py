"""`quantkit quantize` end to end: cheap checks first, then calibration, blocks, atomic write."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import time
import warnings
from collections import ChainMap
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch

import quantkit
from quantkit.arch import ArchSpec, spec_for_config
from quantkit.errors import ModelLoadError, QuantkitError, SchemeMismatch
from quantkit.formats import (
    DEFAULT_FORMAT,
    FORMAT_CHOICES,
    format_record,
    get_writer,
    kv_cache_formats,
)
from quantkit.formats.kv_cache import add_kv_cache_config, kv_scale_tensors
from quantkit.machine import torch_cpu_bf16_native
from quantkit.methods import MOE_METHODS_HINT, get_quantizer, method_record
from quantkit.methods.kvcache import fp8_kv_scales
from quantkit.model_io import (
    PROCESSOR_FILES,
    TOKENIZER_FILES,
    check_finite,
    load_config,
    load_model,
    load_tokenizer,
    meta_model,
    resolve_model,
)
from quantkit.pipeline.attention_v import check_attention_v, wants_attention_v
from quantkit.pipeline.blocks import dense_tensor, get_blocks, quantize_blocks
from quantkit.pipeline.checkpoint import (
    BlockCheckpoint,
    checkpoint_dir,
    checkpoint_note,
    request_key,
)
from quantkit.pipeline.experts import linearize_experts
from quantkit.pipeline.heap import end_small_heap, keep_heap_small
from quantkit.pipeline.mtp import find_mtp, mtp_quantizer, quantize_mtp
from quantkit.pipeline.offload import reserve_pinned
from quantkit.pipeline.output import (
    atomic_output,
    check_not_input,
    check_output,
    describe_output,
    identity,
)
from quantkit.pipeline.plan import (
    OFFLOAD_BATCH,
    MemoryPlan,
    check_memory,
    estimate,
    offload_activations,
)
from quantkit.pipeline.streaming import (
    ShardReader,
    StreamingSource,
    block_tensor,
    materialise,
    skeleton,
    stream_plan_ok,
    to_meta,
)
from quantkit.pipeline.towers import quantize_vision, tower_linears, vision_quantizer
from quantkit.readers import model_fingerprint, read_config_json, scan_finite
from quantkit.reproducible import ENV_VAR as REPRODUCIBLE_ENV
from quantkit.reproducible import active as reproducible_active
from quantkit.reproducible import check_cpu, kernel_facts
from quantkit.types import EXPERT_MIN_TOKENS, ProgressFn, QuantResult, QuantScheme

__all__ = ["QuantizeRequest", "quantize", "plan", "linear_shapes", "check_group_size",
           "resolve_group_size"]

GROUP_SIZES = (128, 64, 32)  # the default's candidates, best first (kernels' favourites)


@dataclass
class QuantizeRequest:
    model: str
    method: str
    scheme: QuantScheme
    out: Path
    format: str = DEFAULT_FORMAT
    force: bool = False
    calib: str = "mixed"
    calib_samples: int = 128
    calib_seqlen: int = 512
    seed: int = 0
    chat: bool = False
    allow_pickle: bool = False
    trust_remote_code: bool = False
    device: str | None = None
    method_options: dict = field(default_factory=dict)
    command: str = ""
    stream: bool | None = None  # None: block-at-a-time from the shards whenever they allow it
    resume: bool = True  # per-block checkpoints in .OUT.partial/, resumed by the same request
    memory_check: bool = True  # refuse early when the plan's peak RAM exceeds what is available
    group_size_auto: bool = False  # scheme.group_size was not asked for: fit it to the shapes
    # scheme.symmetric was not asked for (no --sym / --asym): the format's grid decides
    # (FormatRecord.symmetric: asymmetric for mlx, symmetric elsewhere)
    symmetric_auto: bool = False
    # scheme.act_order was not asked for (GPTQ without --act-order / --no-act-order): the
    # format's default decides (FormatRecord.act_order: on for mlx)
    act_order_auto: bool = False
    text_column: str | None = None  # the calibration column of a .jsonl/.parquet/hf: source
    # mixture of experts: every token through every expert for statistics (routing unchanged)
    moe_calibrate_all_experts: bool = False
    expert_min_tokens: int = EXPERT_MIN_TOKENS  # warn about experts calibrated on fewer
    kv_cache: str | None = None  # "fp8": calibrate per-layer k/v scales for an FP8 KV cache
    # same kernels on every AVX2 CPU (quantkit.reproducible); the process must have pinned
    # them before torch loaded (QUANTKIT_REPRODUCIBLE=1), else quantize() refuses
    reproducible: bool = False
    # a vision-language checkpoint: quantize the vision encoder's Linears too (RTN where the
    # method is calibrated: calibration text never reaches the vision tower)
    quantize_vision: bool = False
    # multi-token-prediction layers: quantize their Linears like the trunk's (RTN where the
    # method is calibrated: transformers gives no forward for them); default: kept dense
    quantize_mtp: bool = False

    def cli_equivalent(self) -> str:
        """The `quantkit quantize` command that makes this request (for API callers)."""
        import shlex

        record = method_record(self.method)
        # a method's native format is its only one (the CLI refuses any other --format)
        args = [self.model, "--method", self.method, "--format",
                record.native_format or self.format]
        args += record.command_args(self)
        if "damp" in self.method_options:
            args += ["--damp", str(self.method_options["damp"])]
        if self.method_options.get("true_sequential") is False:
            args += ["--no-true-sequential"]
        if self.method_options.get("v_hessian", "tokens") != "tokens":
            args += ["--gptq-v-hessian", str(self.method_options["v_hessian"])]
        if self.moe_calibrate_all_experts:
            args += ["--moe-calibrate-all-experts"]
        if self.kv_cache:
            args += ["--kv-cache", self.kv_cache]
        if self.reproducible:
            args += ["--reproducible"]
        if self.quantize_vision:
            args += ["--quantize-vision"]
        if self.quantize_mtp:
            args += ["--quantize-mtp"]
        args += record.command_tail(self)
        reads_calib = record.reads_calibration(self.method_options) or bool(self.kv_cache)
        if reads_calib:  # the CLI refuses calibration flags a method would not read
            args += ["--calib", self.calib, "--calib-samples", str(self.calib_samples),
                     "--calib-seqlen", str(self.calib_seqlen), "--seed", str(self.seed)]
            args += ["--text-column", self.text_column] if self.text_column else []
            args += ["--chat"] if self.chat else []
        return "quantkit quantize " + shlex.join(args + ["-o", str(self.out)])


def linear_shapes(config, spec: ArchSpec) -> dict[str, tuple[int, int]]:
    """[N, K] of every block Linear, from the config alone (a meta-device model, no weights);
    MoE experts as their per-expert Linears."""
    model = linearize_experts(meta_model(config), spec)
    shapes = {}
    for i, block in enumerate(get_blocks(model, spec)):
        mods = dict(block.named_modules())
        for name in spec.linears_for(spec.experts.count(config) if spec.experts else 0):
            if name in mods:
                shapes[f"{spec.block_path}.{i}.{name}"] = tuple(mods[name].weight.shape)
    return shapes


def fitting_group_sizes(shapes: dict[str, tuple[int, int]],
                        candidates: tuple[int, ...] = (*GROUP_SIZES, 16)) -> list[int]:
    """The candidates that divide every Linear's input width."""
    widths = {k for _, k in shapes.values()}
    return [g for g in candidates if all(k % g == 0 for k in widths)]


def resolve_group_size(req: QuantizeRequest,
                       shapes: dict[str, tuple[int, int]]) -> tuple[QuantizeRequest, str | None]:
    """The request with its default group size fitted to the model, and what was chosen and why
    (None when nothing changed): 128 where it divides every width, else the largest of 64 / 32
    that does, else one group per row. An explicit --group-size is left to check_group_size."""
    if not req.group_size_auto or req.scheme.kind != "int":
        return req, None
    fits = fitting_group_sizes(shapes, GROUP_SIZES)
    group = fits[0] if fits else -1
    if group == req.scheme.group_size:
        return req, None
    widths = sorted({k for _, k in shapes.values()})
    note = (f"group size {group if group > 0 else '-1 (one group per row)'}: the default 128 "
            f"does not divide every Linear input width {widths}; pass --group-size to choose")
    scheme = dataclasses.replace(req.scheme, group_size=group)
    return dataclasses.replace(req, scheme=scheme, group_size_auto=False), note


def resolve_symmetric(req: QuantizeRequest) -> QuantizeRequest:
    """The request with the grid its format defaults to, where it chose none
    (symmetric_auto), with float zero points where the format stores a free float bias and
    the grid is asymmetric (FormatRecord.float_zero), and GPTQ's act-order where it chose
    none (act_order_auto), and NVFP4 without its tensor scale where the format stores none
    (FormatRecord.fp4_tensor_scale): the one place a format sets a scheme default."""
    record = format_record(req.format)
    if req.scheme.kind == "nvfp4" and req.scheme.tensor_scale and not record.fp4_tensor_scale:
        return dataclasses.replace(req, scheme=dataclasses.replace(req.scheme,
                                                                   tensor_scale=False))
    if req.scheme.kind != "int":
        return req
    scheme = req.scheme
    if req.symmetric_auto:
        scheme = dataclasses.replace(scheme, symmetric=record.symmetric)
    if req.act_order_auto:
        scheme = dataclasses.replace(scheme, act_order=record.act_order)
    if record.float_zero and not scheme.symmetric and not scheme.float_zero:
        scheme = dataclasses.replace(scheme, float_zero=True)
    if scheme == req.scheme and not req.symmetric_auto and not req.act_order_auto:
        return req
    return dataclasses.replace(req, scheme=scheme, symmetric_auto=False, act_order_auto=False)


def check_group_size(scheme: QuantScheme, shapes: dict[str, tuple[int, int]]) -> None:
    """Group size must divide every in_features; name the layers and suggest one that works."""
    if scheme.kind != "int" or scheme.group_size in (-1, 0):
        return
    bad = {n: k for n, (_, k) in shapes.items() if k % scheme.group_size}
    if not bad:
        return
    widths = sorted({k for _, k in shapes.values()})
    fits = fitting_group_sizes(shapes)
    names = [n for n in shapes if n in bad]  # model order
    shown = ", ".join(f"{n} (in_features {bad[n]})" for n in names[:4])
    more = f" and {len(names) - 4} more" if len(names) > 4 else ""
    hint = (f"Use --group-size {fits[0]} (divides every width: {widths})" if fits
            else "Use --group-size -1 (one group per row)")
    raise SchemeMismatch(
        f"Group size {scheme.group_size} does not divide the input width of {len(names)} "
        f"layers: {shown}{more}.", hint + ".")


def plan_request(req: QuantizeRequest, config, spec: ArchSpec, quantizer,
                 raw_config: dict, gpus: int = 1) -> MemoryPlan:
    """The memory / disk / time plan of `req` (quantkit plan; quantize's early memory check);
    `gpus` > 1: one rank of a data-parallel run over that many."""
    return estimate(config, spec, method=req.method, scheme=req.scheme,
                    gpus=gpus, spread_solves=quantizer.data_parallel is True,
                    calib_samples=req.calib_samples, calib_seqlen=req.calib_seqlen,
                    calibrated=quantizer.needs_calibration or bool(req.kv_cache),
                    device=_device(req.device),
                    calib_batch=quantizer.calib_batch_size,
                    store_dtype=_storage_dtype(raw_config), streaming=req.stream is not False,
                    compute_dtype=compute_dtype_for(
                        _device(req.device), _storage_dtype(raw_config),
                        quantizer.needs_calibration or bool(req.kv_cache), req.reproducible),
                    resume=req.resume and not quantizer.quantizes_outside_blocks
                    and not req.kv_cache,
                    true_sequential=quantizer.true_sequential,
                    moe_all_experts=req.moe_calibrate_all_experts,
                    expert_input_bytes=quantizer.expert_input_bytes,
                    hessians="hessian" in quantizer.stats,
                    attention_v=wants_attention_v(quantizer) and spec.attention_v)


def plan(req: QuantizeRequest, gpus: int = 1) -> tuple[MemoryPlan, dict]:
    """Cheap checks as in quantize(), then the plan; no weights or calibration are read.
    `gpus` > 1: a torchrun data-parallel run over that many GPUs (per-rank peaks)."""
    from quantkit.pipeline.distributed import DataParallel

    req = resolve_symmetric(req)
    quantizer = get_quantizer(req.method, **req.method_options)
    quantizer.check(req.scheme)
    if gpus < 1:
        raise SchemeMismatch(f"--gpus must be at least 1, got {gpus}.")
    if gpus > 1:  # the refusal a torchrun run would give, now
        DataParallel(rank=0, world=gpus, local_rank=0, backend="nccl").check_method(quantizer)
    source = resolve_model(req.model, allow_pickle=req.allow_pickle)
    raw_config = read_config_json(source.path)
    spec = spec_for_config(raw_config)
    check_attention_v(spec, quantizer)
    config = load_config(source.path, trust_remote_code=req.trust_remote_code)
    req, group_note = resolve_group_size(req, linear_shapes(config, spec))
    if req.kv_cache:
        check_kv_cache(req.kv_cache, req.format, spec, False)
    calibrated = quantizer.needs_calibration or bool(req.kv_cache)
    info = {"model": str(source.path), "architecture": spec.name, "method": req.method,
            "scheme": req.scheme.describe(), "device": _device(req.device),
            "calib_samples": req.calib_samples if calibrated else 0,
            "calib_seqlen": req.calib_seqlen if calibrated else 0,
            **({"rounding": quantizer.rounding} if quantizer.rounding is not None else {}),
            **({"kv_cache": req.kv_cache} if req.kv_cache else {}),
            **({"group_size_choice": group_note} if group_note else {}),
            **({"gpus": gpus} if gpus > 1 else {})}
    return plan_request(req, config, spec, quantizer, raw_config, gpus), info


def _device(requested: str | None) -> str:
    if requested:
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


def quantize(req: QuantizeRequest, on_progress: ProgressFn | None = None) -> dict:
    """Run a quantization; returns the artifact's metadata (also written as quantkit.json).

    Under torchrun (WORLD_SIZE > 1) this is one rank of a data-parallel run
    (quantkit.pipeline.distributed): rank 0 writes the artifact and returns its metadata,
    the other ranks return {"rank": r, "world_size": N} and write nothing.
    """
    from quantkit.pipeline.distributed import from_env, world_size_from_env

    out = Path(req.out)
    before: tuple[int, int] | None | str = "unchecked"
    try:
        check_output(out, req.force)  # before anything is loaded
        before = identity(out)
        if world_size_from_env() <= 1:
            return _quantize(req, on_progress, None)
        dp, device = from_env(_device(req.device))
        try:
            return _quantize(req, on_progress if dp.is_main else None, (dp, device))
        finally:
            dp.close()
    except KeyboardInterrupt as exc:  # say what is on disk now, truthfully
        if before == "unchecked":
            raise KeyboardInterrupt(f"stopped before anything was written to {out}") from exc
        kept = checkpoint_note(out)
        raise KeyboardInterrupt(describe_output(out, before) + (f"; {kept}" if kept else "")) \
            from exc
    except QuantkitError as exc:
        kept = checkpoint_note(out)
        if kept:
            exc.hint = f"{exc.hint} ({kept}.)" if exc.hint else kept[0].upper() + kept[1:] + "."
        raise
    finally:
        end_small_heap()  # _quantize's heap settings, for what this process does next


def _quantize(req: QuantizeRequest, on_progress: ProgressFn | None, dist) -> dict:
    dp, dp_device = dist if dist is not None else (None, None)
    t_start = time.perf_counter()
    if req.reproducible:
        if not reproducible_active():
            raise QuantkitError("reproducible=True needs the kernels pinned before torch loads, "
                                "and this process loaded torch first.",
                                f"Set {REPRODUCIBLE_ENV}=1 in the environment before Python "
                                "starts, or run `quantkit quantize --reproducible`.")
        check_cpu()
    if req.stream is not False:
        keep_heap_small()  # before torch's threads make their malloc arenas
    out = Path(req.out)
    req = resolve_symmetric(req)
    quantizer = get_quantizer(req.method, **req.method_options)
    quantizer.check(req.scheme)
    if dp is not None:
        dp.check_method(quantizer)
    source = resolve_model(req.model, allow_pickle=req.allow_pickle, on_progress=on_progress)
    check_not_input(out, _input_paths(req, source.path))
    writer = get_writer(req.format)  # after the cheap refusals: compressed-tensors loads slowly
    raw_config = read_config_json(source.path)
    spec = spec_for_config(raw_config)  # before transformers parses it: cheap, clear errors
    check_moe_support(spec, req.method, writer.name, quantizer.needs_calibration,
                      quantizer.moe_calibrated)
    check_attention_v(spec, quantizer)
    if req.kv_cache:
        check_kv_cache(req.kv_cache, writer.name, spec, dp is not None)
    vision_method = vision_quantizer(quantizer, req.scheme, spec) if req.quantize_vision else None
    # MTP tensors (transformers drops them): copied from the shards; GGUF checks them itself
    mtp = find_mtp(source.path, raw_config, spec)
    mtp_method = mtp_quantizer(quantizer, req.scheme, mtp, writer.name, writer.single_file,
                               writer.mtp_as_blocks) if req.quantize_mtp else None
    # a format that stores MTP layers as blocks (GGUF's nextn): their weight matrices are
    # planned and quantized by the run's method, as the trunk's
    mtp_blocks = mtp.block_weights(spec.experts.router if spec.experts else None) \
        if mtp is not None and writer.mtp_as_blocks else {}
    if mtp_blocks:
        if quantizer.needs_calibration:
            raise SchemeMismatch(
                f"{writer.name} stores the MTP layers as blocks quantized like the trunk's; "
                f"transformers gives no forward for them, so {quantizer.name} with calibration "
                "(--calib / --rounding gptq) has nothing to calibrate them with.",
                "Drop --calib / --rounding gptq (an --imatrix FILE is read as llama-quantize "
                "reads it), or use --format compressed-tensors.")
        mtp_method = quantizer
    calibrate = quantizer.needs_calibration or bool(req.kv_cache)
    config = load_config(source.path, trust_remote_code=req.trust_remote_code)
    shapes = linear_shapes(config, spec)
    req, group_note = resolve_group_size(req, shapes)
    if group_note:
        warnings.warn(group_note, stacklevel=2)
    check_group_size(req.scheme, shapes)
    problems = writer.check(req.scheme, shapes)
    if problems:
        raise SchemeMismatch(f"Format {writer.name} cannot store this: " + "; ".join(problems) + ".",
                             f"Choose another --format ({FORMAT_CHOICES}) or the scheme flags "
                             "the message names.")
    if writer.checks_modules:  # an ignore list matched by substring (AutoAWQ's)
        check_kept_modules(writer, config, spec, shapes)
    if writer.embeds_source:  # writers that embed tokenizer/config (GGUF) check them now
        writer.check_source(source.path, config)
    if quantizer.file_overhead_bytes is not None and writer.sizes_overhead:
        # a whole-file size budget (GGUF auto --target-size): what the file holds besides the
        # weight matrices, known before any data is read
        floats, n_tensors = _non_matrix_values(config, spec, shapes)
        quantizer.file_overhead_bytes = writer.overhead_bytes(config, floats, n_tensors)
    # per-tensor plans (GGUF type mix) from the config alone
    quantizer.prepare(config=config, spec=spec, shapes={**shapes, **mtp_blocks})
    device = dp_device or _device(req.device)
    mem_plan = plan_request(req, config, spec, quantizer, raw_config)
    if req.memory_check:
        check_memory(mem_plan)
    # NaN/Inf in any tensor (embeddings and lm_head too) stops the run before the model is
    # opened, not after every block was quantized: one streamed pass over the shards, read by
    # threads while the tokenizer and the calibration text are loaded (it waits on the disk,
    # they on a core), and waited for below. On a GPU the decoder blocks are left to the
    # block loop, which checks each block as it reads it (before anything is written): the
    # whole-checkpoint pass cost about as much as the disk read of every block, which the
    # loop reads anyway, overlapped with the previous block's compute
    t_checked = time.perf_counter()
    gpu_stream = dp is None and str(device).startswith("cuda")
    scan_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="quantkit-scan")
    scan = scan_pool.submit(scan_finite, source.path,
                            checked_later=block_tensor(spec) if gpu_stream else None)
    scan_pool.shutdown(wait=False)
    # calibration activations in host memory when they would not fit the GPU (one process
    # per GPU: data-parallel ranks keep their smaller shards on it)
    offload = dp is None and str(device).startswith("cuda") and torch.cuda.is_available() \
        and offload_activations(mem_plan, torch.cuda.mem_get_info(torch.device(device))[0])
    # before any work, so a broken tokenizer fails fast; a writer that embeds the tokenizer
    # (GGUF) has loaded and checked it in check_source, and only calibration needs it again
    tokenizer = None
    if calibrate or not writer.embeds_source:
        tokenizer = load_tokenizer(source.path, trust_remote_code=req.trust_remote_code)

    calib = None
    if calibrate:
        from quantkit.calibration import load_calibration

        calib = load_calibration(req.calib, tokenizer, n_samples=req.calib_samples,
                                 seqlen=req.calib_seqlen, seed=req.seed, chat=req.chat,
                                 text_column=req.text_column)
    t_calibration = time.perf_counter()
    store_dtype = _storage_dtype(raw_config)
    compute_dtype = compute_dtype_for(device, store_dtype, calibrate, req.reproducible)
    # methods may ask for larger calibration batches (fewer, bigger ops: much faster on CPU)
    batch = quantizer.calib_batch_size
    if offload:  # GPU memory is short: smaller forwards too (what the plan assumed)
        batch = min(batch, OFFLOAD_BATCH)
        if calib is not None:  # the first block's pinned host memory, got while the scan reads
            reserve_pinned([(len(ids), ids.shape[1], int(config.get_text_config().hidden_size))
                            for ids in calib.batches(batch)], compute_dtype, copies=2)
    scan.result()  # raises BadWeights naming the first bad tensor
    if on_progress:
        on_progress("checking weights for NaN/Inf", 1, 1)
    t_scanned = time.perf_counter()
    load_dtype = compute_dtype  # the dtype load_model gives; streaming loads blocks the same way
    streaming, reader, model = _open_model(req, source.path, config, load_dtype, spec)
    ckpt = None
    # data-parallel ranks hold only their shard's hidden states: no per-block checkpoints
    # GGUF keeps cross-block state; KV-cache scales are not checkpointed (yet)
    if req.resume and dp is None and not quantizer.quantizes_outside_blocks and not req.kv_cache:
        describe = {"model": str(source.path), "model_files": model_fingerprint(source.path),
                    "method": req.method, "format": writer.name,
                    "scheme": req.scheme.record(), "options": req.method_options,
                    "calibration": calib.provenance if calib is not None else None,
                    "device": device, "quantkit": quantkit.__version__,
                    "moe_calibrate_all_experts": req.moe_calibrate_all_experts,
                    "reproducible": req.reproducible}
        ckpt = BlockCheckpoint(checkpoint_dir(out), request_key(describe), describe)
    batches = list(calib.batches(batch)) if calib is not None else None
    if dp is not None and batches is not None:
        batches = dp.shard(batches)
    t_quant = time.perf_counter()
    kept: dict[str, torch.Tensor] = {}
    kv_absmax: dict[str, tuple[float, float]] | None = {} if req.kv_cache else None
    results = quantize_blocks(model, spec, quantizer, req.scheme, batches, device=device,
                              compute_dtype=compute_dtype, options=req.method_options,
                              on_progress=on_progress, checkpoint=ckpt, dense=kept,
                              dense_dtype=store_dtype, expert_min_tokens=req.expert_min_tokens,
                              source=StreamingSource(model, reader, spec, load_dtype,
                                                     read_ahead=gpu_stream)
                              if streaming else None, dp=dp, offload_activations=offload,
                              kv_absmax=kv_absmax)
    if dp is not None and not dp.is_main:  # rank 0 alone writes the artifact
        return {"rank": dp.rank, "world_size": dp.world}
    vision: dict[str, QuantResult] = {}
    if vision_method is not None:
        load = (lambda prefix, block: materialise(block, prefix, reader, load_dtype)) \
            if streaming else None
        vision = quantize_vision(model, spec, vision_method, req.scheme, load,
                                 to_meta if streaming else None)
        results = ChainMap(vision, results)
    if quantizer.quantizes_outside_blocks:  # tensors outside the blocks (GGUF embeddings)
        # the final norm too for a method that reads the head's input (GGUF auto)
        wanted = (spec.embed, spec.lm_head, *(m for m, _ in spec.gguf_outer_embeds)) + (
            (spec.final_norm,) if quantizer.reads_final_norm else ())
        present = dict(model.named_modules())
        outside = [m for m in wanted if streaming and m in present]
        for name in outside:
            materialise(model.get_submodule(name), name + ".", reader, load_dtype, root=model)
        results.update(quantizer.quantize_rest(model, spec))
        for name in outside:
            to_meta(model.get_submodule(name))
    quant_seconds = time.perf_counter() - t_quant
    kv_scales = {name: fp8_kv_scales(*amax) for name, amax in (kv_absmax or {}).items()}

    if streaming:
        dense = _streamed_dense(model, reader, spec, results, kept, load_dtype, store_dtype)
    else:
        dense = _dense_tensors(model, results, store_dtype)
        dense.update(kept)
    meta = {
        "quantkit_version": quantkit.__version__,
        "method": req.method,
        "format": writer.name,
        "engines": list(writer.engines),
        "scheme": req.scheme.record(),
        "source_model": {"spec": req.model, "path": str(source.path),
                         "name_or_path": raw_config.get("_name_or_path") or getattr(
                             config, "name_or_path", "") or req.model,
                         "architecture": spec.name},
        "calibration": calib.provenance if calib is not None else None,
        "method_options": req.method_options,
        **({"kv_cache": {"dtype": "fp8_e4m3", "strategy": "tensor",
                         "scales": {n: {"k_scale": k, "v_scale": v}
                                    for n, (k, v) in kv_scales.items()}}} if req.kv_cache else {}),
        **({"group_size_choice": group_note} if group_note else {}),
        **({"moe": {"calibrate_all_experts": req.moe_calibrate_all_experts,
                    "expert_min_tokens": req.expert_min_tokens,
                    "router": "unquantized"}} if spec.experts is not None else {}),
        # Linears the method could not treat its own way, and what ran instead (loud on purpose)
        **({"fallbacks": fb} if (fb := {n: r.fallback for n, r in results.items()
                                         if r.fallback}) else {}),
        # the smoothing groups of a family without a table, as discovery found them, and
        # which of them the method folded (table families: their family module says)
        **({"awq_groups": _scaling_record(spec, quantizer.history)}
           if spec.awq_source == "discovered" and quantizer.history else {}),
        # per-tensor types the method chose itself (GGUF auto: the budget, the solve, each type)
        **({"gguf_auto": quantizer.allocation} if quantizer.allocation else {}),
        **({"towers": {"modules": [spec.checkpoint_name(t + ".")[:-1] for t in spec.towers],
                       "vision_quantized": len(vision),
                       **({"vision_method": vision_method.name} if vision_method else {})}}
           if spec.towers else {}),
        "device": device, "compute_dtype": str(compute_dtype).removeprefix("torch."),
        # which float32 kernels ran: artifacts whose facts differ may differ in their codes
        **({"kernels": kernel_facts()} if device == "cpu" else {}),
        **({"offload_activations": True} if offload else {}),
        # where the command's time went: the checks before the NaN/Inf scan, tokenizer and
        # calibration text (while the scan runs), the wait for the scan's end, the block
        # loop; `total` (set last) adds opening the model and writing the artifact
        "seconds": {"checks": round(t_checked - t_start, 3),
                    "calibration": round(t_calibration - t_checked, 3),
                    "scan_wait": round(t_scanned - t_calibration, 3),
                    "quantize": round(quant_seconds, 3)},
        **({"data_parallel": dp.describe()} if dp is not None else {}),
        "command": req.command or req.cli_equivalent(),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    out_config = without_remote_code(raw_config, "config.json")
    # the towers' Linears left dense, by exact name: vLLM maps exact names (not regexes) to
    # its own module names (its model's hf_to_vllm_mapper), and builds these Linears with
    # the quantization method unless the ignore list names them
    ignore = _ignored(spec) + [spec.checkpoint_name(n + ".")[:-1]
                               for n in tower_linears(meta_model(config), spec) if n not in vision]
    if spec.checkpoint_renames:  # the engines load the checkpoint's names (Mixtral's)
        dense = {spec.checkpoint_name(k): v for k, v in dense.items()}
        results = CheckpointNamed(results, spec)
    if mtp is not None:  # under the checkpoint's names, which vLLM's MTP loaders read
        dense, results, ignore = _with_mtp(mtp, mtp_method, req.scheme, dense, results, ignore,
                                           spec, list(mtp_blocks) or None)
        meta["mtp"] = mtp.record(mtp_method.name if mtp_method else None)
    if writer.single_file:  # one file (GGUF): metadata goes inside it
        meta["seconds"]["total"] = round(time.perf_counter() - t_start, 3)
        with atomic_output(out, req.force, is_dir=False) as tmp:
            writer.write(tmp, config=out_config, dense=dense, results=results,
                         ignore=ignore, dtype=store_dtype, scheme=req.scheme, meta=meta,
                         source_dir=source.path)
        if ckpt is not None:
            ckpt.remove()
        return meta
    if req.kv_cache:  # the scale tensors as the format names them, beside the weights
        dense.update(kv_scale_tensors(writer.name, kv_scales, store_dtype))
    with atomic_output(out, req.force) as tmp:
        writer.write(tmp, config=out_config, dense=dense, results=results,
                     ignore=ignore, dtype=store_dtype)
        if req.kv_cache:
            add_kv_cache_config(tmp, writer.name)
        meta["engines"] = list(writer.engines)  # a writer may narrow them by what it wrote (FP8)
        for engine, why in spec.engine_gaps.items():
            if engine in meta["engines"]:
                meta["engines"].remove(engine)
                meta.setdefault("engine_gaps", {})[engine] = why
                warnings.warn(f"{spec.name}: {engine} cannot load this artifact: {why}", stacklevel=2)
        for name in TOKENIZER_FILES + PROCESSOR_FILES:
            if (source.path / name).is_file():
                shutil.copy2(source.path / name, tmp / name)
        tok_config = json.loads((tmp / "tokenizer_config.json").read_text()) \
            if (tmp / "tokenizer_config.json").is_file() else {}
        if "auto_map" in tok_config:
            (tmp / "tokenizer_config.json").write_text(json.dumps(
                without_remote_code(tok_config, "tokenizer_config.json"), indent=2,
                ensure_ascii=False))
        (tmp / "quantkit_stats.json").write_text(json.dumps(_stats(results, spec, req.expert_min_tokens), indent=1))
        meta["seconds"]["total"] = round(time.perf_counter() - t_start, 3)
        (tmp / "quantkit.json").write_text(json.dumps(meta, indent=2))
    if ckpt is not None:
        ckpt.remove()
    return meta


def _with_mtp(mtp, method, scheme: QuantScheme, dense: dict, results, ignore: list[str],
              spec: ArchSpec, modules: list[str] | None = None):
    """dense, results and ignore with the MTP layers: quantized Linears beside the trunk's
    results (--quantize-mtp: those shaped like the trunk's; `modules`: these, a format's MTP
    blocks), every other MTP tensor as stored, each dense MTP Linear named in the ignore list
    (vLLM then builds it unquantized)."""
    if method is not None:
        trunk = {spec.checkpoint_name(n) for n in results} if not spec.checkpoint_renames \
            else set(results)
        quantize_mtp(mtp, modules if modules is not None else mtp.linears_like(trunk), method,
                     scheme)
        results = ChainMap(mtp.quantized, results)
    skip = {m + s for m in mtp.quantized for s in (".weight", ".bias")}
    dense = {**dense, **mtp.read([n for n in mtp.names if n not in skip])}
    return dense, results, ignore + mtp.dense_linears(mtp.shapes())


def _non_matrix_values(config, spec: ArchSpec, shapes: dict[str, tuple[int, int]]) -> tuple[int, int]:
    """(values of every tensor that is not a block Linear or the embeddings / output head, the
    number of tensors in all), from a meta-device model: no weights are read."""
    model = meta_model(config)
    skip = {f"{n}.weight" for n in shapes} | {f"{spec.embed}.weight", f"{spec.lm_head}.weight"}
    state = model.state_dict()
    return sum(t.numel() for n, t in state.items() if n not in skip), len(state)


def without_remote_code(config: dict, what: str) -> dict:
    """`config` without `auto_map`: it names Python files of the source model, which the
    artifact does not carry and quantkit never runs; an engine that followed it would fail."""
    if "auto_map" not in config:
        return config
    warnings.warn(f"dropped auto_map ({', '.join(sorted(config['auto_map']))}) from the "
                  f"artifact's {what}: it names Python files of the source model that the "
                  "artifact does not contain", stacklevel=2)
    return {k: v for k, v in config.items() if k != "auto_map"}


def _input_paths(req: QuantizeRequest, model_dir: Path) -> dict[str, Path]:
    """Every local path the run reads, by what it is (an output must not replace any)."""
    paths = {"source model": model_dir}
    for what, value in (("calibration file", req.calib),
                        ("imatrix file", req.method_options.get("imatrix"))):
        if isinstance(value, str) and Path(value).is_file():
            paths[what] = Path(value)
    return paths


# Uncalibrated schemes (FP8 dynamic / block, NVFP4 W4A16 and MXFP4 rounded to nearest, int8
# W8A8 with dynamic inputs) quantize every expert from its weights alone, whatever the router
# chose. Calibrated ones run on experts where the quantizer says `moe_calibrated` (FP8 static,
# int8 static / SmoothQuant / GPTQ, NVFP4 W4A4, FP4 GPTQ): per-expert statistics, and a
# fallback for a starved expert; rtn / gptq / awq handle experts in the pipeline itself.


def check_moe_support(spec: ArchSpec, method: str, format_name: str, calibrated: bool,
                      moe_calibrated: bool = False) -> None:
    """Refuse, before any work, what is not built for mixture-of-experts models yet.
    `moe_calibrated`: the quantizer's statistics are per expert and it handles an expert the
    router fed no calibration token (static input scales: borrowed from the widest expert)."""
    if spec.experts is None:
        return
    if not format_record(format_name).stores_experts(spec):
        raise SchemeMismatch(
            f"Format {format_name} cannot store the experts of {spec.name} (mixture of experts) yet.",
            f"Use --format {DEFAULT_FORMAT} (per-expert tensors vLLM's FusedMoE loader reads).")
    record = method_record(method)
    if format_name == record.native_format:
        return  # the method's own format stores what it makes of every expert
    if record.handles_experts or not calibrated or moe_calibrated:
        return
    raise SchemeMismatch(
        f"Method {method} does not handle the experts of {spec.name} (mixture of experts) yet.",
        MOE_METHODS_HINT)


def check_kept_modules(writer, config, spec: ArchSpec, shapes: dict[str, tuple[int, int]]) -> None:
    """Refuse, before any work, an artifact whose unquantized modules (the MoE routers, lm_head)
    the format's ignore list cannot name without also naming a quantized Linear: AutoAWQ's
    modules_to_not_convert is matched by substring. Names come from the config alone (a
    meta-device model: which blocks are MoE is the model's own choice), as the artifact will
    spell them."""
    model = linearize_experts(meta_model(config), spec)
    quantized = {spec.checkpoint_name(n) for n in shapes}
    kept = {spec.checkpoint_name(n.rpartition(".")[0]) for n in model.state_dict()} - quantized
    problems = writer.check_modules(_ignored(spec), kept, quantized)
    if problems:
        raise SchemeMismatch(
            f"Format {writer.name} cannot keep the unquantized modules of {spec.name} apart from "
            f"the quantized ones: {problems[0]}" + (f" (and {len(problems) - 1} more)"
                                                    if len(problems) > 1 else "") + ".",
            f"Use --format {DEFAULT_FORMAT} (its ignore list takes exact patterns).")


def check_kv_cache(kv_cache: str, format_name: str, spec: ArchSpec, data_parallel: bool) -> None:
    """Refuse, before any work, a KV-cache request the artifact or the run cannot carry."""
    if kv_cache != "fp8":
        raise SchemeMismatch(f"--kv-cache {kv_cache!r} is not known.", "Use --kv-cache fp8.")
    kv_formats = kv_cache_formats()
    if format_name not in kv_formats:
        raise SchemeMismatch(
            f"Format {format_name} cannot carry KV-cache scales (--kv-cache fp8): its engine "
            "loads no k_scale / v_scale from it.",
            f"Use --format {' or --format '.join(kv_formats)}, or drop --kv-cache "
            "(llama.cpp picks its KV-cache type at run time: --cache-type-k / --cache-type-v).")
    if data_parallel:
        raise SchemeMismatch("--kv-cache fp8 is not wired into data-parallel (torchrun) runs yet.",
                             "Run it as one process (no torchrun).")
    if spec.kv_cache_gap:
        raise SchemeMismatch(f"--kv-cache fp8 is not built for {spec.name}: {spec.kv_cache_gap}.",
                             "Drop --kv-cache.")


def _scaling_record(spec, history: list[dict]) -> dict:
    """quantkit.json's `awq_groups`: the discovered groups (prev -> balance Linears), per group
    the blocks where AWQ searched and folded its scale (s = 1 where no other scale won),
    and the Linear sets that have no group, with why (quantkit.arch.dataflow)."""
    def template(name: str) -> str:  # an expert's own group, under its table row's name
        e = spec.experts
        if e is not None and name.startswith(e.module + "."):
            head, _, tail = name[len(e.module) + 1:].partition(".")
            if head.isdigit():
                return f"{e.module}.{{e}}.{tail}"
        return name

    folded: dict[str, dict[int, object]] = {}
    for h in history:
        folded.setdefault(template(h["prev"]), {}).setdefault(h["block"], h.get("alpha"))
    return {"source": "discovered",
            "groups": [{"prev": g.prev, "balance": list(g.balance), "inspect": g.inspect,
                        **({"prev_tail": True} if g.prev_tail else {}),
                        **({"compensate": list(g.compensate)} if g.compensate else {}),
                        **({"norm_offset": g.norm_offset} if g.norm_offset else {}),
                        "blocks": sorted(folded.get(g.prev, {}))} for g in spec.awq_groups],
            "unscaled": [{"linears": list(names), "why": why} for names, why in spec.awq_unscaled]}


def _ignored(spec: ArchSpec) -> list[str]:
    """Modules the artifact keeps unquantized: lm_head, MoE routers (vLLM's GateLinear
    would otherwise match the "Linear" target and expect packed router weights), the dense
    Linears in and outside the blocks, under the names the artifact stores."""
    dense = [f"re:.*{re.escape(spec.checkpoint_name(f'.{n}.').strip('.'))}$"
             for n in spec.dense_linears]
    dense += [spec.checkpoint_name(n) for n in spec.outer_linears]
    if spec.experts is None:
        return [spec.lm_head, *dense]
    # named by its weight, as the checkpoint stores it (Granite 4's `router` module holds the
    # weight the checkpoint calls `router.layer.weight`)
    router = spec.checkpoint_name(f".{spec.experts.router}.weight").strip(".")[: -len(".weight")]
    return [spec.lm_head, f"re:.*{re.escape(router)}$", *dense]


class CheckpointNamed(Mapping):
    """Results keyed by the checkpoint's tensor names (ArchSpec.checkpoint_name), read from
    `results` on access (a per-block checkpoint's results stay on disk until written)."""

    def __init__(self, results: Mapping[str, QuantResult], spec: ArchSpec):
        self._results = results
        self._names = {spec.checkpoint_name(k): k for k in results}

    def __getitem__(self, name: str) -> QuantResult:
        return self._results[self._names[name]]

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _open_model(req: QuantizeRequest, path: Path, config, load_dtype: torch.dtype,
                spec: ArchSpec):
    """(streaming, reader, model): a meta skeleton when the shards allow block-at-a-time
    loading (the default), else the whole model in memory (`stream=False`, pickle weights,
    checkpoint names that differ from the module names). MoE experts become per-expert
    Linears either way (quantkit.pipeline.experts): per-expert shards stream as they are,
    fused in-memory experts are sliced."""
    all_experts = req.moe_calibrate_all_experts
    if req.stream is not False and any(path.glob("*.safetensors")):
        reader = ShardReader(path, spec.checkpoint_name, spec)
        model = skeleton(config, load_dtype, trust_remote_code=req.trust_remote_code)
        linearize_experts(model, spec, all_experts)
        if stream_plan_ok(model, reader):
            return True, reader, model
        if req.stream:
            raise ModelLoadError(
                f"Cannot stream {path}: its tensor names or shapes differ from the model's.",
                "Drop --stream to load the whole model into memory.")
    model = load_model(path, dtype=load_dtype, allow_pickle=req.allow_pickle,
                       trust_remote_code=req.trust_remote_code)
    return False, None, linearize_experts(model, spec, all_experts)


def _streamed_dense(model, reader: ShardReader, spec: ArchSpec, results: dict[str, QuantResult],
                    kept: dict[str, torch.Tensor], load_dtype: torch.dtype,
                    dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """_dense_tensors for a meta skeleton: block tensors from the loop, the rest from the shards
    (through the load dtype when that could round, so both paths store the same bytes)."""
    blocks = spec.block_path + "."
    tied = getattr(model.config, "tie_word_embeddings", False)
    skip = {f"{n}.weight" for n in results} | {f"{n}.bias" for n in results}
    out = {}
    for name in model.state_dict():
        if name.startswith(blocks):
            if name in kept:
                out[name] = kept[name]
            continue
        if name in skip or (tied and name == "lm_head.weight"):
            continue
        t = reader.get(name)
        check_finite([(name, t)])
        if t.is_floating_point() and load_dtype != torch.float32 and t.dtype != load_dtype:
            t = t.to(load_dtype)
        out[name] = dense_tensor(t, dtype)
    return out


CPU_DTYPE_ENV = "QUANTKIT_CPU_DTYPE"


def compute_dtype_for(device: str, store_dtype: torch.dtype, calibrated: bool,
                      reproducible: bool = False) -> torch.dtype:
    """The dtype the blocks run in. On a GPU bfloat16. On the CPU, for calibrated methods, the
    checkpoint's own bfloat16 where torch runs bf16 GEMMs natively (AMX / AVX512-BF16: the
    block forwards, most of a CPU run, go 2-10x faster; the weights are the checkpoint's
    values either way and every statistic still accumulates in float32, as on the GPU);
    float32 where bf16 is emulated (no faster), without calibration (no forward to speed up),
    for float16 / float32 checkpoints (bf16 would round their weights) and under
    --reproducible (the same kernels on every CPU). QUANTKIT_CPU_DTYPE=float32 (or bfloat16)
    overrides the CPU choice, e.g. to match artifacts made on CPUs of the other kind."""
    if device != "cpu":
        return torch.bfloat16
    forced = os.environ.get(CPU_DTYPE_ENV)
    if forced:
        if forced not in ("float32", "bfloat16"):
            raise QuantkitError(f"{CPU_DTYPE_ENV}={forced!r} is not a compute dtype.",
                                f"Set {CPU_DTYPE_ENV}=float32 or bfloat16, or unset it.")
        return getattr(torch, forced)
    if calibrated and store_dtype == torch.bfloat16 and not reproducible \
            and torch_cpu_bf16_native():
        return torch.bfloat16
    return torch.float32


def _storage_dtype(raw_config: dict) -> torch.dtype:
    name = raw_config.get("dtype") or raw_config.get("torch_dtype") or "bfloat16"
    return {"float16": torch.float16, "bfloat16": torch.bfloat16,
            "float32": torch.float32}.get(str(name), torch.bfloat16)


def _dense_tensors(model, results: dict[str, QuantResult], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Everything that is not a quantized Linear weight, in the checkpoint's own dtype."""
    skip = {f"{n}.weight" for n in results} | {f"{n}.bias" for n in results}
    tied = getattr(model.config, "tie_word_embeddings", False)
    out = {}
    for name, t in model.state_dict().items():
        if name in skip or (tied and name == "lm_head.weight"):
            continue
        out[name] = dense_tensor(t, dtype)
    return out


def _stats(results: dict[str, QuantResult], spec: ArchSpec, min_tokens: int) -> dict:
    """Per-Linear error and time; calibration tokens where the method gathered statistics
    (for MoE experts: the tokens routed to each, with the expert's block and index, so the
    report draws them without knowing the architecture's names), and the experts that fell
    back to RTN."""
    layers = {}
    for name, r in results.items():
        layers[name] = {"shape": list(r.shape), "rel_error": r.loss, "seconds": r.seconds}
        if r.calib_tokens is not None:
            layers[name]["tokens"] = r.calib_tokens
        if r.fallback:
            layers[name]["fallback"] = r.fallback
    out = {"version": 1, "metric": "relative Frobenius reconstruction error ||W-Wq||/||W||",
           "layers": layers}
    if spec.experts is not None:
        blocks = spec.block_path + "."
        experts = {}
        for name, entry in layers.items():
            bid, _, rel = spec.module_name(name)[len(blocks):].partition(".")
            if spec.is_expert_linear(rel):
                experts[name] = entry
                index = rel[len(spec.experts.module) + 1:].partition(".")[0]
                if bid.isdigit() and index.isdigit():
                    entry.update(block=int(bid), expert=int(index))
        out["experts"] = {
            "linears": len(experts),
            "min_tokens": min_tokens,
            "below_min_tokens": sorted(n for n, v in experts.items()
                                       if v.get("tokens", min_tokens) < min_tokens),
            "fallback_rtn": sorted(n for n, v in experts.items() if v.get("fallback") == "rtn"),
        }
    return out
