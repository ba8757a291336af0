"""`quantkit eval`: one harness, one results schema (quantkit.eval/v1, see eval/schema.json)."""

from __future__ import annotations

import gc
import hashlib
import os
import re
from datetime import datetime, timezone
from pathlib import Path

import torch

import quantkit
from quantkit.calibration import load_heldout_text
from quantkit.engines.llamacpp import LlamaCppModel, llama_cpp_version
from quantkit.errors import ModelLoadError, QuantkitError
from quantkit.eval.lmeval import flips, run_tasks
from quantkit.eval.logits import LogitsFn, PPLConvention, make_windows, score
from quantkit.formats import detect_format
from quantkit.info import artifact_info
from quantkit.loader import load_artifact
from quantkit.machine import available_memory, hardware, rss_bytes
from quantkit.model_io import load_tokenizer, resolve_model
from quantkit.readers import safetensors_headers
from quantkit.transformers_lean import trim_transformers_extras

__all__ = ["evaluate", "eval_memory_cap", "EVAL_MEMORY_ENV", "SCHEMA"]

SCHEMA = "quantkit.eval/v1"


EVAL_MEMORY_ENV = "QUANTKIT_EVAL_MEMORY"
_GROWTH_MARGIN = 1.5  # the next artifact may take this much more than the largest one seen
_SCORING_LOGITS = 3  # [batch, ctx, vocab] float32 tensors at score()'s peak: the base's log-probs, a model's logits, one spare
_UNITS = {"": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def eval_memory_cap(value: str | None = None) -> int | None:
    """$QUANTKIT_EVAL_MEMORY (or `value`): the most bytes the artifacts scored together may
    take, as whole bytes or a whole number of KiB / MiB / GiB; None when unset."""
    text = os.environ.get(EVAL_MEMORY_ENV, "") if value is None else value
    if not text.strip():
        return None
    m = re.fullmatch(r"\s*([0-9]+)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in _UNITS or int(m.group(1)) < 1:
        raise QuantkitError(f"${EVAL_MEMORY_ENV}={text!r} is not a size in bytes.",
                            "Write whole bytes or a whole number of KiB, MiB or GiB (e.g. 8GiB), "
                            "or unset it: quantkit then groups artifacts by the free memory.")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def evaluate(artifacts: list[str], base: str | None = None, *, heldout: str = "mixed",
             conv: PPLConvention | None = None, on_progress=None, command: str = "",
             ppl: bool = True, max_group_bytes: int | None = None,
             backend: str = "quantkit") -> list[dict]:
    """Results records, one per artifact, all scored against the same base pass.

    Artifacts are loaded a group at a time (as many as the free memory, or `max_group_bytes` /
    $QUANTKIT_EVAL_MEMORY, allows): comparing many must not need them all in memory at once.
    The base runs again for each group; its logits are deterministic, so the records equal a
    single pass's, and its log-probs are never stored.
    `backend` "mlx": every safetensors model (artifacts and base) is scored by MLX's own
    decoder in mlx-lm (engines/mlx.py), so the metrics are MLX's.
    """
    conv = conv or PPLConvention()
    if not ppl:
        return [_record(a, base, {}, None, {}, command) for a in artifacts]
    cap = max_group_bytes if max_group_bytes is not None else eval_memory_cap()
    if cap is not None and cap < 1:
        raise QuantkitError(f"max_group_bytes={cap} is not a positive size.",
                            "Pass None to group artifacts by the free memory.")
    opened: dict[str, _EvalModel] = {}
    base_loaded, tokenizers = None, {}
    try:  # tokenizers and paths now; weights only when their group is scored
        for a in artifacts:
            opened[a] = _load_for_eval(a, tokenizers, backend)
        base_loaded = _load_for_eval(base, tokenizers, backend) if base else None
        tok = next((lm.tokenizer for lm in [base_loaded, *opened.values()]
                    if lm is not None and lm.tokenizer is not None), None)
        if tok is None:
            raise ModelLoadError(f"No tokenizer could be read from {', '.join(map(str, artifacts))}.",
                                 "Pass --base MODEL (the model it was quantized from): its "
                                 "tokenizer is used for the held-out text.")
        for a, lm in opened.items():
            if lm.tokenizer not in (None, tok) and lm.tokenizer.get_vocab() != tok.get_vocab():
                raise QuantkitError(f"{a} and the base model use different tokenizers; KLD "
                                    "needs one.",
                                    "Compare an artifact against the model it was quantized from.")
        for lm in opened.values():  # a GGUF's own tokenizer object is large; one is used
            if lm.tokenizer is not tok:
                lm.tokenizer = None
        text, text_info = load_heldout_text(heldout)
        windows, bos = make_windows(tok, text, conv)
        base_fn = base_loaded.logits_fn(conv.ctx) if base_loaded is not None else None
        reserve = _SCORING_LOGITS * 4 * conv.batch_size * conv.ctx * len(tok)
        scores = _score_in_groups(opened, base_fn, windows, conv, cap=cap, reserve=reserve,
                                  on_progress=on_progress)
    finally:
        for lm in [base_loaded, *opened.values()]:
            if lm is not None:
                lm.close()
    convention = conv.describe(tok, text_info, windows.shape[0], bos, windows)
    records = []
    for a in artifacts:
        metrics = {k: v for k, v in scores[a].items() if k != "scored_tokens"}
        if base_loaded is not None:
            metrics["base_ppl"] = scores["__base__"]["ppl"]
            if base_loaded.engine["name"] != opened[a].engine["name"]:
                metrics["base_engine"] = base_loaded.engine["name"]
        records.append(_record(opened[a].path, base_loaded.path if base_loaded else None,
                               metrics, convention, text_info, command, opened[a].engine))
    return records


def _weight_bytes(path: Path) -> int:
    """Bytes of a model's weight files (a GGUF file, or a directory's .safetensors)."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def _room_for_one_more(largest: int, in_group: int, cap: int | None, reserve: int) -> bool:
    """Whether one more artifact (as large as the largest measured so far) fits beside those
    loaded, with room left for score()'s logits; from measured memory, not from file sizes."""
    if cap is not None and in_group + largest > cap:
        return False
    available, _source = available_memory()
    return available - rss_bytes() >= _GROWTH_MARGIN * largest + reserve


def _score_in_groups(models: dict[str, _EvalModel], base_fn: LogitsFn | None,
                     windows: torch.Tensor, conv: PPLConvention, *, cap: int | None,
                     reserve: int, on_progress=None) -> dict[str, dict]:
    """score() over `models` a group at a time, each group with the base; a group's models are
    closed before the next group loads. An artifact's size is the growth of this process's RSS
    while its logits function is made (at least its weight files' bytes) and, once its group
    has run, the group's growth per artifact."""
    names, scores, largest, done, group_no = list(models), {}, 0, 0, 0
    while done < len(names):
        first, group, in_group = done, {}, 0
        group_start = rss_bytes()
        try:
            while done < len(names) and (not group or _room_for_one_more(largest, in_group, cap,
                                                                         reserve)):
                before = rss_bytes()
                group[names[done]] = models[names[done]].logits_fn(conv.ctx)
                # never less than its weights' bytes on disk: a load that reuses freed heap
                # memory grows RSS by less than it holds
                grown = max(0, rss_bytes() - before, _weight_bytes(models[names[done]].path))
                largest, in_group, done = max(largest, grown), in_group + grown, done + 1
            group_no += 1
            stage = "scoring held-out windows"
            if group_no > 1 or done < len(names):
                stage += f" (group {group_no}: artifacts {first + 1}-{done} of {len(names)})"
            fns = {**group, **({"__base__": base_fn} if base_fn is not None else {})}
            scores.update(score(fns, windows, base="__base__" if base_fn is not None else None,
                                batch_size=conv.batch_size,
                                on_progress=on_progress and (
                                    lambda _s, n, total, st=stage: on_progress(st, n, total))))
            largest = max(largest, (rss_bytes() - group_start) // len(group))
        finally:
            for name in group:
                models[name].close()
            group.clear()
            if done < len(names):
                gc.collect()  # a model held in a reference cycle: freed before the next group
    return scores


class _EvalModel:
    """What the scorer needs of one model: a tokenizer (None: use the base's), a logits
    function over [B, T] windows, the engine that computes them."""

    def __init__(self, path: Path, tokenizer, logits_fn, engine: dict, close=None):
        self.path, self.tokenizer, self.logits_fn, self.engine = path, tokenizer, logits_fn, engine
        self._close = close

    def close(self) -> None:
        if self._close:
            self._close()


_TOKENIZER_FILES = ("tokenizer", "special_tokens_map", "added_tokens", "vocab", "merges")


def _tokenizer(path: Path, cache: dict):
    """The tokenizer of a model directory, loaded once for all directories whose tokenizer
    files hold the same bytes (the quantized versions of one model): ~0.5 s each saved."""
    key = tuple((f.name, hashlib.sha256(f.read_bytes()).hexdigest())
                for f in sorted(path.iterdir()) if f.is_file() and f.name.startswith(_TOKENIZER_FILES))
    if not key:
        return load_tokenizer(path)  # its own clear error
    if key not in cache:
        cache[key] = load_tokenizer(path)
    return cache[key]


def _load_for_eval(spec, tokenizers: dict | None = None, backend: str = "quantkit") -> _EvalModel:
    """Safetensors artifacts and models: quantkit's loader (dequantized, float32, torch).
    GGUF files: real llama.cpp logits, so a GGUF is scored by the engine that will run it.
    Only the tokenizer is read here; the weights when the logits function is made."""
    path = Path(str(spec))
    if path.suffix == ".gguf":
        return _load_gguf(path)
    if not path.exists():
        path = resolve_model(str(spec)).path
    detect_format(path)  # not an artifact: one clear error before any group is scored
    if path.is_dir():  # truncated / overlapping shards too, before the first group's work
        safetensors_headers(path)
    tok = _tokenizer(path, {} if tokenizers is None else tokenizers)
    if backend == "mlx":
        return _load_mlx(path, tok)
    holder: dict = {}

    def make(_ctx: int):
        holder["m"] = load_artifact(path, tokenizer=tok)
        return lambda ids: holder["m"].model(input_ids=ids, use_cache=False).logits

    return _EvalModel(path, tok, make,
                      {"name": "quantkit-torch", "version": torch.__version__, "dtype": "float32",
                       "device": "cpu", "note": "quantkit's loader: stored weights dequantized exactly"},
                      close=holder.clear)


def _load_mlx(path: Path, tok) -> _EvalModel:
    """mlx-lm's model of a directory (an MLX artifact or a float model), its quantized layers
    dequantized to the model dtype by mx.dequantize (engines/mlx_worker.py says why)."""
    from quantkit.engines.mlx import MLXScorer, mlx_python

    holder: dict = {}
    engine = {"name": "mlx", "version": "", "dtype": "", "device": "cpu",
              "note": "mlx-lm's own decoder; quantized layers mx.dequantize'd to the model dtype"}
    mlx_python()  # not installed: one clear error before any group is scored

    def make(_ctx: int):
        holder["m"] = MLXScorer(path, dequantize=True)
        engine.update(version=f"mlx {holder['m'].info['mlx_version']}, mlx-lm "
                              f"{holder['m'].info['mlx_lm_version']}",
                      dtype=holder["m"].info["dtype"])
        return holder["m"].logits

    return _EvalModel(path, tok, make, engine,
                      close=lambda: holder.pop("m").close() if "m" in holder else None)


def _load_gguf(path: Path) -> _EvalModel:
    # imported on use: the GGUF reader loads the gguf package, which scoring safetensors
    # artifacts never needs
    from quantkit.formats.gguf import read_gguf

    read_gguf(path)  # a truncated or foreign file: one clear error before llama.cpp sees it
    holder: dict = {}

    def make(ctx: int):
        holder["m"] = LlamaCppModel(path, n_ctx=ctx, logits_all=True)
        # llama.cpp writes its buffers only when it runs, and RSS counts pages once written
        # (a q8_0 GGUF of the tiny test model grew far more after one window than once made):
        # one full window now, so the harness sizes its groups by what scoring will hold
        holder["m"].logits([0] * ctx)

        def logits(ids: torch.Tensor) -> torch.Tensor:
            return torch.stack([torch.from_numpy(holder["m"].logits(row.tolist())) for row in ids])
        return logits

    try:  # transformers reads the tokenizer stored in the GGUF (used when no base is given)
        trim_transformers_extras()
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception:  # noqa: BLE001 - the base model's tokenizer is used instead
        tok = None
    return _EvalModel(path, tok, make,
                      {"name": "llama.cpp", "version": llama_cpp_version(), "dtype": "gguf",
                       "device": "cpu", "note": "llama-cpp-python logits for every position"},
                      close=lambda: holder.pop("m").close() if "m" in holder else None)


def _record(artifact, base, metrics: dict, convention: dict | None, text_info: dict,
            command: str, engine: dict | None = None) -> dict:
    if base is not None and not Path(str(base)).exists():
        base = resolve_model(str(base)).path
    return {
        "schema": SCHEMA,
        "quantkit_version": quantkit.__version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "artifact": artifact_info(_artifact_path(artifact)),
        "base": artifact_info(base) if base else None,
        "engine": engine or {"name": "quantkit-torch", "version": torch.__version__,
                             "dtype": "float32", "device": "cpu",
                             "note": "quantkit's loader: stored weights dequantized exactly"},
        "hardware": hardware(),
        "convention": convention,
        "heldout": text_info,
        "metrics": metrics,
        "command": command,
    }


def _artifact_path(spec) -> Path:
    p = Path(str(spec))
    if p.exists():
        return p
    return resolve_model(str(spec)).path


def task_record(record: dict, artifact: str, base: str | None, tasks: list[str], *,
                backend: str, reuse_base: bool = True, **settings) -> dict:
    """Add lm-eval task metrics (and flips vs `base`, run on the same backend) to a record.
    The base's results come from the results cache when an identical run is stored there
    (`reuse_base`): evaluating several quantized versions runs the base once."""
    res = run_tasks(str(_artifact_path(artifact)), tasks, backend=backend, **settings)
    record["metrics"]["tasks"] = res["tasks"]
    record["lm_eval"] = {**res["settings"], "version": res["lm_eval_version"], "tasks": tasks}
    record["samples"] = res["samples"]
    if base:
        base_backend = "hf" if backend == "llamacpp" else backend
        ref = run_tasks(str(_artifact_path(base)), tasks, backend=base_backend, reuse=reuse_base,
                        **settings)
        record["lm_eval"]["base_results"] = ref.get("cached", "computed")
        record["metrics"]["base_tasks"] = ref["tasks"]
        record["metrics"]["flips"] = flips(ref, res)
    return record
