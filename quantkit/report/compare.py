"""`quantkit compare`: gather eval records for several artifacts into one summary.

The summary (schema `quantkit.compare/v1`) is the single source of the HTML page, its markdown
twin, its JSON twin and the terminal table, so the four never disagree. A metric that was not
measured is absent (None), never 0.

Inputs are artifact directories (their `quantkit_eval.json` is reused when it was measured
against the requested base), single files (GGUF), or results JSON files (one record, a list of
records, or a previous compare summary). Artifacts without a usable record are evaluated
together in one shared pass of `quantkit.eval.harness.evaluate`.

Record sections beyond PPL/KLD are read when present (the eval issue adds them):
  metrics.tasks  {task: {metric: {value, stderr}}}      (lm-eval, `run_tasks()["tasks"]`)
  metrics.flips  {task: {value, ...}}                    (`lmeval.flips`)
  metrics.speed  {prefill_tokens_per_s|decode_tokens_per_s: number | {median|value, spread}}
                 (also accepted: "prefill"/"decode"/"*_tps" keys, or one level of nesting
                 such as {"batch_1": {...}}, batch 1 preferred)
  metrics.memory {peak_rss_bytes|peak_bytes|peak_memory_bytes: int}
  engine_check   {ok: bool, engine, message|error}   (record or quantkit.json)
  warnings       [str]                                (record)
Each may also sit at the top level of the record instead of under metrics.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path

import quantkit
from quantkit.errors import QuantkitError
from quantkit.eval.logits import PPLConvention
from quantkit.machine import cache_dir, hardware

__all__ = ["SUMMARY_SCHEMA", "RECORD_FILE", "collect", "summarize", "read_records"]

SUMMARY_SCHEMA = "quantkit.compare/v1"
RECORD_FILE = "quantkit_eval.json"
_CONV_KEYS = ("ctx", "max_windows", "windows", "scored_tokens", "corpus", "split", "bos",
              "stride", "overlap", "tokenizer", "tokens_sha256")


# ------------------------------------------------------------------ reading inputs

def read_records(path: Path) -> list[dict]:
    """Eval records in a results file: one record, a list of them, or a compare summary."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise QuantkitError(f"Cannot read results JSON {path}: {exc}.",
                            "Pass an artifact directory or a file written by `quantkit eval --json`.") from exc
    if isinstance(data, dict) and data.get("schema") == SUMMARY_SCHEMA:
        data = data.get("records") or []
    records = data if isinstance(data, list) else [data]
    for r in records:
        if not isinstance(r, dict) or "metrics" not in r or "artifact" not in r:
            raise QuantkitError(f"{path} is not a quantkit eval results file.",
                                "Results files are written by `quantkit eval` (schema quantkit.eval/v1).")
    return records


def _is_results_file(p: Path) -> bool:
    return p.is_file() and p.suffix == ".json"


def _meta(path: str | Path) -> dict:
    """quantkit.json of a directory artifact; the embedded metadata of a GGUF file."""
    p = Path(path)
    if p.is_dir():
        from quantkit.loader import artifact_meta

        return artifact_meta(p)
    if p.is_file() and p.suffix == ".gguf":  # a damaged GGUF is refused here, before any eval
        from quantkit.formats.gguf import gguf_metadata

        meta = gguf_metadata(p)
        check = p.with_name(p.name + ".verify.json")  # quantize --verify (quantkit.verify)
        if check.is_file():
            from quantkit.readers import read_json

            meta = {**meta, "engine_check": read_json(check, check.name).get("engine_check")}
        return meta
    return {}


def _stats_file(path: str | Path) -> dict | None:
    """The artifact's quantkit_stats.json, if written."""
    p = Path(path)
    f = p / "quantkit_stats.json" if p.is_dir() else p.with_name(p.name + ".stats.json")
    if not f.is_file():
        return None
    from quantkit.readers import read_json

    return read_json(f)


