"""Readers for user-supplied calibration data: .txt, .jsonl, .parquet and Hugging Face datasets.

Each reader returns *records*: a plain string (one document) or a conversation (a list of
{"role", "content"} dicts, rendered later through the tokenizer's chat template). Keeping the
two apart until a tokenizer is known is why readers do not return text directly.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from quantkit.errors import CalibrationError

__all__ = [
    "Record",
    "read_txt",
    "read_jsonl",
    "read_parquet",
    "read_hf",
    "pick_column",
    "TEXT_COLUMNS",
    "SUFFIXES",
    "hub_offline",
]

Record = str | list  # a document, or a conversation: list of {"role", "content"}
TEXT_COLUMNS = ("text", "content", "messages")
SUFFIXES = (".txt", ".jsonl", ".parquet")
_LOCAL_HINT = "pass a local .txt, .jsonl or .parquet file instead (or a built-in set name)"


def split_documents(text: str) -> list[str]:
    """Documents of a text file: blocks separated by one or more blank lines."""
    return [d.strip("\n") for d in re.split(r"\n[ \t]*\n", text.replace("\r\n", "\n")) if d.strip()]


MAX_GARBLED_SHARE = 0.05  # of characters; real UTF-8 text has none, random bytes ~0.45


def garbled_share(text: str) -> float:
    """Share of characters that are undecodable (U+FFFD) or control characters other than
    whitespace: what a binary file read as text is mostly made of."""
    if not text:
        return 0.0
    bad = sum(1 for ch in text if ch == "\ufffd" or (ord(ch) < 32 and ch not in "\t\n\r\f\v")
              or 0x7F <= ord(ch) < 0xA0)
    return bad / len(text)


def read_txt(path: Path) -> list[Record]:
    """Documents of a UTF-8 text file; a file that is mostly not text is refused."""
    text = path.read_text("utf-8", errors="replace")
    share = garbled_share(text)
    if share > MAX_GARBLED_SHARE:
        raise CalibrationError(
            f"{path.name} does not look like UTF-8 text: {100 * share:.0f} % of its characters "
            "are undecodable bytes or control characters",
            "pass a UTF-8 text file (convert other encodings first, e.g. with iconv), or a "
            "built-in set with --calib mixed")
    return split_documents(text)


def pick_column(columns: list[str], text_column: str | None, where: str) -> str:
    """The requested column, or the first of text/content/messages; errors list what exists."""
    if text_column is not None:
        if text_column not in columns:
            raise CalibrationError(
                f"{where} has no column {text_column!r}; available columns: {', '.join(columns)}",
                "pass --text-column with one of the available columns",
            )
        return text_column
    for name in TEXT_COLUMNS:
        if name in columns:
            return name
    raise CalibrationError(
        f"{where} has none of the columns {', '.join(TEXT_COLUMNS)}; "
        f"available columns: {', '.join(columns) or '(none)'}",
        "pass --text-column naming the column that holds the text",
    )


def to_record(value: Any, where: str) -> Record | None:
    """A column value as a record; None/empty values are skipped, other types are an error."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, list | tuple) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in value
    ):
        return [{"role": m["role"], "content": m["content"]} for m in value] or None
    raise CalibrationError(
        f"{where}: expected a string or a list of {{role, content}} messages, got {type(value).__name__}",
        "point --text-column at a text column or a chat 'messages' column",
    )


def read_jsonl(path: Path, text_column: str | None) -> list[Record]:
    """One JSON object per line; the column is chosen from the first object."""
    records: list[Record] = []
    column = None
    with path.open("r", encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise CalibrationError(
                    f"{path.name}: line {lineno} is not valid JSON ({e.msg})",
                    "each line of a .jsonl file must be one JSON object",
                ) from e
            if not isinstance(obj, dict):
                raise CalibrationError(
                    f"{path.name}: line {lineno} is a JSON {type(obj).__name__}, not an object",
                    'each line must look like {"text": "..."} or {"messages": [...]}',
                )
            if column is None:
                column = pick_column(list(obj), text_column, f"{path.name} (line {lineno})")
            elif column not in obj:
                raise CalibrationError(
                    f"{path.name}: line {lineno} has no {column!r} field; "
                    f"available columns: {', '.join(obj)}",
                    "every line needs the same text column",
                )
            rec = to_record(obj[column], f"{path.name} line {lineno}")
            if rec is not None:
                records.append(rec)
    return records


def read_parquet(path: Path, text_column: str | None) -> list[Record]:
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(path).names
    except Exception as e:  # pyarrow raises several types for a bad file
        raise CalibrationError(f"{path.name} is not a readable parquet file: {e}") from e
    column = pick_column(names, text_column, path.name)
    values = pq.read_table(path, columns=[column]).column(column).to_pylist()
    return [
        r for i, v in enumerate(values) if (r := to_record(v, f"{path.name} row {i}")) is not None
    ]


def hub_offline() -> bool:
    flags = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    return any(os.environ.get(f, "").strip().upper() in {"1", "ON", "YES", "TRUE"} for f in flags)


def parse_hf(source: str) -> tuple[str, str | None, str, str | None]:
    """'hf:<dataset>[:<config>][:<split>][:<column>]' -> (dataset, config, split, column)."""
    parts = source[3:].split(":")
    if not parts[0] or len(parts) > 4:
        raise CalibrationError(
            f"bad Hugging Face dataset source {source!r}",
            "write hf:<dataset>[:<config>][:<split>][:<column>], e.g. hf:wikitext:wikitext-2-raw-v1:train:text",
        )
    parts += [""] * (4 - len(parts))
    return parts[0], parts[1] or None, parts[2] or "train", parts[3] or None


def read_hf(source: str, text_column: str | None) -> tuple[list[Record], dict]:
    """A Hub dataset through datasets.load_dataset (never with trust_remote_code)."""
    name, config, split, column = parse_hf(source)
    where = f"Hugging Face dataset {name!r}"
    if hub_offline():
        raise CalibrationError(
            f"{where} cannot be fetched offline (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set)",
            _LOCAL_HINT,
        )
    try:
        import datasets

        ds = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # connection, auth, not-found and cache errors all mean "not here"
        raise CalibrationError(
            f"{where} cannot be fetched (the Hub may be unreachable or offline): "
            f"{type(e).__name__}: {e}",
            _LOCAL_HINT,
        ) from e
    col = pick_column(list(ds.column_names), column or text_column, where)
    records = [
        r for i, v in enumerate(ds[col]) if (r := to_record(v, f"{where} row {i}")) is not None
    ]
    meta = {
        "dataset": name,
        "config": config,
        "hf_split": split,
        "text_column": col,
        "dataset_fingerprint": getattr(ds, "_fingerprint", None),
    }
    return records, meta
