"""Summary rows from eval records: one flat dict per artifact plus the base reference row.

Only facts go in here (numbers with their uncertainty, or None when not measured); formatting
for the page, the markdown and the terminal lives in `table.py`.
"""

from __future__ import annotations

import math
from pathlib import Path

__all__ = ["artifact_row", "base_row", "bits_note", "conventions", "warnings", "reproduction",
           "scheme_text"]

_PRIMARY = ("acc", "acc_norm", "exact_match", "word_perplexity", "bits_per_byte")
_LOWER_IS_BETTER = ("word_perplexity", "byte_perplexity", "bits_per_byte")


def _section(record: dict | None, key: str):
    """A results section, under metrics or at the top level of the record."""
    if not record:
        return None
    m = record.get("metrics") or {}
    return m.get(key) if m.get(key) is not None else record.get(key)


def _num(v) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
        return None
    return float(v)


def _estimate(v) -> dict | None:
    """{value, stderr|spread} from a number or a dict (value / median / mean)."""
    if isinstance(v, dict):
        value = next((_num(v.get(k)) for k in ("value", "median", "mean") if _num(v.get(k)) is not None), None)
        if value is None:
            return None
        out = {"value": value}
        for k in ("stderr", "spread", "iqr", "std"):
            if _num(v.get(k)) is not None:
                out["stderr" if k == "stderr" else "spread"] = _num(v.get(k))
                break
        return out
    return {"value": _num(v)} if _num(v) is not None else None


def _speed(record: dict | None) -> dict:
    """prefill / decode tokens per second (batch 1 preferred) from the record's speed section."""
    sec = _section(record, "speed")
    if not isinstance(sec, dict):
        return {}
    nested = [v for k, v in sorted(sec.items(), key=lambda kv: "1" not in kv[0]) if isinstance(v, dict)
              and any(kind in kk for kk in v for kind in ("prefill", "decode"))]
    if nested and not any(k.startswith(("prefill", "decode")) for k in sec):
        sec = nested[0]
    out = {}
    for kind in ("prefill", "decode"):
        for k in (f"{kind}_tokens_per_s", f"{kind}_tok_s", f"{kind}_tps", kind):
            est = _estimate(sec.get(k))
            if est is not None:
                out[f"{kind}_tps"] = est
                break
    return out


def _unmeasured(record: dict | None) -> str | None:
    """Why speed and memory have no numbers: the engine's refusal, kept as one phrase."""
    sec = _section(record, "speed")
    return str(sec["unmeasured"]) if isinstance(sec, dict) and sec.get("unmeasured") else None


def _speed_engine(record: dict | None) -> str | None:
    sec = _section(record, "speed")
    return sec.get("engine") if isinstance(sec, dict) else None


def _speed_dtype(record: dict | None) -> str | None:
    """The activation dtype the speed engine said it ran in (vLLM: float32 where its bf16 is
    emulated on the CPU that measured it), or None."""
    sec = _section(record, "speed")
    return sec.get("dtype") if isinstance(sec, dict) else None


def _peak_memory(record: dict | None) -> float | None:
    for sec in (_section(record, "memory"), _section(record, "speed")):
        if isinstance(sec, dict):
            for k in ("peak_rss_bytes", "peak_bytes", "peak_memory_bytes", "peak_rss"):
                v = _estimate(sec.get(k))
                if v is not None:
                    return v["value"]
    return None


def _tasks(record: dict | None) -> dict:
    """{task: {metric, value, stderr, higher_is_better}} with lm-eval's primary metric."""
    out = {}
    for task, metrics in (_section(record, "tasks") or {}).items():
        if not isinstance(metrics, dict):
            continue
        name = next((m for m in _PRIMARY if m in metrics), next(iter(metrics), None))
        est = _estimate(metrics.get(name)) if name else None
        if est is not None:
            out[task] = {"metric": name, **est, "higher_is_better": name not in _LOWER_IS_BETTER}
    return out


def _flips(record: dict | None) -> dict:
    out = {}
    for task, v in (_section(record, "flips") or {}).items():
        est = _estimate(v)
        if est is not None:
            out[task] = est
    return out


def scheme_text(scheme: dict | None, info: dict) -> str:
    """'int4 g64 sym', 'q4_k_m', 'fp8 dynamic' ... from quantkit.json's scheme."""
    if not scheme:
        q = info.get("quantization_config") or {}
        if q.get("bits"):
            return f"int{q['bits']} g{q.get('group_size', '?')}"
        if info.get("gguf_file_type"):  # a GGUF quantkit did not write: its own file type
            return f"{info['gguf_file_type']} (file type)"
        return "bf16/fp16 (unquantized)" if info.get("format") == "dense" else ""
    kind = scheme.get("kind")
    if kind == "kquant" or scheme.get("gguf_type"):
        return str(scheme.get("gguf_type") or "k-quant")
    if kind == "fp8":
        return "fp8"
    gs = scheme.get("group_size")
    if scheme.get("activations"):  # int8 W8A8
        return f"int{scheme.get('bits')} W8A8 {scheme['activations']}"
    parts = [f"int{scheme.get('bits')}", "per-channel" if gs in (-1, None) else f"g{gs}",
             "sym" if scheme.get("symmetric", True) else "asym"]
    if scheme.get("act_order"):
        parts.append("act-order")
    return " ".join(parts)


