"""Choose one option per tensor under a byte budget so the summed measured cost is minimal.

Format-neutral on purpose: an option is (label, exact bytes, cost), where cost is whatever the
method measured for that tensor at that option (GGUF: imatrix-weighted squared dequantization
error per GGML type; an int format could give per-layer bits). The solve is the classic
greedy on each tensor's lower convex hull of (bytes, cost) - a Lagrangian relaxation of the
multiple-choice knapsack: start every tensor at its smallest option and keep taking the
upgrade with the largest cost decrease per added byte while it fits; then spend what is left
on any upgrade that still fits (largest decrease first), so the budget is not left idle
because one hull step was too big.

A few tensors can be too big for that: token_embd / output of a small model are most of its
bytes, one hull step of theirs is more than the whole leftover, and the greedy then leaves a
large part of the budget idle (tiny Llama: 5.04 of 5.5 bits per weight). Those (`whole`) are
solved exactly: every combination of their options, the greedy for the rest under what each
leaves, the cheapest total kept (8 x 8 combinations for two tensors).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from quantkit.errors import SchemeMismatch

__all__ = ["Option", "hull", "pareto", "allocate", "budget_range"]


@dataclass(frozen=True)
class Option:
    label: str
    nbytes: int
    cost: float


def hull(options: list[Option]) -> list[Option]:
    """The options worth buying: sorted by bytes, each cheaper in cost than the one before, on
    the lower convex hull (an option above the chord of its neighbours never wins the greedy)."""
    best: dict[int, Option] = {}
    for o in options:  # same size: keep the lower cost
        if o.nbytes not in best or o.cost < best[o.nbytes].cost:
            best[o.nbytes] = o
    pts: list[Option] = []
    for o in sorted(best.values(), key=lambda o: o.nbytes):
        if pts and o.cost >= pts[-1].cost:
            continue  # more bytes, no less cost: dominated
        while len(pts) >= 2:
            a, b = pts[-2], pts[-1]
            # b lies on or above the segment a -> o: drop it
            if (b.cost - a.cost) * (o.nbytes - a.nbytes) >= (o.cost - a.cost) * (b.nbytes - a.nbytes):
                pts.pop()
            else:
                break
        pts.append(o)
    return pts


def pareto(options: list[Option]) -> list[Option]:
    """The options no other beats in both bytes and cost, by bytes (for `whole` tensors, whose
    options off the convex hull can still be the best combination)."""
    out: list[Option] = []
    for o in sorted(options, key=lambda o: (o.nbytes, o.cost)):
        if not out or o.cost < out[-1].cost:
            out.append(o)
    return out


def budget_range(candidates: dict[str, list[Option]]) -> tuple[int, int]:
    """(bytes when every tensor takes its smallest option, bytes when every one takes its largest)."""
    return (sum(min(o.nbytes for o in opts) for opts in candidates.values()),
            sum(max(o.nbytes for o in opts) for opts in candidates.values()))


def allocate(candidates: dict[str, list[Option]], budget: int, whole: tuple[str, ...] = ()
             ) -> dict[str, Option]:
    """One option per tensor, total bytes <= budget, summed cost minimal (greedy on the hulls;
    the tensors named in `whole` by trying each combination of their options).

    Raises SchemeMismatch when the budget is below every tensor's smallest option.
    A budget above every tensor's largest option gives every tensor its largest-useful one.
    """
    lo, _ = budget_range(candidates)
    if budget < lo:
        raise SchemeMismatch(f"The size budget ({budget} bytes) is below the smallest possible "
                             f"choice ({lo} bytes).", "Raise the budget.")
    whole = tuple(n for n in whole if n in candidates)
    if not whole:
        return _greedy(candidates, budget)
    rest = {n: v for n, v in candidates.items() if n not in whole}
    rest_lo = budget_range(rest)[0] if rest else 0
    best: tuple[float, dict[str, Option]] | None = None
    for combo in itertools.product(*(candidates[n] for n in whole)):
        left = budget - sum(o.nbytes for o in combo)
        if left < rest_lo:
            continue
        chosen = {**dict(zip(whole, combo, strict=True)), **(_greedy(rest, left) if rest else {})}
        cost = sum(o.cost for o in chosen.values())
        if best is None or cost < best[0]:
            best = (cost, chosen)
    assert best is not None  # budget >= lo: the smallest options fit
    return {n: best[1][n] for n in candidates}


def _greedy(candidates: dict[str, list[Option]], budget: int) -> dict[str, Option]:
    """The greedy on the hulls, then the leftover fill (budget >= the smallest choice)."""
    hulls = {name: hull(opts) for name, opts in candidates.items()}
    # start at the smallest option (the hull's first point is the smallest size)
    pick = {name: 0 for name in hulls}
    used = sum(h[0].nbytes for h in hulls.values())
    heap: list[tuple[float, str]] = []

    def push(name: str) -> None:
        h, i = hulls[name], pick[name]
        if i + 1 < len(h):
            gain = (h[i].cost - h[i + 1].cost) / max(1, h[i + 1].nbytes - h[i].nbytes)
            heapq.heappush(heap, (-gain, name))

    for name in hulls:
        push(name)
    skipped: list[str] = []
    while heap:
        _, name = heapq.heappop(heap)
        h, i = hulls[name], pick[name]
        extra = h[i + 1].nbytes - h[i].nbytes
        if used + extra > budget:
            skipped.append(name)  # does not fit now; nothing later frees bytes
            continue
        pick[name] = i + 1
        used += extra
        push(name)
    # leftover bytes: any single upgrade that fits, biggest cost decrease first
    chosen = {name: hulls[name][pick[name]] for name in hulls}
    improved = True
    while improved:
        improved = False
        best = None
        for name, opts in candidates.items():
            cur = chosen[name]
            for o in opts:
                extra = o.nbytes - cur.nbytes
                if 0 < extra <= budget - used and o.cost < cur.cost:
                    gain = cur.cost - o.cost
                    if best is None or gain > best[0]:
                        best = (gain, name, o)
        if best is not None:
            _, name, o = best
            used += o.nbytes - chosen[name].nbytes
            chosen[name] = o
            improved = True
    return chosen
