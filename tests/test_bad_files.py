"""Malformed or foreign input files: one clear `error:` line, never a traceback, nothing changed.

The many mutations (every truncation point and bit flips in every header byte of a small
safetensors file, a small GGUF, a config.json and an index.json) run in-process against the
readers themselves; a handful of real `python -m quantkit.cli` runs per command check that what
the readers raise reaches the user as one `error:` + `hint:` with exit code 2.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_runner import run_cli
from safetensors import safe_open
from safetensors.torch import save_file

from quantkit.errors import BadWeights, ModelLoadError
from quantkit.formats.gguf import read_gguf
from quantkit.readers import read_config_json, safetensors_header, scan_finite, tensor_files

REPO = Path(__file__).resolve().parent.parent
FLIPS = (0x01, 0x08, 0x20, 0x80)  # low, middle and high bits of each byte


# ------------------------------------------------------------------ helpers

def snapshot(root: Path) -> dict[str, str]:
    """Every file under root with its sha256 (to prove nothing was written or changed)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def cli(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    return run_cli(args, env=env, cwd=REPO, timeout=600)


def assert_input_error(res: subprocess.CompletedProcess, *needles: str) -> str:
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert "Traceback" not in out, out
    lines = out.splitlines()
    assert sum(line.startswith("error:") for line in lines) == 1, out
    assert sum(line.startswith("hint:") for line in lines) == 1, out
    for needle in needles:
        assert needle in out, (needle, out)
    return out


def mutations(data: bytes, header_end: int):
    """(label, bytes): every truncation inside the header and a few in the data, and bit flips
    of every header byte."""
    for n in range(header_end):
        yield f"truncated at {n}", data[:n]
    for n in (header_end + 1, (header_end + len(data)) // 2, len(data) - 1):
        if header_end < n < len(data):
            yield f"truncated at {n}", data[:n]
    for i in range(header_end):
        for bit in FLIPS:
            yield f"byte {i} ^ {bit:#x}", data[:i] + bytes([data[i] ^ bit]) + data[i + 1:]


# ------------------------------------------------------------------ small inputs

def small_safetensors(path: Path) -> Path:
    save_file({"a.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
               "b.bias": torch.ones(5, dtype=torch.bfloat16),
               "c.idx": torch.arange(3, dtype=torch.int64)}, str(path), metadata={"format": "pt"})
    return path


def small_gguf(path: Path) -> Path:
    from gguf import GGMLQuantizationType, GGUFWriter

    w = GGUFWriter(str(path), "llama")
    w.add_string("general.name", "fuzz")
    w.add_uint32("llama.block_count", 1)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_array("tokenizer.ggml.tokens", ["a", "bc", "def"])
    w.add_array("tokenizer.ggml.token_type", [1, 1, 1])
    w.add_tensor("token_embd.weight", np.arange(64, dtype=np.float32).reshape(2, 32))
    q8 = np.arange(2 * 34, dtype=np.uint8).reshape(2, 34)  # 2 rows of one Q8_0 block
    w.add_tensor("blk.0.attn_q.weight", q8, raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_data_start(path: Path) -> int:
    from gguf import GGUFReader

    return int(GGUFReader(str(path)).data_offset)


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ------------------------------------------------------------------ in-process fuzzing

@pytest.mark.fast
def test_safetensors_header_fuzz(tmp_path):
    """Every truncation and header bit flip: the validator raises ModelLoadError or accepts a
    file that the safetensors library then reads completely (it never accepts a file the
    library would refuse)."""
    good = small_safetensors(tmp_path / "good.safetensors").read_bytes()
    header_end = 8 + int.from_bytes(good[:8], "little")
    f = tmp_path / "m.safetensors"
    accepted = rejected = 0
    for label, data in mutations(good, header_end):
        f.write_bytes(data)
        try:
            header, _ = safetensors_header(f)
        except ModelLoadError as exc:
            assert "Corrupt safetensors file" in exc.message and exc.hint, label
            rejected += 1
            continue
        with safe_open(str(f), framework="pt") as st:
            for name in header:
                st.get_tensor(name)
        accepted += 1
    assert rejected > 1000 and accepted > 10  # flips in names/metadata text stay valid


@pytest.mark.fast
@pytest.mark.parametrize("case, needle", [
    ("overlap", "overlaps tensor"), ("gap", "unused bytes"), ("length_beyond_file", "truncated"),
    ("numel_mismatch", "needs"), ("bad_dtype", "unknown dtype"), ("negative_shape", "invalid shape"),
    ("trailing_bytes", "after the last tensor"), ("not_json", "not a UTF-8 JSON"),
    ("duplicate_key", "appears twice"), ("tiny", "shorter than"),
])
def test_safetensors_header_cases(tmp_path, case, needle):
    f = small_safetensors(tmp_path / "model.safetensors")
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    if case == "overlap":
        header["b.bias"]["data_offsets"] = [o - 8 for o in header["b.bias"]["data_offsets"]]
    elif case == "gap":
        first = min(header[k]["data_offsets"][0] for k in header if k != "__metadata__")
        for k, v in header.items():
            if k != "__metadata__" and v["data_offsets"][0] == first:
                v["data_offsets"] = [o + 2 for o in v["data_offsets"]]
    elif case == "numel_mismatch":
        header["a.weight"]["shape"] = [3, 5]
    elif case == "bad_dtype":
        header["a.weight"]["dtype"] = "Q4"
    elif case == "negative_shape":
        header["a.weight"]["shape"] = [-3, -4]
    elif case == "trailing_bytes":
        body += b"\0" * 8
    raw = json.dumps(header).encode()
    if case == "duplicate_key":
        raw = raw[:-1] + b', "c.idx": ' + json.dumps(header["c.idx"]).encode() + b"}"
    if case == "not_json":
        raw = b"\xff" + raw[1:]
    out = len(raw).to_bytes(8, "little") + raw + body
    if case == "length_beyond_file":
        out = (len(out) * 1000).to_bytes(8, "little") + out[8:]
    if case == "tiny":
        out = b"\x01\x02"
    f.write_bytes(out)
    with pytest.raises(ModelLoadError, match=needle):
        safetensors_header(f)


@pytest.mark.fast
def test_gguf_header_fuzz(tmp_path):
    """Every truncation and header bit flip of a small GGUF: read_gguf returns or raises
    ModelLoadError, never ValueError / struct.error / OverflowError / MemoryError."""
    good_path = small_gguf(tmp_path / "good.gguf")
    good = good_path.read_bytes()
    kv, tensors = read_gguf(good_path)
    assert kv["tokenizer.ggml.tokens"] == ["a", "bc", "def"] and len(tensors) == 2
    f = tmp_path / "m.gguf"
    rejected = 0
    for label, data in mutations(good, gguf_data_start(good_path)):
        f.write_bytes(data)
        try:
            read_gguf(f)
        except ModelLoadError as exc:
            assert "GGUF" in exc.message and "--method gguf" in exc.hint, label
            rejected += 1
    assert rejected > 500


@pytest.mark.fast
@pytest.mark.parametrize("field, value, needle", [
    ("n_tensors", 2**63, "more than a"), ("n_kv", 2**40, "more than a"),
    ("version", 1, "version 1"), ("version", 3 << 24, "little-endian"),
    ("magic", b"GGML", "magic"),
])
def test_gguf_impossible_header_fields(tmp_path, field, value, needle):
    f = small_gguf(tmp_path / "m.gguf")
    data = bytearray(f.read_bytes())
    at = {"magic": 0, "version": 4, "n_tensors": 8, "n_kv": 16}[field]
    data[at:at + (4 if field in ("magic", "version") else 8)] = (
        value if isinstance(value, bytes) else value.to_bytes(4 if field == "version" else 8, "little"))
    f.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=needle):
        read_gguf(f)


@pytest.mark.fast
def test_gguf_tensor_past_end_and_unknown_type(tmp_path):
    f = small_gguf(tmp_path / "m.gguf")
    data = f.read_bytes()
    f.write_bytes(data[:-40])  # last tensor's data cut short (past the <= 31 padding bytes)
    with pytest.raises(ModelLoadError, match="ends past the end"):
        read_gguf(f)
    name = b"blk.0.attn_q.weight"
    at = data.index(name) + len(name) + 4 + 2 * 8  # n_dims, 2 dims -> the type field
    f.write_bytes(data[:at] + (250).to_bytes(4, "little") + data[at + 4:])
    with pytest.raises(ModelLoadError, match="unknown type 250"):
        read_gguf(f)


@pytest.mark.fast
def test_config_json_fuzz(tmp_path, tiny_llama):
    good = (tiny_llama / "config.json").read_bytes()
    d = tmp_path / "m"
    d.mkdir()
    cases = [good[:n] for n in range(0, len(good), 7)]
    cases += [good[:i] + bytes([good[i] ^ 0x80]) + good[i + 1:] for i in range(0, len(good), 5)]
    cases += [b"[1, 2]", b"\x00\x01\x02\xff" * 10, b"", b'{"a": 1, "a": 2}']
    for data in cases:
        (d / "config.json").write_bytes(data)
        try:
            assert isinstance(read_config_json(d), dict)
        except ModelLoadError as exc:
            assert "config.json" in exc.message and exc.hint


@pytest.mark.fast
@pytest.mark.parametrize("entry, needle", [
    ("/etc/passwd", "not a file inside"), ("../outside.safetensors", "not a file inside"),
    ("sub/../../outside.safetensors", "not a file inside"), ("gone.safetensors", "missing"),
    (7, "not a file inside"),
])
def test_index_paths_must_stay_inside(tmp_path, tiny_llama, entry, needle):
    d = copy_model(tiny_llama, tmp_path / "m")
    shutil.copy(d / "model.safetensors", tmp_path / "outside.safetensors")
    names = list(safetensors_header(d / "model.safetensors")[0])
    weight_map = dict.fromkeys(names, "model.safetensors")
    weight_map[names[0]] = entry
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelLoadError, match=needle):
        tensor_files(d)


@pytest.mark.fast
def test_index_fuzz_and_inside_paths(tmp_path, tiny_llama):
    d = copy_model(tiny_llama, tmp_path / "m")
    names = list(safetensors_header(d / "model.safetensors")[0])
    index = d / "model.safetensors.index.json"
    good = json.dumps({"weight_map": dict.fromkeys(names, "./model.safetensors")}).encode()
    index.write_bytes(good)
    assert set(tensor_files(d)) == set(names)  # "./x" names the same file
    # a symlinked shard is followed (Hugging Face cache snapshots are symlinks into ../../blobs)
    blob = tmp_path / "blobs" / "0123abcd"
    blob.parent.mkdir()
    (d / "model.safetensors").rename(blob)
    (d / "model.safetensors").symlink_to(blob)
    assert set(tensor_files(d)) == set(names)
    for data in [good[:n] for n in range(0, len(good), 97)] + [b"{}", b'{"weight_map": []}']:
        index.write_bytes(data)
        with pytest.raises(ModelLoadError):
            tensor_files(d)
    weight_map = dict.fromkeys(names, "model.safetensors")
    weight_map["not.in.the.shard"] = "model.safetensors"
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelLoadError, match="holds no such tensor"):
        tensor_files(d)


