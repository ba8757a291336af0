"""`quantkit compare`'s page for mixture-of-experts artifacts: the tokens-per-expert heatmap."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from moe_models import (
    STARVED,
    _quantize,
)
from tiny_models import make_tiny_model


def _page(artifact: Path) -> str:
    """The compare page for one artifact, its record without metrics (the page draws the
    stats beside the artifact; no eval needed)."""
    from quantkit.eval.harness import _record
    from quantkit.eval.logits import PPLConvention
    from quantkit.report import summarize
    from quantkit.report.html import render_html

    text = {"name": "none", "sha256": ""}
    record = _record(artifact, None, {}, PPLConvention().describe(None, text, 0, False), text, "")
    return render_html(summarize([record], command="test"))


def test_report_heatmap_of_tokens_per_expert(starved_model, tmp_path):
    """`quantkit compare`'s page draws one cell per (MoE layer, expert) with the tokens from
    quantkit_stats.json, the experts under the warning threshold outlined and the RTN
    fallbacks crossed; a calibrated dense artifact's page has no such map."""
    import re

    with pytest.warns(RuntimeWarning, match="fall back to RTN"):
        moe = _quantize(starved_model, tmp_path / "moe", "gptq")
    stats = json.loads((moe / "quantkit_stats.json").read_text())
    want = {}
    for name, v in stats["layers"].items():
        if ".mlp.experts." in name:
            key = (v["block"], v["expert"])
            assert name.startswith(f"model.layers.{key[0]}.mlp.experts.{key[1]}.")
            want[key] = min(want.get(key, v["tokens"]), v["tokens"])
    html = _page(moe)
    svg = re.search(r'<svg class="plot expert-heatmap".*?</svg>', html, re.S).group(0)
    cells = re.findall(r'<rect class="expert( under)?( rtn)?" data-layer="(\d+)" data-expert="(\d+)" '
                       r'data-tokens="(\d+)"', svg)
    got = {(int(b), int(e)): (int(t), bool(u), bool(r)) for u, r, b, e, t in cells}
    assert len(cells) == len(got) == 2 * 8
    assert {k: v[0] for k, v in got.items()} == want
    floor = stats["experts"]["min_tokens"]
    assert {k for k, v in got.items() if v[1]} == {k for k, t in want.items() if t < floor}
    assert {k for k, v in got.items() if v[2]} == {k for k, t in want.items() if t == 0} >= \
        {(b, e) for b in (0, 1) for e in STARVED}
    assert svg.count('class="rtnmark"') == sum(v[2] for v in got.values())
    assert "http" not in svg and 'id="experts"' in html

    dense_model = make_tiny_model(tmp_path / "dense_src", "llama", hidden=128, intermediate=256)
    dense = _quantize(dense_model, tmp_path / "dense", "gptq")
    assert all("tokens" in v for v in json.loads((dense / "quantkit_stats.json").read_text())["layers"].values())
    page = _page(dense)
    assert 'class="plot heatmap"' in page and "expert-heatmap" not in page and 'id="experts"' not in page
