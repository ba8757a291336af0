"""Bad flags and unsafe outputs are refused up front; --force and checkpoints never lose an
artifact. Every case runs the real CLI in a subprocess and checks the disk afterwards."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_runner import run_cli
from click.testing import CliRunner
from tiny_models import make_tiny_model

from quantkit.cli import main
from quantkit.methods.options import FLAG_READERS
from quantkit.pipeline.checkpoint import checkpoint_dir

REPO = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", COLUMNS="200")
    env.update(extra)
    return env


def cli(*args, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return run_cli(args, env=env or _env(), timeout=timeout)


def refused(res: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit 2 with exactly one `error:` line and a `hint:`, no traceback; returns stderr."""
    text = res.stdout + res.stderr
    assert res.returncode == 2, text
    assert "Traceback" not in text, text
    assert len(re.findall(r"^error:", res.stderr, re.M)) == 1, text
    assert re.search(r"^hint:", res.stderr, re.M), text
    for needle in needles:
        assert needle in res.stderr, (needle, text)
    return res.stderr


def tree_hash(path: Path) -> dict[str, str]:
    if path.is_file():
        return {path.name: hashlib.sha256(path.read_bytes()).hexdigest()}
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def rtn(model: Path, out: Path, *extra) -> tuple:
    return ("quantize", model, "--method", "rtn", "--group-size", 64, "-o", out, *extra)


# ------------------------------------------------------------------- 1. unwritable output ----

def test_unwritable_output_is_refused_before_the_model_loads(tmp_path, tiny_llama):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    for out, needle in ((blocker / "out", "is a file, not a directory"),
                        (Path("/proc/self/quantkit-test/out"), "is not writable")):
        t0 = time.perf_counter()
        err = refused(cli(*rtn(tiny_llama, out, "--no-resume")), needle, "-o")
        assert time.perf_counter() - t0 < 60, err
    # "before the model loads": a model path that does not exist is not even looked at
    refused(cli(*rtn(tmp_path / "no-such-model", blocker / "out")), "is a file")
    # the other commands' output files too, before any evaluation runs
    refused(cli("compare", tmp_path / "no-such-artifact", "--report", blocker / "r.html"),
            "is a file", "--report")
    refused(cli("eval", tmp_path / "no-such-artifact", "--json", blocker / "r.json"),
            "is a file", "--json")
    assert blocker.read_text() == "not a directory"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


# ------------------------------------------------------------ 2. scheme vs shapes up front ----

def test_fp8_block_on_a_model_no_block_tiles_is_refused_before_work(tmp_path, smollm_path):
    before = tree_hash(smollm_path)
    err = refused(cli("quantize", "smollm2-135m", "--method", "fp8", "--scheme", "block",
                      "-o", tmp_path / "out"), "every Linear", "--scheme dynamic")
    assert "blocks" not in err.split("error:")[0]  # no block was quantized before the refusal
    assert not (tmp_path / "out").exists() and not checkpoint_dir(tmp_path / "out").exists()
    assert tree_hash(smollm_path) == before


# ------------------------------------------------------------- 3. binary "text" calibration ----

@pytest.mark.fast
def test_binary_txt_calibration_is_refused_with_its_share(tmp_path, tiny_llama):
    noise = tmp_path / "noise.txt"
    noise.write_bytes(os.urandom(64 * 1024))
    err = refused(cli("quantize", tiny_llama, "--method", "gptq", "--group-size", 64,
                      "--calib", noise, "--calib-samples", 4, "--calib-seqlen", 32,
                      "-o", tmp_path / "out"), "does not look like UTF-8 text")
    share = int(re.search(r"(\d+) % of its characters", err).group(1))
    assert 30 <= share <= 60, err
    assert not (tmp_path / "out").exists() and not checkpoint_dir(tmp_path / "out").exists()


@pytest.mark.fast
def test_latin1_accents_in_utf8_text_are_not_garbled():
    from quantkit.calibration.files import MAX_GARBLED_SHARE, garbled_share

    assert garbled_share("Café, naïve, Ærøskøbing — ок.\n\tfin") == 0.0
    assert garbled_share("abc\x00\x01\ufffd") > MAX_GARBLED_SHARE


# ---------------------------------------------------- 4. --text-column and hints' options ----