def _stats(stats: dict | None) -> dict | None:
    """{layer name: relative reconstruction error} from quantkit_stats.json."""
    layers = (stats or {}).get("layers") or {}
    out = {k: float(v["rel_error"]) for k, v in layers.items()
           if isinstance(v, dict) and isinstance(v.get("rel_error"), (int, float))}
    return out or None


def _expert_tokens(stats: dict | None) -> dict | None:
    """Calibration tokens per MoE expert from quantkit_stats.json: {min_tokens, experts:
    [{block, expert, tokens, fallback_rtn}]}, an expert's tokens the fewest any of its Linears
    saw (with all-experts calibration, what its statistics saw). None for dense models and
    methods that gather no statistics (RTN, FP8 dynamic)."""
    if not stats or not isinstance(stats.get("experts"), dict):
        return None
    cells: dict[tuple[int, int], dict] = {}
    for name, v in (stats.get("layers") or {}).items():
        if not isinstance(v, dict) or not all(isinstance(v.get(k), int) for k in ("block", "expert", "tokens")):
            continue
        cell = cells.setdefault((v["block"], v["expert"]), {
            "block": v["block"], "expert": v["expert"], "tokens": v["tokens"], "fallback_rtn": []})
        cell["tokens"] = min(cell["tokens"], v["tokens"])
        if v.get("fallback") == "rtn":
            cell["fallback_rtn"].append(name)
    if not cells:
        return None
    return {"min_tokens": int(stats["experts"].get("min_tokens") or 0),
            "experts": [cells[k] for k in sorted(cells)]}


def _info(recorded: dict) -> dict:
    """The artifact's file facts (bits per weight, tensor types) read again where it is here:
    records written before a field existed still get it; else what the record holds."""
    from quantkit.info import artifact_info

    try:
        return {**recorded, **artifact_info(recorded["path"])} if Path(recorded["path"]).exists() else recorded
    except Exception:  # noqa: BLE001 - an unreadable artifact keeps its recorded facts
        return recorded


# ------------------------------------------------------------------ model identity

def _model_ids(spec: str | None, path: str | None = None) -> set[str]:
    """Every name a model goes by here (alias, real path, Hub id): two models are the same
    model when their sets meet. Built-in aliases resolve to the cached checkpoint."""
    ids: set[str] = set()
    for s in (spec, path):
        if not s:
            continue
        ids.add(str(s))
        p = Path(str(s)).expanduser()
        if p.exists():
            ids.add(os.path.realpath(p))
        else:
            from quantkit.builtin_models import BUILTIN_MODELS

            if s in BUILTIN_MODELS:
                ids.add(os.path.realpath(cache_dir() / "models" / f"{s}-bf16"))
    return ids


def _source_ids(meta: dict, record: dict | None) -> set[str]:
    src = meta.get("source_model") or {}
    ids = _model_ids(src.get("spec"), src.get("path")) | _model_ids(src.get("name_or_path"))
    if not ids and record:
        ids = _model_ids((record.get("artifact") or {}).get("source_model"))
    return ids


def _record_base_ids(record: dict) -> set[str]:
    base = record.get("base") or {}
    return _model_ids(base.get("path"))


# ------------------------------------------------------------------ collecting

class _Entry:
    """One compared artifact: where it is, its metadata and (once found or run) its record."""

    def __init__(self, arg: str, path: str, record: dict | None, stored: list[dict]):
        self.arg, self.path, self.record, self.stored = arg, path, record, stored
        self.meta = _meta(path) if Path(path).exists() else {}
        self.sources = _source_ids(self.meta, record or (stored[0] if stored else None))
        self.self_ids = _model_ids(path)