def conventions(records: list[dict]) -> list[dict]:
    """Distinct eval conventions, numbered c1, c2 ... in first-seen order."""
    out: list[dict] = []
    for r in records:
        c = {**(r.get("convention") or {}), "heldout": r.get("heldout") or {}}
        for known in out:
            if known["convention"] == c:
                known["records"].append(r["artifact"]["path"])
                break
        else:
            out.append({"id": f"c{len(out) + 1}", "convention": c, "records": [r["artifact"]["path"]]})
    return out


def _conv_id(record: dict, convs: list[dict]) -> str | None:
    return next((c["id"] for c in convs if record["artifact"]["path"] in c["records"]), None)


def bits_note(row: dict) -> str | None:
    """'5.6 bpw effective, 4.9 nominal' where the stored bits differ from what the label
    promises by a quarter bit or more (e.g. K-quants falling back on widths not divisible by
    256), else None."""
    eff, nominal = row.get("bits_per_weight"), row.get("nominal_bits_per_weight")
    if eff is None or not nominal or abs(eff - nominal) < 0.25:
        return None
    return f"{eff:.1f} bpw effective, {nominal:.1f} nominal"


def _types(info: dict) -> list[dict] | None:
    """GGUF tensor types, most weights first: [{type, tensors, params, bytes, bits, share}]."""
    types = info.get("tensor_types")
    if not isinstance(types, dict) or not all(isinstance(v, dict) for v in types.values()):
        return None  # records before the per-type breakdown held counts only
    return [{"type": k, **v} for k, v in types.items()]


def artifact_row(record: dict, meta: dict, layers: dict | None, convs: list[dict], i: int,
                 info: dict | None = None, expert_tokens: dict | None = None) -> dict:
    a = info or record["artifact"]
    m = record.get("metrics") or {}
    ppl, base_ppl = _estimate(m.get("ppl")), _estimate(m.get("base_ppl"))
    kld = m.get("kld") if isinstance(m.get("kld"), dict) else None
    engine = record.get("engine") or {}
    check = record.get("engine_check") or meta.get("engine_check")
    return {
        "id": f"r{i}", "role": "artifact",
        "label": Path(a["path"]).name or a["path"], "path": a["path"],
        "method": a.get("method") or meta.get("method"), "format": a.get("format"),
        "scheme": meta.get("scheme") or a.get("scheme"),
        "scheme_text": scheme_text(meta.get("scheme") or a.get("scheme"), a),
        "engine": {k: engine.get(k) for k in ("name", "version", "dtype", "device") if engine.get(k)},
        "target_engines": meta.get("engines") or a.get("engines") or [],
        "source_model": a.get("source_model"),
        "size_bytes": _num(a.get("size_bytes")),
        "bits_per_weight": _num(a.get("bits_per_weight_quantized")),
        "bits_per_weight_model": _num(a.get("bits_per_weight_model")),
        "bits_per_weight_with_embeddings": _num(a.get("bits_per_weight_with_embeddings")),
        "nominal_bits_per_weight": _num(a.get("nominal_bits_per_weight")),
        "tensor_types": _types(a),
        "ppl": ppl, "base_ppl": base_ppl,
        "delta_ppl_pct": 100 * (ppl["value"] / base_ppl["value"] - 1) if ppl and base_ppl else None,
        "kld": {k: _num(kld.get(k)) for k in ("mean", "stderr", "median", "p99", "max")} if kld else None,
        "top1": _estimate(m.get("top1_agreement")),
        "rms_delta_p": _estimate(m.get("rms_delta_p")),
        "tasks": _tasks(record), "flips": _flips(record), "speed": _speed(record),
        "peak_memory_bytes": _peak_memory(record), "speed_unmeasured": _unmeasured(record),
        "speed_engine": _speed_engine(record), "speed_dtype": _speed_dtype(record),
        "convention": _conv_id(record, convs),
        "calibration": meta.get("calibration"),
        "quantize_command": meta.get("command"),
        "quantize_seconds": _num((meta.get("seconds") or {}).get("total")),
        "eval_command": record.get("command") or None,
        "engine_check": check if isinstance(check, dict) else None,
        "warnings": [str(w) for w in record.get("warnings") or []],
        "layers": layers, "expert_tokens": expert_tokens,
    }


