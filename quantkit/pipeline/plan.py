"""`quantkit plan`: peak RAM / GPU memory, artifact size and time, from config.json alone.

The memory model follows the streaming path (quantkit.pipeline.streaming), phase by phase;
the peak is the largest phase plus a measured constant for Python + torch + transformers:
  capture  embedding table (stored dtype) + block-0 inputs + every batch's rotary tables
  blocks   one block in the load dtype (+ the largest tensor as read from the shard)
           + hidden states in and out + rotary tables + per-method statistics + one batch's
           activations, or on the CPU with true-sequential GPTQ every batch's activations at
           the worst pause of the one-pass forward (see _staged_floats_per_token)
           (+ all earlier blocks' results, 1 byte per weight, when checkpoints are off)
  write    the packed results + the unquantized tensors in the stored dtype (results are
           read back from the checkpoint one at a time)
With `--device cuda` the block, hidden states and statistics live on the GPU instead; with
the hidden states offloaded (quantkit.pipeline.offload) only three batches of them are there
(the one computing, the next one arriving, the last output leaving) and the batch is at most
OFFLOAD_BATCH samples. quantize() offloads when `peak_gpu_bytes` does not fit the free GPU
memory (`offload_activations`).
With `gpus` N > 1 (`quantkit plan --gpus N`: a torchrun data-parallel run,
quantkit.pipeline.distributed) the peaks are one rank's (one process, one GPU): its share of
the calibration batches, every statistic of a group (all-reduced), the rank-order sum's
gather buffers and one group's gathered results. The time: the forwards shrink with the
share; the solves, when the method spreads them, take per sequential group its most loaded
rank's share (the very assignment the run makes), else stay on rank 0 (and so do the passes
of a rank-0 search beyond the statistics' forward: AWQ's); every rank reads
every block's weights; plus the statistics' and results' transfers at a rough link speed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from quantkit.arch import ArchSpec
from quantkit.errors import NotEnoughMemory
from quantkit.machine import available_memory
from quantkit.methods import method_record
from quantkit.pipeline.distributed import GATHER_CHUNK_BYTES, assign
from quantkit.types import PlanFacts, QuantScheme

__all__ = ["MemoryPlan", "estimate", "check_memory", "BASELINE_BYTES",
           "OFFLOAD_BATCH", "offload_activations"]

# RSS of `python -m quantkit.cli quantize` before any weights load: interpreter, torch,
# transformers, compressed-tensors, tokenizer (measured on CPU)
BASELINE_BYTES = 600 * 2**20
_CUDA_CONTEXT_BYTES = 512 * 2**20  # CUDA context + cuBLAS workspaces, not measured here
# samples per forward when the activations are offloaded: GPU memory is short then, and a
# forward's intermediates grow with the batch (Llama-3.1-8B MLP: ~0.9 GiB per 4 x 2048 tokens)
OFFLOAD_BATCH = 4
_FREE_GPU_MARGIN = 0.9  # of the free memory: the caching allocator's fragmentation
_GIB = 2**30
# rough sustained throughput of the block forward + method math (FLOP/s); time is a hint only
_FLOPS = {"cpu": 5e10, "cuda": 1.5e14}
# large float32 matmuls alone (the attention-v forward), from the extra time a SmolLM2 int4
# GPTQ run with 64 x 512 tokens spent on them (benchmarks/results/gptq_int4_v_hessian_smollm2.json)
_DENSE_FLOPS = {"cpu": 2e11, "cuda": 5e13}
# per quantized weight: rounding, packing, checkpoint and artifact writes (from the time of a
# CPU RTN run of a 0.5 B weight model)
_PER_WEIGHT_S = {"cpu": 5.5e-8, "cuda": 5e-9}
_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
# bytes/s a rank receives in the collectives (statistics, results): NVLink-class GPUs, gloo
# over loopback; assumed, not measured here (no multi-GPU machine yet)
_LINK_BYTES_S = {"cpu": 2e9, "cuda": 1e11}


@dataclass
class MemoryPlan:
    peak_ram_bytes: int
    peak_gpu_bytes: int | None
    disk_bytes: int
    seconds: float
    phase_bytes: dict[str, int]
    model_bytes: int  # the source checkpoint's weights in its stored dtype
    block_params: int
    total_params: int
    streaming: bool = True
    peak_gpu_offloaded_bytes: int | None = None  # hidden states in host memory (see module doc)
    gpus: int = 1  # data-parallel ranks: the peaks are per rank (one process, one GPU)
    # data-parallel: the solves' share of the time, and whether they are spread over the ranks
    solve_seconds: float | None = None
    solves_spread: bool | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _param_counts(config, spec: ArchSpec):
    """(per-block param counts, per-block linear shapes, non-block params) from a meta model.
    MoE experts count as their per-expert Linears (what is quantized and stored)."""
    from quantkit.model_io import meta_model
    from quantkit.pipeline.experts import linearize_experts

    model = linearize_experts(meta_model(config), spec)
    blocks_prefix = spec.block_path + "."
    per_block: dict[int, int] = {}
    outside = 0
    largest = 0
    tied = bool(getattr(config, "tie_word_embeddings", False))
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if tied and name == spec.lm_head + ".weight":
            continue
        if id(p) in seen:
            continue
        seen.add(id(p))
        largest = max(largest, p.numel())
        if name.startswith(blocks_prefix):
            i = int(name[len(blocks_prefix):].split(".")[0])
            per_block[i] = per_block.get(i, 0) + p.numel()
        else:
            outside += p.numel()
    blocks = list(model.get_submodule(spec.block_path))
    linears = []
    for block in blocks:
        mods = dict(block.named_modules())
        names = spec.linears_for(spec.experts.count(config) if spec.experts else 0)
        linears.append({n: tuple(mods[n].weight.shape) for n in names if n in mods})
    return per_block, linears, outside, largest


def _staged_floats_per_token(hidden: int, inter: int, q_dim: int, kv_dim: int) -> float:
    """Resident floats per calibration token while the CPU one-pass true-sequential forward
    (quantkit.pipeline.staged) holds every batch paused at a sequential group's entry: what
    is alive in each batch's forward there. What the forwards allocated and freed before the
    pause is not resident: the one-pass forward runs without
    quantkit.pipeline.heap.reuse_freed_memory, so each activation is its own mapping and goes
    back to the OS when freed (with reuse, the heap kept about half of it between the paused
    batches' live tensors: a tiny llama, hidden 128, intermediate 1536, 280 x 512 tokens,
    peaked at 3.1-3.4 GiB, 1.8 GiB without).

    The llama block's activations (float32 widths per token):
      o_proj's pause     normed input, q and k after rotary, v, attention output
      down_proj's pause  residual, normed input, act(gate) * up
    """
    at_o = hidden + 2 * q_dim + 2 * kv_dim
    at_down = 2 * hidden + inter
    return max(at_o, at_down)


def _attention_v_bytes(batch: int, seqlen: int, hidden: int, heads: int) -> int:
    """Memory of the attention-v forward: [n, heads, S, S] float32 weights for as many
    sequences of a calibration batch as WEIGHTS_BUDGET holds (at least one), and their
    A_h X [n, heads, rows, K]."""
    from quantkit.pipeline.attention_v import MAX_QUERY_ROWS, WEIGHTS_BUDGET

    per_seq = heads * seqlen * seqlen * 4
    n = max(1, min(batch, WEIGHTS_BUDGET // max(per_seq, 1)))
    return n * (per_seq + heads * min(seqlen, MAX_QUERY_ROWS) * hidden * 4)


def _largest(config, key: str):
    """`config.key`, or its largest per-layer value where the config varies it by layer
    (transformers' heterogeneous configs refuse the global read: Gemma 4's head_dim is 512 on
    its global layers, 64 on the sliding ones); None where absent."""
    try:
        return getattr(config, key, None)
    except RuntimeError:  # AmbiguousGlobalPerLayerAttributeError
        values = [getattr(layer, key, None) for layer in getattr(config, "per_layer_config", ())]
        return max((v for v in values if v is not None), default=None)


def _attention_v_flops(samples: int, seqlen: int, hidden: int, heads: int, head_dim: int,
                       kv_heads: int) -> int:
    """One block's attention-v forward: q/k/v/o projections, QK^T and AV, then the sampled
    rows' A_h X and their Gram sum (quantkit.pipeline.attention_v)."""
    from quantkit.pipeline.attention_v import MAX_QUERY_ROWS

    proj = 2 * seqlen * hidden * (2 * heads + 2 * kv_heads) * head_dim
    scores = 4 * heads * head_dim * seqlen * seqlen
    rows = heads * min(seqlen, MAX_QUERY_ROWS)
    products = 2 * rows * seqlen * hidden + rows * hidden * hidden  # the Gram: one triangle (syrk)
    return samples * (proj + scores + products)