def _entries(args: list[str]) -> list[_Entry]:
    entries = []
    for arg in args:
        p = Path(arg)
        if _is_results_file(p):
            for rec in read_records(p):
                entries.append(_Entry(arg, rec["artifact"]["path"], rec, [rec]))
        elif p.exists():
            f = p / RECORD_FILE
            stored = read_records(f) if p.is_dir() and f.is_file() else []
            entries.append(_Entry(arg, str(p), None, stored))
        else:
            from quantkit.builtin_models import BUILTIN_MODELS

            if arg not in BUILTIN_MODELS:
                raise QuantkitError(f"{arg} is neither an artifact, a results JSON file nor a "
                                    "built-in model.",
                                    "Pass directories written by `quantkit quantize`, GGUF files, "
                                    "or files written by `quantkit eval --json`.")
            from quantkit.model_io import resolve_model

            entries.append(_Entry(arg, str(resolve_model(arg).path), None, []))
    return entries


def _name(ids: set[str]) -> str:
    return min(ids, key=len) if ids else "unknown"


def _pick_base(entries: list[_Entry], base: str | None) -> tuple[str | None, set[str]]:
    """The base model spec and its ids; refuses when the artifacts come from different models."""
    quantized = [e for e in entries if e.sources]
    for e in quantized[1:]:
        if not (e.sources & quantized[0].sources):
            raise QuantkitError(
                f"{quantized[0].arg} was quantized from {_name(quantized[0].sources)} but "
                f"{e.arg} from {_name(e.sources)}: their base models differ.",
                "Compare artifacts of one base model only (quantkit info ARTIFACT shows each "
                "one's source model).")
    if base is not None:
        ids = _model_ids(base)
        if not Path(base).exists():
            from quantkit.model_io import resolve_model

            ids |= _model_ids(None, str(resolve_model(base).path))
        for e in quantized:
            if not (e.sources & ids):
                raise QuantkitError(
                    f"{e.arg} was quantized from {_name(e.sources)}, not from the base {base}.",
                    "Pass the model the artifacts were quantized from as --base.")
        return base, ids
    if quantized:  # default: the common source model, when it is reachable here
        src = quantized[0].meta.get("source_model") or {}
        cand = src.get("spec") or src.get("path")
        if cand and (Path(cand).exists() or _is_builtin(cand)):
            return cand, quantized[0].sources
    bases = [e.record or (e.stored[0] if e.stored else None) for e in entries]
    bases = [b["base"]["path"] for b in bases if b and b.get("base")]
    if bases:
        return bases[0], _model_ids(bases[0])
    return None, set()


def _is_builtin(spec: str) -> bool:
    from quantkit.builtin_models import BUILTIN_MODELS

    return spec in BUILTIN_MODELS


def _usable(entry: _Entry, base_ids: set[str]) -> dict | None:
    """A stored record measured against this base and newer than the artifact itself."""
    created = entry.meta.get("created") or ""
    for rec in ([entry.record] if entry.record else entry.stored):
        if base_ids and not (_record_base_ids(rec) & base_ids):
            continue
        if entry.record is None and created and (rec.get("created") or "") < created:
            continue  # the artifact was rewritten after this eval
        return rec
    return None


def _may_write(entry: _Entry) -> bool:
    """Cache a new record beside the artifact, never over a record that is still valid
    (it may hold lm-eval or speed results this pass did not measure)."""
    p = Path(entry.path)
    if not p.is_dir() or not os.access(p, os.W_OK):
        return False
    created = entry.meta.get("created") or ""
    return not entry.stored or all((r.get("created") or "") < created for r in entry.stored)


def _store(entry: _Entry) -> None:
    """Write the entry's record (with what this pass added, e.g. speed) beside a directory
    artifact: in place of the stored record it came from, or as a new one where allowed."""
    p = Path(entry.path)
    if not p.is_dir() or not os.access(p, os.W_OK):
        return
    if any(r is entry.record for r in entry.stored):
        data = entry.stored if len(entry.stored) > 1 else entry.stored[0]
    elif _may_write(entry):
        data = entry.record
    else:
        return
    (p / RECORD_FILE).write_text(json.dumps(data, indent=2))


# ------------------------------------------------------------------ speed

