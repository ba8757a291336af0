"""The summary table as text cells, shared by the HTML page, the markdown and the terminal.

A cell that has no measurement says NOT_MEASURED (and sorts last), or for speed and memory
the engine's reason where it could not run the artifact here; the base row says
"reference" where a metric is defined against itself (KLD, top-1, PPL change). The best value
per column is marked among the quantized rows only: the base is the yardstick, not a contender.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from quantkit.eval.speed import ENGINE_NAMES

__all__ = ["NOT_MEASURED", "SPEED_KEYS", "Column", "columns", "cells", "omitted", "fmt_bytes"]

NOT_MEASURED = "not measured"
REFERENCE = "reference"


@dataclass(frozen=True)
class Column:
    key: str
    label: str
    better: str | None  # "lower", "higher" or None (not ranked)
    get: Callable[[dict], tuple[str | None, float | None]]  # row -> (text, sort value)
    title: str = ""
    numeric: bool = True
    relative: bool = False  # defined against the base: the base row shows "reference"
    tip: Callable[[dict], str] | None = None  # hover text with detail the cell leaves out


def fmt_bytes(n: float | None) -> str | None:
    if n is None:
        return None
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _g(v: float, digits: int = 4) -> str:
    if v != 0 and abs(v) < 10 ** -(digits - 1):
        return f"{v:.2e}"
    return f"{v:.{digits}f}"


def _sig(v: float, n: int = 3) -> str:
    """n significant digits without an exponent down to 1e-6 (KLD spans 1e-5 .. 1)."""
    if v == 0 or not math.isfinite(v):
        return f"{v:g}"
    digits = max(n - 1 - math.floor(math.log10(abs(v))), 0)
    return f"{v:.{n - 1}e}" if digits > 7 else f"{v:.{digits}f}"


def _pm(est: dict | None, digits: int = 3, scale: float = 1.0, unit: str = "") -> tuple:
    if not est or est.get("value") is None:
        return None, None
    v = est["value"] * scale
    text = _g(v, digits)
    se = est.get("stderr", est.get("spread"))
    if se is not None:
        text += f" ± {_g(se * scale, digits)}"
    return text + unit, v


def _text(key: str) -> Callable[[dict], tuple]:
    return lambda r: (str(r[key]) if r.get(key) else None, None)


def _method(r: dict) -> tuple:
    m = r.get("method") or ""
    s = r.get("scheme_text") or ""
    return (f"{m} {s}".strip() or None), None


def _verified(r: dict) -> tuple:
    """'vllm: verified' / 'vllm: WRONG (coverage): TENSOR: ...' from the row's engine_check."""
    c = r.get("engine_check")
    if not c:
        return None, None
    if c.get("ok"):
        return f"{c.get('engine')}: verified", None
    return f"{c.get('engine')}: {c.get('message') or c.get('verdict') or 'failed'}", None


def _engine(r: dict) -> tuple:
    """The engine that scored accuracy, and the one that measured speed where that differs
    (e.g. quantkit-torch for PPL/KLD, vLLM for tokens/s): one name would hide which is which."""
    name = (r.get("engine") or {}).get("name") or None
    speed = r.get("speed_engine") if r.get("speed") else None
    if speed:  # e.g. 'vLLM (float32)'
        dtype = r.get("speed_dtype")
        speed = ENGINE_NAMES.get(speed, speed) + (f" ({dtype})" if dtype else "")
    if speed and name and speed.lower() != name.lower():
        return f"{name}; speed: {speed}", None
    return name or speed, None


def _engine_tip(r: dict) -> str:
    e = r.get("engine") or {}
    return ", ".join(f"{k} {e[k]}" for k in ("version", "dtype", "device") if e.get(k))


def _kld_tip(r: dict) -> str:
    k = r.get("kld") or {}
    return ", ".join(f"{n} {_sig(k[n])}" for n in ("median", "p99", "max") if k.get(n) is not None)


def _path_tip(r: dict) -> str:
    return str(r.get("path") or "")


def _kld(r: dict) -> tuple:
    k = r.get("kld")
    if not k or k.get("mean") is None:
        return None, None
    text = _sig(k["mean"]) + (f" ± {_sig(k['stderr'], 2)}" if k.get("stderr") is not None else "")
    return text, k["mean"]


def _bpw_tip(r: dict) -> str:
    """The other bits-per-weight views: with embeddings/output, nominal, GGUF tensor types."""
    parts = []
    if r.get("bits_per_weight_with_embeddings") is not None:
        parts.append(f"{r['bits_per_weight_with_embeddings']:.3f} with embeddings and output")
    if r.get("nominal_bits_per_weight"):
        parts.append(f"{r['nominal_bits_per_weight']:.3f} nominal for the scheme")
    if r.get("tensor_types"):
        parts.append("types: " + ", ".join(f"{t['type']} {100 * t['share']:.0f} %"
                                           for t in r["tensor_types"][:4]))
    return "; ".join(parts)


# speed and memory columns: where the engine could not run an artifact, the cell names why
SPEED_KEYS = ("prefill", "decode", "mem")


