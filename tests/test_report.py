"""`quantkit compare` and its HTML report, rendered from real results and checked in a real
headless Chromium: rows and plots in the DOM after the page's script ran, no network request
(Chromium's own net log), screenshots at 1280x800 and 420x900, escaping of hostile names.

QUANTKIT_SAVE_SCREENSHOTS=1 also copies the screenshots to reports/demo-1280.png / demo-420.png.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from quantkit.cli import main
from quantkit.report import summarize, write_report
from quantkit.report.plots import pareto

REPO = Path(__file__).resolve().parents[1]
EVIL = "<script>alert(1)</script>"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--virtual-time-budget=5000"]


def chromium(url: str, *extra: str, netlog: Path | None = None) -> str:
    """Run headless Chromium on `url` with a fresh profile; returns stdout (e.g. --dump-dom)."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail("headless Chromium is needed: apt-get install -y chromium")
    profile = tempfile.mkdtemp(prefix="qk-chromium-")
    try:
        cmd = [exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *extra]
        if netlog is not None:
            cmd.append(f"--log-net-log={netlog}")
        proc = subprocess.run([*cmd, url], capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def page_requests(netlog: Path) -> list[str]:
    """URLs the PAGE asked the network stack for (Chromium's own background fetches, such as
    update checks, carry the initiator "not an origin" and are left out)."""
    log = json.loads(netlog.read_text())
    start = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    urls = []
    for e in log["events"]:
        p = e.get("params") or {}
        if e["type"] == start and "url" in p and (p.get("initiator") != "not an origin"
                                                  or "file://" in p.get("network_isolation_key", "")):
            urls.append(p["url"])
    return urls


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def report(rtn4_artifact, rtn8_artifact, tmp_path_factory) -> Path:
    """A report from a real `quantkit compare` run: base, RTN int4 and int8 of SmolLM2."""
    out = tmp_path_factory.mktemp("report") / "compare.html"
    res = CliRunner().invoke(main, ["compare", str(rtn4_artifact), str(rtn8_artifact),
                                    "--base", "smollm2-135m", "--ctx", "256", "--max-windows", "2",
                                    "--fresh", "--report", str(out)])
    assert res.exit_code == 0, res.output
    return out


@pytest.fixture(scope="module")
def records(report) -> list[dict]:
    return json.loads(report.with_suffix(".json").read_text())["records"]


def test_report_in_chromium_rows_plots_no_network_screenshots(report, tmp_path):
    netlog = tmp_path / "net.json"
    dom = chromium(report.as_uri(), "--dump-dom", netlog=netlog)
    # the table: the base reference row and one row per artifact, with real numbers
    for row, label in (("base", "smollm2-135m"), ("r0", "smollm2-rtn-w4g64"), ("r1", "smollm2-rtn-w8g64")):
        m = re.search(rf'<tr id="row-{row}"[^>]*>(.*?)</tr>', dom, re.S)
        assert m and label in m.group(1), row
    assert re.search(r'<tbody class="ref">\s*<tr id="row-base"', dom)
    assert 'data-sortable="ready"' in dom  # the sorting script ran
    assert dom.count("★") >= 4  # best values marked
    # the plots: two size-vs-quality charts with their points, two heatmaps with cells
    kld = re.search(r'<svg id="plot-size-kld".*?</svg>', dom, re.S).group(0)
    ppl = re.search(r'<svg id="plot-size-ppl".*?</svg>', dom, re.S).group(0)
    assert kld.count("<circle") == 2 and ppl.count("<circle") == 3
    heat = re.findall(r'<svg class="plot heatmap".*?</svg>', dom, re.S)
    assert len(heat) == 2 and all(h.count("<rect") == 30 * 7 for h in heat)
    assert 'id="speed-nm"' in dom  # speed not measured here: said so, not drawn as zeros
    # no network: the page requested nothing, and nothing in it points outside the file
    assert page_requests(netlog) == []
    assert not re.search(r'(src|href|xlink:href)="(https?:)?//', dom)
    assert "@import" not in dom and "url(http" not in dom
    # screenshots at both widths
    shots = {}
    for w, h in ((1280, 800), (420, 900)):
        shot = tmp_path / f"demo-{w}.png"
        chromium(report.as_uri(), f"--screenshot={shot}", f"--window-size={w},{h}")
        assert png_size(shot) == (w, h) and shot.stat().st_size > 20_000
        shots[w] = shot
    if os.environ.get("QUANTKIT_SAVE_SCREENSHOTS") == "1":
        (REPO / "reports").mkdir(exist_ok=True)
        for w, shot in shots.items():
            shutil.copy(shot, REPO / "reports" / f"demo-{w}.png")


def test_netlog_check_sees_a_page_request(tmp_path):
    """The no-network check above is real: the same check catches an <img> from the network."""
    page = tmp_path / "leak.html"
    page.write_text('<!DOCTYPE html><html><body><img src="http://127.0.0.1:9/x.png"></body></html>')
    netlog = tmp_path / "net.json"
    chromium(page.as_uri(), "--dump-dom", netlog=netlog)
    assert page_requests(netlog) == ["http://127.0.0.1:9/x.png"]


def test_sorting_in_the_browser(report):
    """#sort=KEY,DIR runs the same sort as a header click; the base row stays on top."""
    def order(fragment: str) -> list[str]:
        dom = chromium(report.as_uri() + fragment, "--dump-dom")
        return re.findall(r'<tr id="row-(\w+)"', dom)

    assert order("#sort=kld,desc") == ["base", "r0", "r1"]  # int4 has the larger KLD
    assert order("#sort=kld,asc") == ["base", "r1", "r0"]
    assert order("#sort=size,desc") == ["base", "r1", "r0"]  # int8 is the larger file


def test_twins_and_terminal_table(report, rtn4_artifact, rtn8_artifact):
    summary = json.loads(report.with_suffix(".json").read_text())
    assert summary["schema"] == "quantkit.compare/v1"
    assert [r["role"] for r in summary["rows"]] == ["base", "artifact", "artifact"]
    w4, w8 = summary["rows"][1], summary["rows"][2]
    assert w8["kld"]["mean"] < w4["kld"]["mean"] and w8["size_bytes"] > w4["size_bytes"]
    assert w4["layers"] and len(w4["layers"]) == 30 * 7
    md = report.with_suffix(".md").read_text()
    assert "| smollm2-135m (base) |" in md and "| smollm2-rtn-w4g64 |" in md and "reference" in md
    assert "quantkit quantize smollm2-135m --method rtn" in md
    # without --report: the rich table, from the stored results (nothing is re-evaluated)
    res = CliRunner().invoke(main, ["compare", str(report.with_suffix(".json"))])
    assert res.exit_code == 0, res.output
    assert "smollm2-rtn-w4g64" in res.output and "reference" in res.output


def test_script_in_a_model_name_is_escaped(records, tmp_path):
    evil = copy.deepcopy(records)
    for r in evil:
        r["artifact"]["path"] = f"/nowhere/{EVIL}/{Path(r['artifact']['path']).name}"
        r["artifact"]["method"] = EVIL
        r["convention"]["corpus"] = EVIL
        r["command"] = f"quantkit eval '{EVIL}'"
    summary = summarize(evil, base_spec=EVIL, command=f"quantkit compare '{EVIL}'", title=EVIL)
    paths = write_report(summary, tmp_path / "evil.html")
    html = paths["html"].read_text()
    assert EVIL not in html and "alert(1)</" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert html.count("<script") == 1  # only the page's own sorting script
    dom = chromium(paths["html"].as_uri(), "--dump-dom")
    scripts = re.findall(r"<script[^>]*>(.*?)</script>", dom, re.S)
    assert len(scripts) == 1 and not any("alert" in s for s in scripts)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in dom  # shown as text
    # markdown: escaped everywhere except inside fenced code blocks, where commands stay
    # verbatim for copy-paste and no renderer interprets HTML
    md = re.sub(r"```.*?```", "", paths["md"].read_text(), flags=re.S)
    assert EVIL not in md and "&lt;script&gt;alert(1)&lt;/script&gt;" in md


def test_compare_refuses_artifacts_of_different_base_models(rtn4_artifact, tiny_model_factory,
                                                             tmp_path):
    tiny = tiny_model_factory("llama")
    tiny_rtn = tmp_path / "tiny-rtn"
    res = CliRunner().invoke(main, ["quantize", str(tiny), "--method", "rtn", "--bits", "4",
                                    "--group-size", "64", "-o", str(tiny_rtn)])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(main, ["compare", str(rtn4_artifact), str(tiny_rtn),
                                    "--report", str(tmp_path / "r.html")])
    assert res.exit_code == 2, res.output
    assert "base models differ" in res.output and "hint:" in res.output
    assert not (tmp_path / "r.html").exists()
    res = CliRunner().invoke(main, ["compare", str(tiny_rtn), "--base", "smollm2-135m"])
    assert res.exit_code == 2 and "not from the base smollm2-135m" in res.output


def test_missing_fields_render_as_not_measured(records, tmp_path):
    """A record without KLD / top-1 / bits per weight shows "not measured", never 0; a
    measured speed on the other row gets its column and bars; mixed conventions warn."""
    recs = copy.deepcopy(records)
    for key in ("kld", "top1_agreement", "rms_delta_p"):
        del recs[0]["metrics"][key]
    del recs[0]["artifact"]["bits_per_weight_quantized"]
    # no longer on disk: its bits come from the record only (a present file is read again)
    recs[0]["artifact"]["path"] = str(tmp_path / "gone" / Path(recs[0]["artifact"]["path"]).name)
    recs[1]["metrics"]["speed"] = {"prefill_tokens_per_s": {"median": 850.0, "spread": 20.0},
                                   "decode_tokens_per_s": {"median": 42.0, "spread": 1.5}}
    recs[1]["convention"]["max_windows"] = 99
    results = tmp_path / "results.json"
    results.write_text(json.dumps(recs))
    res = CliRunner().invoke(main, ["compare", str(results), "--report", str(tmp_path / "r.html")])
    assert res.exit_code == 0, res.output
    html = (tmp_path / "r.html").read_text()
    row = re.search(r'<tr id="row-r0".*?</tr>', html, re.S).group(0)
    for col in ("kld", "top1", "bpw", "prefill", "decode"):
        cell = re.search(rf'<td data-col="{col}"[^>]*>(.*?)</td>', row, re.S)
        assert cell and cell.group(1).strip() == "not measured", col
        assert 'data-sort=""' in cell.group(0)
    assert re.search(r'<svg class="plot speed" id="plot-speed-1"', html)
    assert "different eval conventions" in html
    md = (tmp_path / "r.md").read_text()
    assert "_not measured_" in md
    res = CliRunner().invoke(main, ["compare", str(results)])
    assert res.exit_code == 0 and "not measured" in res.output


def test_speed_engine_cell_names_the_dtype_and_mixed_dtypes_warn(records, tmp_path):
    """Where vLLM ran rows in different activation dtypes (float32 where bf16 is emulated,
    bf16 for int4), the engine cell names each row's dtype and the page warns."""
    recs = copy.deepcopy(records)
    for rec, dtype in zip(recs[:2], ("float32", "bfloat16"), strict=True):
        rec["metrics"]["speed"] = {"engine": "vllm", "dtype": dtype,
                                   "batch_1": {"prefill_tok_s": {"median": 850.0},
                                               "decode_tok_s": {"median": 42.0}}}
    results = tmp_path / "results.json"
    results.write_text(json.dumps(recs))
    res = CliRunner().invoke(main, ["compare", str(results), "--report", str(tmp_path / "r.html")])
    assert res.exit_code == 0, res.output
    html = (tmp_path / "r.html").read_text()
    assert "speed: vLLM (float32)" in html and "speed: vLLM (bfloat16)" in html
    assert "different activation dtypes (bfloat16, float32)" in html
    assert "Rows ran in different engines" not in html


@pytest.mark.fast
def test_pareto_front():
    pts = [(100, 0.5), (160, 0.01), (120, 0.6), (260, 0.01), (90, 0.9)]
    assert sorted(pareto(pts)) == [0, 1, 4]
