"""The self-contained HTML page: one file, inline CSS/JS/SVG, no network.

Jinja's autoescape is on for everything the user controls (model names, paths, commands,
dataset text). A Content-Security-Policy allows no network at all and only the page's own
script (by hash), so even a string that escaped escaping could not run or fetch anything.
"""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path

import jinja2

from quantkit.report import plots
from quantkit.report.rows import bits_note
from quantkit.report.table import NOT_MEASURED, cells, omitted

__all__ = ["render_html", "SORT_JS"]

# Sorts the quantized rows by a column (the base row stays on top as the reference);
# "not measured" sorts last either way. `#sort=KEY,asc|desc` in the URL pre-sorts.
SORT_JS = """(function () {
  var table = document.getElementById("summary");
  if (!table) { return; }
  var body = table.tBodies[table.tBodies.length - 1];
  var ths = table.tHead.rows[0].cells;
  function key(td) {
    var s = td.getAttribute("data-sort");
    if (s === null || s === "") { return null; }
    var n = Number(s);
    return isNaN(n) ? s.toLowerCase() : n;
  }
  function sortBy(idx, dir) {
    var rows = Array.prototype.slice.call(body.rows);
    rows.sort(function (a, b) {
      var x = key(a.cells[idx]), y = key(b.cells[idx]);
      if (x === null && y === null) { return 0; }
      if (x === null) { return 1; }
      if (y === null) { return -1; }
      var c = (typeof x === "number" && typeof y === "number") ? x - y : String(x).localeCompare(String(y));
      return dir === "asc" ? c : -c;
    });
    rows.forEach(function (r) { body.appendChild(r); });
    for (var i = 0; i < ths.length; i++) {
      ths[i].setAttribute("aria-sort", i === idx ? (dir === "asc" ? "ascending" : "descending") : "none");
    }
  }
  Array.prototype.forEach.call(ths, function (th, i) {
    var b = th.querySelector("button");
    if (!b) { return; }
    b.addEventListener("click", function () {
      var cur = th.getAttribute("aria-sort");
      sortBy(i, cur === "ascending" ? "desc" : (cur === "descending" ? "asc" : th.getAttribute("data-first")));
    });
  });
  var h = decodeURIComponent(location.hash.slice(1)).split("sort=")[1];
  if (h) {
    var parts = h.split(",");
    Array.prototype.forEach.call(ths, function (th, i) {
      if (th.getAttribute("data-key") === parts[0]) { sortBy(i, parts[1] || th.getAttribute("data-first")); }
    });
  }
  table.setAttribute("data-sortable", "ready");
})();"""

_TEMPLATES = Path(__file__).parent / "templates"


def _env() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(_TEMPLATES)), autoescape=True,
                              undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)


def _mib(n: float | None) -> float | None:
    return n / 2**20 if n is not None else None


def _why(r: dict) -> str:
    """What the tensor types of a row with a bits note are: 'types: q5_0 62 %, q8_0 21 %'."""
    types = r.get("tensor_types") or []
    return ("types: " + ", ".join(f"{t['type']} {100 * t['share']:.0f} %" for t in types[:4])
            + " of the weights") if types else ""


def _plots(summary: dict) -> dict:
    rows = summary["rows"]
    base = summary.get("base")
    quant = [r for r in rows if r["role"] != "base"]
    kld = plots.scatter(
        [{"label": r["label"], "x": _mib(r.get("size_bytes")), "role": r["role"],
          "y": (r.get("kld") or {}).get("mean"), "err": (r.get("kld") or {}).get("stderr"),
          "tip": f"{r['label']}: KLD {(r.get('kld') or {}).get('mean') or 0:.3g}",
          "note": bits_note(r), "why": _why(r)}
         for r in quant if (r.get("kld") or {}).get("mean", 0) > 0],
        xlabel="size on disk (MiB)", ylabel="KLD vs base (mean)",
        ref_x=_mib(base.get("size_bytes")) if base else None,
        ref_label=f"base {base['label']}" if base else "")
    ppl = plots.scatter(
        [{"label": r["label"], "x": _mib(r.get("size_bytes")), "role": r["role"],
          "y": (r.get("ppl") or {}).get("value"), "err": (r.get("ppl") or {}).get("stderr"),
          "tip": f"{r['label']}: PPL {(r.get('ppl') or {}).get('value') or 0:.4g}",
          "note": bits_note(r), "why": _why(r)}
         for r in rows if r.get("ppl")],
        xlabel="size on disk (MiB)", ylabel="perplexity",
        ref_y=(base.get("ppl") or {}).get("value") if base else None,
        ref_label=f"base {base['label']}" if base else "")
    speed = [b for b in (plots.bars(rows, "prefill_tps", "prefill tokens/s"),
                         plots.bars(rows, "decode_tps", "decode tokens/s")) if b]
    return {"kld": kld, "ppl": ppl, "speed": speed, "heat": plots.heatmaps(quant),
            "experts": plots.expert_heatmaps(quant)}


def render_html(summary: dict) -> str:
    """The report page for a compare summary (see compare.summarize)."""
    cols, table = cells(summary)
    digest = base64.b64encode(hashlib.sha256(SORT_JS.encode()).digest()).decode()
    csp = (f"default-src 'none'; script-src 'sha256-{digest}'; style-src 'unsafe-inline'; "
           "img-src data:; connect-src 'none'; form-action 'none'; base-uri 'none'")
    return _env().get_template("report.html.j2").render(
        s=summary, cols=cols, table=table, plots=_plots(summary), js=SORT_JS, csp=csp,
        omitted=omitted(summary["rows"]), NOT_MEASURED=NOT_MEASURED, zip=zip)
