"""Turn a calibration *source* string into text plus provenance.

A source is a built-in set name ("mixed", "prose", "code", "techdoc"), a path to a .txt,
.jsonl or .parquet file, or "hf:<dataset>[:<config>][:<split>][:<column>]". Everything that
reads calibration or held-out text goes through here, so provenance is recorded one way.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from quantkit.calibration import files
from quantkit.calibration.files import Record
from quantkit.calibration.sets import DEFAULT_SET, builtin_set_file, builtin_sets
from quantkit.errors import CalibrationError

__all__ = ["read_records", "render_records", "load_text", "load_heldout_text", "DOC_SEP"]

DOC_SEP = "\n\n"  # documents (and rendered conversations) are joined with one blank line
CHAT_TURN_CHARS = 2000  # chat=True on plain text: size of the chunk put in one user turn


def _resolve(source: str) -> str:
    """'hf', 'builtin' or 'file'; raises for missing files and unknown set names."""
    if source.startswith("hf:"):
        return "hf"
    path = Path(source).expanduser()
    if path.exists():
        if path.is_dir() or path.suffix.lower() not in files.SUFFIXES:
            raise CalibrationError(
                f"unsupported calibration file {path.name!r}: expected one of {', '.join(files.SUFFIXES)}",
                "convert it to .txt (plain text), .jsonl (one JSON object per line) or .parquet",
            )
        return "file"
    if path.suffix or "/" in source or "\\" in source:
        raise CalibrationError(
            f"calibration file {source} does not exist",
            "check the path, or pass a built-in set name: " + ", ".join(sorted(builtin_sets())),
        )
    return "builtin"


def read_records(
    source: str = DEFAULT_SET, split: str = "calib", text_column: str | None = None
) -> tuple[list[Record], dict[str, Any]]:
    """Records (documents or conversations) of a source and where they came from.

    `split` picks the calib/heldout file of a built-in set; a local file is always read whole,
    and an hf: source uses the split written in the source string (default "train").
    """
    kind = _resolve(source)
    if text_column is not None and (kind == "builtin" or source.lower().endswith(".txt")):
        raise CalibrationError(
            f"--text-column {text_column} applies to .jsonl, .parquet and hf: sources; "
            f"{source} is plain text with no columns",
            "drop --text-column, or pass a .jsonl/.parquet file or an hf: dataset with --calib")
    if kind == "builtin":
        text, prov = builtin_set_file(source, split)
        prov["format"] = "txt"
        return files.split_documents(text), prov
    if kind == "hf":
        records, meta = files.read_hf(source, text_column)
        prov = {
            "kind": "hf",
            "name": meta["dataset"],
            "format": "hf-datasets",
            "licences": [f"see the dataset card of {meta['dataset']}"],
            **meta,
        }
    else:
        path = Path(source).expanduser()
        if path.stat().st_size == 0:
            raise CalibrationError(
                f"calibration file {path.name} is empty", "pass a file with text in it"
            )
        suffix = path.suffix.lower()
        if suffix == ".txt":
            records = files.read_txt(path)
        elif suffix == ".jsonl":
            records = files.read_jsonl(path, text_column)
        else:
            records = files.read_parquet(path, text_column)
        prov = {
            "kind": "file",
            "name": path.name,
            "path": str(path.resolve()),
            "format": suffix[1:],
            "licences": ["unknown (user-supplied file)"],
            "text_column": text_column,
        }
    if not records:
        raise CalibrationError(
            f"calibration source {source} is empty (no text found)",
            "pass a file or dataset with non-empty text",
        )
    return records, prov


def pack_documents(records: list[Record], limit: int = CHAT_TURN_CHARS) -> list[Record]:
    """Consecutive plain documents packed into ~`limit`-char chunks, so that chat=True on a
    text file wraps sizeable chunks, not every paragraph, in the template's turn markers."""
    out: list[Record] = []
    buf: list[str] = []
    for rec in records:
        if isinstance(rec, list):
            out.extend([DOC_SEP.join(buf)] if buf else [])
            out.append(rec)
            buf = []
            continue
        if buf and sum(len(b) + 2 for b in buf) + len(rec) > limit:
            out.append(DOC_SEP.join(buf))
            buf = []
        buf.append(rec)
    out.extend([DOC_SEP.join(buf)] if buf else [])
    return out


def render_records(records: list[Record], tokenizer: Any = None, chat: bool = False) -> str:
    """Join records into one text. Conversations go through
    tokenizer.apply_chat_template(tokenize=False); with chat=True, plain documents are packed
    into ~2,000-char chunks and each chunk is rendered as one user turn."""
    if not chat and all(isinstance(r, str) for r in records):
        return DOC_SEP.join(records)
    if tokenizer is None:
        raise CalibrationError(
            "this calibration source holds chat conversations; rendering them needs a tokenizer",
            "call load_calibration(source, tokenizer, ...) or load_text(..., tokenizer=tok)",
        )
    name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
    if not getattr(tokenizer, "chat_template", None):
        raise CalibrationError(
            f"tokenizer {name} has no chat template, so chat calibration data cannot be rendered",
            "drop --chat, use plain-text calibration data, or use a tokenizer with a chat template",
        )
    out = []
    for rec in pack_documents(records):
        messages = rec if isinstance(rec, list) else [{"role": "user", "content": rec}]
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
        out.append(rendered if isinstance(rendered, str) else str(rendered))
    return DOC_SEP.join(out)


def load_text(
    source: str = DEFAULT_SET,
    split: str = "calib",
    *,
    text_column: str | None = None,
    tokenizer: Any = None,
    chat: bool = False,
) -> tuple[str, dict[str, Any]]:
    """Text of a source (documents joined with a blank line) and its provenance."""
    records, prov = read_records(source, split, text_column)
    has_chat = any(isinstance(r, list) for r in records)
    text = render_records(records, tokenizer, chat)
    if not text.strip():
        raise CalibrationError(
            f"calibration source {source} is empty (no text found)",
            "pass a file or dataset with non-empty text",
        )
    prov.update(
        source=source,
        n_documents=len(records),
        chat=bool(chat or has_chat),
        n_chars=len(text),
        sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(),
    )
    return text, prov


def load_heldout_text(
    source: str = DEFAULT_SET, *, text_column: str | None = None, tokenizer: Any = None
) -> tuple[str, dict[str, Any]]:
    """Evaluation text: the held-out split of a built-in set (never overlaps its calib split),
    or a local file / hf: source read whole."""
    return load_text(source, "heldout", text_column=text_column, tokenizer=tokenizer)