def columns(rows: list[dict]) -> list[Column]:
    """Identity and quality first (what fits a phone), then one column per lm-eval task and
    flips task present in any row, speed and memory when measured, then format and engine."""
    cols = [
        Column("label", "artifact", None, _text("label"), numeric=False, tip=_path_tip),
        Column("method", "method", None, _method, "method and scheme", numeric=False),
        Column("size", "size", "lower", lambda r: (fmt_bytes(r.get("size_bytes")), r.get("size_bytes")),
               "size on disk"),
        Column("bpw", "bits/weight", "lower",
               lambda r: (f"{r['bits_per_weight']:.3f}", r["bits_per_weight"])
               if r.get("bits_per_weight") is not None else (None, None),
               "bits on disk per weight of the quantized Linears (scales and zeros included; "
               "embeddings and output head excluded: hover a cell for the count with them); "
               "base: whole model", tip=_bpw_tip),
        Column("ppl", "PPL", "lower", lambda r: _pm(r.get("ppl"), 3), "perplexity ± stderr"),
        Column("dppl", "ΔPPL", "lower",
               lambda r: (f"{r['delta_ppl_pct']:+.2f} %", r["delta_ppl_pct"])
               if r.get("delta_ppl_pct") is not None else (None, None),
               "PPL change vs the base, same windows", relative=True),
        Column("kld", "KLD", "lower", _kld, "mean KL(p_base || p_quant) per token ± stderr",
               relative=True, tip=_kld_tip),
        Column("top1", "top-1", "higher", lambda r: _pm(r.get("top1"), 2, 100, " %"),
               "same top token as the base ± stderr", relative=True),
    ]
    tasks = sorted({t for r in rows for t in r.get("tasks") or {}})
    for t in tasks:
        metric = next(r["tasks"][t]["metric"] for r in rows if t in (r.get("tasks") or {}))
        higher = next(r["tasks"][t]["higher_is_better"] for r in rows if t in (r.get("tasks") or {}))
        cols.append(Column(f"task:{t}", f"{t} {metric}", "higher" if higher else "lower",
                           lambda r, t=t: _pm((r.get("tasks") or {}).get(t), 3),
                           f"lm-eval {t}: {metric} ± stderr"))
    flips = sorted({t for r in rows for t in r.get("flips") or {}})
    for t in flips:
        cols.append(Column(f"flips:{t}", f"{t} flips", "lower",
                           lambda r, t=t: _pm((r.get("flips") or {}).get(t), 2, 100, " %"),
                           f"share of {t} answers that changed correct<->incorrect vs the base",
                           relative=True))
    optional = [
        Column("prefill", "prefill tok/s", "higher",
               lambda r: _pm((r.get("speed") or {}).get("prefill_tps"), 1), "median ± spread"),
        Column("decode", "decode tok/s", "higher",
               lambda r: _pm((r.get("speed") or {}).get("decode_tps"), 1), "median ± spread"),
        Column("mem", "peak memory", "lower",
               lambda r: (fmt_bytes(r.get("peak_memory_bytes")), r.get("peak_memory_bytes")),
               "peak resident memory while loading and running"),
    ]
    cols += [c for c in optional
             if any(c.get(r)[0] is not None or r.get("speed_unmeasured") for r in rows)]
    if any(r.get("engine_check") for r in rows):
        cols.append(Column("verified", "verified", None, _verified,
                           "`quantkit verify` in the engine that serves it (quantize --verify)",
                           numeric=False))
    cols += [Column("format", "format", None, _text("format"), numeric=False),
             Column("engine", "engine", None, _engine, "where accuracy (and, if different, speed) was measured",
                    numeric=False, tip=_engine_tip)]
    return cols


def omitted(rows: list[dict]) -> list[str]:
    """Optional columns left out because no row measured them (said so under the table)."""
    shown = {c.key for c in columns(rows)}
    return [label for key, label in (("prefill", "prefill tok/s"), ("decode", "decode tok/s"),
                                     ("mem", "peak memory")) if key not in shown]


def cells(summary: dict) -> tuple[list[Column], list[list[dict]]]:
    """Columns and, per row, cells {text, sort, best, missing, reference, title}; `main` and
    `err` split "value ± stderr" so the page can stack the two."""
    rows = summary["rows"]
    cols = columns(rows)
    out = []
    for r in rows:
        line = []
        for c in cols:
            text, sort = c.get(r)
            ref = r["role"] == "base" and c.relative and text is None
            why = r.get("speed_unmeasured") if c.key in SPEED_KEYS and text is None else None
            main, _, err = (text or "").partition(" ± ")
            if err.endswith(" %"):  # "68.82 ± 2.05 %" -> "68.82 %" over "± 2.05"
                main, err = main + " %", err[:-2]
            line.append({"text": REFERENCE if ref else (text if text is not None else why or NOT_MEASURED),
                         "main": main, "err": err,
                         "sort": sort if sort is not None else (text if not c.numeric else None),
                         "missing": text is None and not ref, "why": why is not None,
                         "reference": ref, "best": False,
                         "title": c.tip(r) if c.tip and text is not None else None})
        out.append(line)
    for j, c in enumerate(cols):
        vals = [(line[j]["sort"], i) for i, line in enumerate(out)
                if rows[i]["role"] != "base" and isinstance(line[j]["sort"], (int, float))]
        if c.better is None or len(vals) < 2:
            continue
        best = min(v for v, _ in vals) if c.better == "lower" else max(v for v, _ in vals)
        for v, i in vals:
            if v == best:
                out[i][j]["best"] = True
    return cols, out