def _speed_reusable(stored: dict | None, settings: dict) -> bool:
    """A stored speed result (or reason) was measured with these settings on this machine."""
    if not isinstance(stored, dict) or not isinstance(stored.get("settings"), dict):
        return False
    keys = ("engine", "prompt_tokens", "gen_tokens", "batches", "repeats", "repeat_budget_s",
            "malloc_huge_pages")
    same = all(stored["settings"].get(k) == settings.get(k) for k in keys)
    return same and stored.get("machine", hardware()["cpu"]) == hardware()["cpu"]


def _same_dtype(stored: dict, path: str) -> bool:
    """A stored vLLM speed was measured in the activation dtype vLLM would run `path` in now
    (records from before quantkit chose float32 on CPUs with emulated bf16 were bf16)."""
    from quantkit.engines.capabilities import vllm_dtype

    if stored.get("engine") != "vllm" or stored.get("unmeasured"):
        return True
    return stored.get("dtype", "bfloat16") == vllm_dtype(Path(path))


def _speed(path: str, stored: dict | None, options: dict) -> dict:
    """The artifact's speed in its own engine: reused when measured alike, else measured now;
    where the engine cannot run it, the record names the reason instead of numbers."""
    from quantkit.eval.speed import default_engine, speed_or_reason, speed_settings

    engine = default_engine(path)
    if _speed_reusable(stored, speed_settings(engine, **options)) and _same_dtype(stored, path):
        return stored
    if not Path(path).exists():
        return {"engine": engine, "settings": speed_settings(engine, **options),
                "unmeasured": "the artifact is not on this machine"}
    return {**speed_or_reason(path, engine, **options), "machine": hardware()["cpu"]}


