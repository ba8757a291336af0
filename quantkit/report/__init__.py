"""`quantkit compare`: one summary of several artifacts, as a page, markdown, JSON and a table.

compare.collect() gathers (and, where missing, runs) eval records into a summary dict;
html.render_html(), markdown.render_markdown() and the JSON twin are all drawn from it.
"""

from __future__ import annotations

import json
from pathlib import Path

from quantkit.report.compare import SUMMARY_SCHEMA, collect, read_records, summarize

__all__ = ["collect", "summarize", "read_records", "write_report", "SUMMARY_SCHEMA"]


def write_report(summary: dict, html_path: str | Path) -> dict[str, Path]:
    """FILE.html plus its twins FILE.md and FILE.json (the summary the page was drawn from)."""
    from quantkit.report.html import render_html
    from quantkit.report.markdown import render_markdown

    html_path = Path(html_path)
    html_path.parent.mkdir(parents=True, exist_ok=True)
    paths = {"html": html_path, "md": html_path.with_suffix(".md"),
             "json": html_path.with_suffix(".json")}
    if html_path.suffix.lower() in (".md", ".json"):
        paths["html"] = html_path.with_suffix(html_path.suffix + ".html")
    paths["html"].write_text(render_html(summary), encoding="utf-8")
    paths["md"].write_text(render_markdown(summary), encoding="utf-8")
    paths["json"].write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return paths