def test_text_column_is_threaded_and_recorded(tmp_path, tiny_llama):
    words = "the quick brown fox jumps over the lazy dog and keeps running far away"
    data = tmp_path / "calib.jsonl"
    data.write_text("".join(json.dumps({"id": i, "body": f"{words} {i}. " * 8}) + "\n"
                            for i in range(40)))
    args = ("quantize", tiny_llama, "--method", "gptq", "--group-size", 64, "--calib", data,
            "--calib-samples", 4, "--calib-seqlen", 32)
    refused(cli(*args, "-o", tmp_path / "a"), "available columns: id, body", "--text-column")
    res = cli(*args, "--text-column", "body", "-o", tmp_path / "b")
    assert res.returncode == 0, res.stderr
    meta = json.loads((tmp_path / "b" / "quantkit.json").read_text())
    assert meta["calibration"]["text_column"] == "body"
    assert "--text-column body" in meta["command"]
    refused(cli("quantize", tiny_llama, "--method", "gptq", "--group-size", 64,
                "--text-column", "body", "-o", tmp_path / "c"), "no columns", "--text-column")


def _cli_options() -> set[str]:
    import click

    opts = {"--help", "--version"}
    for cmd in main.commands.values():
        for p in cmd.params:
            if isinstance(p, click.Option):
                opts.update(o for o in p.opts + p.secondary_opts if o.startswith("--"))
    return opts


# options of other programs that messages quote on purpose, with the program
FOREIGN_OPTIONS = {"--nproc-per-node": "torchrun", "--no-deps": "pip install",
                   "--cache-type-k": "llama.cpp (llama-cli, llama-server)",
                   "--cache-type-v": "llama.cpp (llama-cli, llama-server)",
                   "--outtype": "llama.cpp's convert_hf_to_gguf.py"}


@pytest.mark.fast
def test_every_option_named_in_the_code_base_exists():
    known = _cli_options()
    assert "--text-column" in known and "--group-size" in known
    unknown = []
    for path in sorted((REPO / "quantkit").rglob("*.py")):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for opt in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]", line):
                if opt not in known and opt not in FOREIGN_OPTIONS:
                    unknown.append(f"{path.relative_to(REPO)}:{lineno}: {opt}")
    assert not unknown, "messages name options that do not exist:\n" + "\n".join(unknown)


# --------------------------------------------------------------- 5. text printed verbatim ----

@pytest.mark.fast
def test_user_text_is_printed_verbatim(tmp_path, tiny_llama):
    source = "hf:a:smile:b:[red]c[/red]:d"
    err = refused(cli("quantize", tiny_llama, "--method", "gptq", "--group-size", 64,
                      "--calib", source, "-o", tmp_path / "out"), source,
                  "hf:wikitext:wikitext-2-raw-v1:train:text")
    assert "😄" not in err and "🚆" not in err


# ---------------------------------------------------------------- 6. flags that do not apply ----

@pytest.mark.parametrize("method, flags, named", [
    ("rtn", ["--act-order"], "--method gptq"),
    ("rtn", ["--gguf-type", "q4_k_m"], "--method gguf"),
    ("rtn", ["--scheme", "block"], "--method fp8"),
    ("rtn", ["--calib", "mixed"], "--method gptq"),
    ("awq", ["--damp", "0.1"], "--method gptq"),
    ("fp8", ["--bits", "4"], "--method rtn"),
    ("fp8", ["--calib-samples", "8"], "--scheme static"),
    ("gguf", ["--group-size", "64"], "--method rtn"),
    ("gguf", ["--asym"], "--method rtn"),
    ("gguf", ["--calib-seqlen", "64"], "--calib"),
    ("gguf", ["--imatrix", "x.dat", "--calib", "mixed"], "--imatrix"),
    ("gguf", ["--format", "compressed-tensors"], "--format gguf"),
])
def test_a_flag_the_method_does_not_read_is_refused(method, flags, named, tmp_path):
    res = CliRunner().invoke(main, ["plan", "smollm2-135m", "--method", method, *flags])
    assert res.exit_code == 2, res.output
    assert "error:" in res.output and "hint:" in res.output and named in res.output
    assert flags[0] in res.output


@pytest.mark.fast
def test_act_order_with_rtn_is_refused_not_recorded(tmp_path, tiny_llama):
    refused(cli(*rtn(tiny_llama, tmp_path / "out", "--act-order")),
            "--act-order is read by --method gptq only")
    assert not (tmp_path / "out").exists()


@pytest.mark.fast
def test_every_flag_in_the_table_is_an_option():
    names = {p.name for p in main.commands["quantize"].params}
    assert set(FLAG_READERS) <= names


# ---------------------------------------------------------------------------- 7. auto_map ----

