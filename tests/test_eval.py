"""PPL / KLD harness on the real model: CLI output, JSON schema, and sanity of the numbers."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
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


@pytest.mark.fast
def test_schema_rejects_a_zero_for_missing_metric():
    bad = {"schema": "quantkit.eval/v1", "metrics": {"ppl": {"stderr": 1.0}}}
    try:
        jsonschema.validate(bad, SCHEMA)
    except jsonschema.ValidationError:
        return
    raise AssertionError("schema accepted an incomplete record")


@pytest.mark.fast
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


def test_artifacts_scored_a_group_at_a_time_give_the_same_records(tiny_llama, tmp_path,
                                                                   monkeypatch):
    """A memory cap that fits one artifact per group (the base runs again for each) gives
    exactly the metrics of one pass over all three (RTN int4, the weights in float16, the
    model itself): comparing many artifacts needs only one group of them in memory."""
    import shutil

    from safetensors.torch import load_file, save_file

    from quantkit.pipeline.quantize import QuantizeRequest, quantize
    from quantkit.types import QuantScheme

    rtn, fp16 = tmp_path / "rtn-w4g64", tmp_path / "fp16"
    quantize(QuantizeRequest(model=str(tiny_llama), method="rtn", out=rtn,
                             scheme=QuantScheme(bits=4, group_size=64)))
    shutil.copytree(tiny_llama, fp16)  # a dense model, its weights rounded to float16
    weights = load_file(fp16 / "model.safetensors")
    save_file({k: v.half() for k, v in weights.items()}, fp16 / "model.safetensors",
              metadata={"format": "pt"})
    config = json.loads((fp16 / "config.json").read_text())
    (fp16 / "config.json").write_text(json.dumps({**config, "dtype": "float16"}))
    arts = [str(rtn), str(fp16), str(tiny_llama)]
    conv = PPLConvention(ctx=32, max_windows=2, batch_size=2)
    runs = {}
    for cap in (None, "1KiB"):  # 1 KiB: any second artifact would exceed it
        if cap:
            monkeypatch.setenv("QUANTKIT_EVAL_MEMORY", cap)
        stages: dict[str, tuple[int, int]] = {}
        records = evaluate(arts, str(tiny_llama), conv=conv,
                           on_progress=lambda s, done, total, st=stages: st.__setitem__(s, (done, total)))
        runs[cap] = ([r["metrics"] for r in records], stages)
    one, grouped = runs[None], runs["1KiB"]
    assert list(one[1]) == ["scoring held-out windows"]
    assert list(grouped[1]) == [f"scoring held-out windows (group {i}: artifacts {i}-{i} of 3)"
                                for i in (1, 2, 3)]
    assert all(done == total == 2 for done, total in grouped[1].values())
    assert grouped[0] == one[0]  # every float of every metric, exactly
    klds = [m["kld"]["mean"] for m in one[0]]
    assert klds[0] > klds[1] > klds[2] == 0  # int4, float16, the base itself
    # one artifact per run (`eval` of one, then `compare` scoring the rest): the tokenizer object
    # comes from whichever directory held it first, and the convention must not name that path
    # (the demo's report warned of two conventions for the same tokens)
    alone = [evaluate([a], str(tiny_llama), conv=conv)[0]["convention"] for a in arts[:2]]
    assert alone[0] == alone[1] == records[0]["convention"]
    assert str(tmp_path) not in json.dumps(alone[0])
    assert len(alone[0]["tokens_sha256"]) == 64


@pytest.mark.fast
def test_a_truncated_artifact_is_refused_before_any_group_is_scored(tiny_llama, tmp_path,
                                                                   monkeypatch):
    """Weights load a group at a time, but a broken file is still one clear error before any
    scoring: the headers of every artifact are checked when it is opened (here the second of
    two, one artifact per group)."""
    import shutil

    from quantkit.errors import ModelLoadError

    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama, broken)
    shard = broken / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    monkeypatch.setenv("QUANTKIT_EVAL_MEMORY", "1KiB")
    stages: list[str] = []
    with pytest.raises(ModelLoadError, match="truncated"):
        evaluate([str(tiny_llama), str(broken)], str(tiny_llama),
                 conv=PPLConvention(ctx=32, max_windows=2, batch_size=2),
                 on_progress=lambda s, *_: stages.append(s))
    assert not [s for s in stages if s.startswith("scoring")]


@pytest.mark.fast
def test_eval_memory_cap_is_checked_before_loading(monkeypatch):
    """$QUANTKIT_EVAL_MEMORY: whole bytes or KiB/MiB/GiB; anything else is one clear error
    before any model is loaded (the artifact named here does not exist)."""
    from quantkit.errors import QuantkitError
    from quantkit.eval.harness import eval_memory_cap

    assert eval_memory_cap("4096") == 4096 and eval_memory_cap(" 3 GiB ") == 3 * 2**30
    assert eval_memory_cap("512mib") == 512 * 2**20 and eval_memory_cap("") is None
    for bad in ("8GB", "1.5GiB", "0", "-1", "lots"):
        monkeypatch.setenv("QUANTKIT_EVAL_MEMORY", bad)
        with pytest.raises(QuantkitError) as exc:
            evaluate(["/nonexistent/artifact"], None)
        assert "QUANTKIT_EVAL_MEMORY" in exc.value.message and "GiB" in exc.value.hint
