"""Data-parallel calibration over several processes (one per GPU) with torch.distributed.

Launch: `torchrun --nproc-per-node N -m quantkit.cli quantize MODEL --method gptq ... -o OUT`.
torchrun sets RANK / WORLD_SIZE / LOCAL_RANK; `from_env` joins the process group (NCCL on
CUDA, gloo on CPU) and every rank then runs the ordinary block-by-block loop with:

  * its own contiguous share of the calibration batches (`shard`: batch k*n//N .. of the one
    shared loader's batch list, so each batch is the very tensor a single process would use);
  * the per-Linear statistics (GPTQ Hessians sum x^T x, token counts) summed onto rank 0
    (`reduce_stats`) before the method solves: sums of per-rank sums are the single-process
    sums up to float32 summation order;
  * the method run on rank 0 only, whose quantized (dequantized) weights are then broadcast
    (`broadcast_linears`), so every rank propagates its shard through bit-identical weights;
  * only rank 0 writing the artifact.
Methods opt in with `data_parallel = True` (GPTQ, RTN: the calibration data reaches them only
through summed statistics) or `data_parallel = "block"` (AWQ: x_mean from the summed absmean;
its scale and clip searches read the first `search_tokens` calibration tokens, which rank 0's
contiguous share starts with, so rank 0 searches on the same tokens as a single process as
long as its share covers that budget -- 65536 tokens on a GPU, e.g. 128 x 2048 samples on up
to 4 GPUs; rank 0 then broadcasts the whole block, folded norms too). Others (FP8, GGUF) are
refused rather than silently calibrated on one share.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from quantkit.errors import SchemeMismatch

__all__ = ["DataParallel", "from_env", "world_size_from_env"]

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

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def describe(self) -> dict:
        return {"world_size": self.world, "backend": self.backend,
                "split": "contiguous calibration batches per rank; statistics summed; "
                         "method solved on rank 0, weights broadcast"}

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
        """Sum (max for absmax) every Linear's statistics and token count onto rank 0, in place.

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
        dist.reduce(tokens, dst=0)
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
                dist.reduce(t, dst=0, op=dist.ReduceOp.MAX if st in _MAX else dist.ReduceOp.SUM)
                rec[st] = t

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
        dist.init_process_group(backend="nccl" if cuda else "gloo",
                                **({"device_id": torch.device(device)} if cuda else {}))
        owns = True
    return DataParallel(rank=dist.get_rank(), world=dist.get_world_size(), local_rank=local,
                        backend=dist.get_backend(), owns_group=owns), device
