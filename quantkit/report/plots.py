"""Plot geometry for the page's inline SVG: numbers and labels only, no markup.

The template draws these (so every label goes through jinja's autoescape); nothing here
touches the network or a plotting library.
"""

from __future__ import annotations

import math
import re

__all__ = ["pareto", "scatter", "bars", "heatmaps", "expert_heatmaps", "color"]

W, H = 480, 300  # scaled to the figure's width: ~1.2x on a wide screen, ~0.8x at 420 px
ML, MR, MT, MB = 62, 14, 14, 46  # margins: room for tick labels and axis titles
_CHAR_W, _LINE_H = 6.9, 13  # a 12 px label's average glyph width and height, for placement


def pareto(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both x and y (lower is better on both)."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front, best_y = [], math.inf
    for i in order:
        if points[i][1] < best_y:
            front.append(i)
            best_y = points[i][1]
    return front


def _nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [round(first + k * step, 12) for k in range(int((hi - first) / step + 1e-9) + 1)]


def _fmt_tick(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1000 or abs(v) < 0.01:
        return f"{v:.0e}".replace("e-0", "e-").replace("e+0", "e")
    return f"{v:g}"


class _Axis:
    def __init__(self, lo: float, hi: float, a: float, b: float, log: bool):
        self.log, self.a, self.b = log, a, b
        if log:
            self.lo, self.hi = math.log10(lo), math.log10(hi)
            if self.hi - self.lo < 1e-9:
                self.lo, self.hi = self.lo - 0.5, self.hi + 0.5
        else:
            pad = (hi - lo) * 0.08 or abs(hi) * 0.1 or 1.0
            self.lo, self.hi = lo - pad, hi + pad

    def __call__(self, v: float) -> float:
        t = ((math.log10(v) if self.log else v) - self.lo) / (self.hi - self.lo)
        return round(self.a + t * (self.b - self.a), 2)

    def ticks(self) -> list[dict]:
        if self.log:
            vals = [10.0 ** k for k in range(math.ceil(self.lo - 1e-9), math.floor(self.hi + 1e-9) + 1)]
            if len(vals) < 2:
                vals = [10 ** self.lo, 10 ** ((self.lo + self.hi) / 2), 10 ** self.hi]
        else:
            vals = _nice_ticks(self.lo, self.hi)
        return [{"pos": self(v), "label": _fmt_tick(v)} for v in vals]


def scatter(points: list[dict], *, xlabel: str, ylabel: str, ref_x: float | None = None,
            ref_y: float | None = None, ref_label: str = "") -> dict | None:
    """Size-vs-quality chart: points {label, x, y, err, role, note, why}, Pareto front, base
    lines. A point with a `note` (its effective bits differ from its label) is ringed and
    starred, and the note (with `why`) goes in the chart's legend."""
    pts = [p for p in points if p.get("x") is not None and p.get("y") is not None]
    if not pts:
        return None
    xs = [p["x"] for p in pts] + ([ref_x] if ref_x is not None else [])
    ys = [p["y"] for p in pts] + ([ref_y] if ref_y is not None else [])
    y_lo = min([p["y"] - (p.get("err") or 0) for p in pts] + ys)
    y_hi = max([p["y"] + (p.get("err") or 0) for p in pts] + ys)
    log_y = min(ys) > 0 and max(ys) / min(ys) > 20
    if log_y:
        y_lo, y_hi = min(ys) / 2, max(ys) * 2
    xa = _Axis(0, max(xs), ML, W - MR, False)
    ya = _Axis(y_lo, y_hi, H - MB, MT, log_y)
    front = set(pareto([(p["x"], p["y"]) for p in pts]))
    out_pts = []
    for i, p in enumerate(pts):
        e = p.get("err") or 0
        lo = p["y"] - e if not log_y or p["y"] - e > 0 else p["y"]
        note = p.get("note")
        out_pts.append({"label": p["label"] + (" *" if note else ""), "cx": xa(p["x"]), "cy": ya(p["y"]),
                        "role": p.get("role"), "ey0": ya(lo), "ey1": ya(p["y"] + e), "front": i in front,
                        "tip": p.get("tip", "") + (f" ({note})" if note else ""), "note": note})
    _place_labels(out_pts, ML, W - MR, MT, H - MB)
    fp = sorted((q for q in out_pts if q["front"]), key=lambda q: q["cx"])
    path = ""
    for k, q in enumerate(fp):  # staircase: what you can get at each size
        path += f"M{q['cx']},{q['cy']}" if k == 0 else f"H{q['cx']}V{q['cy']}"
    return {
        "w": W, "h": H, "x0": ML, "x1": W - MR, "y0": H - MB, "y1": MT,
        "xticks": xa.ticks(), "yticks": [t for t in ya.ticks() if MT - 1 <= t["pos"] <= H - MB + 1],
        "xticks_in": None, "xlabel": xlabel, "ylabel": ylabel + (" (log scale)" if log_y else ""),
        "points": out_pts, "front": path,
        "ref_x": xa(ref_x) if ref_x is not None else None,
        "ref_y": ya(ref_y) if ref_y is not None else None, "ref_label": ref_label,
        "notes": [{"label": p["label"], "note": p["note"], "why": p.get("why", "")}
                  for p in pts if p.get("note")],
    }


def _place_labels(pts: list[dict], x0: float, x1: float, y0: float, y1: float) -> None:
    """Put each point's label beside it where it overlaps no other label or point."""
    placed: list[tuple[float, ...]] = []

    def hits(b: tuple, others: list) -> int:
        return sum(b[0] < o[2] and o[0] < b[2] and b[1] < o[3] and o[1] < b[3] for o in others)

    for p in sorted(pts, key=lambda q: q["cx"]):
        dots = [(q["cx"] - 6, q["cy"] - 6, q["cx"] + 6, q["cy"] + 6) for q in pts if q is not p]
        w = _CHAR_W * len(p["label"])
        best = None
        for dx, dy, anchor in ((9, -8, "start"), (9, 16, "start"), (-9, -8, "end"),
                               (-9, 16, "end"), (0, -12, "middle"), (0, 22, "middle")):
            x = p["cx"] + dx
            left = x if anchor == "start" else x - w if anchor == "end" else x - w / 2
            box = (left, p["cy"] + dy - 11, left + w, p["cy"] + dy + 2)
            outside = box[0] < x0 or box[2] > x1 + 8 or box[1] < y0 - 10 or box[3] > y1
            score = 10 * outside + hits(box, placed) + hits(box, dots)
            if best is None or score < best[0]:
                best = (score, x, p["cy"] + dy, anchor, box)
            if score == 0:
                break
        _, p["lx"], p["ly"], p["anchor"], box = best
        placed.append(box)


def bars(rows: list[dict], key: str, label: str) -> dict | None:
    """Horizontal bars of one speed metric, one bar per row that measured it."""
    items = [(r["label"], (r.get("speed") or {}).get(key), r["role"]) for r in rows]
    items = [(lbl, est, role) for lbl, est, role in items if est]
    if not items:
        return None
    top = max(e["value"] + (e.get("spread") or 0) for _, e, _ in items) or 1.0
    lane, left, right = 30, 170, 70
    h = MT + lane * len(items) + 30
    scale = (W - left - right) / top
    out = []
    for k, (lbl, e, role) in enumerate(items):
        y = MT + k * lane
        sp = e.get("spread") or 0
        out.append({"label": lbl, "y": y, "w": round(e["value"] * scale, 2), "role": role,
                    "value": f"{e['value']:.1f}", "e0": round(left + max(e["value"] - sp, 0) * scale, 2),
                    "e1": round(left + (e["value"] + sp) * scale, 2), "spread": sp > 0})
    return {"w": W, "h": h, "left": left, "bars": out, "label": label, "lane": lane,
            "axis_y": MT + lane * len(items) + 4}


_STOPS = [(0.0, (247, 251, 255)), (0.25, (198, 219, 239)), (0.5, (107, 174, 214)),
          (0.75, (33, 113, 181)), (1.0, (8, 48, 107))]


def color(t: float) -> str:
    """A light-to-dark blue ramp (readable in print and for red-green colour blindness)."""
    t = min(max(t, 0.0), 1.0)
    for (t0, c0), (t1, c1) in zip(_STOPS, _STOPS[1:], strict=False):
        if t <= t1:
            f = (t - t0) / (t1 - t0) if t1 > t0 else 0
            return "#" + "".join(f"{round(a + f * (b - a)):02x}" for a, b in zip(c0, c1, strict=True))
    return "#08306b"


_BLOCK = re.compile(r"^(?P<prefix>.*?)\.(?P<idx>\d+)\.(?P<role>.+)$")


def heatmaps(rows: list[dict]) -> dict | None:
    """Per-artifact grids of relative reconstruction error: Linear role (y) x block (x).

    Each grid has its own colour scale (light = that artifact's smallest error, dark = its
    largest) so its worst layers stand out; the captions give the ranges, and the table's KLD
    compares artifacts. Names outside numbered blocks are listed, not drawn.
    """
    grids = []
    for r in rows:
        cells, roles, blocks, other = {}, [], set(), []
        for name, err in (r.get("layers") or {}).items():
            m = _BLOCK.match(name)
            if not m:
                other.append(name)
                continue
            role, idx = m["role"], int(m["idx"])
            if role not in roles:
                roles.append(role)
            blocks.add(idx)
            cells[(role, idx)] = (name, err)
        if not cells:
            continue
        lo = min(v[1] for v in cells.values())
        hi = max(v[1] for v in cells.values())
        short = [role.rsplit(".", 1)[-1] for role in roles]
        names = short if len(set(short)) == len(short) else roles
        n_blocks = max(blocks) + 1
        left, top, cell_h = 84, 6, 16
        cell_w = max(6, min(24, 360 // n_blocks))
        out = []
        for y, role in enumerate(roles):
            for b in range(n_blocks):
                if (role, b) in cells:
                    name, err = cells[(role, b)]
                    t = (err - lo) / (hi - lo) if hi > lo else 0.5
                    out.append({"x": left + b * cell_w, "y": top + y * cell_h, "fill": color(t),
                                "tip": f"{name}: {err:.4g}"})
        step = 1 if n_blocks <= 12 else 5
        worst = max(cells.values(), key=lambda v: v[1])
        grids.append({
            "label": r["label"], "cells": out, "cw": cell_w, "ch": cell_h, "left": left,
            "roles": [{"y": top + i * cell_h + cell_h / 2, "name": n} for i, n in enumerate(names)],
            "blocks": [{"x": left + b * cell_w + cell_w / 2, "n": b} for b in range(0, n_blocks, step)],
            "w": left + n_blocks * cell_w + 8, "h": top + len(roles) * cell_h + 32, "other": other,
            "worst": worst, "lo": lo, "hi": hi,
            "mean": sum(v[1] for v in cells.values()) / len(cells),
        })
    return {"grids": grids, "ramp": _ramp()} if grids else None


def _ramp() -> list[dict]:
    """The colour ramp's stops, for the legend's gradient."""
    return [{"offset": f"{100 * t:.0f}%", "color": color(t)} for t in (0, .25, .5, .75, 1)]


def expert_heatmaps(rows: list[dict]) -> dict | None:
    """Per MoE artifact, calibration tokens per expert: MoE layer (y) x expert (x).

    Colour is log(1 + tokens) on the artifact's own scale (a starved expert stays visible
    beside busy ones); experts under the artifact's warning threshold get an outline, experts
    that fell back to RTN (no token at all) a cross. Rows without expert statistics are left
    out (dense models, RTN).
    """
    grids = []
    for r in rows:
        et = r.get("expert_tokens")
        if not et or not et.get("experts"):
            continue
        cells, floor = et["experts"], et.get("min_tokens") or 0
        layers = sorted({c["block"] for c in cells})
        n_experts = max(c["expert"] for c in cells) + 1
        left, top = 40, 6
        cw = max(3, min(24, 720 // n_experts))
        ch = max(4, min(16, 480 // len(layers)))
        top_log = math.log1p(max(c["tokens"] for c in cells)) or 1.0
        out = []
        for c in cells:
            under, rtn = c["tokens"] < floor, bool(c["fallback_rtn"])
            tip = f"layer {c['block']}, expert {c['expert']}: {c['tokens']} tokens"
            tip += f" (under {floor})" if under else ""
            tip += "; fell back to RTN" if rtn else ""
            out.append({"x": left + c["expert"] * cw, "y": top + layers.index(c["block"]) * ch,
                        "fill": color(math.log1p(c["tokens"]) / top_log), "tip": tip,
                        "block": c["block"], "expert": c["expert"], "tokens": c["tokens"],
                        "under": under, "rtn": rtn})
        ystep, xstep = -(-12 // ch), -(-24 // cw)  # labels 12 px tall, up to 24 px wide
        tokens = sorted(c["tokens"] for c in cells)
        grids.append({
            "label": r["label"], "cells": out, "cw": cw, "ch": ch, "left": left, "floor": floor,
            "layers": [{"y": top + i * ch + ch / 2, "n": b} for i, b in enumerate(layers)][::ystep],
            "experts": [{"x": left + e * cw + cw / 2, "n": e} for e in range(0, n_experts, xstep)],
            "w": left + n_experts * cw + 8, "h": top + len(layers) * ch + 32,
            "n_layers": len(layers), "n_experts": n_experts,
            "lo": tokens[0], "hi": tokens[-1], "median": tokens[len(tokens) // 2],
            "under": sum(c["under"] for c in out), "rtn": [c for c in out if c["rtn"]],
        })
    return {"grids": grids, "ramp": _ramp()} if grids else None
