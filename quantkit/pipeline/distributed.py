"""Data-parallel calibration over several processes (one per GPU) with torch.distributed.

Launch: `torchrun --nproc-per-node N -m quantkit.cli quantize MODEL --method gptq ... -o OUT`.
torchrun sets RANK / WORLD_SIZE / LOCAL_RANK; `from_env` joins the process group (NCCL on
CUDA, gloo on CPU) and every rank then runs the ordinary block-by-block loop with:

  * its own contiguous share of the calibration batches (`shard`: batch k*n//N .. of the one
    shared loader's batch list, so each batch is the very tensor a single process would use);
  * the per-Linear statistics (GPTQ Hessians sum x^T x, token counts) summed on EVERY rank
    (`reduce_stats`) before the method solves, in rank order (rank 0's sum + rank 1's + ...):
    with one calibration batch per rank these are the very float32 additions a single
    process makes, otherwise the same sums up to float32 summation order;
  * for a method that declares its solves independent (`Quantizer.solve_units`: GPTQ's
    shared-input sets, RTN's Linears) each rank solves a disjoint share of the group's
    Linears -- for MoE, of its experts -- assigned by `assign` (greedy longest-processing-
    time on the method's cost, per sequential group, computed identically on every rank);
    the results (codes, scales, zeros, g_idx, bias, side tensors: one flat byte
    buffer per rank) are broadcast from each owner to every rank (`solve_spread`), so every
    rank propagates its shard through bit-identical weights and rank 0 holds every result;
  * otherwise (AWQ's per-group searches, `data_parallel = "block"`) rank 0 runs the method
    and broadcasts the quantized weights (`broadcast_linears`) or the whole block;
  * a failure on one rank (its forward, statistics or solve) is agreed on by all ranks
    (`step`: an all-reduced error flag after each such step, before the next collective),
    so every rank raises RankFailed naming the rank and nothing is written;
  * only rank 0 writing the artifact.
Methods opt in with `data_parallel = True` (GPTQ, RTN: the calibration data reaches them only
through summed statistics) or `data_parallel = "block"` (AWQ: x_mean from the summed absmean;
its scale and clip searches read the first `search_tokens` calibration tokens, which rank 0's
contiguous share starts with, so rank 0 searches on the same tokens as a single process as
long as its share covers that budget -- 65536 tokens on a GPU, e.g. 128 x 2048 samples on up
to 4 GPUs; rank 0 then broadcasts the whole block, folded norms too). Others (FP8, GGUF) are
refused rather than silently calibrated on one share.
A rank that never reaches a collective (killed, hung in a driver) ends the others' wait after
the process group's timeout: QUANTKIT_DP_TIMEOUT seconds (default 1800; torchrun also stops
every worker when one exits with an error).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from quantkit.errors import RankFailed, SchemeMismatch

__all__ = ["DataParallel", "from_env", "world_size_from_env", "assign", "ENV_TIMEOUT",
           "GATHER_CHUNK_BYTES"]

ENV_TIMEOUT = "QUANTKIT_DP_TIMEOUT"  # seconds a collective waits for the other ranks
# the ordered sum of a statistic gathers every rank's copy of this many bytes at a time
GATHER_CHUNK_BYTES = 256 * 2**20
_ALIGN = 16  # byte offsets of the tensors packed into one broadcast buffer
_RESULT_TENSORS = ("codes", "scale", "zero", "g_idx", "bias")
_LIST_AT_MOST = 4096  # quantkit.json names each rank's Linears up to this many in all

# statistics that are plain sums over tokens (max-type ones reduce with MAX)
_SUM = ("hessian", "sq_mean", "absmean")
_MAX = ("absmax",)


def world_size_from_env() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


@dataclass
class DataParallel:
    """One rank's view of a data-parallel run (the process group is already initialised)."""

    rank: int
    world: int
    local_rank: int
    backend: str
    owns_group: bool = False  # we initialised the process group, so we tear it down
    device: str = "cpu"  # where this rank's collectives run (NCCL: its GPU)
    # the solves' cost assigned to each rank so far (assign() breaks its ties with it)
    load: list = field(default_factory=list)
    solved: list = field(default_factory=list)  # Linears each rank solved
    spread_groups: int = 0  # sequential groups whose solves were spread
    rank0_groups: int = 0  # groups solved on rank 0 alone (a method without solve_units)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def describe(self) -> dict:
        """What quantkit.json records: the world, and which rank solved how much."""
        out = {"world_size": self.world, "backend": self.backend,
               "split": "contiguous calibration batches per rank; statistics summed on every "
                        "rank in rank order; "
                        + ("each rank solved a cost-balanced share of each group's Linears, "
                           "results broadcast from their owners" if self.spread_groups else
                           "method solved on rank 0, weights broadcast")}
        if self.spread_groups:
            total = sum(self.load) or 1
            out["solves"] = {"groups_spread": self.spread_groups,
                             "groups_on_rank0": self.rank0_groups,
                             "linears_per_rank": [len(s) for s in self._solved()],
                             "cost_share_per_rank": [round(c / total, 4) for c in self._load()]}
            if sum(len(s) for s in self.solved) <= _LIST_AT_MOST:  # a big MoE: counts only
                out["solves"]["linears_by_rank"] = self._solved()
        return out

    def fresh(self) -> DataParallel:
        """This rank in the same process group with the split's records empty (one of several
        quantize_blocks runs in one process: benchmarks/multigpu_gptq.py); it does not own
        the group."""
        return dataclasses.replace(self, owns_group=False, load=[], solved=[], spread_groups=0,
                                   rank0_groups=0)

    def _load(self) -> list:
        return list(self.load) + [0] * (self.world - len(self.load))

    def _solved(self) -> list:
        return [list(s) for s in self.solved] + [[] for _ in range(self.world - len(self.solved))]

    def check_method(self, quantizer) -> None:
        if not quantizer.data_parallel:
            raise SchemeMismatch(
                f"--method {quantizer.name} does not support data-parallel runs "
                f"(WORLD_SIZE={self.world}): its search reads calibration activations "
                "directly, not through summed statistics.",
                "Run it in one process (no torchrun), or use --method gptq / awq / rtn.")
        unsupported = set(quantizer.stats) - set(_SUM) - set(_MAX)
        if unsupported:
            raise SchemeMismatch(f"statistics {sorted(unsupported)} cannot be reduced across ranks.")

    def shard(self, batches: list) -> list:
        """This rank's contiguous share of the batch list (whole batches, deterministic)."""
        n = len(batches)
        if n < self.world:
            from quantkit.errors import CalibrationError

            raise CalibrationError(
                f"{n} calibration batches cannot be split over {self.world} ranks.",
                "Use more --calib-samples (at least one batch per rank) or fewer processes.")
        lo, hi = self.rank * n // self.world, (self.rank + 1) * n // self.world
        return batches[lo:hi]

    def reduce_stats(self, stats: dict, linears: dict[str, torch.nn.Module],
                     wanted: tuple[str, ...], device) -> None:
        """Sum (max for absmax) every Linear's statistics and token count over the ranks, in
        place, on every rank; sums in rank order (`_sum_in_rank_order`).

        Linears whose statistics are bitwise equal on EVERY rank (same input: q/k/v, gate/up)
        are reduced once and share the result, as in a single process. A Linear that saw no
        tokens on some rank (an MoE expert) contributes zeros there.
        """
        import torch.distributed as dist

        names = list(linears)
        seen: set[int] = set()
        for n in names:
            rec = stats.setdefault(n, {"tokens": 0})
            k = linears[n].in_features
            for st in wanted:
                if st not in rec:
                    shape = (k, k) if st == "hessian" else (k,)
                    rec[st] = torch.zeros(shape, dtype=torch.float32, device=device)
                if id(rec[st]) in seen:  # one object under two names must not be reduced twice
                    rec[st] = rec[st].clone()
                seen.add(id(rec[st]))
        # which Linear shares its statistics with an earlier one: decided on all ranks together
        share = []
        for i, n in enumerate(names):
            j = next((j for j in range(i) if _same(stats[names[j]], stats[n], wanted)), -1)
            share.append(j)
        flags = torch.tensor(share, dtype=torch.int64, device=device)
        agreed = flags.clone()
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        tokens = torch.tensor([int(stats[n]["tokens"]) for n in names], dtype=torch.int64,
                              device=device)
        dist.all_reduce(tokens)  # integers: exact in any order
        tokens_l, agreed_l, flags_l = tokens.tolist(), agreed.tolist(), flags.tolist()
        for i, n in enumerate(names):
            rec = stats[n]
            rec["tokens"] = tokens_l[i]
            j = agreed_l[i]
            if j >= 0 and j == flags_l[i]:  # the same earlier Linear on every rank
                for st in wanted:
                    rec[st] = stats[names[j]][st]
                continue
            for st in wanted:
                t = rec[st].contiguous()
                if st in _MAX:
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # exact in any order
                else:
                    _sum_in_rank_order(t, self.world)
                rec[st] = t

    @contextlib.contextmanager
    def step(self, what: str, detail: str = ""):
        """Run a step that holds no collective (a forward, a solve); then agree with every
        other rank that all of them finished it. A failure on any rank -- this one's
        exception, or another's flag -- raises RankFailed on EVERY rank, naming the rank(s),
        before any rank enters the next collective (where the others would wait for it).
        `what` is the same on every rank; `detail` this rank's part of it (its Linears)."""
        error = None
        try:
            yield
        except Exception as exc:  # noqa: BLE001 -- re-raised below, on every rank
            error = exc
        self.agree(error, what, detail)

    def agree(self, error: BaseException | None, what: str, detail: str = "") -> None:
        import torch.distributed as dist

        flag = torch.tensor([0 if error is None else 1], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not int(flag.item()):
            return
        said: list = [None] * self.world
        mine = None if error is None else \
            (f" ({detail})" if detail else "") + f": {type(error).__name__}: {error}"
        dist.all_gather_object(said, mine)
        failed = [(r, m) for r, m in enumerate(said) if m is not None]
        names = ", ".join(f"rank {r}" for r, _ in failed)
        raise RankFailed(
            f"{names} of {self.world} failed while {what}: "
            + "; ".join(f"rank {r}{m}" for r, m in failed),
            "Every rank stopped and nothing was written; fix the cause the message names "
            "(it fails in one process too) and run again.") from error

    def assign(self, costs: list[int]) -> list[int]:
        """The owner rank of each of a group's units (`assign`); this run's load updated."""
        if len(self.load) < self.world:
            self.load = self._load()
        owners = assign(costs, self.world, self.load)
        for c, r in zip(costs, owners, strict=True):
            self.load[r] += c
        return owners

    def solve_spread(self, solve, ctx, units: list[tuple[list[str], int]], where: str) -> dict:
        """Every rank solves its share of `units` ((Linear names solved together, cost) from
        the quantizer's solve_units) with `solve(ctx holding only those Linears)`; returns
        every unit's results on every rank, keyed as ctx.linears orders them.

        Each owner's results travel as one flat byte buffer broadcast from it (its layout
        first, by all_gather_object), so rank r receives the very tensors rank s computed."""
        import torch.distributed as dist

        owners = self.assign([int(c) for _, c in units])
        owner = {n: r for (names, _), r in zip(units, owners, strict=True) for n in names}
        mine = {n: m for n, m in ctx.linears.items() if owner.get(n) == self.rank}
        if len(self.solved) < self.world:
            self.solved = self._solved()
        for n, r in owner.items():
            self.solved[r].append(f"{where}{n}")
        self.spread_groups += 1
        for n in ctx.linears:  # the statistics other ranks solve with: freed now (a MoE
            if n not in mine and n in ctx.stats:  # group's Hessians: each rank keeps its share)
                ctx.stats[n] = {"tokens": ctx.stats[n].get("tokens", 0)}
        local: dict = {}
        shown = ", ".join(list(mine)[:6]) + (f" and {len(mine) - 6} more" if len(mine) > 6 else "")
        with self.step(f"solving {where.rstrip('.')}", shown):
            if mine:
                local = solve(dataclasses.replace(ctx, linears=mine))
            stray = set(local) - set(mine)
            if stray:
                raise RuntimeError(f"the method returned Linears outside its share: {sorted(stray)}")
            layout, flat = _pack(local, self.device)
        layouts: list = [None] * self.world
        dist.all_gather_object(layouts, layout)
        results: dict = {}
        for r in range(self.world):
            entries, size = layouts[r]
            if not entries:
                continue
            buf = flat if r == self.rank else torch.empty(size, dtype=torch.uint8, device=self.device)
            if size:
                dist.broadcast(buf, src=r)
            results.update(local if r == self.rank else _unpack(layouts[r][0], buf))
            del buf
        missing = [n for n in ctx.linears if n not in results]
        if missing:
            raise RuntimeError(f"no rank solved {missing} of {where.rstrip('.')}")
        return {n: results[n] for n in ctx.linears}

    def broadcast_linears(self, linears: dict[str, torch.nn.Module]) -> None:
        """Rank 0's (quantized) weights and biases into every rank's Linears, in place."""
        for n in linears:
            _broadcast([linears[n].weight, linears[n].bias])

    def broadcast_module(self, module: torch.nn.Module) -> None:
        """Every parameter and buffer of rank 0's `module` (a block whose norms a method such
        as AWQ rescaled) into every rank's, in place."""
        _broadcast([*module.parameters(), *module.buffers()])

    def close(self) -> None:
        import torch.distributed as dist

        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def assign(costs: list[int], world: int, prior: list | None = None) -> list[int]:
    """The owner rank of each of one group's units: greedy longest-processing-time. Each unit,
    most costly first (ties: the earlier one), goes to the rank with the least cost of THIS
    group so far -- the group ends with every rank waiting for its results, so its time is
    its most loaded rank's -- ties broken by the least cost over the run so far (`prior`:
    a group of one unit, dense attention's q/k/v, goes to the least busy rank), then by the
    lower rank. Pure integers and a fixed order: every rank computes the same owners."""
    before = list(prior) if prior is not None else [0] * world
    have = [0] * world
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world), key=lambda r: (have[r], before[r], r))
        owners[i] = r
        have[r] += costs[i]
    return owners


