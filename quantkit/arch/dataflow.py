"""AWQ smoothing groups found from a block's dataflow, in discovery's one fake-tensor forward.

Why: AWQ (and SmoothQuant) fold a per-input-channel scale s of a group of Linears into the op
that produced their input: `balance` Linears' columns * s, `prev`'s weight / s. Which op that
is was a hand-written table per family (quantkit.arch.spec.AwqGroup rows), so a discovered
family had none and AWQ refused it. The relation can be read off the model instead: during
the forward that finds the sequential groups, a TorchFunctionMode records, for every tensor,
how its values relate to the output channels of an "origin" (a Linear's output rows or a
norm's per-channel weight), following only ops that keep each channel a multiple of that
origin channel:

- shape ops: view / reshape / flatten / unsqueeze / squeeze, transpose / permute, contiguous /
  clone / casts / dropout, expand (grouped-query attention's repeat_kv: marked "expanded"),
  a contiguous slice of the channel axis (chunk / split / [..., a:b]: Phi-3's fused gate_up);
- `x * g` and `x / g` with g not derived from the same origin (act(gate) * up, gated
  attention's `out * sigmoid(gate)`): still linear per channel in x;
- attention's `probs @ V` and scaled_dot_product_attention in V: each output channel is a
  mix of V's same channel over tokens.

Every other op (a nonlinearity, a sum of two branches, a residual add, a conv, an SSM
recurrence, a norm that reads two tensors such as a gated norm, a cat) ends the relation and
is recorded as a use of the origin. A Linear's group gets a `prev` only where:
(a) the origin is a norm module that reads one tensor and computes x_hat * (offset + w) per
    channel (checked numerically on real tensors, offset 0 or Gemma's 1) and whose output
    feeds nothing but the group's Linears and unquantized Linears reading the very same
    tensor (an MoE router: compensated), or
(b) the origin is a quantized Linear of the block whose output (its last rows, for a fused
    Linear: `prev_tail`) reaches the group's input channel for channel and nothing else;
    through attention only its whole output (v_proj -> o_proj; a slice of a fused qkv_proj
    has no group, as in AutoAWQ's tables), and where grouped-query attention repeats heads
    the group is kept for the scaling code's width check to skip, as the tables do.
Everything else is no group, with the reason recorded (`Found.unscaled`).

Routed experts are not run in the trace (routing needs values): one expert is traced as
quantkit.pipeline.experts runs it, act(gate(x)) * up(x) -> down, or the fused module's own
gate function (ExpertsSpec.glu) on its gate/up output.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from quantkit.arch.spec import EXPERT, AwqGroup, ExpertsSpec

__all__ = ["Dataflow", "Found"]

_SAME = {"contiguous", "clone", "to", "float", "half", "bfloat16", "double", "type_as", "type",
         "detach", "dropout", "neg", "__neg__", "requires_grad_"}
_RESHAPE = {"view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze", "view_as",
            "reshape_as"}
_PERMUTE = {"transpose", "permute", "swapaxes", "t", "movedim", "swapdims"}
_MUL = {"mul", "__mul__", "__rmul__", "multiply", "div", "__truediv__", "true_divide", "divide"}
_MATMUL = {"matmul", "__matmul__", "bmm"}
_SPLIT = {"chunk", "split", "tensor_split", "unbind"}


@dataclass(frozen=True)
class _Ch:
    """How a tensor relates to its origin's output channels: `tags` per dim of the tensor,
    None (not a channel axis), "e" (a broadcast copy, size from expand) or a key tuple (a
    channel axis; the origin's channel index is row-major over the keyed axes in key order);
    channels [start, stop) of the origin (a slice of a fused Linear's rows)."""

    block: int
    origin: str
    kind: str  # "linear" | "norm"
    width: int
    tags: tuple
    start: int = 0
    stop: int = 0
    expanded: bool = False
    attention: bool = False


@dataclass
class _Use:
    consumer: str  # a Linear's block-relative name, or an op's name
    kind: str  # "linear" | "compensate" | "opaque"
    state: _Ch
    order: int = 0


@dataclass
class Found:
    """Per block: the AWQ groups found (forward order) and the Linear sets without one."""

    groups: list[AwqGroup] = field(default_factory=list)
    unscaled: list[tuple[tuple[str, ...], str]] = field(default_factory=list)


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)


def _reshape_tags(old: tuple[int, ...], new: tuple[int, ...], tags: tuple):
    """Tags of `new` after reshaping a tensor of shape `old` (None: channels mixed with other
    axes, no relation left); second value: whether a broadcast copy merged into channels."""
    out: list = [None] * len(new)
    expanded = False
    i = j = 0
    while i < len(old) or j < len(new):
        if i < len(old) and old[i] == 1:
            i += 1
            continue
        if j < len(new) and new[j] == 1:
            j += 1
            continue
        if i >= len(old) or j >= len(new):
            return None, False
        gi, gj, pi, pj = [i], [j], old[i], new[j]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                if i >= len(old):
                    return None, False
                gi.append(i)
                pi *= old[i]
                i += 1
            else:
                if j >= len(new):
                    return None, False
                gj.append(j)
                pj *= new[j]
                j += 1
        group = [tags[k] for k in gi if old[k] != 1]
        keys = [t for t in group if isinstance(t, tuple)]
        if not keys:
            fill = "e" if group and all(t == "e" for t in group) else None
            for k in gj:
                out[k] = fill if new[k] != 1 else None
            continue
        if any(t is None for t in group) or keys != sorted(keys):
            return None, False
        expanded |= "e" in group
        for n, k in enumerate(d for d in gj if new[d] != 1):
            out[k] = keys[0] + (n,) if len(gj) > 1 or len(gi) > 1 else keys[0]
    return tuple(out), expanded


class Dataflow(TorchFunctionMode):
    """Records channel relations during the forward (see the module docstring). Hooks: a
    block's quantized Linears (`linear_in` / `linear_out`), its single-tensor norms
    (`norm_in` / `norm_out`), unquantized modules reading the hidden states
    (`compensable_in` / `compensable_out`: the router, 1-row gates) and the experts module
    (`experts`)."""

    def __init__(self):
        super().__init__()
        self.states: dict[int, _Ch] = {}
        self._keep: list[torch.Tensor] = []
        self.uses: dict[tuple[int, str], list[_Use]] = {}
        self.sinks: list[list[tuple[str, _Ch | None, int]]] = []
        self.norms: dict[tuple[int, str], nn.Module] = {}
        self.quiet = 0
        self.order = 0
        # the op that made a tensor from tracked ones without a relation (a sink's reason)
        self.ended: dict[int, str] = {}

    # -- recording
    def _state(self, t) -> _Ch | None:
        return self.states.get(id(t)) if isinstance(t, torch.Tensor) else None

    def _tag(self, t: torch.Tensor, st: _Ch) -> None:
        self.states[id(t)] = st
        self._keep.append(t)

    def _use(self, st: _Ch, consumer: str, kind: str) -> None:
        self.order += 1
        self.uses.setdefault((st.block, st.origin), []).append(_Use(consumer, kind, st, self.order))

    def origin(self, t: torch.Tensor, block: int, name: str, kind: str, width: int) -> None:
        tags = (None,) * (t.dim() - 1) + ((0,),)
        self._tag(t, _Ch(block, name, kind, width, tags, 0, width))

    def sink(self, block: int, name: str, x) -> None:
        """A quantized Linear `name` of `block` reads x."""
        while len(self.sinks) <= block:
            self.sinks.append([])
        st = self._state(x)
        self.order += 1
        self.sinks[block].append((name, st if st is not None else self.ended.get(id(x)), self.order))
        if st is not None:
            self._use(st, name, "linear")

    def compensable(self, name: str, x) -> None:
        st = self._state(x)
        if st is not None:
            self._use(st, name, "compensate")

    def opaque(self, what: str, *args) -> None:
        for t in _tensors(args):
            st = self._state(t)
            if st is not None:
                self._use(st, what, "opaque")

    # -- hooks
    def hook_block(self, bi: int, block: nn.Module, quantized: set[str], compensable: set[str],
                   skip: tuple[str, ...], stack) -> None:
        for name, mod in block.named_modules():
            if any(name == s or name.startswith(s + ".") for s in skip):
                continue
            if name in quantized:
                stack.enter_context(mod.register_forward_pre_hook(
                    lambda _m, a, _n=name: self._enter(lambda: self.sink(bi, _n, a[0]))))
                stack.enter_context(mod.register_forward_hook(
                    lambda m, _a, out, _n=name: self._leave(
                        lambda: self.origin(out, bi, _n, "linear", m.out_features))))
            elif name in compensable:
                stack.enter_context(mod.register_forward_pre_hook(
                    lambda _m, a, _n=name: self._enter(lambda: self.compensable(_n, a[0]))))
                stack.enter_context(mod.register_forward_hook(
                    lambda _m, _a, _o: self._leave(lambda: None)))
            elif _is_norm_like(mod):
                self.norms[(bi, name)] = mod

                def pre(_m, args, kwargs, _n=name):
                    self._enter(lambda: self.opaque(f"norm {_n}", *args, *kwargs.values()))

                def post(m, args, kwargs, out, _n=name):
                    def tag():
                        single = len(list(_tensors((args, tuple(kwargs.values()))))) == 1
                        if single and isinstance(out, torch.Tensor) \
                                and out.shape[-1] == m.weight.shape[0]:
                            self.origin(out, bi, _n, "norm", int(m.weight.shape[0]))
                        elif isinstance(out, torch.Tensor):
                            self.ended[id(out)] = f"{_n}, a norm of {'several inputs (a gated norm)' if not single else 'other width'}"
                            self._keep.append(out)
                    self._leave(tag)
                stack.enter_context(mod.register_forward_pre_hook(pre, with_kwargs=True))
                stack.enter_context(mod.register_forward_hook(post, with_kwargs=True))

    def _enter(self, first) -> None:
        """Record what a hooked module reads (`first`, unless inside another hooked module),
        then stop recording the ops inside it."""
        if self.quiet == 0:
            first()
        self.quiet += 1

    def _leave(self, then) -> None:
        self.quiet -= 1
        if self.quiet == 0:
            then()

    def experts(self, bi: int, spec: ExpertsSpec, module: nn.Module, hidden: torch.Tensor) -> None:
        """One routed expert as quantkit.pipeline.experts computes it, on stand-in tensors:
        gate/up read `hidden`; down reads act(up) (no gate), or the fused module's own gate
        function (`ExpertsSpec.glu`, or transformers' `_apply_gate`: act(gate) * up by
        default, gpt-oss's clamped (up + 1) * glu(gate)) on the concatenated gate/up rows,
        traced like the rest; act(gate) * up where the module has none (Llama 4)."""
        for name in spec.input_linears():
            self.sink(bi, name, hidden)
        fused = getattr(module, spec.fused_gate_up)
        rows = int(fused.shape[1] if not spec.fused_transposed else fused.shape[2])
        inter = rows // 2 if spec.gated else rows
        up = spec.linear("up")
        glu = getattr(module, spec.glu or "_apply_gate", None) if spec.gated else None
        self.quiet += 1
        try:
            made = hidden.new_empty((*hidden.shape[:-1], rows))
        finally:
            self.quiet -= 1
        if not spec.gated:
            self.origin(made, bi, up, "linear", inter)
            h = module.act_fn(made)
        elif glu is None:
            self.quiet += 1
            try:
                gate, made = made[..., :inter], made[..., inter:]
            finally:
                self.quiet -= 1
            self.origin(made, bi, up, "linear", inter)
            h = module.act_fn(gate) * made
        else:
            stand_in = f"{up} <gate_up>"
            self.origin(made, bi, stand_in, "linear", rows)
            h = glu(made)
            st = self._state(h)
            up_used = [u for u in self.uses.get((bi, stand_in), []) if u.state.stop > inter]
            if st is not None and st.origin == stand_in and (st.start, st.stop) == (inter, rows) \
                    and not st.expanded and not up_used:
                self._tag(h, replace(st, origin=up, width=inter, start=0, stop=inter))
            else:
                self.opaque(f"the fused experts' {glu.__name__}", h)
                self.states.pop(id(h), None)
                self.ended[id(h)] = (f"the fused experts' {glu.__name__} of gate and up, not "
                                     "act(gate) * up")
        self.sink(bi, spec.linear("down"), h)

    # -- the mode
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.quiet:
            return out
        inputs = list(_tensors((args, tuple(kwargs.values()))))
        tracked = [t for t in inputs if id(t) in self.states]
        if not tracked:
            name = getattr(func, "__name__", "")
            # a product's channels are its value operand's (probs @ V): its reason first
            first = {"scaled_dot_product_attention": 2, **dict.fromkeys(_MATMUL, 1)}.get(name)
            order = ([args[first]] if first is not None and len(args) > first else []) + inputs
            mark = next((self.ended[id(t)] for t in order
                         if isinstance(t, torch.Tensor) and id(t) in self.ended), None)
            if mark is not None:  # carry why a relation ended down the chain of ops
                for o in _tensors(out):
                    self.ended[id(o)] = mark
                    self._keep.append(o)
            return out
        name = getattr(func, "__name__", str(func))
        outs = list(_tensors(out))
        if not outs:
            if (name.endswith("_") and not name.endswith("__")) or name == "__setitem__":
                self.opaque(name, *tracked)
            return out
        if any(o is t for o in outs for t in tracked) and name in _SAME:
            return out  # the same tensor back (dropout with p = 0, a no-op cast)
        new = self._propagate(name, args, kwargs, out)
        if new is None:
            self.opaque(name, *tracked)
            for o in outs:
                self.ended[id(o)] = f"{name} of {', '.join(sorted({self.states[id(t)].origin for t in tracked}))}"
                self._keep.append(o)
            return out
        carried = {(st.block, st.origin) for _, st in new}
        self.opaque(name, *[t for t in tracked
                            if (self.states[id(t)].block, self.states[id(t)].origin) not in carried])
        for o, st in new:
            self._tag(o, st)
        return out

    def _propagate(self, name, args, kwargs, out):
        """[(output tensor, its state)], or None: the op ends every relation it reads."""
        first = args[0] if args else None
        st = self._state(first)
        if name in _SAME and st is not None and isinstance(out, torch.Tensor):
            return [(out, st)] if out.shape == first.shape else None
        if name in _RESHAPE and st is not None and isinstance(out, torch.Tensor):
            return self._reshaped(st, tuple(first.shape), out)
        if name in _PERMUTE and st is not None and isinstance(out, torch.Tensor):
            return self._permuted(name, st, first, args[1:], kwargs, out)
        if name in ("expand", "expand_as") and st is not None:
            old = (1,) * (out.dim() - first.dim()) + tuple(first.shape)
            tags = (None,) * (out.dim() - first.dim()) + st.tags
            tags = tuple("e" if o == 1 and n != 1 and t is None else t
                         for o, n, t in zip(old, out.shape, tags, strict=True))
            return [(out, replace(st, tags=tags))]
        if name == "repeat" and st is not None and isinstance(out, torch.Tensor):
            reps = args[1:] if len(args) > 2 or not isinstance(args[1], (list, tuple)) else args[1]
            reps = tuple(int(r) for r in reps)
            tags = (None,) * (len(reps) - first.dim()) + st.tags
            if any(isinstance(t, tuple) and r != 1 for t, r in zip(tags, reps, strict=True)):
                return None  # channels repeated: no longer one to one
            return [(out, replace(st, tags=tags))]
        if name == "__getitem__" and st is not None:
            return self._indexed(st, first, args[1], out)
        if name in _SPLIT and st is not None:
            return self._split(name, st, first, args[1:], kwargs, out)
        if name in _MUL:
            return self._mul(name, args, out)
        if name in _MATMUL and len(args) >= 2:
            return self._matmul(args[0], args[1], out)
        if name == "scaled_dot_product_attention":
            q, k, v = (list(args) + [kwargs.get(n) for n in ("query", "key", "value")])[:3]
            sv = self._state(v)
            if sv is None or any(_same_origin(self._state(t), sv) for t in (q, k)):
                return None
            return self._matmul(None, v, out)
        return None

    def _reshaped(self, st, old, out):
        tags, expanded = _reshape_tags(old, tuple(out.shape), st.tags)
        return None if tags is None else [(out, replace(st, tags=tags,
                                                        expanded=st.expanded or expanded))]

    def _permuted(self, name, st, x, rest, kwargs, out):
        n = x.dim()
        order = list(range(n))
        if name == "t":
            order = order[::-1]
        elif name == "permute":
            dims = rest[0] if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest
            order = [d % n for d in (dims or kwargs.get("dims"))]
        elif name == "movedim":
            src, dst = rest[0] % n, rest[1] % n
            order.remove(src)
            order.insert(dst, src)
        else:
            a, b = (rest[0] % n, rest[1] % n) if len(rest) >= 2 else \
                (kwargs.get("dim0") % n, kwargs.get("dim1") % n)
            order[a], order[b] = order[b], order[a]
        return [(out, replace(st, tags=tuple(st.tags[d] for d in order)))]

    def _indexed(self, st, x, idx, out):
        idx = idx if isinstance(idx, tuple) else (idx,)
        if any(i is Ellipsis for i in idx):
            k = idx.index(Ellipsis)
            fill = x.dim() - sum(1 for i in idx if i is not None and i is not Ellipsis)
            idx = idx[:k] + (slice(None),) * fill + idx[k + 1:]
        tags, d, start, stop = [], 0, st.start, st.stop
        for i in idx:
            if i is None:
                tags.append(None)
                continue
            tag = st.tags[d] if d < len(st.tags) else None
            size = x.shape[d]
            if isinstance(i, slice):
                a, b, step = i.indices(size)
                if (a, b, step) != (0, size, 1) and isinstance(tag, tuple):
                    if step != 1 or sum(isinstance(t, tuple) for t in st.tags) != 1:
                        return None
                    start, stop = start + a, start + b
                tags.append(tag)
            elif isinstance(i, int) and not isinstance(tag, tuple):
                pass  # a non-channel axis taken at one index
            else:
                return None  # tensor indices, a channel taken at one index
            d += 1
        tags += list(st.tags[d:])
        if not isinstance(out, torch.Tensor) or len(tags) != out.dim():
            return None
        return [(out, replace(st, tags=tuple(tags), start=start, stop=stop))]

    def _split(self, name, st, x, rest, kwargs, out):
        dim = (rest[1] if len(rest) > 1 else kwargs.get("dim", 0 if name != "chunk" else 0))
        dim = dim % x.dim()
        pieces = list(out)
        tag = st.tags[dim]
        if name == "unbind":
            return None if isinstance(tag, tuple) else \
                [(p, replace(st, tags=st.tags[:dim] + st.tags[dim + 1:])) for p in pieces]
        if not isinstance(tag, tuple):
            return [(p, st) for p in pieces]
        if sum(isinstance(t, tuple) for t in st.tags) != 1:
            return None
        res, at = [], st.start
        for p in pieces:
            n = p.shape[dim]
            res.append((p, replace(st, start=at, stop=at + n)))
            at += n
        return res

    def _mul(self, name, args, out):
        a, b = (args + (None,))[:2]
        sa, sb = self._state(a), self._state(b)
        divide = "div" in name
        if (sa is None) == (sb is None) or (divide and sa is None):
            return None  # x * x, or g / x: not linear per channel in x
        x, st = (a, sa) if sa is not None else (b, sb)
        if name == "__rmul__":
            x, st = (a, sa) if sa is not None else (b, sb)
        if not isinstance(out, torch.Tensor):
            return None
        pad = out.dim() - x.dim()
        tags = (None,) * pad + st.tags
        shape = (1,) * pad + tuple(x.shape)
        if any(isinstance(t, tuple) and shape[d] != out.shape[d] for d, t in enumerate(tags)):
            return None
        return [(out, replace(st, tags=tags))]

    def _matmul(self, a, b, out):
        """a @ b linear per channel in b: b's last axis carries the channels (not its
        contracted one), a is not derived from an origin."""
        sb = self._state(b)
        if sb is None or _same_origin(self._state(a), sb) or b.dim() < 2 \
                or not isinstance(out, torch.Tensor):
            return None
        if isinstance(sb.tags[-2], tuple):
            return None  # the contraction mixes channels (q @ k^T)
        pad = out.dim() - b.dim()
        tags = list((None,) * pad + sb.tags)
        shape = (1,) * pad + tuple(b.shape)
        tags[-2] = None
        expanded = sb.expanded or any(  # heads repeated by broadcasting (grouped-query attention)
            shape[d] != out.shape[d] and isinstance(tags[d], tuple) for d in range(out.dim() - 2))
        return [(out, replace(sb, tags=tuple(tags), expanded=expanded, attention=True))]

    # -- the groups
    def groups(self, bi: int, block: nn.Module, compensate_ok: set[str]) -> Found:
        found = Found()
        by_origin: dict[str, list[tuple[str, _Ch, int]]] = {}
        for name, st, order in (self.sinks[bi] if bi < len(self.sinks) else []):
            why = _sink_problem(st)
            if why:
                found.unscaled.append(((name,), why))
                continue
            by_origin.setdefault(st.origin, []).append((name, st, order))
        for origin, members in by_origin.items():
            kind = members[0][1].kind
            names = tuple(m[0] for m in members)
            states = {(m[1].start, m[1].stop, m[1].expanded, m[1].attention) for m in members}
            if len(states) != 1:
                found.unscaled.append((names, f"they read different channels of {origin}"))
                continue
            start, stop, expanded, attention = states.pop()
            width = members[0][1].width
            overlap = [u for u in self.uses.get((bi, origin), [])
                       if u.state.start < stop and start < u.state.stop]
            others = [u for u in overlap if not (u.kind == "linear" and u.consumer in names)]
            compensate: list[str] = []
            why = ""
            if kind == "norm":
                offset = _norm_offset(self.norms[(bi, origin)])
                if offset is None:
                    why = f"{origin} is not x_hat * (offset + w) per channel"
                elif expanded or (start, stop) != (0, width):
                    why = f"they read a slice or repeated channels of {origin}"
                for u in others:
                    if u.kind == "compensate" and u.consumer in compensate_ok \
                            and _plain(u.state) and not _sink_problem(u.state):
                        compensate.append(u.consumer)
                    else:
                        why = why or f"{origin}'s output also feeds {u.consumer}"
            else:
                offset = None
                sliced = (start, stop) != (0, width)
                if sliced and stop != width:
                    why = f"they read rows {start}:{stop} of {origin}, not its last rows"
                elif sliced and (attention or expanded):
                    why = (f"they read {origin}'s rows {start}:{stop} through attention: a slice "
                           "of a fused Linear's rows is no AWQ pair there (AutoAWQ's rule)")
                for u in others:
                    why = why or f"{origin}'s output also feeds {u.consumer}"
            if why:
                found.unscaled.append((names, why))
                continue
            balance = _templates_first(names)
            comp = tuple(dict.fromkeys(compensate))
            found.groups.append(AwqGroup(
                origin, balance, _inspect(origin, balance + comp),
                prev_tail=kind == "linear" and (start, stop) != (0, width), compensate=comp,
                norm_offset=offset))
        found.groups.sort(key=lambda g: min(o for n, _, o in by_origin[g.prev]))
        return found


def _same_origin(a: _Ch | None, b: _Ch | None) -> bool:
    return a is not None and b is not None and (a.block, a.origin) == (b.block, b.origin)


def _plain(st: _Ch) -> bool:
    """The origin's channels unsliced, unrepeated."""
    return (st.start, st.stop) == (0, st.width) and not st.expanded


def _templates_first(names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(n for n in names if EXPERT in n) + tuple(n for n in names if EXPERT not in n)


def _sink_problem(st: _Ch | str | None) -> str:
    if isinstance(st, str):
        return f"its input comes from {st}, not channel for channel from a norm or a Linear"
    if st is None:
        return ("its input is no per-channel copy of a norm's or Linear's output (the residual "
                "stream, or tensors made outside the block)")
    keyed = [d for d, t in enumerate(st.tags) if isinstance(t, tuple)]
    if keyed != [len(st.tags) - 1]:
        return f"its input channels are not {st.origin}'s channels one to one"
    return ""


def _inspect(prev: str, names: tuple[str, ...]) -> str:
    """The outermost module holding every name of `names` but not `prev` ("" = the block):
    the tables' choice (self_attn for q/k/v, mlp for gate/up, o_proj for v -> o_proj)."""
    parts = [n.split(".") for n in names]
    common = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    if len(names) == 1:
        common = parts[0]
    for k in range(1, len(common) + 1):
        path = ".".join(common[:k])
        if not (prev == path or prev.startswith(path + ".")):
            return path
    # every module holding them holds prev too (DeepSeek-V3.2's q_a_layernorm -> q_b_proj and
    # the indexer's wq_b): the innermost one holding them all
    return ".".join(common) if len(names) > 1 else ""


def _is_norm_like(mod: nn.Module) -> bool:
    w = getattr(mod, "weight", None)
    return (isinstance(w, torch.Tensor) and w.dim() == 1 and not isinstance(mod, nn.Linear)
            and not list(mod.children()))


_OFFSETS: dict[type, float | None] = {}


def _norm_offset(mod: nn.Module) -> float | None:
    """c where `mod(x)` = x_hat * (c + w) channel by channel (c 0, or 1 for Gemma-style
    norms), measured on real tensors; None where the output is not so (or the module cannot
    run on its own)."""
    from torch.func import functional_call

    w = mod.weight
    n = int(w.shape[0])
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, n, generator=gen)
    named = dict(mod.named_parameters(recurse=False)) | dict(mod.named_buffers(recurse=False))

    def run(weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        values = {k: torch.zeros(v.shape, dtype=torch.float32) for k, v in named.items()}
        values["weight"] = weight
        if bias is not None and "bias" in values:
            values["bias"] = bias
        return functional_call(mod, values, (x,)).float()

    try:
        zero, one = run(torch.zeros(n)), run(torch.ones(n))
        scale = one - zero
        if not torch.all(scale.abs() > 1e-6):
            return None
        offset = float((zero / scale).mean())
        c = round(offset)
        w_rand = torch.rand(n, generator=gen) + 0.5
        want = scale * (c + w_rand)
        if abs(offset - c) > 1e-4 or not torch.allclose(run(w_rand), want, atol=1e-4, rtol=1e-4):
            return None
        if "bias" in named:
            b = torch.randn(n, generator=gen)
            if not torch.allclose(run(w_rand, b), want + b, atol=1e-4, rtol=1e-4):
                return None
        return float(c)
    except Exception:  # noqa: BLE001 - a module that does not run alone is no norm to fold into
        return None


def ordered_union(per_block: list[list]) -> tuple:
    """One sequence of groups that keeps every block's own order (ArchSpec.sequential and
    awq_groups skip the names a block lacks): a block's group not placed yet goes right before
    the next of that block's groups already placed, or at the end (a MoE block's expert
    groups after a dense block's MLP groups)."""
    out: list = []
    for groups in per_block:
        for i, g in enumerate(groups):
            if g in out:
                continue
            later = next((out.index(h) for h in groups[i + 1:] if h in out), len(out))
            out.insert(later, g)
    return tuple(out)


def present_groups(groups, block: nn.Module, experts_module: str | None) -> list[AwqGroup]:
    """`groups` as the scaling code resolves them on `block` (quantkit.methods.scaling): the
    balance names the block holds (expert templates where its experts module exists); rows
    with none are skipped."""
    modules = dict(block.named_modules())
    out = []
    for g in groups:
        balance = tuple(n for n in g.balance if n in modules
                        or (EXPERT in n and experts_module and experts_module in modules))
        if balance:
            out.append(replace(g, balance=balance))
    return out