@pytest.mark.fast
def test_scan_finite_names_the_tensor(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e5m2):
        for bad in (float("nan"), float("inf"), -float("inf")):
            x = torch.randn(300, 7).to(dtype)
            x[123, 4] = bad
            save_file({"ok": torch.ones(3), "w": x, "i": torch.arange(4)}, str(d / "model.safetensors"))
            with pytest.raises(BadWeights, match=r"Tensor w contains 1 NaN/Inf"):
                scan_finite(d, chunk_bytes=64)  # several chunks per tensor
            x[123, 4] = 0
            save_file({"ok": torch.ones(3), "w": x}, str(d / "model.safetensors"))
            scan_finite(d, chunk_bytes=64)


def test_scan_finite_cost_on_smollm(smollm_path):
    """The NaN/Inf pass over SmolLM2-135M (269 MB bf16) stays small next to any quantize run."""
    scan_finite(smollm_path)  # page cache warm, as it is right before quantize reads the shards
    cpu = time.process_time()
    wall = time.perf_counter()
    scan_finite(smollm_path)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    print(f"scan_finite SmolLM2-135M: {wall:.3f} s wall, {cpu:.3f} s CPU")
    assert cpu < 2.0


# ------------------------------------------------------------------ the real CLI

def test_cli_info_verify_corrupt_safetensors(tmp_path, tiny_llama):
    d = copy_model(tiny_llama, tmp_path / "m")
    f = d / "model.safetensors"
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    names = sorted((k for k in header if k != "__metadata__"),
                   key=lambda k: header[k]["data_offsets"][0])
    header[names[1]]["data_offsets"] = header[names[0]]["data_offsets"]  # overlapping tensors
    raw = json.dumps(header, separators=(",", ":")).encode()
    assert len(raw) <= n
    raw = raw.ljust(n)
    f.write_bytes(data[:8] + raw + data[8 + n:])
    before = snapshot(tmp_path)
    assert_input_error(cli("info", d), "overlaps")
    (d / "model.safetensors").write_bytes((2**40).to_bytes(8, "little") + data[8:])
    before = snapshot(tmp_path)
    assert_input_error(cli("verify", d, "--engine", "trtllm"), "header length")
    assert_input_error(cli("info", d, "--json"), "header length")
    assert snapshot(tmp_path) == before


