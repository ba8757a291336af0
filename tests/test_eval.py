"""PPL / KLD harness on the real model: CLI output, JSON schema, and sanity of the numbers."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
from click.testing import CliRunner

import quantkit.eval
from quantkit.cli import main
from quantkit.eval.harness import evaluate
from quantkit.eval.logits import PPLConvention

SCHEMA = json.loads((Path(quantkit.eval.__file__).parent / "schema.json").read_text())


def test_eval_cli_prints_and_writes_json(rtn4_artifact, tmp_path):
    out = tmp_path / "res.json"
    res = CliRunner().invoke(main, ["eval", str(rtn4_artifact), "--base", "smollm2-135m",
                                    "--max-windows", "4", "--json", str(out)])
    assert res.exit_code == 0, res.output
    for label in ("PPL (base)", "PPL (artifact)", "KLD mean", "top-1 agreement", "convention:"):
        assert label in res.output
    record = json.loads(out.read_text())
    jsonschema.validate(record, SCHEMA)
    m = record["metrics"]
    assert m["kld"]["mean"] > 0
    assert m["ppl"]["value"] > m["base_ppl"]["value"]  # int4 RTN loses something
    assert record["convention"]["scored_tokens"] == 4 * 511
    assert abs(record["artifact"]["bits_per_weight_quantized"] - 4.25) < 0.01


def test_int8_kld_far_below_int4(rtn4_artifact, rtn8_artifact):
    conv = PPLConvention(max_windows=4)
    r4, r8 = evaluate([str(rtn4_artifact), str(rtn8_artifact)], "smollm2-135m", conv=conv)
    for r in (r4, r8):
        jsonschema.validate(r, SCHEMA)
    k4, k8 = r4["metrics"]["kld"]["mean"], r8["metrics"]["kld"]["mean"]
    assert k4 > 0 and k8 < 0.1 * k4
    assert r8["metrics"]["top1_agreement"]["value"] > r4["metrics"]["top1_agreement"]["value"]


def test_schema_rejects_a_zero_for_missing_metric():
    bad = {"schema": "quantkit.eval/v1", "metrics": {"ppl": {"stderr": 1.0}}}
    try:
        jsonschema.validate(bad, SCHEMA)
    except jsonschema.ValidationError:
        return
    raise AssertionError("schema accepted an incomplete record")


def test_lmeval_results_cache_key_follows_model_files_tasks_and_settings(tiny_model_factory, tmp_path):
    """Stored base results are found again only for the same model files, tasks and settings."""
    import os

    from quantkit.eval.lmeval import results_cache_path

    model = tiny_model_factory("llama")
    settings = {"backend": "hf", "num_fewshot": 0, "limit": 5, "batch_size": 8, "seed": 1234,
                "chat_template": False}
    task = ["quantkit_cloze_mixed"]
    first = results_cache_path(str(model), task, settings)
    assert first is not None and first == results_cache_path(str(model), task, dict(settings))
    assert Path(os.environ["QUANTKIT_LMEVAL_CACHE"]) in first.parents  # the session's folder
    assert results_cache_path(str(model), task, {**settings, "limit": 6}) != first
    assert results_cache_path(str(model), ["quantkit_cloze_code"], settings) != first
    weights = next(model.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert results_cache_path(str(model), task, settings) != first  # re-written weights
    assert results_cache_path(str(model), ["hellaswag"], settings) is None  # Hub data can change
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert results_cache_path(str(gguf), task, settings) is None
