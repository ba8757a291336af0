"""Recording what a decoder block's submodules receive (and return) while the block reruns on
its cached calibration batches, and replaying an experts module's recorded calls.

Why in the pipeline: hooks, the rerun's early stop, batch merging and expert replays are about
running the block, not about any method's math. A method reaches them through its block
context (`BlockContext.replay`, a BlockReplay), so methods never import the pipeline. AWQ's
scale search reads real submodule outputs and captured Linear inputs this way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from quantkit.pipeline.experts import LinearExperts, routed_only

__all__ = ["BlockReplay", "Recording", "linear_inputs", "merge_batches", "expert_inputs",
           "chunks_within"]


class _Enough(Exception):
    """Raised by a pre-hook to stop a capture rerun once enough batches were seen."""


@dataclass
class Recording:
    """What one submodule received (and returned) on the captured calibration batches."""

    args: list[tuple] = field(default_factory=list)
    kwargs: list[dict] = field(default_factory=list)
    outs: list[torch.Tensor] = field(default_factory=list)

    def x(self) -> torch.Tensor:
        """The first input of every batch, flattened to [tokens, features], compute dtype."""
        xs = [a[0] if a else kw["hidden_states"] for a, kw in zip(self.args, self.kwargs, strict=True)]
        return torch.cat([t.reshape(-1, t.shape[-1]) for t in xs])

    def take_x(self) -> torch.Tensor:
        """x(), but the record lets go of its batches as they are copied, so a captured input
        is never held twice (down_proj's: 65536 x 14336 bf16 = 1.75 GiB on the accelerator)."""
        xs = [a[0] if a else kw["hidden_states"] for a, kw in zip(self.args, self.kwargs, strict=True)]
        self.args, self.kwargs = [], []
        width = xs[0].shape[-1]
        out = torch.empty(sum(t.numel() // width for t in xs), width, dtype=xs[0].dtype,
                          device=xs[0].device)
        pos = 0
        while xs:
            t = xs.pop(0).reshape(-1, width)
            out[pos:pos + t.shape[0]].copy_(t)
            pos += t.shape[0]
            del t
        return out


def _recorder(seen: dict[str, Recording], key: str, keep_out: bool):
    """A forward hook appending a module's call (and output) to seen[key]."""
    rec = seen.setdefault(key, Recording())

    def fn(_m, args, kwargs, out):
        rec.args.append(args)
        rec.kwargs.append(kwargs)
        if keep_out:
            rec.outs.append(out[0] if isinstance(out, tuple) else out)
    return fn


def linear_inputs(seen: dict[str, Recording], linears: dict) -> dict[str, torch.Tensor]:
    """[tokens, K] input of every Linear; Linears fed the same tensors (q/k/v) share one copy.

    The "lin:" records are emptied on the way (nothing reads them later): a batch that only a
    Linear's record held (o_proj's, down_proj's inputs) is freed as soon as it is copied.
    """
    out: dict[str, torch.Tensor] = {}
    by_ids: dict[tuple, torch.Tensor] = {}
    for name, lin in linears.items():
        rec = seen["lin:" + name]
        if not rec.args:  # an expert no search token was routed to: [0, K]
            w = lin.weight
            out[name] = torch.empty(0, lin.in_features, dtype=w.dtype, device=w.device)
            continue
        ids = tuple(id(a[0]) if a else id(kw["hidden_states"]) for a, kw in zip(rec.args, rec.kwargs, strict=True))
        if ids not in by_ids:
            by_ids[ids] = rec.take_x()
        rec.args, rec.kwargs = [], []
        out[name] = by_ids[ids]
    return out


def expert_inputs(experts: torch.nn.Module, calls: Recording,
                   linears: dict[str, torch.nn.Linear]) -> dict[str, torch.Tensor]:
    """What `linears` (Linears of some experts of the LinearExperts `experts`) receive when
    `experts` runs its recorded calls again with only their experts running: the same
    tensors the block's capture would have given them (same inputs, same routing)."""
    wanted = {id(lin) for lin in linears.values()}
    keep = {e for e, expert in enumerate(experts) if any(id(m) in wanted for m in expert.modules())}
    seen: dict[str, Recording] = {}
    handles = [lin.register_forward_hook(_recorder(seen, "lin:" + name, False), with_kwargs=True)
               for name, lin in linears.items()]
    experts.only = keep
    try:
        with torch.no_grad():
            for args, kwargs in zip(calls.args, calls.kwargs, strict=True):
                experts(*args, **kwargs)
    finally:
        experts.only = None
        for h in handles:
            h.remove()
    return linear_inputs(seen, linears)


_MERGE_TOKENS = 16384  # tokens per merged call of an inspect module


def _same(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and (
            a is b or bool(torch.equal(a, b)))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a is b or (isinstance(a, (int, float, str, bool, type(None))) and a == b)


def merge_batches(rec: Recording) -> Recording:
    """Concatenate consecutive batches along the batch dim where every other argument is the
    same (rotary tables, causal mask, flags): one module call instead of one per sample."""
    out = Recording()
    for args, kwargs, o in zip(rec.args, rec.kwargs, rec.outs, strict=True):
        h = args[0] if args else kwargs["hidden_states"]
        rest = (args[1:], {k: v for k, v in kwargs.items() if k != "hidden_states"})
        if out.args:
            la, lk, lo = out.args[-1], out.kwargs[-1], out.outs[-1]
            lh = la[0] if la else lk["hidden_states"]
            lrest = (la[1:], {k: v for k, v in lk.items() if k != "hidden_states"})
            if (lh.shape[1:] == h.shape[1:] and lh.shape[:-1].numel() + h.shape[:-1].numel()
                    <= _MERGE_TOKENS and _same(rest, lrest)):
                hh = torch.cat([lh, h])
                out.args[-1] = (hh, *la[1:]) if la else la
                out.kwargs[-1] = lk if la else {**lk, "hidden_states": hh}
                out.outs[-1] = torch.cat([lo, o])
                continue
        out.args.append(args)
        out.kwargs.append(kwargs)
        out.outs.append(o)
    return out


def chunks_within(need: dict, budget: int) -> list[list]:
    """`need`'s keys (in order) in consecutive chunks of at most `budget` bytes together (a
    key alone larger than the budget gets a chunk of its own): what a memory-bounded replay
    handles at a time."""
    chunks: list[list] = []
    held = 0
    for key, size in need.items():
        if not chunks or (held + size > budget and chunks[-1]):
            chunks.append([])
            held = 0
        chunks[-1].append(key)
        held += size
    return chunks


class BlockReplay:
    """The recording and replay services of one decoder block, for its BlockContext.

    `rerun()` runs the block on its cached batches (the pipeline's); `spec` is the block's
    architecture row (its experts module, if any); `inputs` the cached hidden states.
    """

    def __init__(self, block: torch.nn.Module, rerun: Callable[..., list[torch.Tensor]],
                 spec=None, inputs: list[torch.Tensor] | None = None):
        self.block, self.rerun, self.spec, self.inputs = block, rerun, spec, inputs or []

    def record(self, modules: dict[str, torch.nn.Module], linears: dict[str, torch.nn.Linear],
               n_batches: int, calls: dict[str, torch.nn.Module] | None = None
               ) -> dict[str, Recording]:
        """Rerun the block on its first `n_batches` cached batches, recording what `modules`
        receive and return ("mod:NAME"), what every Linear receives ("lin:NAME") and the calls
        of `calls` without their outputs ("in:NAME": a later replay's arguments)."""
        seen: dict[str, Recording] = {}
        handles = []
        for name, mod in modules.items():
            handles.append(mod.register_forward_hook(_recorder(seen, "mod:" + name, True), with_kwargs=True))
        for name, lin in linears.items():
            handles.append(lin.register_forward_hook(_recorder(seen, "lin:" + name, False), with_kwargs=True))
        for name, mod in (calls or {}).items():
            handles.append(mod.register_forward_hook(_recorder(seen, "in:" + name, False), with_kwargs=True))
        count = [0]

        def stop(_m, _args, _kwargs):
            if count[0] >= n_batches:
                raise _Enough
            count[0] += 1

        handles.append(self.block.register_forward_pre_hook(stop, with_kwargs=True))
        try:
            self.rerun()
        except _Enough:
            pass
        finally:
            for h in handles:
                h.remove()
        return seen

    def linear_inputs(self, seen: dict[str, Recording], linears: dict) -> dict[str, torch.Tensor]:
        """linear_inputs(): the recorded [tokens, K] input of every Linear."""
        return linear_inputs(seen, linears)

    def merge_batches(self, rec: Recording) -> Recording:
        """merge_batches(): consecutive compatible batches as one call."""
        return merge_batches(rec)

    def linear_experts(self) -> LinearExperts | None:
        """The block's per-expert Linear container (pipeline.experts.LinearExperts) when it has
        one and captured inputs to chunk, else None."""
        spec = self.spec
        if spec is None or spec.experts is None or not self.inputs:
            return None
        try:
            experts = self.block.get_submodule(spec.experts.module)
        except AttributeError:
            return None
        return experts if isinstance(experts, LinearExperts) else None

    def expert_inputs(self, experts: torch.nn.Module, calls: Recording,
                      linears: dict[str, torch.nn.Linear]) -> dict[str, torch.Tensor]:
        """expert_inputs(): some experts' Linear inputs from a replay of the recorded calls."""
        return expert_inputs(experts, calls, linears)

    def routed_only(self, mod: torch.nn.Module) -> contextlib.AbstractContextManager:
        """pipeline.experts.routed_only(): all-experts calibration off inside `mod` meanwhile."""
        return routed_only(mod)

    def chunks_within(self, need: dict, budget: int) -> list[list]:
        """chunks_within(): `need`'s keys in chunks of at most `budget` bytes."""
        return chunks_within(need, budget)
