"""Built-in calibration sets and the shared loader, with a real (tiny, trained-here) tokenizer."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from quantkit.calibration import (
    CalibrationData,
    builtin_sets,
    calibration_sets_dir,
    load_calibration,
    load_heldout_text,
    load_text,
)
from quantkit.errors import CalibrationError

SETS = ("prose", "code", "techdoc", "mixed")
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)


def _train_tokenizer(chat_template: str | None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = load_text("mixed")[0][:60_000]
    tok.train_from_iterator([corpus[i : i + 2000] for i in range(0, len(corpus), 2000)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.name_or_path = "test-bpe-600"
    fast.chat_template = chat_template
    return fast


@pytest.fixture(scope="module")
def tok():
    return _train_tokenizer(CHATML)


@pytest.fixture(scope="module")
def tok_nochat():
    return _train_tokenizer(None)


@pytest.fixture(autouse=True)
def _repo_sets(monkeypatch):
    monkeypatch.delenv("QUANTKIT_CALIBRATION_DIR", raising=False)


def _err(fn, *args, **kwargs) -> str:
    with pytest.raises(CalibrationError) as ei:
        fn(*args, **kwargs)
    return str(ei.value)


# ---------------------------------------------------------------- built-in sets


def test_manifest_lists_sets_with_sizes_hashes_and_licences():
    sets = builtin_sets()
    assert set(sets) == set(SETS)
    root = calibration_sets_dir()
    total = 0
    for name, entry in sets.items():
        assert entry["name"] == name and entry["domain"] and entry["split"]
        assert entry["sources"] and all(s["licence"] for s in entry["sources"])
        for split, lo, hi in (("calib", 300_000, 600_000), ("heldout", 100_000, 210_000)):
            meta = entry["files"][split]
            data = (root / meta["path"]).read_bytes()
            assert len(data) == meta["bytes"] and lo <= len(data) <= hi, (name, split, len(data))
            assert hashlib.sha256(data).hexdigest() == meta["sha256"]
            assert entry["n_documents"][split] == len(entry["documents"][split])
            total += len(data)
        # split by source document: no document id in both splits
        assert not set(entry["documents"]["calib"]) & set(entry["documents"]["heldout"])
    assert total < 4_000_000


def _shared_windows(a: str, b: str, width: int = 200, stride: int = 100) -> list[str]:
    return [b[i : i + width] for i in range(0, len(b) - width, stride) if b[i : i + width] in a]


@pytest.mark.parametrize("name", SETS)
def test_builtin_set_loads_and_heldout_is_disjoint(name, tok):
    calib, prov = load_text(name)
    held, hprov = load_heldout_text(name)
    assert prov["split"] == "calib" and hprov["split"] == "heldout"
    assert prov["file_matches_manifest"] and prov["licences"]
    long_docs = lambda t: {d for d in re.split(r"\n\s*\n", t) if len(d) >= 200}  # noqa: E731
    assert not long_docs(calib) & long_docs(held), "a document is in both splits"
    assert not _shared_windows(calib, held), "held-out text repeats calibration text"
    data = load_calibration(name, tok, n_samples=16, seqlen=128, seed=1)
    assert data.input_ids.shape == (16, 128) and data.input_ids.dtype == torch.int64
    assert data.provenance["name"] == name


@pytest.mark.fast
def test_no_heldout_text_in_any_calib_split():
    all_calib = "".join(load_text(n)[0] for n in SETS)
    for name in SETS:
        assert not _shared_windows(all_calib, load_heldout_text(name)[0]), name


@pytest.mark.fast
def test_default_is_mixed_and_big_enough_for_default_sampling(tok):
    data = load_calibration(tokenizer=tok)  # 128 x 512 by default
    assert data.input_ids.shape == (128, 512)
    assert data.provenance["name"] == "mixed" and data.provenance["source"] == "mixed"


# ---------------------------------------------------------------- sampling


@pytest.mark.fast
def test_sampling_is_deterministic_and_seeded(tok):
    a = load_calibration("prose", tok, n_samples=8, seqlen=64, seed=0)
    b = load_calibration("prose", tok, n_samples=8, seqlen=64, seed=0)
    c = load_calibration("prose", tok, n_samples=8, seqlen=64, seed=1)
    assert isinstance(a, CalibrationData)
    assert torch.equal(a.input_ids, b.input_ids)
    assert not torch.equal(a.input_ids, c.input_ids)
    assert a.provenance["sha256"] == b.provenance["sha256"]


@pytest.mark.fast
def test_windows_are_raw_slices_without_bos(tok):
    text, _ = load_text("code")
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
    data = load_calibration("code", tok, n_samples=4, seqlen=32, seed=3)
    gen = torch.Generator().manual_seed(3)
    starts = torch.randint(0, ids.numel() - 32 + 1, (4,), generator=gen)
    for row, s in zip(data.input_ids, starts, strict=True):
        assert torch.equal(row, ids[s : s + 32])


@pytest.mark.fast
def test_batches_and_provenance(tok):
    data = load_calibration("techdoc", tok, n_samples=5, seqlen=16, seed=0)
    assert [b.shape[0] for b in data.batches(2)] == [2, 2, 1]
    assert torch.equal(torch.cat(list(data.batches(2))), data.input_ids)
    p = data.provenance
    for key in (
        "source",
        "name",
        "licences",
        "n_samples",
        "seqlen",
        "seed",
        "chat",
        "sha256",
        "tokenizer",
        "n_tokens",
    ):
        assert key in p, key
    assert (p["n_samples"], p["seqlen"], p["seed"], p["chat"]) == (5, 16, 0, False)
    assert p["tokenizer"] == "test-bpe-600"
    assert p["sha256"] == hashlib.sha256(load_text("techdoc")[0].encode()).hexdigest()


# ---------------------------------------------------------------- local files

DOCS = ["First document about apples.\nSecond line.", "Second document, on pears.", "Third: plums."]


@pytest.mark.fast
def test_txt_jsonl_parquet(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    txt = tmp_path / "c.txt"
    txt.write_text("\n\n\n".join(DOCS) + "\n")
    text, prov = load_text(str(txt))
    assert text == "\n\n".join(DOCS) and prov["n_documents"] == 3 and prov["format"] == "txt"

    jl = tmp_path / "c.jsonl"
    jl.write_text(
        "\n".join(json.dumps({"id": i, "content": d}) for i, d in enumerate(DOCS)) + "\n\n"
    )
    assert load_text(str(jl))[0] == "\n\n".join(DOCS)
    jl2 = tmp_path / "c2.jsonl"
    jl2.write_text("\n".join(json.dumps({"text": "x", "body": d}) for d in DOCS))
    assert load_text(str(jl2), text_column="body")[0] == "\n\n".join(DOCS)

    pqf = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": DOCS, "n": [1, 2, 3]}), pqf)
    assert load_text(str(pqf))[0] == "\n\n".join(DOCS)

    big = tmp_path / "big.txt"
    big.write_text("\n\n".join(f"Document {i}: " + "word " * 50 for i in range(40)))
    data = load_calibration(str(big), tok, n_samples=4, seqlen=32)
    assert data.input_ids.shape == (4, 32) and data.provenance["name"] == "big.txt"
    assert load_heldout_text(str(big))[0] == load_text(str(big))[0]  # a local file is read whole


@pytest.mark.fast
def test_chat_messages_render_through_template(tmp_path, tok, tok_nochat):
    conv = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}]
    jl = tmp_path / "chat.jsonl"
    jl.write_text("\n".join(json.dumps({"messages": conv}) for _ in range(3)))
    text, prov = load_text(str(jl), tokenizer=tok)
    one = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4.<|im_end|>\n"
    assert text == "\n\n".join([one] * 3) and prov["chat"] is True
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.convert_tokens_to_ids("<|im_start|>") in ids  # special tokens survive as tokens
    data = load_calibration(str(jl), tok, n_samples=2, seqlen=8)
    assert data.provenance["chat"] is True
    import pyarrow as pa
    import pyarrow.parquet as pq

    pqf = tmp_path / "chat.parquet"
    pq.write_table(pa.table({"messages": [conv] * 3}), pqf)
    assert load_text(str(pqf), tokenizer=tok)[0] == text

    # chat=True on plain text: consecutive documents packed into ~2000-char user turns
    txt = tmp_path / "plain.txt"
    txt.write_text("\n\n".join(DOCS))
    text, _ = load_text(str(txt), tokenizer=tok, chat=True)
    assert text == "<|im_start|>user\n" + "\n\n".join(DOCS) + "<|im_end|>\n"
    txt.write_text("\n\n".join(["x" * 900] * 10))
    text, prov = load_text(str(txt), tokenizer=tok, chat=True)
    assert text.count("<|im_start|>user\n") == 5 and prov["chat"] is True

    msg = _err(load_calibration, str(jl), tok_nochat, n_samples=1, seqlen=4)
    assert "no chat template" in msg and "test-bpe-600" in msg
    assert "no chat template" in _err(load_calibration, "prose", tok_nochat, 1, 4, chat=True)
    assert "tokenizer" in _err(load_text, str(jl))


# ---------------------------------------------------------------- errors


def test_unknown_set_lists_builtins(tok):
    msg = _err(load_calibration, "wikitext2", tok)
    assert "wikitext2" in msg and all(n in msg for n in SETS)


@pytest.mark.fast
def test_missing_file_unsupported_extension_and_empty(tmp_path, tok):
    msg = _err(load_calibration, str(tmp_path / "nope.txt"), tok)
    assert "nope.txt" in msg and "does not exist" in msg
    csv = tmp_path / "data.csv"
    csv.write_text("text\nhello\n")
    msg = _err(load_calibration, str(csv), tok)
    assert "data.csv" in msg and ".jsonl" in msg
    for name, content in (("empty.txt", ""), ("blank.txt", "\n \n\n"), ("empty.jsonl", "")):
        f = tmp_path / name
        f.write_text(content)
        msg = _err(load_calibration, str(f), tok)
        assert "empty" in msg and name in msg


@pytest.mark.fast
def test_too_short_names_both_numbers(tmp_path, tok):
    f = tmp_path / "short.txt"
    f.write_text("a few words only")
    n = len(tok(f.read_text(), add_special_tokens=False)["input_ids"])
    msg = _err(load_calibration, str(f), tok, n_samples=4, seqlen=512)
    assert f"has {n} tokens" in msg and "seqlen 512" in msg
    f.write_text("word " * 200)
    n = len(tok(f.read_text(), add_special_tokens=False)["input_ids"])
    msg = _err(load_calibration, str(f), tok, n_samples=64, seqlen=16)
    assert (
        str(n) in msg and "64 x 16" in msg and "--calib-samples" in msg and "--calib-seqlen" in msg
    )


@pytest.mark.fast
def test_bad_jsonl_line_and_missing_column(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "ok"}\n{"text": broken\n')
    msg = _err(load_text, str(f))
    assert "line 2" in msg and "bad.jsonl" in msg
    f.write_text('{"text": "ok"}\n["a list"]\n')
    assert "line 2" in _err(load_text, str(f))
    f.write_text('{"body": "ok", "id": 1}\n')
    msg = _err(load_text, str(f))
    assert "body" in msg and "id" in msg and "text" in msg
    msg = _err(load_text, str(f), text_column="prompt")
    assert "'prompt'" in msg and "body" in msg
    f.write_text('{"text": "ok"}\n{"body": "x"}\n')
    assert "line 2" in _err(load_text, str(f))
    p = tmp_path / "t.parquet"
    pq.write_table(pa.table({"question": ["a"], "answer": ["b"]}), p)
    msg = _err(load_text, str(p))
    assert "question" in msg and "answer" in msg


@pytest.mark.fast
def test_hf_source_offline_gives_clear_error(monkeypatch, tok):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    msg = _err(load_calibration, "hf:wikitext:wikitext-2-raw-v1:train:text", tok)
    assert "wikitext" in msg and "offline" in msg and "local" in msg
    assert "hf:" in _err(load_text, "hf:")


def test_calibration_dir_env_override(tmp_path, monkeypatch):
    root = calibration_sets_dir()
    shutil.copytree(root, tmp_path / "sets", ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    monkeypatch.setenv("QUANTKIT_CALIBRATION_DIR", str(tmp_path / "sets"))
    assert calibration_sets_dir() == tmp_path / "sets"
    assert load_text("prose")[1]["file_matches_manifest"]
    monkeypatch.setenv("QUANTKIT_CALIBRATION_DIR", str(tmp_path / "none"))
    assert "QUANTKIT_CALIBRATION_DIR" in _err(builtin_sets)


@pytest.mark.fast
def test_package_finds_repo_sets():
    assert calibration_sets_dir() == Path(__file__).resolve().parents[1] / "calibration_sets"