def estimate(config, spec: ArchSpec, *, method: str, scheme: QuantScheme, calib_samples: int,
             calib_seqlen: int, calibrated: bool, device: str = "cpu", calib_batch: int = 1,
             store_dtype: torch.dtype = torch.bfloat16, streaming: bool = True,
             resume: bool = True, true_sequential: bool = True,
             hessians: bool | None = None, moe_all_experts: bool = False,
             compute_dtype: torch.dtype | None = None,
             expert_input_bytes: int | None = None, attention_v: bool = False,
             gpus: int = 1, spread_solves: bool = True) -> MemoryPlan:
    """Expected peaks for `quantize` with these settings (see the module docstring).

    `hessians`: the method gathers GPTQ Hessians and solves with them (default: method gptq;
    int8, nvfp4 and mxfp4 with GPTQ rounding do too).

    `moe_all_experts` (--moe-calibrate-all-experts): every expert reads every token; AWQ
    then searches the experts' up -> down groups on chunks of experts whose down_proj inputs
    (over all search tokens) fill at most `expert_input_bytes` (the quantizer's
    expert_input_bytes); routed, the experts' gate/up inputs too (each expert its own rows).

    `compute_dtype`: what the blocks run in (default bf16 on a GPU, float32 on the CPU;
    quantize's compute_dtype_for decides): the loaded blocks and the activations take its size.

    `true_sequential` (GPTQ) sets the block forwards per block: on a GPU the replay runs
    ~2.5 partial forwards for the groups + 1 for the outputs, or 1 + 1 without it; on the
    CPU the true-sequential groups share one forward, and without them it is 1 + 1.

    `attention_v` (--gptq-v-hessian attention): v_proj's Hessian from one more eager attention
    forward per batch (quantkit.pipeline.attention_v): its float32 attention weights (whole
    sequences, up to WEIGHTS_BUDGET unless one sequence is larger) and the A_h X products of
    the sampled query rows beside the statistics; its flops in the time.

    `gpus` (> 1): one rank of a data-parallel run over that many (see the module docstring);
    `spread_solves`: the method spreads its solves over the ranks (Quantizer.solve_units).
    """
    record = method_record(method)
    gpus = max(1, int(gpus))
    all_tokens = calib_samples * calib_seqlen if calibrated else 0
    if gpus > 1 and calibrated:  # the largest rank's share: whole batches (DataParallel.shard)
        per_batch = max(1, min(calib_batch, calib_samples))
        n_batches = -(-calib_samples // per_batch)
        calib_samples = min(calib_samples, -(-n_batches // gpus) * per_batch)
    per_block, linears, outside, largest = _param_counts(config, spec)
    # a vision-language config holds the language model's widths in its text config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    cuda = str(device).startswith("cuda")
    if compute_dtype is None:
        compute_dtype = torch.bfloat16 if cuda else torch.float32
    load_bytes = _BYTES[compute_dtype]
    sb = _BYTES.get(store_dtype, 2)
    hidden = int(config.hidden_size)
    inter = int(_largest(config, "intermediate_size") or 4 * hidden)
    heads = int(_largest(config, "num_attention_heads") or 1)
    head_dim = int(_largest(config, "head_dim") or hidden // heads)
    kv_heads = int(_largest(config, "num_key_value_heads") or heads)
    tokens = calib_samples * calib_seqlen if calibrated else 0
    act_bytes = load_bytes
    hidden_io = 2 * tokens * hidden * act_bytes  # inputs + outputs of the current block
    batch_tokens = min(calib_batch, max(calib_samples, 1)) * calib_seqlen if calibrated else 0

    def rotary_tables(batch: int) -> int:
        """The captured keyword arguments: the model's forward made cos and sin [1, seqlen,
        head_dim] for every batch, and each batch keeps its own (AWQ's batches of one sample,
        head_dim 128, hidden 256: as large as the hidden states)."""
        batches = -(-calib_samples // max(1, min(batch, calib_samples))) if calibrated else 0
        return batches * 2 * calib_seqlen * head_dim * act_bytes

    kwargs_bytes = rotary_tables(calib_batch)
    # one batch through a block: MLP intermediates (gate, up, act) + attention scores
    # attention scores: materialised by the CPU path; CUDA's SDPA kernels (flash / memory-
    # efficient) never hold them (the measured GPU GPTQ peak sat well below a plan that
    # counted them: benchmarks/plan_vs_gpu.py, benchmarks/results/plan_vs_h100.json)
    forward = batch_tokens * (3 * inter + 4 * hidden) * act_bytes + \
        (min(calib_batch, calib_samples) * heads * calib_seqlen**2 * act_bytes
         if calibrated and not cuda else 0)
    moe = spec.experts is not None and spec.experts.count(config) > 0
    solves = record.solves_hessians if hessians is None else hessians  # GPTQ Hessians gathered
    # one-pass true-sequential (CPU): every batch paused mid-block; MoE blocks replay instead
    if solves and true_sequential and not cuda and not moe:
        forward = max(forward, int(tokens * act_bytes * _staged_floats_per_token(
            hidden, inter, heads * head_dim, kv_heads * head_dim)))

    block_params = max(per_block.values(), default=0)
    quantized = sum(n * k for lin in linears for n, k in lin.values())
    first_block_q = sum(n * k for n, k in linears[0].values()) if linears else 0
    groups = scheme.groups
    scales = sum(n * groups(k) for lin in linears for n, k in lin.values())

    facts = PlanFacts(config=config, spec=spec, scheme=scheme, linears=linears, tokens=tokens,
                      cuda=cuda, hidden=hidden, inter=inter, act_bytes=act_bytes,
                      block_params=block_params, moe=moe, moe_all_experts=moe_all_experts,
                      expert_input_bytes=expert_input_bytes, quantized=quantized,
                      scales=scales, outside=outside, dense_outside=outside * sb)
    stats = 0
    group_hessians: list[int] = []  # bytes of each sequential group's Hessians
    gram_phase = 0  # GPU GPTQ: Hessians alive while the forward accumulates them
    if solves:  # K x K fp32 per Linear of a sequential group, + ~3 K^2 of working set
        # (a MoE block: one Hessian per expert Linear, hidden^2 for every gate/up of the
        # expert group; only the current block's exist at a time)
        widest = max(linears, key=len, default={})  # a MoE block, not a dense one
        n_exp = spec.experts.count(config) if spec.experts else 0
        for seq in spec.groups_for(n_exp):
            ks = [widest[n][1] for n in seq if n in widest]
            rows = sum(widest[n][0] for n in seq if n in widest)
            if ks:
                # the solve: H, its reversed Cholesky factor and that factor's inverse
                # (gptq.inverse_hessian_factor) + the group's fp32 weights
                stats = max(stats, 3 * ks[0] ** 2 * 4 + rows * ks[0] * 4)
                inputs = n_exp if spec.is_expert_linear(seq[0]) else 1  # each expert its own
                group_hessians.append(inputs * ks[0] ** 2 * 4)
        if group_hessians:
            # true-sequential: one group's Hessian at a time; otherwise all of the block's
            # (+ one gram temporary of the widest either way)
            others = sum(group_hessians) - max(group_hessians)
            widest_h = max(group_hessians)
            gram_phase = (widest_h if true_sequential else sum(group_hessians)) + widest_h
            stats += 0 if true_sequential else others
    elif record.plan_stats is not None:  # the method's own statistics (AWQ's search inputs)
        stats = record.plan_stats(facts)
    n_exp = spec.experts.count(config) if spec.experts else 0
    units = [_plan_units(spec, lin, n_exp, true_sequential) for lin in linears] \
        if gpus > 1 and solves else []
    if gpus > 1:
        # the rank-order sum of a statistic: every rank's copy of one chunk + the running sum
        widest_one = max((k * k * 4 for lin in linears for _, k in lin.values()), default=0) \
            if solves else 0
        stats += min(GATHER_CHUNK_BYTES, gpus * widest_one) + \
            min(GATHER_CHUNK_BYTES // gpus, widest_one)
        # one group's results arriving as one buffer (at most the whole block's: codes + scales)
        stats += max((sum(n * k + 8 * n * scheme.groups(k) for n, k in lin.values())
                      for lin in linears), default=0)
    if attention_v and solves and calibrated:  # counted beside the Hessians and the solve
        stats += _attention_v_bytes(min(calib_batch, calib_samples), calib_seqlen, hidden, heads)
    # uint8 codes + fp32 scale + int32 zero; with checkpoints (resume) finished blocks' results
    # live on disk and are read back one at a time by the writer
    results_all = quantized + scales * 8
    results_ram = 0 if resume else results_all
    packed = quantized * scheme.bits // 8 if scheme.kind == "int" else quantized
    largest_linear = max((n * k for lin in linears for n, k in lin.values()), default=0)
    embed_bytes = int(getattr(config, "vocab_size", 0) or 0) * hidden * sb
    dense_outside = outside * sb
    # one block in the load dtype (on a GPU the streamed next block, read ahead while the
    # current one computes there), the tensor being read (stored dtype), the method's
    # temporaries (~4 fp32 copies of the largest Linear: scales, rounding, dequantize)
    block_ram = (block_params * load_bytes if streaming or not cuda else 0) + largest * sb \
        + 4 * largest_linear * 4

    def working_set(fwd: int) -> int:
        if group_hessians:
            # the forward (Hessians accumulating) and the solve (Hessian, inverse factor,
            # fp32 weights, codes) come one after the other: the larger of the two
            return max(fwd + gram_phase, stats + largest_linear * 4 * (1 if cuda else 4))
        return stats + fwd + 4 * largest_linear * 4

    work = working_set(forward)
    gpu_block = _CUDA_CONTEXT_BYTES + block_params * load_bytes + hidden_io + kwargs_bytes + work
    offload_tokens = min(calib_batch, OFFLOAD_BATCH, max(calib_samples, 1)) * calib_seqlen \
        if calibrated else 0
    gpu_offloaded = _CUDA_CONTEXT_BYTES + block_params * load_bytes \
        + 3 * offload_tokens * hidden * act_bytes + rotary_tables(min(calib_batch, OFFLOAD_BATCH)) \
        + working_set(forward * offload_tokens // max(batch_tokens, 1))
    phases = {
        "capture": embed_bytes + (0 if cuda else tokens * hidden * act_bytes + kwargs_bytes),
        "blocks": block_ram + (0 if cuda else hidden_io + kwargs_bytes + stats + forward)
        + results_ram + first_block_q,  # the block's own results and their checkpoint copy
        # packed results + scales + unquantized tensors + one result unpacked (uint8 codes,
        # int32 reshaped and shifted copies while packing)
        "write": packed + scales * sb + dense_outside + results_ram + 9 * largest_linear,
    }
    if record.plan_write is not None:  # e.g. GGUF's experts stacked into one 3-D tensor
        phases["write"] += record.plan_write(facts)
    if not streaming:
        model_load = (sum(per_block.values()) + outside) * load_bytes
        phases = {k: v + model_load for k, v in phases.items()}
    peak = BASELINE_BYTES + max(phases.values())

    if record.plan_disk is not None:  # the method's own storage
        disk = record.plan_disk(facts)
    else:  # packed integer codes, scales (and zero points) in the stored dtype
        disk = packed + scales * sb + (scales * scheme.bits // 8 if not scheme.symmetric else 0) \
            + dense_outside
    total_params = sum(per_block.values()) + outside
    block_norms = (sum(per_block.values()) - quantized) * sb
    disk += block_norms

    gptq_passes = (3.5 if cuda else 1) if true_sequential else 2
    passes = gptq_passes if solves else record.plan_passes
    flops = 2 * quantized * tokens * passes  # data-parallel: this rank's share of the tokens
    if gpus > 1 and not spread_solves and passes > 1:  # the statistics' pass splits; rank 0's
        flops += 2 * quantized * (all_tokens - tokens) * (passes - 1)  # search (AWQ) does not
    solve_flops = 0.0
    if solves:
        solve_flops = sum(n * k * k * 2 + k**3 for lin in linears for n, k in lin.values())
        if gpus > 1 and spread_solves:  # per group, its most loaded rank's share
            solve_flops *= _spread_share(units, gpus)
        flops += solve_flops
    dev = "cuda" if cuda else "cpu"
    io = (total_params * sb) / 1.5e9  # reading the shards (every rank reads every block)
    seconds = flops / _FLOPS[dev] + quantized * _PER_WEIGHT_S[dev] + io + 5.0
    if gpus > 1:  # what one rank receives: the others' statistics and the solved weights
        stat_bytes = sum(c[1] for blk in units for group in blk for c in group)
        if spread_solves:  # codes + scale + zero of the Linears the other ranks solved
            moved = (quantized + scales * 8) * (gpus - 1) / gpus
        else:  # rank 0's weights in the compute dtype
            moved = quantized * load_bytes
        seconds += ((gpus - 1) * stat_bytes + moved) / _LINK_BYTES_S[dev]
    if attention_v and solves and calibrated:
        seconds += _attention_v_flops(calib_samples, calib_seqlen, hidden, heads, head_dim,
                                      kv_heads) * len(linears) / _DENSE_FLOPS[dev]
    return MemoryPlan(peak_ram_bytes=int(peak), peak_gpu_bytes=int(gpu_block) if cuda else None,
                      peak_gpu_offloaded_bytes=int(gpu_offloaded) if cuda and calibrated else None,
                      disk_bytes=int(disk), seconds=round(seconds, 1), phase_bytes=phases,
                      model_bytes=int(total_params * sb), block_params=int(block_params),
                      total_params=int(total_params), streaming=streaming, gpus=gpus,
                      solve_seconds=round(solve_flops / _FLOPS[dev], 6),
                      solves_spread=bool(spread_solves and solves) if gpus > 1 else None)


def _plan_units(spec: ArchSpec, lin: dict[str, tuple[int, int]], n_exp: int,
                true_sequential: bool) -> list[list[tuple[int, int]]]:
    """One block's solves as a data-parallel run assigns them: per group the run balances
    (a sequential group, or the whole block without true-sequential order), (cost, Hessian
    bytes) of each solve -- the Linears of a sequential group under one parent module share
    their input and are solved together (q/k/v, gate/up, one expert's gate/up)."""
    from quantkit.methods.gptq import solve_cost

    groups = []
    for seq in spec.groups_for(n_exp):
        by_input: dict[str, list[str]] = {}
        for n in seq:
            if n in lin:
                by_input.setdefault(n.rsplit(".", 1)[0], []).append(n)
        groups.append([(solve_cost(lin[names[0]][1], sum(lin[m][0] for m in names)),
                        lin[names[0]][1] ** 2 * 4) for names in by_input.values()])
    groups = [g for g in groups if g]
    return groups if true_sequential else [[u for g in groups for u in g]]


def _spread_share(units: list, gpus: int) -> float:
    """The solves' time over N ranks as a fraction of one rank's: per group, the cost of its
    most loaded rank under the run's own assignment (distributed.assign)."""
    total = longest = 0
    for blk in units:
        for group in blk:
            costs = [c for c, _ in group]
            loads = [0] * gpus
            for c, r in zip(costs, assign(costs, gpus), strict=True):
                loads[r] += c
            total += sum(costs)
            longest += max(loads)
    return longest / total if total else 1.0


def offload_activations(plan: MemoryPlan, free_gpu_bytes: int) -> bool:
    """Keep the calibration activations in host memory when the plan's GPU peak with them on
    the GPU does not fit the free GPU memory (less a margin) and offloading needs less."""
    if plan.peak_gpu_bytes is None or plan.peak_gpu_offloaded_bytes is None:
        return False
    return plan.peak_gpu_bytes > _FREE_GPU_MARGIN * free_gpu_bytes \
        and plan.peak_gpu_offloaded_bytes < plan.peak_gpu_bytes


def check_memory(plan: MemoryPlan) -> None:
    """Refuse before any work when the plan's peak RAM does not fit."""
    avail, why = available_memory()
    if plan.peak_ram_bytes <= avail:
        return
    raise NotEnoughMemory(
        f"Quantizing needs about {plan.peak_ram_bytes / _GIB:.2f} GiB of RAM at peak "
        f"(model {plan.model_bytes / _GIB:.2f} GiB, largest phase: "
        f"{max(plan.phase_bytes, key=plan.phase_bytes.get)}), but only "
        f"{avail / _GIB:.2f} GiB is available ({why}).",
        "Lower --calib-samples / --calib-seqlen, use --device cuda, free memory, or pass "
        "--no-memory-check to try anyway; `quantkit plan` shows the breakdown.")
