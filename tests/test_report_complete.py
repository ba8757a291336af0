"""A complete comparison report (issue 21): `quantkit compare --speed` measures speed and peak
memory of every row in its own engine (vLLM for directories, llama.cpp for GGUF, the base
included) or names why the engine could not run it here; every row has bits per weight, and
a GGUF row's equal a hand count over its tensor types read with gguf-py.

Real engines, the real SmolLM2-135M: an RTN int4 directory (vLLM's int4 CPU kernel runs or
refuses depending on the CPU, and the test checks the refusal against vLLM itself) and a
Q4_K_M GGUF, whose 576/1536-wide tensors fall back to Q5_0/Q8_0 (effective bits > nominal).
"""

from __future__ import annotations

import html
import json
import re
import subprocess

import pytest
from click.testing import CliRunner

from quantkit.cli import main
from quantkit.engines.vllm import run_vllm_worker
from quantkit.eval.speed import speed_or_reason, unmeasured_reason

SPEED = ["--speed", "--speed-prompt", "32", "--speed-gen", "4", "--speed-batch", "1",
         "--repeats", "1"]
INT4_REASON = "vLLM has no int4 CPU kernel on this CPU (cpu_gemm_wna16; needs AVX512)"


def vllm_has_int4_kernel(tmp_path) -> bool:
    """Asks vLLM itself: load its CPU kernels as it does at startup, look for the int4 GEMM."""
    script = tmp_path / "has_int4.py"
    script.write_text("from vllm.platforms.cpu import CpuPlatform\nCpuPlatform.import_kernels()\n"
                      "import torch\nprint('int4 kernel:', hasattr(torch.ops._C, 'cpu_gemm_wna16'))\n")
    proc = run_vllm_worker(script, [], cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.log[-2000:]
    return re.findall(r"^int4 kernel: (True|False)$", proc.log, re.M) == ["True"]


def hand_bits(path) -> tuple[float, float]:
    """Bits per weight of the block Linears, and with token_embd/output, from gguf-py's reader."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    linears = [t for n, t in tensors.items()
               if n.startswith("blk.") and n.endswith(".weight") and len(t.shape) >= 2]
    emb = [tensors[n] for n in ("token_embd.weight", "output.weight") if n in tensors]

    def bits(ts):
        return 8 * sum(int(t.n_bytes) for t in ts) / sum(int(t.n_elements) for t in ts)
    return bits(linears), bits(linears + emb)


@pytest.fixture(scope="module")
def q4km(tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf") / "smollm2-q4_k_m.gguf"
    res = CliRunner().invoke(main, ["quantize", "smollm2-135m", "--method", "gguf",
                                    "--gguf-type", "q4_k_m", "-o", str(out)])
    assert res.exit_code == 0, res.output
    return out


@pytest.fixture(scope="module")
def summary(rtn4_artifact, q4km, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("complete") / "complete.html"
    with pytest.MonkeyPatch.context() as mp:  # the base is measured in this run, not reused
        mp.setenv("QUANTKIT_SPEED_CACHE", str(tmp_path_factory.mktemp("speed-cache")))
        res = CliRunner().invoke(main, ["compare", str(rtn4_artifact), str(q4km), "--base",
                                        "smollm2-135m", "--ctx", "128", "--max-windows", "2",
                                        *SPEED, "--report", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.with_suffix(".json").read_text())
    data["_html"] = out.read_text()
    data["_md"] = out.with_suffix(".md").read_text()
    return data


def test_every_speed_cell_is_measured_or_names_why(summary, rtn4_artifact, tmp_path):
    from quantkit.report.table import NOT_MEASURED, cells

    rows = {r["role"] if r["role"] == "base" else r["format"]: r for r in summary["rows"]}
    assert set(rows) == {"base", "compressed-tensors", "gguf"}
    # the base (bf16 in vLLM) and the GGUF (llama.cpp) run on any machine: numbers
    for key in ("base", "gguf"):
        r = rows[key]
        assert r["speed_unmeasured"] is None, r["speed_unmeasured"]
        assert r["speed"]["prefill_tps"]["value"] > 0 and r["speed"]["decode_tps"]["value"] > 0
        assert r["peak_memory_bytes"] > 50 * 2**20  # the engine process holds the model
    # int4 in vLLM: measured where the kernel exists; elsewhere vLLM's own refusal, in words
    int4 = rows["compressed-tensors"]
    if vllm_has_int4_kernel(tmp_path):
        assert int4["speed_unmeasured"] is None and int4["speed"]["decode_tps"]["value"] > 0
    else:
        assert int4["speed_unmeasured"] == INT4_REASON
        stored = json.loads((rtn4_artifact / "quantkit_eval.json").read_text())["speed"]
        assert stored["unmeasured"] == INT4_REASON and "cpu_gemm_wna16" in stored["error"]
    # no cell of a speed/memory/bits column says "not measured"; the reason fills the others
    cols, table = cells(summary)
    keys = [c.key for c in cols]
    assert {"prefill", "decode", "mem", "bpw"} <= set(keys)
    for r, line in zip(summary["rows"], table, strict=True):
        for c, cell in zip(cols, line, strict=True):
            if c.key in ("prefill", "decode", "mem", "bpw"):
                assert cell["text"] != NOT_MEASURED, (r["label"], c.key)
                if cell["missing"]:
                    assert cell["text"] == r["speed_unmeasured"] and cell["why"]
    # the page and the markdown say the same, not "not measured"
    for r in summary["rows"]:
        row_html = re.search(rf'<tr id="row-{r["id"]}".*?</tr>', summary["_html"], re.S).group(0)
        for col in ("prefill", "decode", "mem", "bpw"):
            cell = re.search(rf'<td data-col="{col}"[^>]*>(.*?)</td>', row_html, re.S).group(1)
            assert NOT_MEASURED not in cell, (r["label"], col)
    if int4["speed_unmeasured"]:
        from quantkit.report.markdown import md_escape

        assert html.escape(INT4_REASON) in summary["_html"]
        assert md_escape(INT4_REASON) in summary["_md"]
    assert "speed-nm" not in summary["_html"]  # bars are drawn for the measured rows


def test_gguf_bits_are_the_hand_count_of_its_tensor_types(summary, q4km):
    gguf = next(r for r in summary["rows"] if r["format"] == "gguf")
    linears, with_emb = hand_bits(q4km)
    assert gguf["bits_per_weight"] == pytest.approx(linears, rel=1e-12)
    assert gguf["bits_per_weight_with_embeddings"] == pytest.approx(with_emb, rel=1e-12)
    # SmolLM2's widths are not multiples of 256: most Q4_K tensors fall back to Q5_0
    types = {t["type"]: t for t in gguf["tensor_types"]}
    assert types["Q5_0"]["share"] > types["Q4_K"]["share"]
    assert sum(t["share"] for t in types.values()) == pytest.approx(1.0)
    assert linears > gguf["nominal_bits_per_weight"] + 0.25
    # the size charts ring and star it and say why in their legend; its types get a table
    html = summary["_html"]
    note = f"{linears:.1f} bpw effective, {gguf['nominal_bits_per_weight']:.1f} nominal"
    for plot in ("plot-size-kld", "plot-size-ppl"):
        fig = re.search(rf'<figure id="{plot}-fig">.*?</figure>', html, re.S).group(0)
        assert fig.count('class="bitsdiff"') == 2  # the ring on the point and in the legend key
        assert note in fig and "smollm2-q4_k_m.gguf *" in fig and "Q5_0" in fig
    assert re.search(r'<table class="kv types" id="types-r\d">', html)
    assert f"Tensor types of smollm2-q4\\_k\\_m.gguf ({note})" in summary["_md"]
    # every row has bits per weight; the RTN int4 g64 directory is not marked
    rtn = next(r for r in summary["rows"] if r["format"] == "compressed-tensors")
    assert rtn["bits_per_weight"] == pytest.approx(4.25, abs=0.01)
    assert rtn["nominal_bits_per_weight"] == pytest.approx(4.25)


def test_info_prints_the_tensor_types(q4km):
    res = CliRunner().invoke(main, ["info", str(q4km), "--json"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.output)
    linears, with_emb = hand_bits(q4km)
    assert info["bits_per_weight_quantized"] == pytest.approx(linears, rel=1e-12)
    assert info["bits_per_weight_with_embeddings"] == pytest.approx(with_emb, rel=1e-12)
    q5 = info["tensor_types"]["Q5_0"]
    assert q5["bytes"] * 8 / q5["params"] == pytest.approx(5.5)  # 22 bytes per 32 weights
    res = CliRunner().invoke(main, ["info", str(q4km)])
    assert res.exit_code == 0
    assert "tensor types" in res.output and "Q5_0" in res.output and "nominal" in res.output


def test_an_engine_failure_becomes_a_reason(tmp_path):
    """A file llama.cpp cannot load: the speed record names the engine's failure, no numbers."""
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    rec = speed_or_reason(str(bad), prompt_tokens=8, gen_tokens=2, batches=(1,), repeats=1)
    assert rec["engine"] == "llamacpp" and "batch_1" not in rec
    assert rec["unmeasured"].startswith("llama.cpp failed: ") and rec["error"]


def test_reason_phrases():
    from quantkit.errors import EngineError

    exc = EngineError("vLLM failed to run /m: AttributeError: '_OpNamespace' '_C' object has no "
                      "attribute 'cpu_gemm_wna16'", "log")
    assert unmeasured_reason(exc, "vllm") == INT4_REASON
    exc = EngineError("vLLM failed to run /m: ValueError: unknown quantization method x")
    assert unmeasured_reason(exc, "vllm") == "vLLM failed: ValueError: unknown quantization method x"
    assert unmeasured_reason(subprocess.TimeoutExpired("vllm", 1800), "vllm") == \
        "vLLM did not finish within 1800 s"
