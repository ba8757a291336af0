"""Mixture-of-experts blocks as per-expert Linears, for calibration and export.

transformers 5 stores routed experts as fused 3-D parameters (`gate_up_proj` (E, 2I, H),
`down_proj` (E, H, I)) and runs them with `F.linear` on slices: no per-expert module exists,
so nothing can be hooked per expert and an nn.Linear walker misses them all. Here every
experts module is replaced by one `LinearExperts` holding real nn.Linear modules named as the
Hub checkpoints and vLLM's FusedMoE loader name them (`mlp.experts.{e}.gate_proj`, ...).

Why per-expert Linears rather than slicing hooks on the fused tensors: with them the one
pipeline needs no MoE branch at all. Statistics hooks see exactly the tokens routed to each
expert, results and the writers' tensor names are the checkpoint's per-expert names, streaming
reads the per-expert tensors from the shards under their own names, and the fused in-memory
layout (loaded with `from_pretrained`) becomes the same modules by slicing, so both layouts
give the same artifact. The forward keeps the model's routing (the router module is untouched).
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

from quantkit.arch import ArchSpec, ExpertsSpec

__all__ = ["LinearExperts", "expert_tensors", "linearize_experts", "num_experts", "routed_only"]


class _Expert(nn.Module):
    """One routed expert: down(act(gate(x)) * up(x)), the SwiGLU the fused module computes,
    down(act(up(x))) for experts without a gate (Nemotron-H's relu^2), or down(glu(gate_up(x)))
    with the fused module's own `glu` method (gpt-oss's clamped SwiGLU on the interleaved
    gate/up output)."""

    def __init__(self, spec: ExpertsSpec, hidden: int, inter: int, act_fn, dtype, device,
                 glu=None):
        super().__init__()
        # skip_init: no random init of weights that are copied from the fused tensors (or
        # streamed in) right after: nn.Linear's kaiming init of 128 experts x 3 Linears of
        # Qwen3-30B-A3B shapes took seconds per block on the CPU
        make = lambda i, o: nn.utils.skip_init(  # noqa: E731
            nn.Linear, i, o, bias=spec.bias, dtype=dtype, device=device)
        for which in spec.inputs:
            setattr(self, getattr(spec, which), make(hidden, inter))
        setattr(self, spec.down, make(inter, hidden))
        self._names = (spec.gate, spec.up, spec.down)
        self._interleaved = spec.gate_up_interleaved
        self._glu = glu
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) if n else None for n in self._names)
        if gate is None:
            return down(self.act_fn(up(x)))
        if self._glu is None:
            return down(self.act_fn(gate(x)) * up(x))
        g, u = gate(x), up(x)
        gate_up = torch.stack((g, u), -1).flatten(-2) if self._interleaved else torch.cat((g, u), -1)
        return down(self._glu(gate_up))


def _weightless(module: nn.Module) -> nn.Module:
    shell = copy.copy(module)
    shell._parameters, shell._buffers, shell._modules = {}, {}, {}
    return shell


def expert_tensors(spec: ExpertsSpec, fused: dict[str, torch.Tensor], e: int
                   ) -> dict[str, torch.Tensor]:
    """Expert `e`'s per-expert Linear tensors ("gate_proj.weight", "gate_proj.bias", ...) from
    the fused 3-D ones (`fused` keyed by the fused parameter names: gate_up_proj, down_proj
    and, with biases, gate_up_proj_bias, down_proj_bias), per the spec's layout."""
    gate_up, down = fused[spec.fused_gate_up][e], fused[spec.fused_down][e]
    if spec.fused_transposed:  # (in, out) -> nn.Linear's (out, in)
        gate_up, down = gate_up.T, down.T
    if not spec.gated:  # the fused tensor is up alone
        halves = {spec.up: gate_up}
    elif spec.gate_up_interleaved:
        halves = {spec.gate: gate_up[0::2], spec.up: gate_up[1::2]}
    else:
        inter = gate_up.shape[0] // 2
        halves = {spec.gate: gate_up[:inter], spec.up: gate_up[inter:]}
    out = {f"{n}.weight": w for n, w in halves.items()}
    out[f"{spec.down}.weight"] = down
    if spec.bias:
        gate_up_b = fused[f"{spec.fused_gate_up}_bias"][e]
        if not spec.gated:
            out[f"{spec.up}.bias"] = gate_up_b
        else:
            gate_b, up_b = ((gate_up_b[0::2], gate_up_b[1::2]) if spec.gate_up_interleaved
                            else gate_up_b.chunk(2))
            out.update({f"{spec.gate}.bias": gate_b, f"{spec.up}.bias": up_b})
        out[f"{spec.down}.bias"] = fused[f"{spec.fused_down}_bias"][e]
    return {k: v.contiguous() for k, v in out.items()}