def test_cli_bad_config_json(tmp_path, tiny_llama):
    d = copy_model(tiny_llama, tmp_path / "m")
    (d / "config.json").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00binary")
    before = snapshot(tmp_path)
    assert_input_error(cli("info", d), "not UTF-8")
    (d / "config.json").write_text('{"model_type": "llama", ')
    before = snapshot(tmp_path)
    assert_input_error(cli("quantize", d, "--method", "rtn", "--group-size", "64", "-o",
                           tmp_path / "out"), "not valid JSON", "config.json")
    assert_input_error(cli("eval", d, "--max-windows", "1"), "not valid JSON")
    assert snapshot(tmp_path) == before


@pytest.mark.fast
def test_cli_quantize_refuses_index_outside_and_missing_shard(tmp_path, tiny_llama):
    d = copy_model(tiny_llama, tmp_path / "m")
    (d / "model.safetensors").rename(tmp_path / "outside.safetensors")
    names = list(safetensors_header(tmp_path / "outside.safetensors")[0])
    index = d / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": dict.fromkeys(names, "../outside.safetensors")}))
    before = snapshot(tmp_path)
    quantize = ("quantize", d, "--method", "rtn", "--group-size", "64", "-o", tmp_path / "out")
    assert_input_error(cli(*quantize), "not a file inside", "../outside.safetensors")
    index.write_text(json.dumps({"weight_map": dict.fromkeys(names, "model-00001-of-00002.safetensors")}))
    before = snapshot(tmp_path)
    assert_input_error(cli(*quantize), "missing", "model-00001-of-00002.safetensors")
    assert snapshot(tmp_path) == before
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()


