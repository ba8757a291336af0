"""The markdown twin of the report, for a PR description or a terminal."""

from __future__ import annotations

import html

from quantkit.report.rows import bits_note
from quantkit.report.table import cells, omitted

__all__ = ["render_markdown", "md_escape"]


def md_escape(text: str) -> str:
    """Table-cell safe: no raw HTML, no column breaks, no line breaks, no emphasis."""
    t = html.escape(str(text), quote=False).replace("|", "\\|").replace("\n", " ")
    for ch in ("*", "_", "`", "[", "]"):
        t = t.replace(ch, "\\" + ch)
    return t


def render_markdown(summary: dict) -> str:
    cols, table = cells(summary)
    lines = [f"# {md_escape(summary['title'])}", ""]
    base = summary.get("base")
    if base:
        lines += [f"Base model (reference row): {md_escape(base['label'])}", ""]
    if summary["warnings"]:
        lines += ["## Warnings", ""] + [f"- {md_escape(w)}" for w in summary["warnings"]] + [""]
    lines += ["## Summary", "",
              "| " + " | ".join(md_escape(c.label) for c in cols) + " |",
              "|" + "|".join("---:" if c.numeric else "---" for c in cols) + "|"]
    for r, line in zip(summary["rows"], table, strict=True):
        out = []
        for cell in line:
            t = md_escape(cell["text"])
            out.append(f"**{t}** ★" if cell["best"] else (f"_{t}_" if cell["missing"] else t))
        if r["role"] == "base":
            out[0] += " (base)"
        if len(summary["conventions"]) > 1 and r.get("convention"):
            out[0] += f" [{r['convention']}]"
        lines.append("| " + " | ".join(out) + " |")
    lines += ["", "★ best quantized row per column; _not measured_ means the results hold no such "
              "metric (never 0)."]
    if omitted(summary["rows"]):
        lines += ["", "Not measured for any row: " + ", ".join(omitted(summary["rows"])) + "."]
    why = [f"- {md_escape(r['label'])}: no speed or memory ({md_escape(r['speed_unmeasured'])})"
           for r in summary["rows"] if r.get("speed_unmeasured")]
    lines += [""] + why if why else []
    for r in summary["rows"]:
        if not r.get("tensor_types"):
            continue
        note = bits_note(r)
        lines += ["", f"Tensor types of {md_escape(r['label'])}" + (f" ({note})" if note else "") + ":",
                  "", "| type | tensors | weights | bytes | bits/weight | share |", "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {t['type']} | {t['tensors']} | {t['params']:,} | {t['bytes']:,} | "
                  f"{t['bits_per_weight']:.3f} | {100 * t['share']:.1f} % |" for t in r["tensor_types"]]
    lines += ["", "## Eval conventions", ""]
    for c in summary["conventions"]:
        v = c["convention"]
        lines.append(f"- {c['id']}: {md_escape(v.get('corpus'))} ({md_escape(v.get('split'))}), "
                     f"{v.get('windows')} x {v.get('ctx')} tokens, no overlap, {md_escape(v.get('bos'))}, "
                     f"{v.get('scored_tokens')} scored tokens; KLD = {md_escape(v.get('kld', 'n/a'))}")
    rep = summary["reproduction"]
    lines += ["", "## Reproduction", ""]
    for c in rep["commands"]:
        lines += [f"{md_escape(c['step'])} ({md_escape(c['row'])}):", "", "```",
                  c["command"].replace("```", "'''"), "```", ""]
    lines += ["Versions: " + "; ".join(f"{md_escape(k)} {md_escape(v)}" for k, v in rep["versions"].items()), ""]
    for c in rep["calibration"]:
        cal = c["calibration"]
        text = ", ".join(f"{k}={v}" for k, v in cal.items()) if cal else "none (no calibration data)"
        lines.append(f"- calibration of {md_escape(c['row'])}: {md_escape(text)}")
    return "\n".join(lines) + "\n"