class LinearExperts(nn.ModuleList):
    """Drop-in for a transformers 5 `*Experts` module: forward(hidden, top_k_index, top_k_weights).

    Same routing and summation order as the fused module (experts in index order, each
    expert's tokens ordered by top-k slot then token). `calibrate_all` runs every expert on
    every token so statistics hooks see all of them (llm-compressor's
    moe_calibrate_all_experts); the output still sums only the routed tokens' results.
    `only` (a set of expert indices, normally None) runs just those experts: a replay that
    wants some experts' inputs (AWQ's chunked capture) skips the others' work, and the output
    is then not the module's.
    """

    def __init__(self, experts: list[_Expert], calibrate_all: bool = False):
        super().__init__(experts)
        self.calibrate_all = calibrate_all
        self.only: set[int] | None = None

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor | None = None,
                top_k_weights: torch.Tensor | None = None) -> torch.Tensor:
        if top_k_index is None:
            return self._forward_stacked(hidden_states)
        out = torch.zeros_like(hidden_states)
        tokens = hidden_states.shape[0]
        # one stable sort of the (slot, token) pairs by expert instead of a torch.where per
        # expert: on a GPU each where waits for the device (128 experts x every batch x every
        # replayed forward); a stable sort keeps where's order (slot, then token) per expert
        flat = top_k_index.T.reshape(-1)  # (top_k * tokens): slot-major, as where scans
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self)).tolist()  # the one device sync
        pos_all, tok_all = order // tokens, order % tokens
        start = 0
        for e, expert in enumerate(self):
            end = start + counts[e]
            pos, tok = pos_all[start:end], tok_all[start:end]
            start = end
            if self.only is not None and e not in self.only:
                continue
            if self.calibrate_all:
                y = expert(hidden_states)[tok]
            elif tok.numel():
                y = expert(hidden_states[tok])
            else:
                continue
            y = y * top_k_weights[tok, pos, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out


    def _forward_stacked(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Llama 4's call: every expert's copy of the tokens, stacked (E * tokens, H), each
        already multiplied by its router score (zero where the token is not routed there);
        the outputs stacked alike. Each expert runs on its routed (non-zero) rows only, so its
        statistics see just its tokens; a zero row gives zero (no biases), as the module's."""
        x = hidden_states.view(len(self), -1, hidden_states.shape[-1])
        out = torch.zeros_like(x)
        for e, expert in enumerate(self):
            if self.only is not None and e not in self.only:
                continue
            rows = (x[e] != 0).any(-1)
            if rows.any():
                out[e, rows] = expert(x[e, rows]).to(out.dtype)
        return out.view(-1, hidden_states.shape[-1])


def num_experts(block: nn.Module, spec: ArchSpec) -> int:
    """Routed experts in this block (0 for a dense block or a dense architecture)."""
    if spec.experts is None:
        return 0
    try:
        mod = block.get_submodule(spec.experts.module)
    except AttributeError:
        return 0
    if isinstance(mod, LinearExperts):
        return len(mod)
    fused = getattr(mod, spec.experts.fused_gate_up, None)
    return int(fused.shape[0]) if fused is not None else 0


def linearize_experts(model: nn.Module, spec: ArchSpec, calibrate_all: bool = False) -> nn.Module:
    """Replace every fused experts module of `model` by a LinearExperts, in place (idempotent).

    Works on meta skeletons (shapes only: streaming fills them from the shards) and on loaded
    models (the fused weights are sliced: gate = rows [:I], up = rows [I:] of gate_up_proj;
    without a gate, up is the whole fused up tensor).
    """
    if spec.experts is None:
        return model
    es = spec.experts
    for block in model.get_submodule(spec.block_path):
        try:
            fused = block.get_submodule(es.module)
        except AttributeError:
            continue  # a dense block of a MoE model
        if isinstance(fused, LinearExperts):
            fused.calibrate_all = calibrate_all
            continue
        gate_up = getattr(fused, es.fused_gate_up)
        params = dict(fused.named_parameters(recurse=False))
        n = gate_up.shape[0]
        hidden, rows = gate_up.shape[1:] if es.fused_transposed else gate_up.shape[:0:-1]
        inter = rows // len(es.inputs)
        # gpt-oss: a bound method of a weightless copy of the fused module, the model's own
        # code with its constants (alpha, limit), not keeping the fused weights alive
        glu = getattr(_weightless(fused), es.glu) if es.glu else None
        act_fn = None if es.glu else fused.act_fn
        experts = []
        for e in range(n):
            expert = _Expert(es, hidden, inter, act_fn, gate_up.dtype, gate_up.device, glu)
            if gate_up.device.type != "meta":
                with torch.no_grad():
                    for name, value in expert_tensors(es, params, e).items():
                        expert.get_parameter(name).copy_(value)
            experts.append(expert)
        owner_name, _, leaf = es.module.rpartition(".")
        owner = block.get_submodule(owner_name) if owner_name else block
        setattr(owner, leaf, LinearExperts(experts, calibrate_all))
    return model


@contextlib.contextmanager
def routed_only(mod: torch.nn.Module):
    """Experts modules under `mod` in all-experts calibration (`calibrate_all`, statistics
    only) run just their routed tokens meanwhile. The loss reads the module's output, which
    sums the routed tokens' results either way; every token through every expert there was
    top_k / experts of the work wasted per candidate (16x the expert FLOPs of Qwen3-30B-A3B)."""
    flagged = [m for m in mod.modules() if getattr(m, "calibrate_all", False) is True]
    for m in flagged:
        m.calibrate_all = False
    try:
        yield
    finally:
        for m in flagged:
            m.calibrate_all = True
