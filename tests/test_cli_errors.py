"""Every bad input gets a clear error (exit 2) that names the problem, and loses nothing."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from quantkit.cli import main


def run(*args):
    return CliRunner().invoke(main, list(map(str, args)))


def rtn(model, out, *extra):
    return run("quantize", model, "--method", "rtn", "--bits", 4, "--group-size", 64, "-o", out,
               *extra)


@pytest.mark.fast
def test_help_on_every_command():
    for cmd in ([], ["quantize"], ["eval"], ["info"]):
        res = run(*cmd, "--help")
        assert res.exit_code == 0 and "Usage" in res.output


@pytest.mark.fast
def test_gptq_only_flags_are_refused_for_other_methods(tmp_path, tiny_llama):
    for flag in (["--damp", "0.05"], ["--no-true-sequential"]):
        res = rtn(tiny_llama, tmp_path / "out", *flag)
        # --damp: "gptq / int8 only" (int8 reads it with --rounding gptq)
        assert res.exit_code == 2 and "read by --method gptq" in res.output, res.output
    assert not (tmp_path / "out").exists()


@pytest.mark.fast
def test_missing_safetensors(tmp_path, tiny_llama):
    d = tmp_path / "noweights"
    d.mkdir()
    shutil.copy(tiny_llama / "config.json", d)
    res = rtn(d, tmp_path / "out")
    assert res.exit_code == 2
    assert "no weights" in res.output and "safetensors" in res.output
    assert not (tmp_path / "out").exists()


@pytest.mark.fast
def test_corrupt_safetensors(tmp_path, tiny_llama):
    d = tmp_path / "corrupt"
    shutil.copytree(tiny_llama, d)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    res = rtn(d, tmp_path / "out")
    assert res.exit_code == 2
    assert "Corrupt safetensors file" in res.output and "truncated" in res.output


@pytest.mark.fast
def test_pickle_only_needs_allow_pickle(tmp_path, tiny_llama):
    d = tmp_path / "pickled"
    d.mkdir()
    shutil.copy(tiny_llama / "config.json", d)
    torch.save({"x": torch.zeros(1)}, d / "pytorch_model.bin")
    res = rtn(d, tmp_path / "out")
    assert res.exit_code == 2 and "--allow-pickle" in res.output


@pytest.mark.fast
def test_missing_tokenizer(tmp_path, tiny_model_factory):
    src = tiny_model_factory("llama", name="notok", tokenizer=False)
    res = rtn(src, tmp_path / "out")
    assert res.exit_code == 2 and "No tokenizer" in res.output
    assert not (tmp_path / "out").exists()


@pytest.mark.fast
def test_unsupported_architecture(tmp_path, tiny_llama):
    d = tmp_path / "gpt2ish"
    shutil.copytree(tiny_llama, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["NotAModelForCausalLM"]  # a class transformers does not have
    cfg["model_type"] = "not_a_model"
    (d / "config.json").write_text(json.dumps(cfg))
    res = rtn(d, tmp_path / "out")
    assert res.exit_code == 2
    assert "NotAModelForCausalLM is not supported" in res.output
    assert "no model class for it" in res.output
    assert "Qwen2ForCausalLM" in res.output  # the supported list


def test_group_size_not_dividing_names_layers_and_suggests(tmp_path):
    # SmolLM2: hidden 576 is not a multiple of 128; refused before any weights are loaded
    res = run("quantize", "smollm2-135m", "--method", "rtn", "--bits", 4, "--group-size", 128,
              "-o", tmp_path / "out")
    assert res.exit_code == 2
    assert "Group size 128 does not divide" in res.output
    assert "model.layers.0.self_attn.q_proj (in_features 576)" in res.output
    assert "--group-size 64" in res.output


@pytest.mark.fast
def test_output_exists_needs_force(tmp_path, tiny_llama):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    res = rtn(tiny_llama, out)
    assert res.exit_code == 2 and "already exists" in res.output and "--force" in res.output
    assert (out / "precious.txt").read_text() == "keep me"
    res = rtn(tiny_llama, out, "--force")
    assert res.exit_code == 0, res.output
    assert not (out / "precious.txt").exists() and (out / "model.safetensors").exists()


@pytest.mark.fast
def test_interrupted_run_leaves_no_artifact(tmp_path, tiny_llama):
    from quantkit.pipeline.quantize import QuantizeRequest, quantize
    from quantkit.types import QuantScheme

    def interrupt(stage, done, total):
        if stage.startswith("quantizing") and done == 1:
            raise KeyboardInterrupt

    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        quantize(QuantizeRequest(model=str(tiny_llama), method="rtn", scheme=QuantScheme(bits=4, group_size=64),
                                 out=out), on_progress=interrupt)
    assert not out.exists()
    # no temp leftovers either; only the finished block's checkpoint, kept to resume from
    assert [p.name for p in tmp_path.iterdir()] == [".out.partial"]


@pytest.mark.fast
def test_nan_weights_are_refused_by_name(tmp_path, tiny_llama):
    d = tmp_path / "nan"
    shutil.copytree(tiny_llama, d)
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")
    tensors["model.layers.1.mlp.down_proj.weight"][0, 0] = float("inf")
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    res = rtn(d, tmp_path / "out")
    assert res.exit_code == 2
    assert "model.layers.1.mlp.down_proj.weight contains 2 NaN/Inf" in res.output
    assert not (tmp_path / "out").exists()


@pytest.mark.fast
def test_hub_id_offline_is_explained(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    res = rtn("some-org/some-model-that-is-not-cached", tmp_path / "out")
    assert res.exit_code == 2
    assert "Cannot fetch Hub model 'some-org/some-model-that-is-not-cached'" in res.output
    assert "HF_HUB_OFFLINE" in res.output


@pytest.mark.fast
def test_not_a_model_at_all(tmp_path):
    res = rtn("./does/not/exist", tmp_path / "out")
    assert res.exit_code == 2 and "neither a built-in alias" in res.output


@pytest.mark.fast
def test_unsupported_bits(tmp_path, tiny_llama):
    res = run("quantize", tiny_llama, "--method", "rtn", "--bits", 5, "--group-size", 64,
              "-o", tmp_path / "out")
    assert res.exit_code == 2 and "Unsupported bit width 5" in res.output


@pytest.mark.fast
def test_eval_bad_artifact_path(tmp_path):
    res = run("eval", tmp_path / "nothing-here")
    assert res.exit_code == 2 and "neither a built-in alias" in res.output


@pytest.mark.fast
def test_failure_while_writing_keeps_the_old_artifact(tmp_path):
    from quantkit.pipeline.output import atomic_output

    out = tmp_path / "artifact"
    out.mkdir()
    (out / "model.safetensors").write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_output(out, force=True) as tmp:
            (tmp / "model.safetensors").write_text("half-written")
            raise KeyboardInterrupt
    assert (out / "model.safetensors").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["artifact"]