def test_auto_map_is_dropped_from_the_artifact(tmp_path, tiny_llama):
    model = tmp_path / "remote"
    shutil.copytree(tiny_llama, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_x.XConfig",
                       "AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (model / "config.json").write_text(json.dumps(cfg))
    tok = json.loads((model / "tokenizer_config.json").read_text())
    tok["auto_map"] = {"AutoTokenizer": ["tokenization_x.XTokenizer", None]}
    (model / "tokenizer_config.json").write_text(json.dumps(tok))
    res = cli(*rtn(model, tmp_path / "out"))
    assert res.returncode == 0, res.stderr
    assert "warning: dropped auto_map (AutoConfig, AutoModelForCausalLM)" in res.stderr
    assert "tokenizer_config.json" in res.stderr
    for name in ("config.json", "tokenizer_config.json"):
        written = json.loads((tmp_path / "out" / name).read_text())
        assert "auto_map" not in written, name
    assert "quantization_config" in json.loads((tmp_path / "out" / "config.json").read_text())
    # metadata shown by `info` is printed as it is stored (no emoji codes, no markup)
    meta_path = tmp_path / "out" / "quantkit.json"
    meta = json.loads(meta_path.read_text())
    meta["source_model"]["name_or_path"] = "org/m:smile:[red]x[/red]"
    meta_path.write_text(json.dumps(meta))
    shown = cli("info", tmp_path / "out", env=_env(COLUMNS="300"))
    assert shown.returncode == 0, shown.stderr
    assert "org/m:smile:[red]x[/red]" in shown.stdout and "😄" not in shown.stdout


# -------------------------------------------------------- 8. output that is or holds an input ----

@pytest.mark.fast
def test_output_that_would_replace_an_input_is_refused(tmp_path, tiny_llama):
    home = tmp_path / "models"
    model = home / "m"
    shutil.copytree(tiny_llama, model)
    (tmp_path / "link").symlink_to(model)
    before = tree_hash(model)
    calib = tmp_path / "calib.txt"
    calib.write_text("some text " * 500)
    cases = [(model, "is the source model"), (home, "contains the source model"),
             (tmp_path / "link", "is the source model"), (model / "q", "lies inside")]
    for out, needle in cases:
        refused(cli(*rtn(model, out, "--force")), needle, "-o")
    refused(cli("quantize", model, "--method", "gptq", "--group-size", 64, "--calib", calib,
                "-o", calib, "--force"), "is the calibration file")
    assert tree_hash(model) == before and not (model / "q").exists()
    assert calib.read_text() == "some text " * 500


# ------------------------------------------------------------------ 9. default group size ----

@pytest.mark.parametrize("hidden, group", [(192, 64), (96, 32)])
def test_default_group_size_fits_the_model(tmp_path, hidden, group):
    model = make_tiny_model(tmp_path / "m", hidden=hidden, intermediate=2 * hidden, heads=4,
                            kv_heads=2)
    res = cli("quantize", model, "--method", "rtn", "-o", tmp_path / "out")
    assert res.returncode == 0, res.stderr
    assert f"warning: group size {group}: the default 128 does not divide" in res.stderr
    meta = json.loads((tmp_path / "out" / "quantkit.json").read_text())
    assert meta["scheme"]["group_size"] == group
    assert meta["group_size_choice"].startswith(f"group size {group}")
    qcfg = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qcfg["config_groups"]["group_0"]["weights"]["group_size"] == group
    # an explicit group size stays strict
    refused(cli("quantize", model, "--method", "rtn", "--group-size", 128, "-o",
                tmp_path / "out2"), "Group size 128 does not divide", f"--group-size {group}")


def test_default_group_size_on_smollm2_plans_64():
    res = CliRunner().invoke(main, ["plan", "smollm2-135m", "--method", "rtn", "--json"])
    assert res.exit_code == 0, res.output
    record = json.loads(res.output[res.output.index("{"):])
    assert record["scheme"] == "W4A16 g64 sym"
    assert "576" in record["group_size_choice"]


# ------------------------------------------------------- 10/11. faults during the replace ----

def _pause_and_signal(args: tuple, point: str, sig: int, tmp_path: Path,
                      ) -> subprocess.CompletedProcess:
    """Run the CLI until it reaches `point` of the replace (the test hook), then send `sig`."""
    marker = tmp_path / f"paused-{point}"
    marker.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "quantkit.cli", *map(str, args)],
                            env=_env(QUANTKIT_TEST_PAUSE_AT=f"{point}:{marker}",
                                     PYTHONFAULTHANDLER="1"),
                            # a shell without job control starts background jobs with SIGINT
                            # ignored, and Python keeps an inherited SIG_IGN: the child then
                            # slept through Ctrl-C (seen when the suite ran under `cmd &`)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert marker.exists(), proc.communicate()
    time.sleep(0.2)  # let it settle into the pause
    proc.send_signal(sig)
    try:
        stdout, stderr = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        # SIGABRT makes faulthandler print every thread's Python stack: the failure says where
        # the child waited (that is how the inherited SIG_IGN above was found)
        proc.send_signal(signal.SIGABRT)
        stdout, stderr = proc.communicate(timeout=60)
        pytest.fail(f"no exit 120 s after signal {sig} at '{point}'; its threads:\n{stderr[-8000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.fixture
def old_artifact(tmp_path, tiny_llama):
    """An artifact at tmp/out made with --bits 8 (the replacing runs use 4)."""
    out = tmp_path / "out"
    res = cli(*rtn(tiny_llama, out, "--bits", 8))
    assert res.returncode == 0, res.stderr
    return out, tree_hash(out)


def _siblings(out: Path, tag: str) -> list[Path]:
    return sorted(out.parent.glob(f".{out.name}.{tag}-*"))


def test_kill_between_the_renames_is_recovered_by_the_next_run(tmp_path, tiny_llama,
                                                               old_artifact):
    out, old = old_artifact
    res = _pause_and_signal(rtn(tiny_llama, out, "--force"), "aside", signal.SIGKILL, tmp_path)
    assert res.returncode == -signal.SIGKILL
    assert not out.exists() and len(_siblings(out, "old")) == 1  # the old one is set aside
    err = refused(cli(*rtn(tiny_llama, out)), "already exists", "--force")
    assert "restored" in err
    assert tree_hash(out) == old and not _siblings(out, "old") and not _siblings(out, "tmp")


def test_ctrl_c_between_the_renames_puts_the_old_artifact_back(tmp_path, tiny_llama,
                                                               old_artifact):
    out, old = old_artifact
    res = _pause_and_signal(rtn(tiny_llama, out, "--force"), "aside", signal.SIGINT, tmp_path)
    assert res.returncode == 130, res.stderr
    assert "Traceback" not in res.stderr
    assert f"interrupted: {out} still holds the artifact that was there before" in res.stderr
    assert "blocks are finished and kept" in res.stderr  # written last: still on disk
    assert tree_hash(out) == old and not _siblings(out, "old") and not _siblings(out, "tmp")


def test_kill_after_the_new_one_is_in_keeps_it(tmp_path, tiny_llama, old_artifact):
    out, old = old_artifact
    res = _pause_and_signal(rtn(tiny_llama, out, "--force"), "replaced", signal.SIGKILL,
                            tmp_path)
    assert res.returncode == -signal.SIGKILL
    new = tree_hash(out)
    assert new != old
    assert json.loads((out / "quantkit.json").read_text())["scheme"]["bits"] == 4
    assert len(_siblings(out, "old")) == 1
    err = refused(cli(*rtn(tiny_llama, out)), "already exists")
    assert "removed" in err
    assert tree_hash(out) == new and not _siblings(out, "old")


def test_kill_before_the_replace_keeps_the_old_one_and_everything_is_cleaned_up(
        tmp_path, tiny_llama, old_artifact):
    out, old = old_artifact
    args = rtn(tiny_llama, out, "--force")
    res = _pause_and_signal(args, "written", signal.SIGKILL, tmp_path)
    assert res.returncode == -signal.SIGKILL
    assert tree_hash(out) == old and len(_siblings(out, "tmp")) == 1
    assert checkpoint_dir(out).is_dir()
    # a failing run for the same output cleans the dead temp dir and names the checkpoint
    err = refused(cli(*rtn(tiny_llama, out, "--force", "--bits", 5)), "bit width 5")
    assert "2 of 2 blocks are finished and kept in the hidden checkpoint" in err
    assert str(checkpoint_dir(out)) in err
    assert not _siblings(out, "tmp") and tree_hash(out) == old
    # the same command again: every block is in the checkpoint, so only the write is left
    again = cli(*args)
    assert again.returncode == 0, again.stderr
    assert "resuming: all 2 blocks were finished" in again.stderr
    assert "3/2" not in again.stderr
    assert json.loads((out / "quantkit.json").read_text())["scheme"]["bits"] == 4
    assert not checkpoint_dir(out).exists() and not _siblings(out, "tmp")


@pytest.mark.parametrize("method, options, group", [
    ("rtn", {}, 64), ("fp8", {"scheme": "dynamic"}, -1), ("fp8", {"scheme": "static"}, 0),
    ("gguf", {"gguf_type": "q4_k_m", "imatrix": "calib"}, 64)])
def test_recorded_command_of_an_api_run_is_accepted_by_the_cli(method, options, group, tmp_path):
    """quantkit.json's command for API callers replays: it names only flags the method reads."""
    from quantkit.pipeline.quantize import QuantizeRequest
    from quantkit.types import QuantScheme

    kind = {"fp8": "fp8", "gguf": "kquant"}.get(method, "int")
    req = QuantizeRequest(model="smollm2-135m", method=method, out=tmp_path / "o",
                          scheme=QuantScheme(kind=kind, bits=8 if kind == "fp8" else 4,
                                             group_size=group), method_options=options)
    args = req.cli_equivalent().split()[2:]
    res = CliRunner().invoke(main, ["plan", *args[:args.index("-o")]])
    assert res.exit_code == 0, (args, res.output)