@pytest.mark.parametrize("method, tensor", [
    ("rtn", "model.embed_tokens.weight"),
    # calibrated: refused before the calibration inputs are captured or any block runs
    ("gptq", "model.embed_tokens.weight"),
    ("gptq", "model.layers.1.mlp.down_proj.weight"),
])
def test_cli_quantize_refuses_nan_weights_before_blocks(tmp_path, tiny_llama, method, tensor):
    d = copy_model(tiny_llama, tmp_path / "m")
    from safetensors.torch import load_file

    tensors = load_file(str(d / "model.safetensors"))
    tensors[tensor][7, 3] = float("nan")
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    before = snapshot(tmp_path)
    calib = ("--calib-samples", "4", "--calib-seqlen", "32") if method == "gptq" else ()
    res = cli("quantize", d, "--method", method, "--group-size", "64", *calib,
              "-o", tmp_path / "out")
    out = assert_input_error(res, f"{tensor} contains 1 NaN/Inf")
    assert "quantizing blocks" not in out  # refused before the first block
    assert snapshot(tmp_path) == before
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()


@pytest.mark.fast
def test_cli_gguf_truncated_and_impossible_counts(tmp_path):
    g = small_gguf(tmp_path / "m.gguf")
    data = g.read_bytes()
    g.write_bytes(data[: len(data) // 3])
    before = snapshot(tmp_path)
    assert_input_error(cli("info", g), "Corrupt or foreign GGUF", "truncated")
    g.write_bytes(data[:8] + (2**62).to_bytes(8, "little") + data[16:])
    before = snapshot(tmp_path)
    assert_input_error(cli("eval", g, "--max-windows", "1"), "Corrupt or foreign GGUF")
    assert_input_error(cli("compare", g), "Corrupt or foreign GGUF")
    assert_input_error(cli("verify", g, "--engine", "trtllm"), "no config.json")
    assert snapshot(tmp_path) == before


def test_cli_eval_gguf_llamacpp_refuses(tmp_path, tiny_llama):
    """A well-formed GGUF llama.cpp cannot load (no real model in it): without --base no
    tokenizer is readable (clear error naming --base), with --base llama.cpp's refusal."""
    g = small_gguf(tmp_path / "m.gguf")
    before = snapshot(tmp_path)
    assert_input_error(cli("eval", g, "--max-windows", "1", "--ctx", "16"), "--base")
    assert_input_error(cli("eval", g, "--base", tiny_llama, "--max-windows", "1", "--ctx", "16"),
                       "llama.cpp refused")
    assert snapshot(tmp_path) == before


@pytest.mark.fast
def test_imatrix_fuzz(tmp_path):
    """--imatrix FILE, GGUF and legacy .dat: every truncation and header bit flip gives the
    loader's result or one ModelLoadError naming --imatrix / --calib."""
    import struct

    from quantkit.methods.imatrix import load_imatrix, save_imatrix

    good_gguf = tmp_path / "good.gguf"
    save_imatrix(good_gguf, {"blk.0.attn_q.weight": (torch.rand(64), 30)}, datasets=["calib"],
                 chunk_count=2, chunk_size=15)
    name, vals = b"blk.3.attn_v.weight", np.arange(1, 33, dtype=np.float32)
    legacy = (struct.pack("<i", 1) + struct.pack("<i", len(name)) + name
              + struct.pack("<ii", 5, vals.size) + vals.tobytes() + struct.pack("<ii", 12, 4) + b"wiki")
    f = tmp_path / "m.imatrix"
    for good, header_end in ((good_gguf.read_bytes(), gguf_data_start(good_gguf)),
                             (legacy, 4 + 4 + len(name) + 8)):
        for label, data in mutations(good, header_end):
            f.write_bytes(data)
            try:
                load_imatrix(f)
            except ModelLoadError as exc:
                assert "--imatrix" in (exc.hint or "") or "does not exist" in exc.message, label


@pytest.mark.fast
def test_gguf_export_reads_tokenizer_files_safely(tmp_path, tiny_llama):
    """`quantize --method gguf` embeds tokenizer.json / tokenizer_config.json: broken ones are a
    clear error before any work."""
    from quantkit.formats.gguf_tokenizer import read_tokenizer

    for name, data in (("tokenizer.json", b"\xff\xfe\x00garbage"),
                       ("tokenizer_config.json", b'{"add_prefix_space": tru')):
        d = copy_model(tiny_llama, tmp_path / name)
        (d / name).write_bytes(data)
        with pytest.raises(ModelLoadError, match=name.replace(".", r"\.")):
            read_tokenizer(d, 49152)


def test_llama_cpp_refusal_is_an_engine_error(tmp_path):
    """Every llama.cpp load (eval logits, lm-eval tasks, --speed) goes through load_llama: a
    damaged header is refused by quantkit's reader, a well-formed GGUF llama.cpp cannot use
    (no model in it) by llama.cpp, both as QuantkitErrors with a hint."""
    from quantkit.engines.llamacpp import load_llama
    from quantkit.errors import EngineError

    g = small_gguf(tmp_path / "m.gguf")
    with pytest.raises(EngineError, match="llama.cpp refused") as exc:
        load_llama(g, n_ctx=16)
    assert "quantkit info" in exc.value.hint
    g.write_bytes(g.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match="Corrupt or foreign GGUF"):
        load_llama(g, n_ctx=16)