def base_row(records: list[dict], base_spec: str | None, convs: list[dict],
             base_record: dict | None = None) -> dict | None:
    """The reference row: the base model's size and its PPL under the first convention."""
    with_base = [r for r in records if r.get("base")]
    if not with_base:
        return None
    first = next((r for r in with_base if _conv_id(r, convs) == "c1"), with_base[0])
    b = first["base"]
    ppl = _estimate((first.get("metrics") or {}).get("base_ppl"))
    engine = first.get("engine") or {}
    return {
        "id": "base", "role": "base",
        "label": base_spec if base_spec and not Path(base_spec).is_absolute() else Path(b["path"]).name,
        "path": b["path"], "method": "unquantized", "format": b.get("format"),
        "scheme": None, "scheme_text": "", "engine": {k: engine.get(k) for k in (
            "name", "version", "dtype", "device") if engine.get(k)},
        "target_engines": [], "source_model": None,
        "size_bytes": _num(b.get("size_bytes")),
        "bits_per_weight": _num(b.get("bits_per_weight_quantized") or b.get("bits_per_weight_model")),
        "bits_per_weight_model": _num(b.get("bits_per_weight_model")),
        "bits_per_weight_with_embeddings": None, "nominal_bits_per_weight": None,
        "tensor_types": None,
        "ppl": ppl, "base_ppl": ppl, "delta_ppl_pct": None, "kld": None, "top1": None,
        "rms_delta_p": None, "tasks": _tasks(base_record), "flips": {}, "speed": _speed(base_record),
        "peak_memory_bytes": _peak_memory(base_record), "speed_unmeasured": _unmeasured(base_record),
        "speed_engine": _speed_engine(base_record), "speed_dtype": _speed_dtype(base_record),
        "convention": _conv_id(first, convs),
        "calibration": None, "quantize_command": None, "quantize_seconds": None,
        "eval_command": None, "engine_check": None, "warnings": [], "layers": None,
        "expert_tokens": None,
    }


def warnings(records: list[dict], rows: list[dict], convs: list[dict], base: dict | None) -> list[str]:
    """What a reader must know before trusting a comparison across rows."""
    out = []
    for r in rows:
        c = r.get("engine_check")
        if c and c.get("ok") is False:
            why = c.get("message") or c.get("error") or c.get("reason") or "no reason recorded"
            out.append(f"{r['label']}: the {c.get('engine', 'engine')} check failed ({why}); "
                       "its numbers come from quantkit's own loader, not from that engine.")
        out.extend(f"{r['label']}: {w}" for w in r["warnings"])
    if len(convs) > 1:
        out.append(f"Rows were measured under {len(convs)} different eval conventions "
                   f"({', '.join(c['id'] for c in convs)}): PPL and KLD compare only within one "
                   "convention (see Reproduction).")
    if base is None:
        out.append("No base model: KLD, top-1 agreement and PPL change are not measured.")
    timed = [r for r in rows + ([base] if base else []) if r["speed"]]
    dtypes = {r.get("speed_dtype") for r in timed}
    if len({r["speed_engine"] for r in timed}) > 1:
        out.append("Rows ran in different engines: speed compares engines, not only formats.")
    elif len(dtypes) > 1:  # one engine, run in float32 for some rows and bf16 for others
        dtypes = ", ".join(sorted(d or "its default" for d in dtypes))
        out.append(f"Rows ran in different activation dtypes ({dtypes}): speed compares dtypes "
                   "too, not only formats (float32 where bf16 is emulated on this CPU, 16-bit "
                   "where the engine's kernel takes nothing else).")
    cpus = {(r.get("hardware") or {}).get("cpu") for r in records}
    if len(cpus) > 1 and any(r["speed"] for r in rows):
        out.append(f"Speed was measured on {len(cpus)} different machines.")
    return out


def _versions(records: list[dict]) -> dict:
    """Versions that produced the numbers (from the records) and this report (installed now)."""
    from importlib.metadata import PackageNotFoundError, version

    seen: dict[str, set] = {}
    for r in records:
        seen.setdefault("quantkit (eval)", set()).add(r.get("quantkit_version"))
        e = r.get("engine") or {}
        seen.setdefault(f"engine {e.get('name')}", set()).add(e.get("version"))
        hw = r.get("hardware") or {}
        for k in ("python", "torch"):
            seen.setdefault(k, set()).add(hw.get(k))
        lm = (r.get("lm_eval") or {}).get("version") or r.get("lm_eval_version")
        if lm:
            seen.setdefault("lm-eval", set()).add(lm)
    out = {k: ", ".join(sorted(str(x) for x in v if x)) for k, v in seen.items()}
    for pkg in ("transformers", "compressed-tensors", "jinja2"):
        try:
            out[f"{pkg} (report)"] = version(pkg)
        except PackageNotFoundError:
            pass
    return {k: v for k, v in out.items() if v}


def reproduction(records: list[dict], rows: list[dict], command: str, evaluated: list[str]) -> dict:
    """Commands, versions, calibration and hardware needed to get these numbers again."""
    commands = []
    for r in rows:
        if r["quantize_command"]:
            commands.append({"row": r["label"], "step": "quantize", "command": r["quantize_command"]})
        if r["eval_command"] and r["path"] not in evaluated:
            commands.append({"row": r["label"], "step": "eval", "command": r["eval_command"]})
    if command:
        commands.append({"row": "all", "step": "compare (evaluates what is missing)", "command": command})
    hardware = []
    for r in records:
        hw = r.get("hardware") or {}
        if hw and hw not in hardware:
            hardware.append(hw)
    return {
        "commands": commands,
        "versions": _versions(records),
        "calibration": [{"row": r["label"], "calibration": r["calibration"]} for r in rows],
        "hardware": hardware,
    }