def _base_speed(base_spec: str, options: dict, fresh: bool = False) -> dict:
    """The base model's speed in vLLM, kept in $QUANTKIT_SPEED_CACHE (else <quantkit
    cache>/speed-results) keyed by its files (config hash, each weight file's size and mtime),
    the settings and the CPU: the base is measured once for every comparison of its
    quantized versions."""
    import hashlib

    from quantkit.eval.speed import speed_settings
    from quantkit.model_io import resolve_model
    from quantkit.readers import model_fingerprint

    try:
        path = Path(base_spec) if Path(base_spec).exists() else resolve_model(base_spec).path
    except QuantkitError:
        return {"engine": "vllm", "settings": speed_settings("vllm", **options),
                "unmeasured": "the base model is not on this machine"}
    if not (path / "config.json").is_file():
        return _speed(str(path), None, options)
    from quantkit.engines.capabilities import vllm_dtype

    key = json.dumps({"model": model_fingerprint(path), "path": str(path.resolve()),
                      "settings": speed_settings("vllm", **options), "machine": hardware()["cpu"],
                      "dtype": vllm_dtype(path)}, sort_keys=True)
    root = Path(os.environ.get("QUANTKIT_SPEED_CACHE") or cache_dir() / "speed-results")
    file = root / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"
    if file.is_file() and not fresh:
        return json.loads(file.read_text())
    res = _speed(str(path), None, options)
    if "unmeasured" not in res:  # a refusal is re-tried next time (the engine may be fixed)
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_name(f"{file.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(res))
        tmp.replace(file)
    return res


def _conv_key(c: dict | None) -> tuple:
    return tuple((k, (c or {}).get(k)) for k in _CONV_KEYS)


def collect(artifacts: list[str], base: str | None = None, *, conv: PPLConvention | None = None,
            heldout: str | None = None, fresh: bool = False, write_records: bool = True,
            on_progress=None, command: str = "", title: str | None = None,
            speed: dict | None = None) -> dict:
    """Summary of `artifacts` against `base`, evaluating (one pass) those without a record.

    speed: measure_speed's settings (prompt_tokens, gen_tokens, batches, repeats) to measure
    every artifact and the base in its engine (stored results measured alike are reused
    unless `fresh`)."""
    entries = _entries(artifacts)
    base_spec, base_ids = _pick_base(entries, base)
    is_base = [bool(base_ids and e.self_ids & base_ids) for e in entries]
    rows = [e for e, b in zip(entries, is_base, strict=True) if not b]
    base_recs = [e.record or (e.stored[0] if e.stored else None)
                 for e, b in zip(entries, is_base, strict=True) if b]
    todo = []
    for e in rows:
        e.record = None if fresh else _usable(e, base_ids)
        if e.record is None:
            if not Path(e.path).exists():
                raise QuantkitError(f"No results against base {base_spec} for {e.arg}, and its "
                                    f"artifact {e.path} is not here to evaluate.",
                                    "Pass the artifact itself, or results measured against this base.")
            todo.append(e)
    if todo:
        from quantkit.eval.harness import evaluate

        known = {_conv_key(e.record.get("convention")): e.record for e in rows if e.record}
        if conv is None and len(known) == 1:  # match what was measured before
            c = next(iter(known.values()))["convention"]
            conv = PPLConvention(ctx=c["ctx"], max_windows=c["max_windows"],
                                 batch_size=c.get("batch_size", 4))
            heldout = heldout or (next(iter(known.values())).get("heldout") or {}).get("name")
        records = evaluate([e.path for e in todo], base_spec, heldout=heldout or "mixed",
                           conv=conv, on_progress=on_progress, command=command)
        for e, rec in zip(todo, records, strict=True):
            e.record = rec
            if write_records and _may_write(e):
                (Path(e.path) / RECORD_FILE).write_text(json.dumps(rec, indent=2))
    base_record = next((r for r in base_recs if r), None)
    if speed is not None:
        for i, e in enumerate(rows):
            if on_progress:
                on_progress("speed in each artifact's engine", i, len(rows) + 1)
            e.record["speed"] = _speed(e.path, None if fresh else e.record.get("speed"), speed)
            if write_records and not _is_results_file(Path(e.arg)):
                _store(e)
        if base_spec is not None:
            base_record = dict(base_record or {})
            if fresh or not _speed_reusable(base_record.get("speed"), _settings_for(base_spec, speed)):
                base_record["speed"] = _base_speed(base_spec, speed, fresh)
        if on_progress:
            on_progress("speed in each artifact's engine", len(rows) + 1, len(rows) + 1)
    return summarize([e.record for e in rows], base_spec=base_spec, command=command, title=title,
                     meta={e.record["artifact"]["path"]: e.meta for e in rows},
                     evaluated=[e.path for e in todo], base_record=base_record)


def _settings_for(spec: str, options: dict) -> dict:
    from quantkit.eval.speed import default_engine, speed_settings

    return speed_settings(default_engine(spec), **options)


def summarize(records: list[dict], *, base_spec: str | None = None, command: str = "",
              title: str | None = None, meta: dict | None = None,
              evaluated: list[str] | None = None, base_record: dict | None = None) -> dict:
    """The compare summary from eval records (no model is loaded here)."""
    from quantkit.report.rows import artifact_row, base_row, conventions, reproduction, warnings

    meta = meta or {}
    convs = conventions(records)
    stats = [_stats_file(r["artifact"]["path"]) for r in records]
    rows = [artifact_row(r, meta.get(r["artifact"]["path"]) or _meta(r["artifact"]["path"]),
                         _stats(st), convs, i, info=_info(r["artifact"]),
                         expert_tokens=_expert_tokens(st))
            for i, (r, st) in enumerate(zip(records, stats, strict=True))]
    base = base_row(records, base_spec, convs, base_record)
    return {
        "schema": SUMMARY_SCHEMA,
        "title": title or "quantkit compare: " + ", ".join(r["label"] for r in rows),
        "quantkit_version": quantkit.__version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "base": base,
        "rows": ([base] if base else []) + rows,
        "conventions": convs,
        "warnings": warnings(records, rows, convs, base),
        "reproduction": reproduction(records, rows, command, evaluated or []),
        "records": records,
    }
