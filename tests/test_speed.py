"""Speed and memory in the real engines: median and spread over repeats, recorded in the JSON."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from quantkit.builtin_models import builtin_gguf_path
from quantkit.cli import main
from quantkit.eval.speed import REPEAT_BUDGET_S, measure_speed

pytestmark = pytest.mark.engine


def _check(batch: dict, repeats: int) -> None:
    for name in ("prefill_tok_s", "decode_tok_s", "ttft_s"):
        v = batch[name]
        assert len(v["values"]) == repeats
        assert 0 < v["min"] <= v["median"] <= v["max"]


def test_vllm_speed_of_a_safetensors_model(smollm_path):
    res = measure_speed(str(smollm_path), "vllm", prompt_tokens=64, gen_tokens=8,
                        batches=(1, 4), repeats=3)
    assert res["engine"] == "vllm" and res["engine_version"] == "0.32.0"
    _check(res["batch_1"], 3)
    _check(res["batch_4"], 3)
    assert res["peak_rss_bytes"] > 200 * 2**20
    assert res["settings"]["repeat_budget_s"] == REPEAT_BUDGET_S


def test_repeats_stop_at_the_time_budget(smollm_path):
    """A batch size whose timed runs have used up the budget is not repeated (the slow FP8
    path decodes at ~2 tok/s on AVX2 CPUs): vLLM's worker and llama.cpp's loop both stop, at
    least one run is kept, and the record says which budget it was measured under."""
    vllm = measure_speed(str(smollm_path), "vllm", prompt_tokens=64, gen_tokens=8,
                         batches=(1, 2), repeats=3, repeat_budget_s=0.0)
    _check(vllm["batch_1"], 1)
    _check(vllm["batch_2"], 1)
    assert vllm["settings"]["repeat_budget_s"] == 0.0
    gguf = str(builtin_gguf_path("smollm2-135m"))
    llama = measure_speed(gguf, "llamacpp", prompt_tokens=64, gen_tokens=8, batches=(1,),
                          repeats=3, repeat_budget_s=0.0)
    _check(llama["batch_1"], 1)


def test_eval_speed_cli_on_a_gguf(tmp_path):
    gguf = str(builtin_gguf_path("smollm2-135m"))
    out = tmp_path / "speed.json"
    res = CliRunner().invoke(main, ["eval", gguf, "--no-ppl", "--speed", "--speed-prompt", "64",
                                    "--speed-gen", "8", "--speed-batch", "1", "--json", str(out)])
    assert res.exit_code == 0, res.output
    record = json.loads(out.read_text())
    assert record["speed"]["engine"] == "llamacpp"
    _check(record["speed"]["batch_1"], 3)
    assert "decode tok/s (llamacpp, batch 1)" in res.output