def _sum_in_rank_order(t: torch.Tensor, world: int) -> None:
    """All-reduce `t` (SUM) in place as ((rank 0 + rank 1) + rank 2) + ..., identically on
    every rank: chunk by chunk, every rank's copy is gathered and added in rank order.
    Why not all_reduce: its summation order depends on the algorithm (ring chunks, tree),
    so with 3+ ranks the sums would not be the single process's float32 additions, and they
    could differ from rank to rank, which would end the ranks' agreement on shared inputs."""
    import torch.distributed as dist

    flat = t.view(-1)
    step = max(1, GATHER_CHUNK_BYTES // max(1, world * t.element_size()))
    for lo in range(0, flat.numel(), step):
        part = flat[lo:lo + step]
        copies = [torch.empty_like(part) for _ in range(world)]
        dist.all_gather(copies, part.contiguous())
        acc = copies[0]
        for c in copies[1:]:
            acc = acc + c
        part.copy_(acc)


def _pack(results: dict, device) -> tuple[tuple[list, int], torch.Tensor]:
    """QuantResults -> (layout, size) and one flat uint8 buffer holding all their tensors."""
    layout, parts, off = [], [], 0
    for name, res in results.items():
        tensors = [(f, getattr(res, f)) for f in _RESULT_TENSORS] + \
            [("extra:" + k, v) for k, v in res.extra.items()]
        entry = {"name": name, "scheme": res.scheme, "loss": res.loss, "seconds": res.seconds,
                 "fallback": res.fallback, "rname": res.name, "tensors": []}
        for f, t in tensors:
            if t is None:
                continue
            b = t.detach().contiguous().reshape(-1).view(torch.uint8)
            pad = -off % _ALIGN
            if pad:
                parts.append(torch.zeros(pad, dtype=torch.uint8, device=b.device))
                off += pad
            entry["tensors"].append((f, tuple(t.shape), str(t.dtype).removeprefix("torch."),
                                     off, b.numel()))
            parts.append(b)
            off += b.numel()
        layout.append(entry)
    flat = torch.cat([p.to(device) for p in parts]) if parts else \
        torch.empty(0, dtype=torch.uint8, device=device)
    return (layout, off), flat


def _unpack(layout: list, buf: torch.Tensor) -> dict:
    from quantkit.types import QuantResult

    out = {}
    for e in layout:
        fields, extra = {}, {}
        for f, shape, dtype, off, n in e["tensors"]:
            t = buf[off:off + n].view(getattr(torch, dtype)).reshape(shape).clone()
            if f.startswith("extra:"):
                extra[f[6:]] = t
            else:
                fields[f] = t
        out[e["name"]] = QuantResult(name=e["rname"], scheme=e["scheme"], extra=extra,
                                     loss=e["loss"], seconds=e["seconds"],
                                     fallback=e["fallback"], **fields)
    return out


def _broadcast(tensors) -> None:
    import torch.distributed as dist

    for p in tensors:
        if p is None:
            continue
        if p.data.is_contiguous():
            dist.broadcast(p.data, src=0)
        else:
            t = p.data.contiguous()
            dist.broadcast(t, src=0)
            p.data.copy_(t)


def _same(a: dict, b: dict, wanted: tuple[str, ...]) -> bool:
    if a["tokens"] != b["tokens"]:
        return False
    return all(a[st] is b[st] or (a[st].shape == b[st].shape and torch.equal(a[st], b[st]))
               for st in wanted)


def from_env(device: str) -> tuple[DataParallel | None, str]:
    """(DataParallel, this rank's device) when launched by torchrun with WORLD_SIZE > 1,
    else (None, device) unchanged. CUDA ranks get cuda:LOCAL_RANK and NCCL; CPU ranks gloo."""
    world = world_size_from_env()
    if world <= 1:
        return None, device
    import torch.distributed as dist

    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    cuda = str(device).startswith("cuda")
    if cuda:
        if torch.cuda.device_count() <= local:
            raise SchemeMismatch(
                f"rank {rank} wants GPU {local} but only {torch.cuda.device_count()} are visible.",
                "Start at most one process per GPU (torchrun --nproc-per-node).")
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    owns = False
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if cuda else "gloo", timeout=_timeout(),
                                **({"device_id": torch.device(device)} if cuda else {}))
        owns = True
    backend = dist.get_backend()
    return DataParallel(rank=dist.get_rank(), world=dist.get_world_size(), local_rank=local,
                        backend=backend, owns_group=owns,
                        device=device if backend == "nccl" else "cpu"), device


def _timeout() -> timedelta:
    raw = os.environ.get(ENV_TIMEOUT, "1800")
    try:
        return timedelta(seconds=float(raw))
    except ValueError:
        raise SchemeMismatch(f"{ENV_TIMEOUT}={raw!r} is not a number of seconds.") from None
