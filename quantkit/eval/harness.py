"""`quantkit eval`: one harness, one results schema (quantkit.eval/v1, see eval/schema.json)."""

from __future__ import annotations

import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

import quantkit
from quantkit.calibration import load_heldout_text
from quantkit.errors import ModelLoadError, QuantkitError
from quantkit.eval.logits import PPLConvention, make_windows, score
from quantkit.info import artifact_info
from quantkit.loader import load_artifact

__all__ = ["evaluate", "SCHEMA", "hardware"]

SCHEMA = "quantkit.eval/v1"


def hardware() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "threads": torch.get_num_threads(), "python": sys.version.split()[0],
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def _logits_fn(model):
    return lambda ids: model(input_ids=ids, use_cache=False).logits


def evaluate(artifacts: list[str], base: str | None = None, *, heldout: str = "mixed",
             conv: PPLConvention | None = None, on_progress=None, command: str = "",
             ppl: bool = True) -> list[dict]:
    """Results records, one per artifact, sharing one pass of the base model over the text."""
    conv = conv or PPLConvention()
    if not ppl:
        return [_record(a, base, {}, None, {}, command) for a in artifacts]
    loaded = {a: _load_for_eval(a) for a in artifacts}
    base_loaded = _load_for_eval(base) if base else None
    tok = next((lm.tokenizer for lm in [base_loaded, *loaded.values()]
                if lm is not None and lm.tokenizer is not None), None)
    if tok is None:
        raise ModelLoadError(f"No tokenizer could be read from {', '.join(map(str, artifacts))}.",
                             "Pass --base MODEL (the model it was quantized from): its tokenizer "
                             "is used for the held-out text.")
    for a, lm in loaded.items():
        if lm.tokenizer is not None and lm.tokenizer.get_vocab() != tok.get_vocab():
            raise QuantkitError(f"{a} and the base model use different tokenizers; KLD needs one.",
                                "Compare an artifact against the model it was quantized from.")
    text, text_info = load_heldout_text(heldout)
    windows, bos = make_windows(tok, text, conv)
    fns = {a: lm.logits_fn(conv.ctx) for a, lm in loaded.items()}
    if base_loaded is not None:
        fns["__base__"] = base_loaded.logits_fn(conv.ctx)
    try:
        scores = score(fns, windows, base="__base__" if base_loaded else None,
                       batch_size=conv.batch_size, on_progress=on_progress)
    finally:
        for lm in [base_loaded, *loaded.values()]:
            if lm is not None:
                lm.close()
    convention = conv.describe(tok, text_info, windows.shape[0], bos)
    records = []
    for a in artifacts:
        metrics = {k: v for k, v in scores[a].items() if k != "scored_tokens"}
        if base_loaded is not None:
            metrics["base_ppl"] = scores["__base__"]["ppl"]
            if base_loaded.engine["name"] != loaded[a].engine["name"]:
                metrics["base_engine"] = base_loaded.engine["name"]
        records.append(_record(loaded[a].path, base_loaded.path if base_loaded else None,
                               metrics, convention, text_info, command, loaded[a].engine))
    return records


class _EvalModel:
    """What the scorer needs of one model: a tokenizer (None: use the base's), a logits
    function over [B, T] windows, the engine that computes them."""

    def __init__(self, path: Path, tokenizer, logits_fn, engine: dict, close=None):
        self.path, self.tokenizer, self.logits_fn, self.engine = path, tokenizer, logits_fn, engine
        self._close = close

    def close(self) -> None:
        if self._close:
            self._close()


def _load_for_eval(spec) -> _EvalModel:
    """Safetensors artifacts and models: quantkit's loader (dequantized, float32, torch).
    GGUF files: real llama.cpp logits, so a GGUF is scored by the engine that will run it."""
    path = Path(str(spec))
    if path.suffix == ".gguf":
        return _load_gguf(path)
    lm = load_artifact(spec)
    return _EvalModel(lm.path, lm.tokenizer, lambda _ctx: _logits_fn(lm.model),
                      {"name": "quantkit-torch", "version": torch.__version__, "dtype": "float32",
                       "device": "cpu", "note": "quantkit's loader: stored weights dequantized exactly"})


def _load_gguf(path: Path) -> _EvalModel:
    from quantkit.engines.llamacpp import LlamaCppModel, llama_cpp_version
    from quantkit.formats.gguf import read_gguf

    read_gguf(path)  # a truncated or foreign file: one clear error before llama.cpp sees it
    holder: dict = {}

    def make(ctx: int):
        holder["m"] = LlamaCppModel(path, n_ctx=ctx, logits_all=True)

        def logits(ids: torch.Tensor) -> torch.Tensor:
            return torch.stack([torch.from_numpy(holder["m"].logits(row.tolist())) for row in ids])
        return logits

    try:  # transformers reads the tokenizer stored in the GGUF (used when no base is given)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception:  # noqa: BLE001 - the base model's tokenizer is used instead
        tok = None
    return _EvalModel(path, tok, make,
                      {"name": "llama.cpp", "version": llama_cpp_version(), "dtype": "gguf",
                       "device": "cpu", "note": "llama-cpp-python logits for every position"},
                      close=lambda: holder["m"].close() if "m" in holder else None)


def _record(artifact, base, metrics: dict, convention: dict | None, text_info: dict,
            command: str, engine: dict | None = None) -> dict:
    if base is not None and not Path(str(base)).exists():
        from quantkit.model_io import resolve_model

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
    from quantkit.model_io import resolve_model

    return resolve_model(str(spec)).path


def task_record(record: dict, artifact: str, base: str | None, tasks: list[str], *,
                backend: str, reuse_base: bool = True, **settings) -> dict:
    """Add lm-eval task metrics (and flips vs `base`, run on the same backend) to a record.
    The base's results come from the results cache when an identical run is stored there
    (`reuse_base`): evaluating several quantized versions runs the base once."""
    from quantkit.eval.lmeval import flips, run_tasks

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
